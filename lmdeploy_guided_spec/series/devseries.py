"""Maintain the patch series as commits in a scratch git checkout of the pristine lmdeploy sources.

Patch files are generated, never edited by hand: :func:`checkout` builds a repository whose first commit (tagged
``pristine``) holds the lmdeploy sources exactly as the wheel installed them and turns every patch into a commit with
``git am``; the developer edits those commits (``git commit --fixup``, ``git rebase -i pristine``) and :func:`export`
writes them back with ``git format-patch`` flags that keep unrelated patch files byte-identical.
"""
from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import NamedTuple

from . import (
    COMMAND,
    PACKAGE,
    PatchDoesNotApplyError,
    PatchError,
    Series,
    SeriesError,
    Target,
    check_version,
    effective_state,
    git_env,
    git_executable,
    load_series,
    patch_files,
    read_pristine,
    write_atomic,
)

__all__ = ['PRISTINE_TAG', 'FORMAT_PATCH_ARGS', 'DevSeriesError', 'SeriesChange', 'checkout', 'checkout_version',
           'export', 'check_applies']

#: Tag of the base commit holding the pristine sources.
PRISTINE_TAG = 'pristine'
#: ``git format-patch`` arguments; zero commit ids, no signature, full blob ids and no diffstat keep re-exports of
#: unchanged commits byte-identical.
FORMAT_PATCH_ARGS = ('format-patch', '--zero-commit', '--no-signature', '--full-index', '--no-stat', '-N')

_VERSION_KEY = 'guidedspec.lmdeployversion'
# A fixed identity and date make the base commit, and so the pristine tag, the same on every machine.
_BASE_IDENTITY = {
    'GIT_AUTHOR_NAME': 'lmdeploy',
    'GIT_AUTHOR_EMAIL': 'pristine@lmdeploy-guided-spec.invalid',
    'GIT_AUTHOR_DATE': '2000-01-01T00:00:00+0000',
    'GIT_COMMITTER_NAME': 'lmdeploy',
    'GIT_COMMITTER_EMAIL': 'pristine@lmdeploy-guided-spec.invalid',
    'GIT_COMMITTER_DATE': '2000-01-01T00:00:00+0000',
}


class DevSeriesError(PatchError):
    """The scratch checkout is missing, not empty, or not in a state that can be exported."""

    exit_code = 2


class SeriesChange(NamedTuple):
    """A patch file that differs between an export and the series: ``kind`` is added, changed or removed."""

    name: str
    kind: str


def _git(args: Sequence[str], cwd: Path, *, extra_env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([git_executable(), *args], cwd=cwd, env=git_env(cwd.parent, extra_env),
                          capture_output=True, text=True)


def _git_ok(args: Sequence[str], cwd: Path, *, extra_env: dict[str, str] | None = None) -> str:
    proc = _git(args, cwd, extra_env=extra_env)
    if proc.returncode != 0:
        raise DevSeriesError(f'`git {" ".join(args)}` failed', path=cwd, details=proc.stderr.strip(),
                             cause='an unexpected state of the scratch checkout',
                             fix=f'remove {cwd} and run `{COMMAND} dev-checkout {cwd}` again')
    return proc.stdout


def _binary_suffixes() -> tuple[str, ...]:
    """File endings of compiled extensions, which the checkouts leave out (as the lmdeploy repository does)."""
    return tuple(EXTENSION_SUFFIXES) + ('.so', '.pyd', '.dll', '.dylib')


def _source_paths(target: Target, series: Series) -> list[str]:
    """Every lmdeploy file of the wheel except compiled extensions, plus the series' targets that RECORD lists."""
    binary = _binary_suffixes()
    paths = {rel for rel in target.record if rel.startswith(f'{PACKAGE}/') and not rel.endswith(binary)}
    paths |= {rel for rel in series.files if rel in target.record}
    return sorted(paths)


def _commit_pristine(workdir: Path, version: str, sources: Mapping[str, bytes | None]) -> None:
    """Write ``sources`` into the (empty) work tree of ``workdir`` and commit them with the fixed identity and date,
    so that the same files give the same commit on every machine."""
    for rel, data in sources.items():
        if data is not None:
            (workdir / rel).parent.mkdir(parents=True, exist_ok=True)
            (workdir / rel).write_bytes(data)
    (workdir / '.git' / 'info').mkdir(exist_ok=True)
    (workdir / '.git' / 'info' / 'exclude').write_text('__pycache__/\n*.pyc\n')
    _git_ok(['add', '-A'], workdir)
    message = (f'lmdeploy {version} pristine sources\n\nThe files of the lmdeploy {version} wheel, '
               'verified against its RECORD.\n')
    _git_ok(['commit', '-q', '--no-verify', '-m', message], workdir, extra_env=_BASE_IDENTITY)


def checkout(workdir: Path, target: Target, series_dir: Path) -> Path:
    """Create a scratch git repository of the pristine lmdeploy sources with the series as commits.

    The base commit holds every file of the installed wheel under ``lmdeploy/`` except compiled extensions (as in
    the lmdeploy repository), each verified against RECORD; files this tool patched are taken from the saved
    pristine copies. It has a fixed author, committer and date and is tagged ``pristine``. Each patch then becomes a
    commit through ``git am --3way``.

    Parameters
    ----------
    workdir : Path
        Directory to create; it must not exist or be empty.
    target : Target
        The installed package providing the pristine sources.
    series_dir : Path
        The ``lmdeploy-<version>/`` directory; a missing directory starts an empty series.

    Returns
    -------
    Path
        ``workdir`` as an absolute path.

    Raises
    ------
    DevSeriesError
        ``workdir`` is not empty.
    VersionMismatchError
        The installed lmdeploy is not the series version.
    NotPristineError
        An installed file differs from RECORD and is not covered by the state's pristine copies.
    PatchDoesNotApplyError
        ``git am`` stopped; the checkout is left mid-``am`` at ``workdir`` for the conflict to be resolved.
    """
    workdir = Path(workdir).absolute()
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise DevSeriesError('the checkout directory exists and is not empty', path=workdir,
                             fix=f'{COMMAND} dev-checkout <a new directory>')
    series_dir = Path(series_dir)
    if series_dir.exists():
        series = load_series(series_dir)
    else:
        name = series_dir.name
        series = Series(directory=series_dir, version=name[len(PACKAGE) + 1:], patches=())
    check_version(target, series)
    sources = read_pristine(target, _source_paths(target, series), state=effective_state(target))
    workdir.mkdir(parents=True, exist_ok=True)
    _git_ok(['init', '-q', '-b', 'main'], workdir)
    _git_ok(['config', _VERSION_KEY, target.version], workdir)
    _commit_pristine(workdir, target.version, sources)
    _git_ok(['tag', PRISTINE_TAG], workdir)
    if series.patches:
        committer = {k: v for k, v in _BASE_IDENTITY.items() if k.startswith('GIT_COMMITTER_')}
        proc = _git(['am', '--3way', '--keep-non-patch', '--quiet', *(str(p.path) for p in series.patches)], workdir,
                    extra_env=committer)
        if proc.returncode != 0:
            raise PatchDoesNotApplyError(
                f'`git am` stopped; the checkout is left mid-series at {workdir}', path=workdir,
                stderr=(proc.stdout + proc.stderr).strip(),
                cause='the series does not apply to the pristine sources of this lmdeploy version',
                fix=f'cd {workdir} && git am --show-current-patch=diff; resolve the conflict, `git add` the files, '
                'then `git am --continue`')
    return workdir


def checkout_version(workdir: Path) -> str:
    """lmdeploy version a scratch checkout was made from.

    Raises
    ------
    DevSeriesError
        When ``workdir`` is not a checkout made by :func:`checkout`.
    """
    workdir = Path(workdir).absolute()
    if not (workdir / '.git').is_dir():
        raise DevSeriesError('not a scratch checkout of the patch series', path=workdir,
                             fix=f'{COMMAND} dev-checkout {workdir}')
    version = _git(['config', '--get', _VERSION_KEY], workdir).stdout.strip()
    if not version:
        raise DevSeriesError('the checkout does not record its lmdeploy version', path=workdir,
                             cause=f'not made by `{COMMAND} dev-checkout`', fix=f'{COMMAND} dev-checkout <new dir>')
    return version


def export(workdir: Path, series_dir: Path, *, dry_run: bool = False) -> list[SeriesChange]:
    """Export the commits after ``pristine`` with ``git format-patch`` and compare them with the series.

    Parameters
    ----------
    workdir : Path
        A checkout made by :func:`checkout`, with every change committed.
    series_dir : Path
        The ``lmdeploy-<version>/`` directory to update (created if missing). Only ``*.patch`` files are touched.
    dry_run : bool, default: False
        Compare only; write nothing.

    Returns
    -------
    list of SeriesChange
        Patch files that are added, changed (bytes differ) or removed, sorted by name; empty when the series is up to
        date.

    Raises
    ------
    DevSeriesError
        ``workdir`` is not a checkout, is in the middle of ``git am`` or a rebase, or has uncommitted changes.
    """
    workdir = Path(workdir).absolute()
    checkout_version(workdir)
    if any((workdir / '.git' / name).exists() for name in ('rebase-apply', 'rebase-merge')):
        raise DevSeriesError('a `git am` or `git rebase` is in progress in the checkout', path=workdir,
                             fix=f'cd {workdir} && git am --continue  (or git rebase --continue), then export again')
    if any((workdir / '.git' / name).exists() for name in ('CHERRY_PICK_HEAD', 'sequencer')):
        raise DevSeriesError('a `git cherry-pick` is in progress in the checkout', path=workdir,
                             fix=f'cd {workdir} && git cherry-pick --continue  (after resolving and `git add`), '
                             'then export again')
    if _git(['rev-parse', '-q', '--verify', f'refs/tags/{PRISTINE_TAG}'], workdir).returncode != 0:
        raise DevSeriesError(f'the checkout has no `{PRISTINE_TAG}` tag', path=workdir,
                             fix=f'{COMMAND} dev-checkout <new dir>')
    dirty = _git_ok(['status', '--porcelain'], workdir).strip()
    if dirty:
        raise DevSeriesError('the checkout has uncommitted changes, which an export would leave out', path=workdir,
                             details=dirty, fix=f'cd {workdir} && git commit (or git stash), then export again')
    series_dir = Path(series_dir)
    with tempfile.TemporaryDirectory(prefix='lmdeploy-guided-spec-export-') as tmp:
        out = Path(tmp) / 'out'
        _git_ok([*FORMAT_PATCH_ARGS, '-q', '-o', str(out), f'{PRISTINE_TAG}..HEAD'], workdir)
        exported = {p.name: p.read_bytes() for p in out.glob('*.patch')} if out.is_dir() else {}
    existing = {p.name: p.read_bytes() for p in series_dir.glob('*.patch')} if series_dir.is_dir() else {}
    changes = []
    for name in sorted(set(exported) | set(existing)):
        if name not in existing:
            changes.append(SeriesChange(name, 'added'))
        elif name not in exported:
            changes.append(SeriesChange(name, 'removed'))
        elif exported[name] != existing[name]:
            changes.append(SeriesChange(name, 'changed'))
    if not dry_run:
        for change in changes:
            if change.kind == 'removed':
                (series_dir / change.name).unlink()
            else:
                write_atomic(series_dir / change.name, exported[change.name])
    return changes


def check_applies(series_dir: Path, target: Target) -> None:
    """Check that the series applies, patch after patch, to the pristine sources of ``target``.

    The pristine files (saved copies where this tool patched the installed package) are copied to a temporary
    directory and every patch is applied with ``git apply`` after the previous one; nothing else is written.

    Parameters
    ----------
    series_dir : Path
        The ``lmdeploy-<version>/`` directory.
    target : Target
        The installed package providing the pristine sources.

    Raises
    ------
    SeriesError
        The series is missing, malformed or empty.
    VersionMismatchError
        The installed lmdeploy is not the series version.
    NotPristineError
        The pristine sources cannot be obtained.
    PatchDoesNotApplyError
        With git's message for the first patch that does not apply.
    """
    series = load_series(series_dir)
    if not series.patches:
        raise SeriesError('the patch series holds no NNNN-*.patch files', path=series.directory,
                          fix=f'{COMMAND} dev-export DIR  (from a checkout with the patch commits)')
    check_version(target, series)
    pristine = read_pristine(target, series.files, state=effective_state(target))
    patch_files(pristine, series.patches)
