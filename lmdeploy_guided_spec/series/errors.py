"""The errors of the series tooling: each says what failed, where, why, and the command that fixes it."""
from __future__ import annotations

from pathlib import Path

from ..errors import GuidedSpecError

__all__ = [
    'COMMAND', 'PatchError', 'LocateError', 'SeriesError', 'VersionMismatchError', 'NotPristineError',
    'ModifiedSinceApplyError', 'OtherSeriesAppliedError', 'StateError', 'PatchDoesNotApplyError', 'GitNotFoundError',
    'WriteError'
]

#: Name of the console script; error messages quote it in the command that fixes the problem.
COMMAND = 'lmdeploy-guided-spec'


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


def _reinstall(version: str) -> str:
    return f'pip install --force-reinstall --no-deps lmdeploy=={version}'

