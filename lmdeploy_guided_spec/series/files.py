"""The series files: ``patches/lmdeploy-<version>/NNNN-*.patch``, where they are, which one fits, what they touch."""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from .errors import COMMAND, SeriesError, VersionMismatchError
from .installed import PACKAGE, sha256_hex

__all__ = ['PATCHES_ENV', 'FileChange', 'Patch', 'Series', 'default_patches_root', 'series_path', 'version_key',
           'find_series', 'load_series']

#: Environment variable naming the directory that holds the ``lmdeploy-<version>/`` series directories.
PATCHES_ENV = 'LMDEPLOY_GUIDED_SPEC_PATCHES'

_PATCH_NAME = re.compile(r'^\d{4}-.+\.patch$')
_DIFF_GIT = re.compile(r'^diff --git a/(\S+) b/(\S+)$')
_INDEX = re.compile(r'^index ([0-9a-f]+)\.\.([0-9a-f]+)')


@dataclass(frozen=True)
class FileChange:
    """One ``diff --git`` section: ``old`` is None for a created file, ``new`` is None for a deleted one.

    ``old_blob`` and ``new_blob`` are the git blob ids of its ``index <old>..<new>`` line (full with
    ``format-patch --full-index``; None where the line is missing, as for a pure rename); equality ignores them.
    """

    old: str | None
    new: str | None
    old_blob: str | None = field(default=None, compare=False)
    new_blob: str | None = field(default=None, compare=False)


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

    @property
    def preimages(self) -> dict[str, str | None]:
        """The files the series was made against: path -> git blob id, or None for a file it creates.

        The first patch touching a path gives its pre-image; a path only ever written (created, or the target of a
        rename) has None: it must be absent. Paths whose diff records no blob id are left out.
        """
        out: dict[str, str | None] = {}
        for patch in self.patches:
            for change in patch.changes:
                if change.old is not None and change.old not in out and change.old_blob is not None:
                    out[change.old] = change.old_blob
                if change.new is not None and change.new not in out and change.old != change.new:
                    out[change.new] = None
        return out


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
    current: list[str | None] | None = None  # old, new, old_blob, new_blob
    in_header = False
    for line in data.decode('utf-8', errors='replace').splitlines():
        if line.startswith('diff --git '):
            match = _DIFF_GIT.match(line)
            if match is None:
                raise SeriesError(f'cannot read the file names of a diff in {path.name}: {line!r}', path=path,
                                  cause='a path with spaces or quoting; lmdeploy has none, so the patch is broken',
                                  fix='regenerate the series with `lmdeploy-guided-spec dev-export DIR`')
            if current is not None:
                changes.append(FileChange(*current))
            current = [match.group(1), match.group(2), None, None]
            in_header = True
        elif current is not None and in_header:
            if line.startswith('@@') or line.startswith('GIT binary patch'):
                in_header = False
            elif _INDEX.match(line):
                old_blob, new_blob = _INDEX.match(line).groups()
                current[2] = None if set(old_blob) == {'0'} else old_blob
                current[3] = None if set(new_blob) == {'0'} else new_blob
            elif line.startswith('new file mode'):
                current[0] = None
            elif line.startswith('deleted file mode'):
                current[1] = None
            elif line.startswith('rename from '):
                current[0] = line[len('rename from '):]
            elif line.startswith('rename to '):
                current[1] = line[len('rename to '):]
    if current is not None:
        changes.append(FileChange(*current))
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
