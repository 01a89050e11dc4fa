"""Many series: a patch release under an earlier release's series (accepted only when the files the series patches
are byte-identical to its pre-images), and dev-port, which starts the series of a new version from an old one.

Everything runs on fake lmdeploy packages of a few small files, with a RECORD like a wheel's."""
from __future__ import annotations

import base64
import hashlib
from pathlib import Path

import pytest
from series_helpers import git as _git
from series_helpers import snapshot as _snapshot

from lmdeploy_guided_spec import series as tooling
from lmdeploy_guided_spec.cli import commands as cli
from lmdeploy_guided_spec.series import devseries

pytestmark = pytest.mark.tooling

def _lines(name: str, n: int = 12, **changed: str) -> str:
    """A module of ``n`` small functions; ``changed={'f3': 'text'}`` replaces the body of f3."""
    return ''.join(f'def {name}{i}():\n    return {changed.get(f"{name}{i}", repr(i))}\n\n' for i in range(n))


def _old_files(version: str = '0.1.0') -> dict[str, str]:
    return {'lmdeploy/__init__.py': f'__version__ = {version!r}\n', 'lmdeploy/a.py': _lines('a'),
            'lmdeploy/b.py': _lines('b')}


def _site(root: Path, version: str, files: dict[str, str]) -> Path:
    """A site-packages with a fake lmdeploy ``version`` and a dist-info whose RECORD hashes its files."""
    site = root / f'site-{version}'
    record = []
    for rel, text in files.items():
        data = text.encode()
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()
        record.append(f'{rel},sha256={digest},{len(data)}')
    dist_info = site / f'lmdeploy-{version}.dist-info'
    dist_info.mkdir()
    (dist_info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: lmdeploy\nVersion: {version}\n')
    (dist_info / 'RECORD').write_text('\n'.join(record + [f'{dist_info.name}/RECORD,,']) + '\n')
    return site


@pytest.fixture(scope='module')
def patches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """patches/lmdeploy-0.1.0/: three patches made the real way on the 0.1.0 files: one edits a.py, one b.py, one
    creates c.py."""
    base = tmp_path_factory.mktemp('series')
    repo = base / 'repo'
    for rel, text in _old_files().items():
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        (repo / rel).write_text(text)
    _git(repo, 'init', '-q')
    _git(repo, 'add', '-A')
    _git(repo, 'commit', '-q', '-m', 'base')
    _git(repo, 'tag', 'base')
    (repo / 'lmdeploy/a.py').write_text(_lines('a', a2="'guided'"))
    _git(repo, 'commit', '-q', '-a', '-m', 'feat(a): guided a2')
    (repo / 'lmdeploy/b.py').write_text(_lines('b', b6="'guided'"))
    _git(repo, 'commit', '-q', '-a', '-m', 'feat(b): guided b6')
    (repo / 'lmdeploy/c.py').write_text('GUIDED = True\n')
    _git(repo, 'add', '-A')
    _git(repo, 'commit', '-q', '-m', 'feat(c): a new module')
    root = base / 'patches'
    _git(repo, *devseries.FORMAT_PATCH_ARGS, '-q', '-o', str(root / 'lmdeploy-0.1.0'), 'base..HEAD')
    return root


# --------------------------------------------------------------------------------------------------------------------
# patch releases


def test_the_series_records_its_preimages(patches: Path):
    found = tooling.load_series(patches / 'lmdeploy-0.1.0')
    old = _old_files()
    assert found.preimages == {'lmdeploy/a.py': tooling.git_blob_id(old['lmdeploy/a.py'].encode()),
                               'lmdeploy/b.py': tooling.git_blob_id(old['lmdeploy/b.py'].encode()),
                               'lmdeploy/c.py': None}


def test_a_byte_identical_patch_release_takes_the_series_and_reverts_byte_identically(tmp_path: Path,
                                                                                     patches: Path):
    site = _site(tmp_path, '0.1.1', _old_files('0.1.1'))
    target = tooling.locate_installed(site)
    chosen = tooling.select_series(target, patches)
    assert chosen == patches / 'lmdeploy-0.1.0'
    before = _snapshot(site)
    result = tooling.apply(target, chosen)
    assert result.action == 'applied'
    assert "'guided'" in (site / 'lmdeploy/a.py').read_text() and (site / 'lmdeploy/c.py').is_file()
    assert tooling.status(target, chosen).overall == 'applied'
    assert tooling.select_series(target, patches) == chosen  # the pre-images come from the saved pristine copies
    assert tooling.revert(target).action == 'reverted'
    assert _snapshot(site) == before


def test_the_exact_series_wins_and_the_newest_fitting_one_is_taken(tmp_path: Path, patches: Path):
    root = tmp_path / 'patches'
    for version in ('0.1.0', '0.1.1', '0.1.10'):
        (root / f'lmdeploy-{version}').mkdir(parents=True)
        for patch in (patches / 'lmdeploy-0.1.0').glob('*.patch'):
            (root / f'lmdeploy-{version}' / patch.name).write_bytes(patch.read_bytes())
    exact = tooling.locate_installed(_site(tmp_path, '0.1.1', _old_files('0.1.1')))
    assert tooling.select_series(exact, root) == root / 'lmdeploy-0.1.1'
    later = tooling.locate_installed(_site(tmp_path, '0.1.2', _old_files('0.1.2')))
    assert tooling.select_series(later, root) == root / 'lmdeploy-0.1.1'  # release order: 0.1.10 is not earlier


def test_a_patch_release_that_changed_a_patched_file_is_refused_naming_it(tmp_path: Path, patches: Path,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture):
    files = _old_files('0.1.1') | {'lmdeploy/b.py': _lines('b', b11="'fixed upstream'")}
    site = _site(tmp_path, '0.1.1', files)
    target = tooling.locate_installed(site)
    before = _snapshot(site)
    with pytest.raises(tooling.VersionMismatchError) as info:
        tooling.select_series(target, patches)
    message = str(info.value)
    assert 'patch release of 0.1.0, but lmdeploy/b.py differs' in message
    assert 'dev-port --from 0.1.0' in message.splitlines()[-1]
    with pytest.raises(tooling.VersionMismatchError, match='lmdeploy/b.py'):
        tooling.apply(target, patches / 'lmdeploy-0.1.0')
    monkeypatch.setenv(tooling.PATCHES_ENV, str(patches))
    assert cli.main(['apply', '--site', str(site)]) == 3
    assert 'lmdeploy/b.py differs' in capsys.readouterr().err
    assert _snapshot(site) == before


def test_a_file_the_series_creates_must_be_absent(tmp_path: Path, patches: Path):
    target = tooling.locate_installed(_site(tmp_path, '0.1.1', _old_files('0.1.1') | {'lmdeploy/c.py': 'C = 1\n'}))
    with pytest.raises(tooling.VersionMismatchError, match='lmdeploy/c.py differs'):
        tooling.select_series(target, patches)


def test_another_minor_version_is_refused(tmp_path: Path, patches: Path):
    target = tooling.locate_installed(_site(tmp_path, '0.2.0', _old_files('0.2.0')))
    with pytest.raises(tooling.VersionMismatchError, match='no patch series for lmdeploy 0.2.0'):
        tooling.select_series(target, patches)
    with pytest.raises(tooling.VersionMismatchError, match='does not match the patch series for lmdeploy 0.1.0'):
        tooling.apply(target, patches / 'lmdeploy-0.1.0')


def test_the_cli_applies_a_patch_release_and_says_so(tmp_path: Path, patches: Path, monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture):
    site = _site(tmp_path, '0.1.1', _old_files('0.1.1'))
    monkeypatch.setenv(tooling.PATCHES_ENV, str(patches))
    assert cli.main(['verify-series', '--site', str(site)]) == 0
    assert cli.main(['apply', '--site', str(site)]) == 0
    assert cli.main(['status', '--site', str(site)]) == 0
    out = capsys.readouterr().out
    assert 'applied lmdeploy-0.1.0 (3 patch(es)) to lmdeploy 0.1.1' in out
    assert 'lmdeploy 0.1.1 is a patch release of 0.1.0' in out and out.splitlines()[-1] == 'overall: applied'
    assert cli.main(['revert', '--site', str(site)]) == 0
