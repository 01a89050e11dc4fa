"""Which series fits the installed lmdeploy: the series of its own version, or, for a patch release, the series of
an earlier release of the same minor version whose pre-images are byte-identical to the installed files.

A series is exported with ``git format-patch --full-index``, so the ``index <old>..<new>`` line of each file diff
records the git blob id of the file the patch was made against. The first patch touching a file gives the series'
pre-image of that file: a blob id, or absent for a file the series creates. A patch release (``0.14.1`` under the
series for ``0.14.0``) is accepted when every such pre-image equals the pristine installed file, so the patched
files are exactly those of the older release.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from .errors import COMMAND, VersionMismatchError
from .files import Series, find_series, load_series, series_path, version_key
from .installed import PACKAGE, Target
from .state import effective_state, read_pristine

__all__ = ['git_blob_id', 'is_patch_release_of', 'preimage_difference', 'check_version', 'select_series']


def git_blob_id(data: bytes) -> str:
    """The id git gives ``data`` as a blob (sha1 of ``blob <size>\\0`` and the bytes)."""
    return hashlib.sha1(b'blob %d\0' % len(data) + data).hexdigest()


def _release(version: str) -> tuple[int, ...]:
    return version_key(version)[0]


def is_patch_release_of(installed: str, series_version: str) -> bool:
    """Whether ``installed`` is a later release of the same major.minor as ``series_version`` (0.14.1 of 0.14.0)."""
    a, b = _release(installed), _release(series_version)
    return len(a) >= 2 and a[:2] == b[:2] and version_key(installed) > version_key(series_version)


def preimage_difference(target: Target, series: Series) -> tuple[str, str] | None:
    """The first file (in path order) whose pristine installed bytes are not the series' pre-image, and why.

    Returns
    -------
    tuple of (str, str) or None
        The path and the reason, or None when every file the series touches is byte-identical to its pre-image.

    Raises
    ------
    NotPristineError, StateError
        When the pristine bytes of the installed files cannot be obtained (see :func:`.state.read_pristine`).
    """
    preimages = series.preimages
    pristine = read_pristine(target, sorted(preimages), state=effective_state(target))
    for rel in sorted(preimages):
        want, data = preimages[rel], pristine[rel]
        if want is None:
            if data is not None:
                return rel, f'the series creates it, but lmdeploy {target.version} has it'
        elif data is None:
            return rel, f'lmdeploy {target.version} does not have it'
        elif len(want) != 40:
            return rel, f'the series records an abbreviated blob id {want} (not exported with --full-index)'
        elif git_blob_id(data) != want:
            return rel, f'its blob {git_blob_id(data)} is not the pre-image {want} of the series'
    return None


def check_version(target: Target, series: Series) -> None:
    """Accept ``series`` for the installed lmdeploy, or raise :class:`VersionMismatchError`.

    Accepted: the series of the installed version; or the series of an earlier release of the same major.minor when
    every file the series touches is byte-identical to the series' pre-image (:func:`preimage_difference`).
    """
    if target.version == series.version:
        return
    if not is_patch_release_of(target.version, series.version):
        raise VersionMismatchError(
            f'installed lmdeploy {target.version} does not match the patch series for lmdeploy {series.version}',
            path=series.directory, cause='lmdeploy was upgraded or downgraded after lmdeploy-guided-spec was installed',
            fix=f'pip install lmdeploy=={series.version}')
    difference = preimage_difference(target, series)
    if difference is not None:
        rel, reason = difference
        raise VersionMismatchError(
            f'installed lmdeploy {target.version} is a patch release of {series.version}, but {rel} differs from the '
            f'file the series {series.name} was made against', path=series.directory, details=f'{rel}: {reason}',
            cause=f'lmdeploy {target.version} changed a file the series patches, so the series may no longer fit',
            fix=f'pip install lmdeploy=={series.version}; or port the series to lmdeploy {target.version}: '
            f'{COMMAND} dev-port --from {series.version} --from-sources <the lmdeploy {series.version} wheel> DIR, '
            f'then {COMMAND} dev-export DIR')


def select_series(target: Target, patches_root: Path | None = None) -> Path:
    """The series directory for the installed lmdeploy.

    The series of its own version when there is one; else the newest series of an earlier release of the same
    major.minor whose pre-images are byte-identical to the installed files (:func:`check_version`).

    Raises
    ------
    SeriesError
        When the patch directory does not exist.
    VersionMismatchError
        When no series fits; for a patch release, the message names the first file that differs.
    """
    exact = series_path(target.version, patches_root)
    if exact.is_dir():
        return exact
    root = exact.parent
    candidates = sorted((p for p in root.glob(f'{PACKAGE}-*') if p.is_dir()
                         and is_patch_release_of(target.version, p.name[len(PACKAGE) + 1:])),
                        key=lambda p: version_key(p.name[len(PACKAGE) + 1:]), reverse=True)
    first_error: VersionMismatchError | None = None
    for path in candidates:
        try:
            check_version(target, load_series(path))
        except VersionMismatchError as err:
            first_error = first_error or err
            continue
        return path
    if first_error is not None:
        raise first_error
    return find_series(target.version, patches_root)
