"""What ``apply`` did, kept in ``<site>/lmdeploy/.guided_spec/``: ``state.json`` and copies of the pristine files."""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

from ..version import __version__
from .errors import COMMAND, NotPristineError, StateError, _reinstall
from .files import Series
from .installed import Target, _optional_sha, sha256_hex

__all__ = ['STATE_FORMAT', 'FileRecord', 'PatchRecord', 'State', 'read_state', 'effective_state', 'read_pristine']

STATE_FORMAT = 1


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
