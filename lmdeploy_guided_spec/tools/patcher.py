"""Patch an installed lmdeploy in place with a patch series, record what was done, and undo it.

The installed package is checked file by file against the sha256 hashes of its wheel ``RECORD`` before anything is
written. Patches are applied with ``git apply`` to copies in a temporary directory outside any git repository; the
installed files are replaced only after every patch of the series applied. What was done is kept in
``<site>/lmdeploy/.guided_spec/`` (``state.json`` plus byte copies of the pristine files), and :func:`revert` trusts
only that record.
"""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path, PurePosixPath

from ..errors import GuidedSpecError
from ..version import __version__

__all__ = [
    'PATCHES_ENV', 'COMMAND', 'PatchError', 'LocateError', 'SeriesError', 'VersionMismatchError', 'NotPristineError',
    'ModifiedSinceApplyError', 'OtherSeriesAppliedError', 'StateError', 'PatchDoesNotApplyError', 'GitNotFoundError',
    'WriteError', 'Target', 'FileChange', 'Patch', 'Series', 'FileRecord', 'PatchRecord', 'State', 'Result',
    'PatchStatus', 'FileStatus', 'Status', 'default_patches_root', 'series_path', 'find_series', 'load_series',
    'locate_installed', 'read_state', 'effective_state', 'read_pristine', 'patch_files', 'check_version', 'apply',
    'revert', 'status', 'sha256_hex', 'write_atomic', 'git_executable', 'git_env'
]

#: Environment variable naming the directory that holds the ``lmdeploy-<version>/`` series directories.
PATCHES_ENV = 'LMDEPLOY_GUIDED_SPEC_PATCHES'
#: Name of the console script; error messages quote it in the command that fixes the problem.
COMMAND = 'lmdeploy-guided-spec'

PACKAGE = 'lmdeploy'
STATE_DIR = '.guided_spec'
STATE_FORMAT = 1

_PATCH_NAME = re.compile(r'^\d{4}-.+\.patch$')
_DIFF_GIT = re.compile(r'^diff --git a/(\S+) b/(\S+)$')


# --------------------------------------------------------------------------------------------------------------------
# errors


class PatchError(GuidedSpecError):
    """Base class of the tooling errors; the message ends with the command that fixes the problem.

    Parameters
    ----------
    what : str
        One line saying what failed.
    path : Path or str, optional
        The file or directory concerned.
    details : str, optional
        Multi-line detail, such as git's stderr or a list of files.
    cause : str, optional
        The likely cause.
    fix : str, optional
        The exact command (or action) that fixes it.

    Attributes
    ----------
    exit_code : int
        Exit status the command line uses for this error.
    """

    exit_code = 1

    def __init__(self, what: str, *, path: Path | str | None = None, details: str | None = None,
                 cause: str | None = None, fix: str | None = None):
        self.what = what
        self.path = path
        self.details = details
        self.cause = cause
        self.fix = fix
        super().__init__(self._render())

    def _render(self) -> str:
        lines = [self.what]
        if self.path is not None:
            lines.append(f'  path: {self.path}')
        if self.details:
            lines.append('  details:')
            lines.extend(f'    {line}' for line in self.details.rstrip().splitlines())
        if self.cause:
            lines.append(f'  likely cause: {self.cause}')
        if self.fix:
            lines.append(f'  to fix: {self.fix}')
        return '\n'.join(lines)


class LocateError(PatchError):
    """lmdeploy, or the wheel metadata needed to verify it, cannot be found."""

    exit_code = 2


class SeriesError(PatchError):
    """The patch series directory is missing or malformed."""

    exit_code = 2


class VersionMismatchError(PatchError):
    """The installed lmdeploy version differs from the version the patch series targets."""

    exit_code = 3


class NotPristineError(PatchError):
    """A file the series touches differs from the wheel's RECORD and was not patched by this tool."""

    exit_code = 4


class ModifiedSinceApplyError(PatchError):
    """A file this tool patched was changed afterwards by something else."""

    exit_code = 4


class OtherSeriesAppliedError(PatchError):
    """A different patch series (other patch contents) is applied; it must be reverted first."""

    exit_code = 4


class StateError(PatchError):
    """The state directory is unreadable, from another tool version, or does not match the installed files."""

    exit_code = 4


class PatchDoesNotApplyError(PatchError):
    """A patch does not apply; ``stderr`` holds git's message."""

    exit_code = 5

    def __init__(self, what: str, *, stderr: str = '', **kwargs):
        self.stderr = stderr
        super().__init__(what, details=stderr or None, **kwargs)


class GitNotFoundError(PatchError):
    """The ``git`` executable is not on ``PATH``."""

    exit_code = 6


class WriteError(PatchError):
    """Writing the installed files failed; everything written so far was rolled back."""

    exit_code = 1


# --------------------------------------------------------------------------------------------------------------------
# data


@dataclass(frozen=True)
class Target:
    """An installed lmdeploy: where it lives, its version and the file hashes of its wheel RECORD.

    Attributes
    ----------
    site_root : Path
        Directory that contains ``lmdeploy/`` (usually ``site-packages``).
    version : str
        Installed lmdeploy version.
    record : Mapping[str, str]
        ``RECORD`` entries with a sha256 hash: posix path relative to ``site_root`` -> hex digest.
    dist_info : Path or None
        The ``lmdeploy-<version>.dist-info`` directory, when known.
    """

    site_root: Path
    version: str
    record: Mapping[str, str]
    dist_info: Path | None = None

    @property
    def package_dir(self) -> Path:
        """``<site_root>/lmdeploy``."""
        return self.site_root / PACKAGE

    @property
    def state_dir(self) -> Path:
        """``<site_root>/lmdeploy/.guided_spec``."""
        return self.package_dir / STATE_DIR

    @property
    def state_file(self) -> Path:
        """``<site_root>/lmdeploy/.guided_spec/state.json``."""
        return self.state_dir / 'state.json'

    def path_of(self, rel: str) -> Path:
        """Absolute path of the posix path ``rel`` (relative to ``site_root``)."""
        return self.site_root / rel

    def current_sha256(self, rel: str) -> str | None:
        """Hex sha256 of the installed file ``rel``; None when it does not exist."""
        path = self.path_of(rel)
        return sha256_hex(path.read_bytes()) if path.is_file() else None

    def is_pristine(self, rel: str) -> bool:
        """Whether ``rel`` is as the wheel installed it (a file absent from RECORD counts when it is absent)."""
        return self.current_sha256(rel) == self.record.get(rel)


@dataclass(frozen=True)
class FileChange:
    """One ``diff --git`` section: ``old`` is None for a created file, ``new`` is None for a deleted one."""

    old: str | None
    new: str | None


@dataclass(frozen=True)
class Patch:
    """One ``NNNN-*.patch`` file of a series.

    Attributes
    ----------
    path : Path
        The patch file.
    sha256 : str
        Hex sha256 of the patch bytes.
    changes : tuple of FileChange
        The files it touches, in the order of its ``diff --git`` lines.
    """

    path: Path
    sha256: str
    changes: tuple[FileChange, ...]

    @property
    def name(self) -> str:
        """File name of the patch."""
        return self.path.name

    @property
    def files(self) -> tuple[str, ...]:
        """Every path the patch reads or writes, relative to the site root."""
        seen: dict[str, None] = {}
        for change in self.changes:
            for rel in (change.old, change.new):
                if rel is not None:
                    seen[rel] = None
        return tuple(seen)


@dataclass(frozen=True)
class Series:
    """A patch series directory ``lmdeploy-<version>/`` and its patches in application order."""

    directory: Path
    version: str
    patches: tuple[Patch, ...]

    @property
    def name(self) -> str:
        """Directory name, ``lmdeploy-<version>``."""
        return self.directory.name

    @property
    def files(self) -> tuple[str, ...]:
        """Sorted union of the files the patches touch."""
        return tuple(sorted({rel for patch in self.patches for rel in patch.files}))


@dataclass(frozen=True)
class FileRecord:
    """State entry of one file: hex sha256 before and after patching (None where the file does not exist)."""

    path: str
    pristine_sha256: str | None
    patched_sha256: str | None


@dataclass(frozen=True)
class PatchRecord:
    """State entry of one patch: its file name and the hex sha256 of its bytes."""

    name: str
    sha256: str


@dataclass(frozen=True)
class State:
    """Contents of ``state.json``: what :func:`apply` did to the installed package."""

    tool_version: str
    lmdeploy_version: str
    series: str
    patches: tuple[PatchRecord, ...]
    files: tuple[FileRecord, ...]
    format: int = STATE_FORMAT

    def same_patches(self, series: Series) -> bool:
        """Whether the recorded patches are exactly the series' patches (names and contents)."""
        return self.patches == tuple(PatchRecord(p.name, p.sha256) for p in series.patches)

    def to_json(self) -> str:
        """Serialise to the ``state.json`` text."""
        doc = {
            'format': self.format,
            'tool': COMMAND,
            'tool_version': self.tool_version,
            'lmdeploy_version': self.lmdeploy_version,
            'series': self.series,
            'patches': [{'name': p.name, 'sha256': p.sha256} for p in self.patches],
            'files': [{'path': f.path, 'pristine_sha256': f.pristine_sha256, 'patched_sha256': f.patched_sha256}
                      for f in self.files],
        }
        return json.dumps(doc, indent=2) + '\n'


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


# --------------------------------------------------------------------------------------------------------------------
# helpers


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _optional_sha(data: bytes | None) -> str | None:
    return None if data is None else sha256_hex(data)


def _reinstall(version: str) -> str:
    return f'pip install --force-reinstall --no-deps lmdeploy=={version}'


def git_executable() -> str:
    """Path of the ``git`` executable.

    Raises
    ------
    GitNotFoundError
        When ``git`` is not on ``PATH``.
    """
    git = shutil.which('git')
    if git is None:
        raise GitNotFoundError('git is not installed or not on PATH', path=os.environ.get('PATH', ''),
                               cause='patches are applied with `git apply`, which needs the git executable',
                               fix='install git (e.g. `apt-get install git` or `conda install git`) and run again')
    return git


def git_env(ceiling: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for running git isolated from the user's configuration and from enclosing repositories.

    Parameters
    ----------
    ceiling : Path
        Directory git must not look above for a repository (``GIT_CEILING_DIRECTORIES``).
    extra : Mapping[str, str], optional
        Variables added last (identity, dates).

    Returns
    -------
    dict
        A copy of ``os.environ`` without ``GIT_*`` variables, with global and system config disabled so settings
        such as ``apply.whitespace=fix`` or ``diff.noprefix`` cannot change the bytes produced.
    """
    env = {k: v for k, v in os.environ.items() if not k.startswith('GIT_')}
    env.update({
        'GIT_CEILING_DIRECTORIES': str(ceiling),
        'GIT_CONFIG_GLOBAL': os.devnull,
        'GIT_CONFIG_NOSYSTEM': '1',
        'GIT_TERMINAL_PROMPT': '0',
        'LC_ALL': 'C',
    })
    if extra:
        env.update(extra)
    return env


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically (temporary file + ``os.replace``).

    Keeps the permission bits of an existing file and makes sure the whole-second mtime changes.
    """
    old = path.stat() if path.exists() else None
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f'.{path.name}.', suffix='.tmp')
    try:
        with os.fdopen(fd, 'wb') as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, stat.S_IMODE(old.st_mode) if old is not None else 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    if old is not None and int(path.stat().st_mtime) <= int(old.st_mtime):
        # .pyc files are validated by whole-second mtime and size; a same-second rewrite of equal size would
        # otherwise keep running the old bytecode.
        later = int(old.st_mtime) + 1
        os.utime(path, (later, later))


def _set_file(path: Path, data: bytes | None) -> None:
    if data is None:
        path.unlink(missing_ok=True)
    else:
        write_atomic(path, data)


# --------------------------------------------------------------------------------------------------------------------
# locating the series and the installed package


def default_patches_root() -> Path:
    """Directory holding the ``lmdeploy-<version>/`` series directories.

    Returns
    -------
    Path
        ``$LMDEPLOY_GUIDED_SPEC_PATCHES`` when set; else the package resource ``lmdeploy_guided_spec/_patches``
        (wheel install); else ``<repository>/patches`` (editable install).
    """
    env = os.environ.get(PATCHES_ENV)
    if env:
        return Path(env).expanduser().absolute()
    here = Path(__file__).resolve()
    packaged = here.parents[1] / '_patches'
    if packaged.is_dir():
        return packaged
    return here.parents[2] / 'patches'


def series_path(lmdeploy_version: str, patches_root: Path | None = None) -> Path:
    """Path of the series directory for ``lmdeploy_version``, whether or not it exists."""
    root = default_patches_root() if patches_root is None else Path(patches_root)
    return root / f'{PACKAGE}-{lmdeploy_version}'


def version_key(version: str) -> tuple:
    """Sort key of a version string in release order: ``0.9.0`` before ``0.14.0``, and ``0.14.0rc1`` before
    ``0.14.0`` before ``0.14.0.post1``."""
    match = re.match(r'(\d+(?:\.\d+)*)(.*)', version)
    if match is None:
        return ((), 0, version)
    release = tuple(int(part) for part in match.group(1).split('.'))
    rest = match.group(2)
    # pre-releases (rc, a, b, dev), the final release, then post-releases
    rank = 1 if not rest else 2 if rest.lstrip('.-_').startswith('post') else 0
    return (release, rank, rest)


def find_series(lmdeploy_version: str, patches_root: Path | None = None) -> Path:
    """Find the series directory ``lmdeploy-<version>/`` for an lmdeploy version.

    Parameters
    ----------
    lmdeploy_version : str
        Version of the lmdeploy to patch.
    patches_root : Path, optional
        Directory of series directories; default :func:`default_patches_root`.

    Returns
    -------
    Path
        The existing series directory.

    Raises
    ------
    SeriesError
        When ``patches_root`` does not exist.
    VersionMismatchError
        When there is no series for this version; the message lists the versions that have one.
    """
    path = series_path(lmdeploy_version, patches_root)
    root = path.parent
    if path.is_dir():
        return path
    if not root.is_dir():
        raise SeriesError('the patch directory does not exist', path=root,
                          cause='lmdeploy-guided-spec was installed without its patch series',
                          fix=f'reinstall lmdeploy-guided-spec, or export {PATCHES_ENV}=/path/to/patches')
    available = sorted((p.name[len(PACKAGE) + 1:] for p in root.glob(f'{PACKAGE}-*') if p.is_dir()),
                       key=version_key)
    newest = available[-1] if available else '<a supported version>'
    raise VersionMismatchError(
        f'no patch series for lmdeploy {lmdeploy_version}; series exist for lmdeploy {", ".join(available) or "none"}',
        path=path, cause='the installed lmdeploy version is not supported by this lmdeploy-guided-spec release',
        fix=f'pip install lmdeploy=={newest}')


def _parse_patch(path: Path) -> Patch:
    data = path.read_bytes()
    changes: list[FileChange] = []
    current: list[str | None] | None = None
    in_header = False
    for line in data.decode('utf-8', errors='replace').splitlines():
        if line.startswith('diff --git '):
            match = _DIFF_GIT.match(line)
            if match is None:
                raise SeriesError(f'cannot read the file names of a diff in {path.name}: {line!r}', path=path,
                                  cause='a path with spaces or quoting; lmdeploy has none, so the patch is broken',
                                  fix='regenerate the series with `lmdeploy-guided-spec dev-export DIR`')
            if current is not None:
                changes.append(FileChange(current[0], current[1]))
            current = [match.group(1), match.group(2)]
            in_header = True
        elif current is not None and in_header:
            if line.startswith('@@') or line.startswith('GIT binary patch'):
                in_header = False
            elif line.startswith('new file mode'):
                current[0] = None
            elif line.startswith('deleted file mode'):
                current[1] = None
            elif line.startswith('rename from '):
                current[0] = line[len('rename from '):]
            elif line.startswith('rename to '):
                current[1] = line[len('rename to '):]
    if current is not None:
        changes.append(FileChange(current[0], current[1]))
    if not changes:
        raise SeriesError(f'{path.name} contains no `diff --git` section', path=path,
                          cause='an empty or truncated patch file',
                          fix='regenerate the series with `lmdeploy-guided-spec dev-export DIR`')
    for change in changes:
        for rel in (change.old, change.new):
            if rel is None:
                continue
            parts = PurePosixPath(rel).parts
            if rel.startswith('/') or parts[0] != PACKAGE or '..' in parts:
                raise SeriesError(f'{path.name} touches {rel!r}, outside the lmdeploy package', path=path,
                                  cause='a patch made against the wrong tree (paths must look like a/lmdeploy/...)',
                                  fix='regenerate the series with `lmdeploy-guided-spec dev-export DIR`')
    return Patch(path=path, sha256=sha256_hex(data), changes=tuple(changes))


def load_series(series_dir: Path) -> Series:
    """Read a series directory: its version from the name and its ``NNNN-*.patch`` files in sorted order.

    Parameters
    ----------
    series_dir : Path
        A ``lmdeploy-<version>/`` directory.

    Returns
    -------
    Series
        May hold no patches.

    Raises
    ------
    SeriesError
        When the directory is missing, misnamed, or holds a ``.patch`` file that is not ``NNNN-*.patch`` or cannot be
        read.
    """
    series_dir = Path(series_dir)
    if not series_dir.is_dir():
        raise SeriesError('the patch series directory does not exist', path=series_dir,
                          cause='a wrong path or a series for another lmdeploy version',
                          fix=f'export {PATCHES_ENV}=/path/to/patches (the directory holding lmdeploy-<version>/)')
    prefix = f'{PACKAGE}-'
    if not series_dir.name.startswith(prefix) or len(series_dir.name) == len(prefix):
        raise SeriesError(f'a series directory must be named lmdeploy-<version>, not {series_dir.name}',
                          path=series_dir, fix='rename the directory after the lmdeploy version it targets')
    names = sorted(p.name for p in series_dir.glob('*.patch'))
    odd = [name for name in names if not _PATCH_NAME.match(name)]
    if odd:
        raise SeriesError(f'patch files must be named NNNN-<subject>.patch: {", ".join(odd)}', path=series_dir,
                          cause='a hand-made patch file', fix='regenerate the series with `git format-patch` via '
                          f'`{COMMAND} dev-export DIR`')
    patches = tuple(_parse_patch(series_dir / name) for name in names)
    return Series(directory=series_dir, version=series_dir.name[len(prefix):], patches=patches)


def _parse_record(text: str) -> dict[str, str]:
    record: dict[str, str] = {}
    for row in csv.reader(io.StringIO(text)):
        if len(row) < 2 or not row[1].startswith('sha256='):
            continue
        digest = row[1][len('sha256='):]
        record[PurePosixPath(row[0]).as_posix()] = base64.urlsafe_b64decode(digest + '=' * (-len(digest) % 4)).hex()
    return record


def _dist_info_in(site_root: Path) -> Path | None:
    candidates = []
    for path in sorted(site_root.glob('*.dist-info')):
        name = path.name[:-len('.dist-info')].rsplit('-', 1)[0]
        if name.lower().replace('_', '-') == PACKAGE:
            candidates.append(path)
    if len(candidates) > 1:
        raise LocateError('several lmdeploy dist-info directories sit next to lmdeploy/', path=site_root,
                          details='\n'.join(str(p) for p in candidates),
                          cause='an interrupted pip upgrade left an old one behind',
                          fix='pip install --force-reinstall --no-deps lmdeploy==<version> (after deleting the '
                          'stale dist-info directory)')
    return candidates[0] if candidates else None


def locate_installed(python_site: Path | None = None) -> Target:
    """Find an installed lmdeploy without importing it.

    Parameters
    ----------
    python_site : Path, optional
        Directory holding ``lmdeploy/`` and ``lmdeploy-<version>.dist-info/``. Default: the lmdeploy the running
        Python would import (``importlib.util.find_spec``) and its distribution metadata.

    Returns
    -------
    Target
        Site root, version and RECORD hashes.

    Raises
    ------
    LocateError
        When lmdeploy or its dist-info/RECORD is not found (a source or editable install has no RECORD hashes).
    """
    if python_site is None:
        spec = util.find_spec(PACKAGE)
        if spec is None or spec.origin is None:
            raise LocateError('lmdeploy is not installed in this Python environment', path=sys.executable,
                              fix='pip install lmdeploy==<version>  (or pass --site DIR)')
        site_root = Path(spec.origin).resolve().parent.parent
    else:
        site_root = Path(python_site).absolute()
        if not (site_root / PACKAGE / '__init__.py').is_file():
            raise LocateError('no lmdeploy package in this directory', path=site_root,
                              fix='pass the site-packages directory that contains lmdeploy/')
    dist_info = _dist_info_in(site_root)
    if dist_info is not None:
        dist = metadata.Distribution.at(dist_info)
    elif python_site is None:
        try:
            dist = metadata.distribution(PACKAGE)
        except metadata.PackageNotFoundError as err:
            raise LocateError('lmdeploy has no distribution metadata', path=site_root,
                              cause='lmdeploy was not installed by pip', fix=_reinstall('<version>')) from err
    else:
        raise LocateError('no lmdeploy-<version>.dist-info next to lmdeploy/', path=site_root,
                          cause='lmdeploy was not installed by pip', fix=_reinstall('<version>'))
    version = dist.version
    record_text = dist.read_text('RECORD')
    if not version or record_text is None:
        raise LocateError('the lmdeploy metadata has no version or no RECORD, so its files cannot be verified',
                          path=dist_info or site_root,
                          cause='lmdeploy was installed from a source tree or in editable mode',
                          fix=_reinstall(version or '<version>'))
    return Target(site_root=site_root, version=version, record=_parse_record(record_text), dist_info=dist_info)


# --------------------------------------------------------------------------------------------------------------------
# state


def read_state(target: Target) -> State | None:
    """Read ``state.json`` of the installed package.

    Returns
    -------
    State or None
        None when the package carries no state (nothing applied).

    Raises
    ------
    StateError
        When the file cannot be read or was written in another format.
    """
    fix = f'rm -rf {target.state_dir} && {_reinstall(target.version)}'
    try:
        doc = json.loads(target.state_file.read_text(encoding='utf-8'))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise StateError(f'cannot read the state file: {err}', path=target.state_file,
                         cause='the file was edited or truncated', fix=fix) from err
    if not isinstance(doc, dict):
        doc = {}
    if doc.get('format') != STATE_FORMAT:
        raise StateError(f'state file format {doc.get("format")!r} is not format {STATE_FORMAT}',
                         path=target.state_file,
                         cause=f'written by lmdeploy-guided-spec {doc.get("tool_version", "?")}, this is {__version__}',
                         fix=f'run `{COMMAND} revert` with the version that applied the patches, or: {fix}')
    try:
        return State(
            tool_version=str(doc['tool_version']),
            lmdeploy_version=str(doc['lmdeploy_version']),
            series=str(doc['series']),
            patches=tuple(PatchRecord(str(p['name']), str(p['sha256'])) for p in doc['patches']),
            files=tuple(FileRecord(str(f['path']), f['pristine_sha256'], f['patched_sha256']) for f in doc['files']),
        )
    except (KeyError, TypeError) as err:
        raise StateError(f'the state file lacks {err}', path=target.state_file, cause='the file was edited',
                         fix=fix) from err


def _state_is_leftover(target: Target, state: State) -> bool:
    # A reinstall of lmdeploy restores the pristine files but leaves the state directory behind.
    return all(target.is_pristine(rec.path) for rec in state.files)


def effective_state(target: Target) -> State | None:
    """The state in effect: :func:`read_state`, or None when every recorded file is pristine again.

    A reinstall of lmdeploy restores the wheel's files but leaves ``.guided_spec/`` behind; such a state describes
    nothing that is installed.
    """
    state = read_state(target)
    return None if state is not None and _state_is_leftover(target, state) else state


def read_pristine(target: Target, paths: Iterable[str], *, state: State | None = None) -> dict[str, bytes | None]:
    """Read the pristine bytes of ``paths``, verified against the wheel RECORD.

    Files recorded in ``state`` are read from the pristine copies in the state directory, all others from the
    installed package. Nothing is written.

    Parameters
    ----------
    target : Target
        The installed package.
    paths : iterable of str
        Posix paths relative to the site root.
    state : State, optional
        State whose pristine copies replace the installed (patched) files.

    Returns
    -------
    dict
        Path -> bytes, or None for a file that does not exist in the pristine package (one the series creates).

    Raises
    ------
    NotPristineError
        When an installed file differs from RECORD, is missing, or exists without being in RECORD; every such file is
        listed.
    StateError
        When a pristine copy in the state directory is missing or differs from its recorded hash or from RECORD.
    """
    recorded = {rec.path: rec for rec in state.files} if state is not None else {}
    out: dict[str, bytes | None] = {}
    problems: list[str] = []
    for rel in paths:
        expected = target.record.get(rel)
        rec = recorded.get(rel)
        if rec is not None:
            copy = target.state_dir / 'pristine' / rel
            data = copy.read_bytes() if copy.is_file() else None
            if _optional_sha(data) != rec.pristine_sha256 or rec.pristine_sha256 != expected:
                raise StateError(f'the saved pristine copy of {rel} does not match the state file and RECORD',
                                 path=copy, cause='the state directory was edited or belongs to another install',
                                 fix=f'rm -rf {target.state_dir} && {_reinstall(target.version)}')
            out[rel] = data
            continue
        path = target.path_of(rel)
        data = path.read_bytes() if path.is_file() else None
        if _optional_sha(data) == expected:
            out[rel] = data
        elif data is None:
            problems.append(f'{rel}: missing (RECORD lists it)')
        elif expected is None:
            problems.append(f'{rel}: exists but is not part of the lmdeploy wheel')
        else:
            problems.append(f'{rel}: sha256 {sha256_hex(data)[:12]}… differs from RECORD {expected[:12]}…')
    if problems:
        raise NotPristineError(f'{len(problems)} file(s) of lmdeploy {target.version} are not as the wheel installed '
                               'them', path=target.package_dir, details='\n'.join(problems),
                               cause='edited by hand or patched by another tool',
                               fix=_reinstall(target.version))
    return out


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


def check_version(target: Target, series: Series) -> None:
    """Raise :class:`VersionMismatchError` unless the installed lmdeploy is the version ``series`` targets."""
    if target.version != series.version:
        raise VersionMismatchError(
            f'installed lmdeploy {target.version} does not match the patch series for lmdeploy {series.version}',
            path=series.directory, cause='lmdeploy was upgraded or downgraded after lmdeploy-guided-spec was installed',
            fix=f'pip install lmdeploy=={series.version}')


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
