"""The patch-series tooling: patch an installed lmdeploy in place, undo it, and maintain the series.

By concern:

- :mod:`.installed`: the installed lmdeploy (:class:`Target`, :func:`locate_installed`) and its wheel RECORD;
- :mod:`.files`: the series files ``patches/lmdeploy-<version>/`` (:func:`find_series`, :func:`load_series`);
- :mod:`.state`: what ``apply`` recorded inside the installed package, and the pristine copies;
- :mod:`.release`: which series fits the installed version (its own, or an earlier patch release's whose
  pre-images are byte-identical: :func:`select_series`, :func:`check_version`);
- :mod:`.patching`: :func:`apply`, :func:`revert`, :func:`status`;
- :mod:`.devseries`: the series as git commits (``dev-checkout``, ``dev-export``, ``verify-series``);
- :mod:`.errors` and :mod:`.git`: the errors every part raises, and git run apart from the user's configuration.

None of it imports torch, xgrammar, lmdeploy, the CPU path or the command line.
"""
from .errors import (
    COMMAND,
    GitNotFoundError,
    LocateError,
    ModifiedSinceApplyError,
    NotPristineError,
    OtherSeriesAppliedError,
    PatchDoesNotApplyError,
    PatchError,
    SeriesError,
    StateError,
    VersionMismatchError,
    WriteError,
)
from .files import (
    PATCHES_ENV,
    FileChange,
    Patch,
    Series,
    default_patches_root,
    find_series,
    load_series,
    series_path,
    version_key,
)
from .git import git_env, git_executable
from .installed import PACKAGE, Target, locate_installed, sha256_hex, write_atomic
from .patching import FileStatus, PatchStatus, Result, Status, apply, patch_files, revert, status
from .release import check_version, git_blob_id, is_patch_release_of, preimage_difference, select_series
from .state import FileRecord, PatchRecord, State, effective_state, read_pristine, read_state

__all__ = [
    'PATCHES_ENV', 'COMMAND', 'PACKAGE', 'PatchError', 'LocateError', 'SeriesError', 'VersionMismatchError',
    'NotPristineError', 'ModifiedSinceApplyError', 'OtherSeriesAppliedError', 'StateError', 'PatchDoesNotApplyError',
    'GitNotFoundError', 'WriteError', 'Target', 'FileChange', 'Patch', 'Series', 'FileRecord', 'PatchRecord', 'State',
    'Result', 'PatchStatus', 'FileStatus', 'Status', 'default_patches_root', 'series_path', 'version_key',
    'find_series', 'load_series', 'locate_installed', 'read_state', 'effective_state', 'read_pristine', 'patch_files',
    'check_version', 'apply', 'revert', 'status', 'sha256_hex', 'write_atomic', 'git_executable', 'git_env',
    'git_blob_id', 'is_patch_release_of', 'preimage_difference', 'select_series'
]
