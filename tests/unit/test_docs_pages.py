"""The documentation pages: both languages have the same structure, and the install page shows the current series."""
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.docs

ROOT = Path(__file__).parents[2]
EN, ZH = ROOT / 'docs' / 'en', ROOT / 'docs' / 'zh_cn'
SERIES = ROOT / 'patches' / 'lmdeploy-0.14.0'


def _structure(path: Path) -> dict[str, list[str]]:
    lines = path.read_text(encoding='utf-8').splitlines()
    return {
        'heading levels': [line.split(' ', 1)[0] for line in lines if re.match(r'#+ ', line)],
        'code fences': [line.strip() for line in lines if re.match(r' *```\w', line)],
        # the directives of the examples test (conftest.py) are written the same in both languages
        'example directives': [line for line in lines if line.startswith('<!-- ')],
    }


def test_both_languages_have_the_same_pages():
    assert sorted(p.name for p in EN.glob('*.md')) == sorted(p.name for p in ZH.glob('*.md'))


@pytest.mark.parametrize('page', sorted(p.name for p in EN.glob('*.md')))
def test_both_languages_have_the_same_structure(page):
    assert _structure(EN / page) == _structure(ZH / page)


def test_the_install_page_shows_every_patch_and_file_of_the_series():
    patches = sorted(p.name for p in SERIES.glob('*.patch'))
    files = {m.group(1) for p in SERIES.glob('*.patch')
             for m in re.finditer(r'^diff --git a/\S+ b/(\S+)$', p.read_text(), re.M)}
    for page in (EN / 'install.md', ZH / 'install.md'):
        text = page.read_text(encoding='utf-8')
        assert f'applied lmdeploy-0.14.0 ({len(patches)} patch(es))' in text, page
        assert f'wrote {len(files)} file(s):' in text, page
        for name in patches:
            assert f'\n  {name}\n' in text, (page, name)  # apply's output
            assert re.search(rf'^{re.escape(name)} +applied$', text, re.M), (page, name)  # status's output
        for rel in files:
            assert f'\n  {rel}\n' in text, (page, rel)


@pytest.mark.parametrize('series', sorted(p.name for p in (ROOT / 'patches').glob('lmdeploy-*')))
def test_the_patches_readme_lists_every_patch_with_its_category(series):
    """patches/README.md has a row for each patch of each series, with the category its commit message gives."""
    readme = (ROOT / 'patches' / 'README.md').read_text(encoding='utf-8')
    assert f'\n## {series}\n' in readme, f'patches/README.md has no section ## {series}'
    section = readme.split(f'\n## {series}\n', 1)[1].split('\n## ', 1)[0]
    rows = dict(re.findall(r'^\| `(\d{4}-[^`]+\.patch)` \| ([^|]+?) \|', section, re.M))
    patches = sorted((ROOT / 'patches' / series).glob('*.patch'))
    stale = set(rows) - {p.name for p in patches}
    assert not stale, f'rows of patches that {series} does not have: {sorted(stale)}'
    for patch in patches:
        assert patch.name in rows, f'{series}/{patch.name} has no row in patches/README.md'
        category = re.search(r'^Category: (.+?)\.?$', patch.read_text(encoding='utf-8'), re.M)
        assert category is not None, f'{series}/{patch.name}: its commit message names no category'
        assert _kind(rows[patch.name]) == _kind(category.group(1)), (patch.name, rows[patch.name], category.group(1))


def _kind(category: str) -> str:
    """The category of the policy (patches/README.md) a category text starts with."""
    return next(kind for kind in ('upstreamable', 'specific to lmdeploy-guided-spec', 'incompatible with upstream')
                if category.startswith(kind))
