"""apply / revert / status, the CLI and the patch-series developer workflow, on a copy of the installed lmdeploy."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import pytest
from series_helpers import git as _git
from series_helpers import snapshot as _snapshot

from lmdeploy_guided_spec import series as tooling
from lmdeploy_guided_spec.cli import commands as cli
from lmdeploy_guided_spec.series import devseries
from lmdeploy_guided_spec.version import __version__

pytestmark = pytest.mark.tooling

AGENT = 'lmdeploy/pytorch/spec_decode/spec_agent.py'
SAMPLER = 'lmdeploy/pytorch/spec_decode/reject_sampler.py'
BASE = 'lmdeploy/pytorch/spec_decode/base.py'
GUIDED = 'lmdeploy/pytorch/spec_decode/guided.py'
COPIED = ['lmdeploy/__init__.py', 'lmdeploy/version.py', AGENT, SAMPLER, BASE]

def _insert_after_first_line(path: Path, line: str) -> None:
    first, rest = path.read_text().split('\n', 1)
    path.write_text(f'{first}\n{line}\n{rest}')


def _write_pristine(real: tooling.Target, site: Path, paths: list[str]) -> None:
    # The running Python's lmdeploy may itself be patched (engine tests need that); take its pristine bytes.
    for rel, data in tooling.read_pristine(real, paths, state=tooling.effective_state(real)).items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)


@pytest.fixture(scope='module')
def real() -> tooling.Target:
    try:
        target = tooling.locate_installed()
    except tooling.LocateError as err:
        pytest.skip(f'lmdeploy is not installed: {err.what}')
    if any(rel not in target.record for rel in COPIED):
        pytest.skip(f'lmdeploy {target.version} does not have the files this test copies')
    return target


@pytest.fixture(scope='module')
def pristine_site(real: tooling.Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A site-packages holding real lmdeploy files and a dist-info whose RECORD lines are the real ones."""
    site = tmp_path_factory.mktemp('pristine') / 'site-packages'
    _write_pristine(real, site, COPIED)
    dist_info = site / f'lmdeploy-{real.version}.dist-info'
    dist_info.mkdir()
    (dist_info / 'METADATA').write_text(f'Metadata-Version: 2.1\nName: lmdeploy\nVersion: {real.version}\n')
    real_record = (real.dist_info / 'RECORD').read_text().splitlines()
    lines = [line for line in real_record if line.split(',', 1)[0] in COPIED]
    assert len(lines) == len(COPIED)
    lines += ['lmdeploy/__pycache__/version.cpython-311.pyc,,', f'{dist_info.name}/RECORD,,']
    (dist_info / 'RECORD').write_text('\n'.join(lines) + '\n')
    return site


@pytest.fixture(scope='module')
def series_root(pristine_site: Path, real: tooling.Target, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A two-patch series made the real way: commits on pristine sources, exported with git format-patch."""
    base = tmp_path_factory.mktemp('series')
    repo = base / 'repo'
    for rel in COPIED:
        (repo / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(pristine_site / rel, repo / rel)
    _git(repo, 'init', '-q')
    _git(repo, 'add', '-A')
    _git(repo, 'commit', '-q', '-m', 'base')
    _git(repo, 'tag', 'base')
    _insert_after_first_line(repo / AGENT, '# guided: the agent hands grammar state to the core here')
    with (repo / AGENT).open('a') as f:
        f.write('\n\ndef guided_hook():\n    return None\n')
    _git(repo, 'commit', '-q', '-a', '-m', 'feat: spec agent hook\n\nCategory: wiring only.')
    _insert_after_first_line(repo / SAMPLER, 'from lmdeploy.pytorch.spec_decode.guided import GUIDED  # noqa: F401')
    (repo / GUIDED).write_text('GUIDED = True\n')
    (repo / BASE).unlink()
    _git(repo, 'add', '-A')
    _git(repo, 'commit', '-q', '-m', 'feat: [sampler] masked rejection sampling\n\nMoves base out of the way.')
    root = base / 'patches'
    _git(repo, 'format-patch', '--zero-commit', '--no-signature', '--full-index', '--no-stat', '-N', '-q',
         '-o', str(root / f'lmdeploy-{real.version}'), 'base..HEAD')
    # The same series with a context line of the second patch broken: the first patch still applies.
    broken = base / 'broken' / f'lmdeploy-{real.version}'
    shutil.copytree(root / f'lmdeploy-{real.version}', broken)
    second = sorted(broken.glob('0002-*.patch'))[0]
    lines = second.read_text().split('\n')
    start = lines.index(f'+++ b/{SAMPLER}')
    context = next(i for i in range(start, len(lines)) if lines[i].startswith(' '))
    lines[context] = ' # a line the pristine file does not have'
    second.write_text('\n'.join(lines))
    return root


@pytest.fixture
def series_dir(series_root: Path, real: tooling.Target) -> Path:
    return series_root / f'lmdeploy-{real.version}'


@pytest.fixture
def broken_dir(series_root: Path, real: tooling.Target) -> Path:
    return series_root.parent / 'broken' / f'lmdeploy-{real.version}'


@pytest.fixture
def site(pristine_site: Path, tmp_path: Path) -> Path:
    path = tmp_path / 'site-packages'
    shutil.copytree(pristine_site, path)
    return path


def test_series_is_read_in_order_with_created_and_deleted_files(series_dir: Path, real: tooling.Target):
    series = tooling.load_series(series_dir)
    assert series.version == real.version
    assert [p.name for p in series.patches] == ['0001-feat-spec-agent-hook.patch',
                                                '0002-feat-sampler-masked-rejection-sampling.patch']
    assert series.patches[0].changes == (tooling.FileChange(AGENT, AGENT),)
    assert set(series.patches[1].changes) == {tooling.FileChange(BASE, None), tooling.FileChange(None, GUIDED),
                                              tooling.FileChange(SAMPLER, SAMPLER)}
    assert series.files == tuple(sorted([AGENT, BASE, GUIDED, SAMPLER]))


def test_locate_reads_version_and_record_without_importing(site: Path, real: tooling.Target):
    target = tooling.locate_installed(site)
    assert target.version == real.version
    assert target.site_root == site
    assert all(target.is_pristine(rel) for rel in COPIED)
    assert 'lmdeploy/__pycache__/version.cpython-311.pyc' not in target.record
    assert tooling.locate_installed().site_root == real.site_root
    code = ('import sys; from lmdeploy_guided_spec import series; series.locate_installed(); '
            'assert "lmdeploy" not in sys.modules')
    subprocess.run([sys.executable, '-c', code], cwd=Path(__file__).parents[2], check=True)


def test_apply_then_revert_is_byte_identical(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)
    before = _snapshot(site)
    old = 1_000_000_000
    os.utime(site / AGENT, (old, old))

    result = tooling.apply(target, series_dir)

    assert result.action == 'applied'
    assert set(result.files) == {AGENT, SAMPLER, GUIDED, BASE}
    assert '# guided: the agent hands grammar state' in (site / AGENT).read_text()
    assert (site / GUIDED).read_text() == 'GUIDED = True\n'
    assert not (site / BASE).exists()
    assert int((site / AGENT).stat().st_mtime) != old
    state = json.loads(target.state_file.read_text())
    assert state['format'] == 1 and state['tool_version'] == __version__
    assert state['lmdeploy_version'] == target.version
    assert [p['name'] for p in state['patches']] == [p.name for p in tooling.load_series(series_dir).patches]
    assert all(p['sha256'] == tooling.sha256_hex((series_dir / p['name']).read_bytes()) for p in state['patches'])
    files = {f['path']: f for f in state['files']}
    assert files[AGENT]['patched_sha256'] == tooling.sha256_hex((site / AGENT).read_bytes())
    assert files[AGENT]['pristine_sha256'] == target.record[AGENT]
    assert files[GUIDED]['pristine_sha256'] is None and files[BASE]['patched_sha256'] is None
    for rel in (AGENT, SAMPLER, BASE):
        assert (target.state_dir / 'pristine' / rel).read_bytes() == before[rel]

    reverted = tooling.revert(target)

    assert reverted.action == 'reverted'
    assert set(reverted.files) == {AGENT, SAMPLER, GUIDED, BASE}
    assert _snapshot(site) == before
    assert not target.state_dir.exists()
    assert tooling.revert(target).action == 'nothing to revert'


def test_apply_twice_is_harmless(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)
    assert tooling.apply(target, series_dir).action == 'applied'
    after_first = _snapshot(site)
    mtimes = {rel: (site / rel).stat().st_mtime_ns for rel in (AGENT, SAMPLER, GUIDED)}

    again = tooling.apply(target, series_dir)

    assert again.action == 'already applied' and again.files == ()
    assert _snapshot(site) == after_first
    assert {rel: (site / rel).stat().st_mtime_ns for rel in mtimes} == mtimes


def test_dry_run_writes_nothing(site: Path, series_dir: Path):
    before = _snapshot(site)
    result = tooling.apply(tooling.locate_installed(site), series_dir, dry_run=True)
    assert result.action == 'would apply' and set(result.files) == {AGENT, SAMPLER, GUIDED, BASE}
    assert _snapshot(site) == before


def test_refuses_version_mismatch(site: Path, series_dir: Path, real: tooling.Target):
    metadata = next(site.glob('lmdeploy-*.dist-info')) / 'METADATA'
    metadata.write_text(metadata.read_text().replace(f'Version: {real.version}', 'Version: 0.13.0'))
    before = _snapshot(site)
    target = tooling.locate_installed(site)
    assert target.version == '0.13.0'

    with pytest.raises(tooling.VersionMismatchError) as info:
        tooling.apply(target, series_dir)

    message = str(info.value)
    assert '0.13.0' in message and f'lmdeploy {real.version}' in message
    assert message.splitlines()[-1].endswith(f'pip install lmdeploy=={real.version}')
    assert _snapshot(site) == before
    with pytest.raises(tooling.VersionMismatchError, match=f'series exist for lmdeploy {real.version}'):
        tooling.find_series('0.13.0', series_dir.parent)


def test_refuses_file_that_is_not_pristine_and_writes_nothing(site: Path, series_dir: Path, real: tooling.Target):
    with (site / SAMPLER).open('a') as f:
        f.write('# local edit\n')
    before = _snapshot(site)

    with pytest.raises(tooling.NotPristineError) as info:
        tooling.apply(tooling.locate_installed(site), series_dir)

    assert SAMPLER in str(info.value) and AGENT not in str(info.value)
    fix = f'pip install --force-reinstall --no-deps lmdeploy=={real.version}'
    assert str(info.value).splitlines()[-1].endswith(fix)
    assert _snapshot(site) == before


def test_patched_files_without_state_are_recognised(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)
    tooling.apply(target, series_dir)
    shutil.rmtree(target.state_dir)
    patched = _snapshot(site)

    with pytest.raises(tooling.NotPristineError, match='look patched by this series without a state file'):
        tooling.apply(target, series_dir)
    assert _snapshot(site) == patched


def test_temporary_directory_inside_a_git_repository(site: Path, series_dir: Path, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch):
    repo = tmp_path / 'repo'
    repo.mkdir()
    _git(repo, 'init', '-q')
    monkeypatch.setattr(tempfile, 'tempdir', str(repo))
    target = tooling.locate_installed(site)
    before = _snapshot(site)

    assert tooling.apply(target, series_dir).action == 'applied'
    assert '# guided: the agent hands grammar state' in (site / AGENT).read_text()
    tooling.revert(target)
    assert _snapshot(site) == before
    assert _git(repo, 'status', '--porcelain') == ''


def test_second_patch_failing_writes_nothing(site: Path, broken_dir: Path):
    before = _snapshot(site)
    target = tooling.locate_installed(site)

    with pytest.raises(tooling.PatchDoesNotApplyError) as info:
        tooling.apply(target, broken_dir)

    assert '0002-' in info.value.what
    assert 'patch does not apply' in info.value.stderr
    assert _snapshot(site) == before
    assert not target.state_dir.exists()
    with pytest.raises(tooling.PatchDoesNotApplyError):
        devseries.check_applies(broken_dir, target)


def test_revert_refuses_file_modified_after_apply(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)
    before = _snapshot(site)
    tooling.apply(target, series_dir)
    with (site / AGENT).open('a') as f:
        f.write('# edited after apply\n')
    edited = _snapshot(site)

    with pytest.raises(tooling.ModifiedSinceApplyError) as info:
        tooling.revert(target)
    assert AGENT in str(info.value) and str(info.value).rstrip().endswith('revert --force  (discards those edits)')
    assert _snapshot(site) == edited
    with pytest.raises(tooling.ModifiedSinceApplyError):
        tooling.apply(target, series_dir)

    forced = tooling.revert(target, force=True)
    assert any(AGENT in w for w in forced.warnings)
    assert _snapshot(site) == before


def test_status_follows_apply_edit_and_revert(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)

    found = tooling.status(target, series_dir)
    assert found.overall == 'not applied' and found.state_file is None
    assert {p.state for p in found.patches} == {'not applied'}
    assert {f.path: f.state for f in found.files} == dict.fromkeys([AGENT, BASE, GUIDED, SAMPLER], 'pristine')

    tooling.apply(target, series_dir)
    found = tooling.status(target, series_dir)
    assert found.overall == 'applied' and found.state_file == target.state_file
    assert {p.state for p in found.patches} == {'applied'}
    assert {f.state for f in found.files} == {'patched'}

    (site / SAMPLER).write_text('rewritten\n')
    found = tooling.status(target, series_dir)
    assert found.overall == 'modified'
    assert {f.path: f.state for f in found.files}[SAMPLER] == 'modified'
    assert {f.path: f.state for f in found.files}[AGENT] == 'patched'

    tooling.revert(target, force=True)
    assert tooling.status(target, series_dir).overall == 'not applied'


def test_changed_series_is_stale_and_must_be_reverted_first(site: Path, series_dir: Path, tmp_path: Path):
    target = tooling.locate_installed(site)
    tooling.apply(target, series_dir)
    edited = tmp_path / 'patches' / series_dir.name
    shutil.copytree(series_dir, edited)
    first = sorted(edited.glob('0001-*.patch'))[0]
    first.write_text(first.read_text().replace('Category: wiring only.', 'Category: wiring only, reworded.'))

    found = tooling.status(target, edited)
    assert found.overall == 'stale'
    assert [p.state for p in found.patches] == ['stale', 'applied']
    with pytest.raises(tooling.OtherSeriesAppliedError, match='revert && lmdeploy-guided-spec apply'):
        tooling.apply(target, edited)

    tooling.revert(target)
    assert tooling.apply(target, edited).action == 'applied'


def test_reinstall_over_a_patched_copy_is_recovered(site: Path, series_dir: Path, pristine_site: Path):
    target = tooling.locate_installed(site)
    before = _snapshot(site)
    tooling.apply(target, series_dir)
    for rel in COPIED:  # what `pip install --force-reinstall` rewrites; it leaves guided.py and the state behind
        shutil.copy2(pristine_site / rel, site / rel)

    assert tooling.status(target, series_dir).overall == 'partially applied'
    result = tooling.apply(target, series_dir)
    assert result.action == 'applied' and result.warnings
    assert tooling.status(target, series_dir).overall == 'applied'
    tooling.revert(target)
    assert _snapshot(site) == before


def test_dev_checkout_then_export_reproduces_the_series(site: Path, series_dir: Path, tmp_path: Path):
    target = tooling.locate_installed(site)
    work = devseries.checkout(tmp_path / 'work', target, series_dir)

    log = _git(work, 'log', '--format=%s', 'pristine..HEAD').splitlines()
    assert log == ['feat: [sampler] masked rejection sampling', 'feat: spec agent hook']
    assert '# guided: the agent hands grammar state' in (work / AGENT).read_text()
    assert _git(work, 'show', f'pristine:{AGENT}') == (site / AGENT).read_text()
    assert devseries.export(work, series_dir, dry_run=True) == []

    out = tmp_path / 'exported' / series_dir.name
    changes = devseries.export(work, out)
    assert changes == [devseries.SeriesChange(p.name, 'added') for p in sorted(series_dir.glob('*.patch'))]
    assert _snapshot(out) == _snapshot(series_dir)

    # The base commit comes from pristine bytes even when the installed package is patched.
    tooling.apply(target, series_dir)
    again = devseries.checkout(tmp_path / 'again', target, series_dir)
    assert _git(again, 'rev-parse', 'pristine') == _git(work, 'rev-parse', 'pristine')


def test_export_reports_added_removed_and_changed_patches(site: Path, series_dir: Path, tmp_path: Path):
    target = tooling.locate_installed(site)
    work = devseries.checkout(tmp_path / 'work', target, series_dir)
    before = _snapshot(series_dir)
    names = sorted(before)
    second = _git(work, 'rev-parse', 'HEAD').strip()

    (work / 'lmdeploy' / 'version.py').write_text('# changed\n')
    _git(work, 'commit', '-q', '-a', '-m', 'fix: version')
    assert devseries.export(work, series_dir, dry_run=True) == [
        devseries.SeriesChange('0003-fix-version.patch', 'added')]
    assert _snapshot(series_dir) == before

    _git(work, 'reset', '-q', '--hard', 'HEAD~2')
    assert devseries.export(work, series_dir, dry_run=True) == [devseries.SeriesChange(names[1], 'removed')]

    _insert_after_first_line(work / AGENT, '# one more line')
    _git(work, 'commit', '-q', '-a', '--amend', '--no-edit')
    _git(work, 'cherry-pick', second)
    assert devseries.export(work, series_dir, dry_run=True) == [devseries.SeriesChange(names[0], 'changed')]
    assert _snapshot(series_dir) == before

    copy = tmp_path / 'copy' / series_dir.name
    shutil.copytree(series_dir, copy)
    assert devseries.export(work, copy) == [devseries.SeriesChange(names[0], 'changed')]
    assert (copy / names[1]).read_bytes() == before[names[1]]
    assert b'+# one more line' in (copy / names[0]).read_bytes()
    assert devseries.export(work, copy, dry_run=True) == []

    (work / AGENT).write_text('uncommitted\n')
    with pytest.raises(devseries.DevSeriesError, match='uncommitted changes'):
        devseries.export(work, series_dir, dry_run=True)


def test_check_applies_on_pristine_sources(site: Path, series_dir: Path):
    target = tooling.locate_installed(site)
    devseries.check_applies(series_dir, target)
    tooling.apply(target, series_dir)
    devseries.check_applies(series_dir, target)  # pristine copies come from the state directory


def test_shipped_series_applies_and_reverts_byte_identically(real: tooling.Target, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(tooling.PATCHES_ENV, raising=False)
    series_dir = tooling.series_path(real.version)
    if not series_dir.is_dir() or not tooling.load_series(series_dir).patches:
        pytest.skip(f'no shipped patch series for lmdeploy {real.version}')
    series = tooling.load_series(series_dir)
    site = tmp_path / 'site-packages'
    copied = sorted({'lmdeploy/__init__.py'} | {rel for rel in series.files if rel in real.record})
    _write_pristine(real, site, copied)
    dist_info = site / real.dist_info.name
    dist_info.mkdir()
    shutil.copy2(real.dist_info / 'METADATA', dist_info / 'METADATA')
    lines = [line for line in (real.dist_info / 'RECORD').read_text().splitlines() if line.split(',')[0] in copied]
    (dist_info / 'RECORD').write_text('\n'.join(lines) + '\n')
    target = tooling.locate_installed(site)
    before = _snapshot(site)

    assert tooling.apply(target, series_dir).action == 'applied'
    assert tooling.status(target, series_dir).overall == 'applied'
    assert all(not target.is_pristine(rel) for rel in series.files)
    assert tooling.revert(target).action == 'reverted'
    assert _snapshot(site) == before


# --------------------------------------------------------------------------------------------------------------------
# command line


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, series_root: Path) -> pytest.MonkeyPatch:
    monkeypatch.setenv(tooling.PATCHES_ENV, str(series_root))
    return monkeypatch


def test_cli_apply_status_revert(site: Path, env, capsys: pytest.CaptureFixture):
    before = _snapshot(site)
    assert cli.main(['status', '--site', str(site)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == 'overall: not applied'
    assert cli.main(['apply', '--dry-run', '--site', str(site)]) == 0
    assert _snapshot(site) == before

    assert cli.main(['apply', '--site', str(site)]) == 0
    assert 'applied lmdeploy-' in capsys.readouterr().out
    assert cli.main(['apply', '--site', str(site)]) == 0
    assert 'already applied' in capsys.readouterr().out
    assert cli.main(['status', '--site', str(site)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == 'overall: applied'
    assert f'  patched   {AGENT}' in out
    assert [line.split() for line in out.splitlines() if line.startswith('000')] == [
        ['0001-feat-spec-agent-hook.patch', 'applied'],
        ['0002-feat-sampler-masked-rejection-sampling.patch', 'applied'],
    ]

    (site / AGENT).write_text('edited\n')
    assert cli.main(['status', '--site', str(site)]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == 'overall: modified'
    assert cli.main(['revert', '--site', str(site)]) == 4
    err = capsys.readouterr().err
    assert AGENT in err and err.splitlines()[-1] == 'finished with 0 warning(s), 1 error(s)'
    assert cli.main(['revert', '--force', '--site', str(site)]) == 0
    assert _snapshot(site) == before
    assert cli.main(['revert', '--site', str(site)]) == 0
    assert 'nothing to revert' in capsys.readouterr().out


def test_cli_fix_hints_keep_the_site(site: Path, env, capsys: pytest.CaptureFixture):
    assert cli.main(['apply', '--site', str(site)]) == 0
    assert f'undo with: lmdeploy-guided-spec revert --site {site}' in capsys.readouterr().out
    (site / AGENT).write_text('edited\n')
    assert cli.main(['status', '--site', str(site)]) == 1
    assert (f'to fix: lmdeploy-guided-spec revert --force --site {site} && lmdeploy-guided-spec apply --site {site}'
            in capsys.readouterr().err)
    assert cli.main(['revert', '--site', str(site)]) == 4
    assert f'to fix: lmdeploy-guided-spec revert --force --site {site}' in capsys.readouterr().err
    assert cli.main(['revert', '--force', '--site', str(site)]) == 0


def test_cli_exit_codes_on_refusals(site: Path, env, series_root: Path, real: tooling.Target, pristine_site: Path,
                                    capsys: pytest.CaptureFixture, tmp_path: Path):
    with (site / SAMPLER).open('a') as f:
        f.write('# local edit\n')
    assert cli.main(['apply', '--site', str(site)]) == 4
    assert 'not as the wheel installed them' in capsys.readouterr().err

    clean = tmp_path / 'clean'
    shutil.copytree(site, clean)
    shutil.copy2(pristine_site / SAMPLER, clean / SAMPLER)
    env.setenv(tooling.PATCHES_ENV, str(series_root.parent / 'broken'))
    assert cli.main(['apply', '--site', str(clean)]) == 5
    assert 'patch does not apply' in capsys.readouterr().err
    assert cli.main(['verify-series', '--site', str(clean)]) == 1
    env.setenv(tooling.PATCHES_ENV, str(series_root))
    assert cli.main(['verify-series', '--site', str(clean)]) == 0
    with env.context() as no_git:
        no_git.setenv('PATH', str(tmp_path / 'no-git-here'))
        assert cli.main(['apply', '--site', str(clean)]) == 6
        assert 'git is not installed' in capsys.readouterr().err

    metadata = next(clean.glob('lmdeploy-*.dist-info')) / 'METADATA'
    metadata.write_text(metadata.read_text().replace(f'Version: {real.version}', 'Version: 0.13.0'))
    capsys.readouterr()
    assert cli.main(['apply', '--site', str(clean)]) == 3
    err = capsys.readouterr().err
    assert '0.13.0' in err and real.version in err and f'pip install lmdeploy=={real.version}' in err

    assert cli.main([]) == 2
    assert cli.main(['apply', '--bogus']) == 2


def test_cli_dev_workflow(site: Path, env, series_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture):
    work = tmp_path / 'work'
    assert cli.main(['dev-checkout', str(work), '--site', str(site)]) == 0
    assert cli.main(['dev-checkout', str(work), '--site', str(site)]) == 2
    assert cli.main(['dev-export', str(work), '--dry-run']) == 0
    (work / 'lmdeploy' / 'version.py').write_text('# changed\n')
    _git(work, 'commit', '-q', '-a', '-m', 'fix: version')
    capsys.readouterr()
    assert cli.main(['dev-export', str(work), '--dry-run']) == 1
    assert 'added   0003-fix-version.patch' in capsys.readouterr().out


def test_cli_check_passes_its_options(monkeypatch: pytest.MonkeyPatch):
    seen = []
    fake = types.ModuleType('lmdeploy_guided_spec.cli.check')
    fake.main = lambda args: seen.append(args) or 0
    monkeypatch.setitem(sys.modules, 'lmdeploy_guided_spec.cli.check', fake)
    assert cli.main(['check', '--steps', '5', '--sampling', '--tokenizer', 'qwen3']) == 0
    (args,) = seen
    assert (args.steps, args.sampling, args.tokenizer, args.num_spec_tokens, args.seed, args.schema) == \
        (5, True, 'qwen3', 3, 0, None)
    assert cli.main(['check', '--tokenizer', 'gpt2']) == 2


def test_series_versions_sort_in_release_order(tmp_path: Path):
    """The newest series is the newest release, not the last name in string order (``0.9.0`` > ``0.18.0`` as
    strings)."""
    for version in ('0.9.0', '0.18.0', '0.14.0', '0.18.0rc1'):
        (tmp_path / f'lmdeploy-{version}').mkdir()
    with pytest.raises(tooling.VersionMismatchError) as info:
        tooling.find_series('0.13.0', tmp_path)
    message = str(info.value)
    assert 'series exist for lmdeploy 0.9.0, 0.14.0, 0.18.0rc1, 0.18.0' in message
    assert message.splitlines()[-1].endswith('pip install lmdeploy==0.18.0')
    assert sorted(['0.14.0', '0.9.0', '1.0', '0.14.1', '0.14.0.post1'], key=tooling.version_key) == [
        '0.9.0', '0.14.0', '0.14.0.post1', '0.14.1', '1.0']
