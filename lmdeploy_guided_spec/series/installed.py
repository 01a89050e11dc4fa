"""The installed lmdeploy: where it lives, its version, the hashes of its wheel RECORD, and writing its files."""
from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import stat
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path, PurePosixPath

from .errors import LocateError, _reinstall

__all__ = ['PACKAGE', 'STATE_DIR', 'Target', 'locate_installed', 'sha256_hex', 'write_atomic']

PACKAGE = 'lmdeploy'
#: Directory inside the installed ``lmdeploy/`` that holds what was applied (see :mod:`.state`).
STATE_DIR = '.guided_spec'


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


def sha256_hex(data: bytes) -> str:
    """Hex sha256 of ``data``."""
    return hashlib.sha256(data).hexdigest()


def _optional_sha(data: bytes | None) -> str | None:
    return None if data is None else sha256_hex(data)

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
