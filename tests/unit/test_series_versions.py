"""Many series: a patch release under an earlier release's series (accepted only when the files the series patches
are byte-identical to its pre-images), and dev-port, which starts the series of a new version from an old one.

Everything runs on fake lmdeploy packages of a few small files, with a RECORD like a wheel's."""
from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest
from series_helpers import git as _git
from series_helpers import snapshot as _snapshot

from lmdeploy_guided_spec import series as tooling
from lmdeploy_guided_spec.cli import commands as cli
from lmdeploy_guided_spec.series import devport, devseries

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


# --------------------------------------------------------------------------------------------------------------------
# dev-port


def _new_files() -> dict[str, str]:
    """lmdeploy 0.2.0: a.py changed away from the series' edit (0001 ports), b.py changed where 0002 edits (a
    conflict), c.py still absent (0003 ports)."""
    return {'lmdeploy/__init__.py': "__version__ = '0.2.0'\n", 'lmdeploy/a.py': _lines('a', 14, a11="'upstream'"),
            'lmdeploy/b.py': _lines('b', b6="'upstream'"), 'lmdeploy/d.py': 'D = 1\n'}


@pytest.fixture
def ported(tmp_path: Path, patches: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake lmdeploy 0.2.0 installed, the 0.1.0 wheel (a zip), and the patches root in a scratch copy."""
    root = tmp_path / 'patches'
    (root / 'lmdeploy-0.1.0').mkdir(parents=True)
    for patch in (patches / 'lmdeploy-0.1.0').glob('*.patch'):
        (root / 'lmdeploy-0.1.0' / patch.name).write_bytes(patch.read_bytes())
    monkeypatch.setenv(tooling.PATCHES_ENV, str(root))
    wheel = tmp_path / 'lmdeploy-0.1.0-py3-none-any.whl'
    with zipfile.ZipFile(wheel, 'w') as z:
        for rel, text in _old_files().items():
            z.writestr(rel, text)
        z.writestr('lmdeploy-0.1.0.dist-info/METADATA', 'Name: lmdeploy\nVersion: 0.1.0\n')
    return _site(tmp_path, '0.2.0', _new_files()), wheel, root


def test_dev_port_stops_mid_cherry_pick_and_exports_once_resolved(tmp_path: Path, ported,
                                                                  capsys: pytest.CaptureFixture):
    site, wheel, root = ported
    work = tmp_path / 'port'
    code = cli.main(['dev-port', '--site', str(site), '--from', '0.1.0', '--from-sources', str(wheel), str(work)])
    out, err = capsys.readouterr()
    assert code == 1
    assert out.splitlines()[1:5] == ['  applied  0001-feat-a-guided-a2.patch',
                                     '  conflict 0002-feat-b-guided-b6.patch  (lmdeploy/b.py)',
                                     '  pending  0003-feat-c-a-new-module.patch', '1 applied, 1 conflict, 1 pending']
    assert 'git cherry-pick --continue' in err and f'dev-export {work}' in err
    # the pristine commit is dev-checkout's
    checkout = devseries.checkout(tmp_path / 'checkout', tooling.locate_installed(site), root / 'lmdeploy-0.2.0')
    assert _git(work, 'rev-parse', 'pristine') == _git(checkout, 'rev-parse', 'pristine')
    with pytest.raises(devseries.DevSeriesError, match='cherry-pick` is in progress'):
        devseries.export(work, root / 'lmdeploy-0.2.0')
    # resolve as the series meant it: the guided b6, with upstream's other lines
    (work / 'lmdeploy/b.py').write_text(_lines('b', b6="'guided'"))
    _git(work, 'add', 'lmdeploy/b.py')
    _git(work, 'cherry-pick', '--continue')  # goes on with 0003
    assert cli.main(['dev-export', str(work)]) == 0
    names = sorted(p.name for p in (root / 'lmdeploy-0.2.0').glob('*.patch'))
    assert names == ['0001-feat-a-guided-a2.patch', '0002-feat-b-guided-b6.patch', '0003-feat-c-a-new-module.patch']
    target = tooling.locate_installed(site)
    assert tooling.select_series(target, root) == root / 'lmdeploy-0.2.0'
    assert tooling.apply(target, root / 'lmdeploy-0.2.0').action == 'applied'
    assert (site / 'lmdeploy/a.py').read_text() == _lines('a', 14, a2="'guided'", a11="'upstream'")
    assert (site / 'lmdeploy/b.py').read_text() == _lines('b', b6="'guided'")
    assert (site / 'lmdeploy/c.py').read_text() == 'GUIDED = True\n'


def test_dev_port_keep_going_leaves_conflicts_out_and_sees_changes_upstream_has(tmp_path: Path, ported,
                                                                                capsys: pytest.CaptureFixture):
    site, wheel, root = ported
    new = _new_files() | {'lmdeploy/c.py': 'GUIDED = True\n'}  # upstream took 0003 as it is
    site = _site(tmp_path / 'with-c', '0.2.0', new)
    sources = tmp_path / 'old-site'
    for rel, text in _old_files().items():  # a directory this time
        (sources / rel).parent.mkdir(parents=True, exist_ok=True)
        (sources / rel).write_text(text)
    result = devport.port(tmp_path / 'port', tooling.locate_installed(site), root / 'lmdeploy-0.1.0', sources,
                          keep_going=True)
    assert [(p.name[:4], p.state) for p in result.patches] == [('0001', 'applied'), ('0002', 'conflict'),
                                                               ('0003', 'empty')]
    assert not result.stopped
    assert devseries.export(result.workdir, root / 'lmdeploy-0.2.0', dry_run=True) == [
        devseries.SeriesChange('0001-feat-a-guided-a2.patch', 'added')]


def test_dev_port_refuses_sources_that_are_not_the_old_pristine_files(tmp_path: Path, ported):
    site, _, root = ported
    sources = _site(tmp_path / 'other', '0.1.1', _old_files() | {'lmdeploy/a.py': _lines('a', 13)})
    with pytest.raises(devseries.DevSeriesError, match='not pristine lmdeploy 0.1.0: lmdeploy/a.py'):
        devport.port(tmp_path / 'port', tooling.locate_installed(site), root / 'lmdeploy-0.1.0', sources)
    assert not (tmp_path / 'port').exists()
