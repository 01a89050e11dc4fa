"""Patch an installed lmdeploy in place with a patch series, record what was done, and undo it.

The installed package is checked file by file against the sha256 hashes of its wheel ``RECORD`` before anything is
written. Patches are applied with ``git apply`` to copies in a temporary directory outside any git repository; the
installed files are replaced only after every patch of the series applied. What was done is kept in
``<site>/lmdeploy/.guided_spec/`` (``state.json`` plus byte copies of the pristine files), and :func:`revert` trusts
only that record.
"""
from __future__ import annotations

import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from ..version import __version__
from .errors import (
    COMMAND,
    ModifiedSinceApplyError,
    NotPristineError,
    OtherSeriesAppliedError,
    PatchDoesNotApplyError,
    PatchError,
    SeriesError,
    StateError,
    WriteError,
    _reinstall,
)
from .files import Patch, Series, load_series
from .git import git_env, git_executable
from .installed import Target, _optional_sha, _set_file, write_atomic
from .release import check_version
from .state import FileRecord, PatchRecord, State, _state_is_leftover, effective_state, read_pristine, read_state

__all__ = ['Result', 'PatchStatus', 'FileStatus', 'Status', 'patch_files', 'apply', 'revert', 'status']


@dataclass(frozen=True)
class Result:
    """Outcome of :func:`apply` or :func:`revert`.

    Attributes
    ----------
    action : str
        ``'applied'``, ``'already applied'``, ``'would apply'``, ``'reverted'`` or ``'nothing to revert'``.
    series : str or None
        Series directory name concerned.
    patches : tuple of str
        Patch file names concerned.
    files : tuple of str
        Files written or removed (for ``'would apply'``: that would be).
    warnings : tuple of str
        Things the caller should tell the user.
    """

    action: str
    series: str | None = None
    patches: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class PatchStatus:
    """One row of :class:`Status`: ``state`` is ``'applied'``, ``'not applied'`` or ``'stale'``."""

    name: str
    state: str


@dataclass(frozen=True)
class FileStatus:
    """One file of :class:`Status`: ``state`` is ``'pristine'``, ``'patched'`` or ``'modified'``."""

    path: str
    state: str


@dataclass(frozen=True)
class Status:
    """What :func:`status` found.

    Attributes
    ----------
    overall : str
        ``'applied'``, ``'not applied'``, ``'partially applied'``, ``'stale'`` or ``'modified'``.
    installed_version : str
        Installed lmdeploy version.
    series_version : str
        Version the series targets.
    patches : tuple of PatchStatus
        Series patches in order, then patches recorded as applied that the series no longer has (``'stale'``).
    files : tuple of FileStatus
        Files the series or the state touch.
    state_file : Path or None
        The state file when one is in effect.
    """

    overall: str
    installed_version: str
    series_version: str
    patches: tuple[PatchStatus, ...]
    files: tuple[FileStatus, ...]
    state_file: Path | None

    @property
    def version_matches(self) -> bool:
        """Whether the installed lmdeploy is the version the series targets."""
        return self.installed_version == self.series_version


def patch_files(files: Mapping[str, bytes | None], patches: Sequence[Patch], *,
                reverse: bool = False) -> dict[str, bytes | None]:
    """Apply ``patches`` in order to copies of ``files`` in a temporary directory outside any git repository.

    Parameters
    ----------
    files : Mapping[str, bytes or None]
        Posix path relative to the site root -> contents (None: absent). Must cover every file the patches touch.
    patches : sequence of Patch
        Applied one after another with ``git apply`` (each patch applies entirely or not at all).
    reverse : bool, default: False
        Undo the patches instead (``git apply -R``, last patch first).

    Returns
    -------
    dict
        The contents after patching, for the keys of ``files`` and every file the patches touch (None: absent).

    Raises
    ------
    PatchDoesNotApplyError
        With git's stderr, naming the first patch that does not apply.
    GitNotFoundError
        When git is not installed.
    """
    git = git_executable()
    order = list(reversed(patches)) if reverse else list(patches)
    with tempfile.TemporaryDirectory(prefix='lmdeploy-guided-spec-') as tmp:
        tree = Path(tmp) / 'tree'
        tree.mkdir()
        for rel, data in files.items():
            if data is not None:
                (tree / rel).parent.mkdir(parents=True, exist_ok=True)
                (tree / rel).write_bytes(data)
        env = git_env(ceiling=Path(tmp))
        for patch in order:
            cmd = [git, 'apply', '--whitespace=nowarn'] + (['-R'] if reverse else []) + [str(patch.path)]
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            if proc.returncode != 0:
                raise PatchDoesNotApplyError(
                    f'patch {patch.name} does not {"reverse" if reverse else "apply"}', path=patch.path,
                    stderr=proc.stderr.strip(),
                    cause='the series does not fit the pristine sources of this lmdeploy version',
                    fix=f'regenerate the series: {COMMAND} dev-checkout DIR, resolve the conflict there, then '
                    f'{COMMAND} dev-export DIR  (users: report it with the output of `{COMMAND} status`)')
        keys = set(files) | {rel for patch in patches for rel in patch.files}
        return {rel: (tree / rel).read_bytes() if (tree / rel).is_file() else None for rel in sorted(keys)}


# --------------------------------------------------------------------------------------------------------------------
# apply / revert / status


def _looks_applied(target: Target, series: Series) -> bool:
    current = {rel: (target.path_of(rel).read_bytes() if target.path_of(rel).is_file() else None)
               for rel in series.files}
    try:
        patch_files(current, series.patches, reverse=True)
    except PatchDoesNotApplyError:
        return False
    return True


def _install(target: Target, state: State, pristine: Mapping[str, bytes | None],
             patched: Mapping[str, bytes | None], write: Sequence[str]) -> None:
    """Save pristine copies and the state, then write the patched files; roll back everything on failure."""
    done: list[str] = []
    try:
        if target.state_dir.exists():
            shutil.rmtree(target.state_dir)
        for rel, data in pristine.items():
            if data is not None:
                write_atomic(target.state_dir / 'pristine' / rel, data)
        write_atomic(target.state_file, state.to_json().encode())
        for rel in write:
            _set_file(target.path_of(rel), patched[rel])
            done.append(rel)
    except OSError as err:
        for rel in done:
            _set_file(target.path_of(rel), pristine[rel])
        shutil.rmtree(target.state_dir, ignore_errors=True)
        raise WriteError(f'cannot write the patched files: {err}; nothing was changed', path=target.package_dir,
                         cause='no write permission on the installed package',
                         fix=f'run `{COMMAND} apply` as the user that installed lmdeploy') from err


def apply(target: Target, series_dir: Path, *, dry_run: bool = False) -> Result:
    """Apply a patch series to an installed lmdeploy, all or nothing.

    Every file the series touches must be pristine (its sha256 equals the wheel RECORD). All patches are applied to
    copies in a temporary directory first; the installed files are replaced (each atomically, with a new mtime) only
    when every patch applied. The state file and pristine copies are written to ``<site>/lmdeploy/.guided_spec/``.

    Applying the same series again is a no-op (``action == 'already applied'``). A state left behind by a reinstall
    of lmdeploy (every file pristine again) is discarded and the series applied afresh; an apply that was
    interrupted (some files patched, the others pristine) is completed.

    Parameters
    ----------
    target : Target
        The installed package, from :func:`locate_installed`.
    series_dir : Path
        The ``lmdeploy-<version>/`` directory.
    dry_run : bool, default: False
        Check and patch in the temporary directory only; write nothing (``action == 'would apply'``).

    Returns
    -------
    Result
        ``action`` is ``'applied'``, ``'already applied'`` or ``'would apply'``.

    Raises
    ------
    SeriesError
        The series is missing, malformed or empty.
    VersionMismatchError
        The installed version is not the series version.
    NotPristineError
        A target file is not pristine and not patched by this tool (nothing is written).
    OtherSeriesAppliedError
        Patches with other contents are applied; revert them first.
    ModifiedSinceApplyError
        The series is applied but a patched file was changed since.
    PatchDoesNotApplyError
        A patch does not apply to the pristine files (nothing is written).
    StateError
        The state directory is unusable.
    GitNotFoundError
        git is missing.
    WriteError
        Writing failed; what was written has been rolled back.
    """
    series = load_series(series_dir)
    if not series.patches:
        raise SeriesError('the patch series holds no NNNN-*.patch files', path=series.directory,
                          cause='an incomplete installation of lmdeploy-guided-spec',
                          fix='pip install --force-reinstall lmdeploy-guided-spec')
    check_version(target, series)
    names = tuple(p.name for p in series.patches)
    state = effective_state(target)
    if state is not None:
        if state.lmdeploy_version != target.version:
            raise StateError(f'the state file records lmdeploy {state.lmdeploy_version}, but lmdeploy '
                             f'{target.version} is installed and its files are not pristine', path=target.state_file,
                             cause='lmdeploy was reinstalled over a patched copy and then edited',
                             fix=f'rm -rf {target.state_dir} && {_reinstall(target.version)}')
        if not state.same_patches(series):
            applied = ', '.join(p.name for p in state.patches)
            raise OtherSeriesAppliedError(
                f'a different patch series is applied ({state.series}: {applied})', path=target.state_file,
                cause='lmdeploy-guided-spec was upgraded or the series was edited after the last apply',
                fix=f'{COMMAND} revert && {COMMAND} apply')
        return _complete(target, series, state, dry_run=dry_run)
    try:
        pristine = read_pristine(target, series.files)
    except NotPristineError as err:
        if _looks_applied(target, series):
            err = NotPristineError(err.what + ', and they look patched by this series without a state file',
                                   path=err.path, details=err.details,
                                   cause=f'{target.state_dir} was deleted after an apply',
                                   fix=err.fix)
        raise err from None
    patched = patch_files(pristine, series.patches)
    write = tuple(rel for rel in series.files if patched[rel] != pristine[rel])
    if dry_run:
        return Result('would apply', series.name, names, write)
    state = State(tool_version=__version__, lmdeploy_version=target.version, series=series.name,
                  patches=tuple(PatchRecord(p.name, p.sha256) for p in series.patches),
                  files=tuple(FileRecord(rel, _optional_sha(pristine[rel]), _optional_sha(patched[rel]))
                              for rel in series.files))
    _install(target, state, pristine, patched, write)
    return Result('applied', series.name, names, write)


def _complete(target: Target, series: Series, state: State, *, dry_run: bool) -> Result:
    names = tuple(p.name for p in series.patches)
    todo: list[str] = []
    modified: list[str] = []
    for rec in state.files:
        now = target.current_sha256(rec.path)
        if now == rec.patched_sha256:
            continue
        (todo if now == rec.pristine_sha256 else modified).append(rec.path)
    if modified:
        raise ModifiedSinceApplyError(f'{len(modified)} patched file(s) were changed after `{COMMAND} apply`',
                                      path=target.package_dir, details='\n'.join(modified),
                                      cause='edited by hand or by another tool',
                                      fix=f'{COMMAND} revert --force && {COMMAND} apply')
    if not todo:
        return Result('already applied', series.name, names)
    pristine = read_pristine(target, series.files, state=state)
    patched = patch_files(pristine, series.patches)
    wrong = [rec.path for rec in state.files if _optional_sha(patched[rec.path]) != rec.patched_sha256]
    if wrong:
        raise StateError('the series no longer produces the recorded patched files', path=target.state_file,
                         details='\n'.join(wrong), cause='git produced different bytes than at the last apply',
                         fix=f'{COMMAND} revert && {COMMAND} apply')
    if dry_run:
        return Result('would apply', series.name, names, tuple(todo))
    try:
        for rel in todo:
            _set_file(target.path_of(rel), patched[rel])
    except OSError as err:
        raise WriteError(f'cannot write the patched files: {err}', path=target.package_dir,
                         cause='no write permission on the installed package',
                         fix=f'run `{COMMAND} apply` as the user that installed lmdeploy') from err
    return Result('applied', series.name, names, tuple(todo),
                  warnings=('an earlier apply had not finished; it has been completed',))


def _prune_empty_dirs(target: Target, path: Path) -> None:
    keep = {str(PurePosixPath(rel).parent) for rel in target.record}
    for parent in path.parents:
        if parent == target.package_dir or not parent.is_relative_to(target.package_dir):
            return
        rel = parent.relative_to(target.site_root).as_posix()
        if any(k == rel or k.startswith(rel + '/') for k in keep) or any(parent.iterdir()):
            return
        parent.rmdir()


def revert(target: Target, *, force: bool = False) -> Result:
    """Restore the files recorded in the state file to their pristine bytes and remove the state directory.

    Only the state file is trusted: the restored bytes are checked against the recorded pristine hash and against
    the wheel RECORD before anything is written.

    Parameters
    ----------
    target : Target
        The installed package.
    force : bool, default: False
        Also restore files that were changed after the apply, discarding those changes.

    Returns
    -------
    Result
        ``action`` is ``'reverted'`` or ``'nothing to revert'`` (no state file).

    Raises
    ------
    ModifiedSinceApplyError
        A patched file was changed after the apply and ``force`` is False (nothing is written).
    StateError
        The state is unreadable, its pristine copies do not verify, or it belongs to another lmdeploy version while
        the files are not pristine.
    """
    state = read_state(target)
    if state is None:
        return Result('nothing to revert')
    names = tuple(p.name for p in state.patches)
    if _state_is_leftover(target, state):
        shutil.rmtree(target.state_dir)
        return Result('nothing to revert', state.series, names,
                      warnings=(f'removed a state directory left behind by a reinstall of lmdeploy: '
                                f'{target.state_dir}',))
    if state.lmdeploy_version != target.version:
        raise StateError(f'the state file records lmdeploy {state.lmdeploy_version}, but lmdeploy {target.version} '
                         'is installed', path=target.state_file,
                         cause='lmdeploy was upgraded over a patched copy',
                         fix=f'rm -rf {target.state_dir} && {_reinstall(target.version)}')
    current = {rec.path: target.current_sha256(rec.path) for rec in state.files}
    modified = [rec.path for rec in state.files if current[rec.path] not in (rec.patched_sha256, rec.pristine_sha256)]
    if modified and not force:
        raise ModifiedSinceApplyError(
            f'{len(modified)} patched file(s) were changed after `{COMMAND} apply`; reverting would discard that',
            path=target.package_dir, details='\n'.join(modified), cause='edited by hand or by another tool',
            fix=f'{COMMAND} revert --force  (discards those edits)')
    pristine = read_pristine(target, current, state=state)
    restored: list[str] = []
    try:
        for rec in state.files:
            if current[rec.path] != rec.pristine_sha256:
                path = target.path_of(rec.path)
                _set_file(path, pristine[rec.path])
                if pristine[rec.path] is None:
                    _prune_empty_dirs(target, path)
                restored.append(rec.path)
    except OSError as err:
        raise WriteError(f'cannot restore the pristine files: {err}; the state is kept, run revert again',
                         path=target.package_dir, cause='no write permission on the installed package',
                         fix=f'run `{COMMAND} revert` as the user that installed lmdeploy') from err
    shutil.rmtree(target.state_dir)
    warnings = tuple(f'discarded changes made after apply to {rel}' for rel in modified)
    return Result('reverted', state.series, names, tuple(restored), warnings)


def installed_is_applied() -> bool:
    """Whether the installed lmdeploy carries its series, applied by this tool (any lmdeploy version with a series)."""
    from .files import find_series
    from .installed import locate_installed
    try:
        target = locate_installed()
        return status(target, find_series(target.version)).overall == 'applied'
    except PatchError:
        return False


def status(target: Target, series_dir: Path) -> Status:
    """Compare the installed package with a series and the state file; changes nothing.

    Parameters
    ----------
    target : Target
        The installed package.
    series_dir : Path
        The ``lmdeploy-<version>/`` directory.

    Returns
    -------
    Status
        Per patch ``applied`` / ``not applied`` / ``stale`` (recorded with other contents, or no longer in the
        series); per file ``pristine`` / ``patched`` (bytes recorded by this tool) / ``modified`` (neither). The
        overall state is ``modified`` if any file is, else ``not applied`` without (effective) state, ``stale`` if a
        patch is, ``applied`` if every file is patched, else ``partially applied``.

    Raises
    ------
    SeriesError, StateError
        When the series or the state file cannot be read.
    """
    series = load_series(series_dir)
    state = effective_state(target)
    recorded = {rec.path: rec for rec in state.files} if state is not None else {}
    files: list[FileStatus] = []
    for rel in sorted(set(series.files) | set(recorded)):
        now = target.current_sha256(rel)
        rec = recorded.get(rel)
        if rec is not None and now == rec.patched_sha256 and rec.patched_sha256 != rec.pristine_sha256:
            files.append(FileStatus(rel, 'patched'))
        elif now == (rec.pristine_sha256 if rec is not None else target.record.get(rel)):
            files.append(FileStatus(rel, 'pristine'))
        elif rec is not None and now == rec.patched_sha256:
            files.append(FileStatus(rel, 'patched'))
        else:
            files.append(FileStatus(rel, 'modified'))
    hashes = {p.name: p.sha256 for p in state.patches} if state is not None else {}
    patches = [PatchStatus(p.name, 'not applied' if p.name not in hashes else
                           'applied' if hashes[p.name] == p.sha256 else 'stale') for p in series.patches]
    in_series = {p.name for p in series.patches}
    patches += [PatchStatus(name, 'stale') for name in hashes if name not in in_series]
    changed = [f for f in files if f.path in recorded and recorded[f.path].pristine_sha256 !=
               recorded[f.path].patched_sha256]
    if any(f.state == 'modified' for f in files):
        overall = 'modified'
    elif state is None:
        overall = 'not applied'
    elif any(p.state == 'stale' for p in patches):
        overall = 'stale'
    elif all(f.state == 'patched' for f in changed):
        overall = 'applied'
    else:
        overall = 'partially applied'
    return Status(overall=overall, installed_version=target.version, series_version=series.version,
                  patches=tuple(patches), files=tuple(files),
                  state_file=target.state_file if state is not None else None)
