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
