"""Start the series of a new lmdeploy version from the series of an older one: ``dev-port``.

The scratch checkout holds two histories. Branch ``from-<old>``: the old version's pristine sources (the merge bases
git needs) and the old series as commits, as ``dev-checkout`` makes them. Branch ``main``: the installed version's
pristine sources, tagged ``pristine`` (the same commit ``dev-checkout`` makes), onto which every old commit is
cherry-picked with a three-way merge. What applies becomes a commit; a conflict stops the port mid-cherry-pick (or,
with ``keep_going``, is skipped and listed). The finished checkout is exported by ``dev-export`` into
``patches/lmdeploy-<installed version>/``.
"""
from __future__ import annotations

import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from . import COMMAND, PACKAGE, Series, Target, effective_state, load_series, read_pristine
from .devseries import (
    _BASE_IDENTITY,
    PRISTINE_TAG,
    DevSeriesError,
    _binary_suffixes,
    _commit_pristine,
    _git,
    _git_ok,
    _source_paths,
)
from .release import git_blob_id

__all__ = ['PortedPatch', 'PortResult', 'read_sources', 'port']

_COMMITTER = {k: v for k, v in _BASE_IDENTITY.items() if k.startswith('GIT_COMMITTER_')}


@dataclass(frozen=True)
class PortedPatch:
    """What became of one patch of the old series: ``applied``, ``empty`` (lmdeploy already has the change),
    ``conflict`` (with the conflicted files) or ``pending`` (not tried: an earlier conflict stopped the port);
    ``commit`` is its commit on the ``from-<old>`` branch of the checkout."""

    name: str
    state: str
    commit: str
    files: tuple[str, ...] = ()


@dataclass(frozen=True)
class PortResult:
    """The checkout, the versions, and each old patch's fate in series order; ``stopped`` while a cherry-pick is
    in progress in the checkout."""

    workdir: Path
    from_version: str
    version: str
    patches: tuple[PortedPatch, ...]
    stopped: bool


def read_sources(path: Path, from_version: str) -> dict[str, bytes]:
    """The ``lmdeploy/`` files (compiled extensions left out) of an lmdeploy wheel or of a directory holding
    ``lmdeploy/`` (a site-packages or a source tree; the ``lmdeploy/`` directory itself is accepted too).

    Raises
    ------
    DevSeriesError
        When ``path`` is neither, or holds no ``lmdeploy/__init__.py``.
    """
    path = Path(path).expanduser().absolute()
    binary = _binary_suffixes()
    files: dict[str, bytes] = {}
    if path.is_file() and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as wheel:
            for name in wheel.namelist():
                if name.startswith(f'{PACKAGE}/') and not name.endswith('/') and not name.endswith(binary):
                    files[name] = wheel.read(name)
    elif path.is_dir():
        root = path.parent if path.name == PACKAGE and (path / '__init__.py').is_file() else path
        for file in sorted((root / PACKAGE).rglob('*')):
            rel = file.relative_to(root).as_posix()
            parts = PurePosixPath(rel).parts
            if (file.is_file() and not rel.endswith(binary) and not rel.endswith('.pyc')
                    and '__pycache__' not in parts and '.guided_spec' not in parts):
                files[rel] = file.read_bytes()
    if f'{PACKAGE}/__init__.py' not in files:
        raise DevSeriesError(f'no lmdeploy {from_version} sources here', path=path,
                             cause='--from-sources must name an lmdeploy wheel (.whl) or a directory holding lmdeploy/',
                             fix=f'pip download --no-deps lmdeploy=={from_version} and pass the wheel')
    return files


def _check_preimages(series: Series, sources: dict[str, bytes], path: Path) -> None:
    for rel, want in sorted(series.preimages.items()):
        data = sources.get(rel)
        if want is None and data is None:
            continue
        if want is None or data is None or git_blob_id(data) != want:
            have = 'missing' if data is None else f'blob {git_blob_id(data)}'
            raise DevSeriesError(f'the sources are not pristine lmdeploy {series.version}: {rel} is {have}, the '
                                 f'series {series.name} was made against '
                                 f'{"no such file" if want is None else "blob " + want}', path=path,
                                 cause='another lmdeploy version, or an installation with a series applied',
                                 fix=f'pass the lmdeploy {series.version} wheel: pip download --no-deps '
                                 f'lmdeploy=={series.version}')


def _conflicted(workdir: Path) -> tuple[str, ...]:
    return tuple(_git_ok(['diff', '--name-only', '--diff-filter=U'], workdir).split())


def port(workdir: Path, target: Target, from_series_dir: Path, sources: Path, *, keep_going: bool = False,
         progress: Callable[[PortedPatch], None] | None = None) -> PortResult:
    """Port the series in ``from_series_dir`` onto the pristine sources of the installed lmdeploy, in ``workdir``.

    Parameters
    ----------
    workdir : Path
        Directory to create; it must not exist or be empty.
    target : Target
        The installed lmdeploy: the version to port to, and its pristine sources.
    from_series_dir : Path
        The old ``lmdeploy-<old>/`` series.
    sources : Path
        The old version's wheel or a directory holding its ``lmdeploy/`` (the merge bases).
    keep_going : bool, default: False
        On a conflict, skip that patch and go on with the next instead of stopping.
    progress : callable, optional
        Called with each patch's outcome as it is known.

    Returns
    -------
    PortResult
        ``stopped`` when a conflict left a cherry-pick in progress in ``workdir``.

    Raises
    ------
    DevSeriesError
        ``workdir`` is not empty, the sources are not the old version's pristine files, or the old series does not
        apply to them.
    """
    workdir = Path(workdir).absolute()
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise DevSeriesError('the checkout directory exists and is not empty', path=workdir,
                             fix=f'{COMMAND} dev-port --from <version> --from-sources <wheel> <a new directory>')
    old = load_series(from_series_dir)
    if not old.patches:
        raise DevSeriesError('the series to port holds no patches', path=old.directory)
    old_files = read_sources(sources, old.version)
    _check_preimages(old, old_files, Path(sources))
    new_empty = Series(directory=from_series_dir.parent / f'{PACKAGE}-{target.version}', version=target.version,
                       patches=())
    new_files = read_pristine(target, _source_paths(target, new_empty), state=effective_state(target))
    workdir.mkdir(parents=True, exist_ok=True)
    _git_ok(['init', '-q', '-b', f'from-{old.version}'], workdir)
    # the old version's pristine sources and series: the bases of the three-way merges
    _commit_pristine(workdir, old.version, old_files)
    _git_ok(['tag', f'{PRISTINE_TAG}-{old.version}'], workdir)
    proc = _git(['am', '--3way', '--keep-non-patch', '--quiet', *(str(p.path) for p in old.patches)], workdir,
                extra_env=_COMMITTER)
    if proc.returncode != 0:
        raise DevSeriesError(f'the series {old.name} does not apply to the given lmdeploy {old.version} sources',
                             path=workdir, details=(proc.stdout + proc.stderr).strip(),
                             fix=f'{COMMAND} verify-series in an environment with lmdeploy {old.version}')
    old_commits = _git_ok(['rev-list', '--reverse', f'{PRISTINE_TAG}-{old.version}..HEAD'], workdir).split()
    # the installed version's pristine sources: the same commit dev-checkout makes
    _git_ok(['checkout', '-q', '--orphan', 'main'], workdir)
    _git_ok(['rm', '-rfq', '.'], workdir)
    _git_ok(['config', 'guidedspec.lmdeployversion', target.version], workdir)
    _commit_pristine(workdir, target.version, new_files)
    _git_ok(['tag', PRISTINE_TAG], workdir)
    outcomes: list[PortedPatch] = []

    def record(outcome: PortedPatch) -> None:
        outcomes.append(outcome)
        if progress is not None:
            progress(outcome)

    stopped = False
    for index, (patch, commit) in enumerate(zip(old.patches, old_commits)):
        proc = _git(['cherry-pick', '--allow-empty-message', commit], workdir, extra_env=_COMMITTER)
        if proc.returncode == 0:
            record(PortedPatch(patch.name, 'applied', commit))
            continue
        conflicted = _conflicted(workdir)
        if not conflicted:
            # the change is already in lmdeploy: the pick is empty
            _git_ok(['cherry-pick', '--skip'], workdir)
            record(PortedPatch(patch.name, 'empty', commit))
            continue
        record(PortedPatch(patch.name, 'conflict', commit, conflicted))
        if keep_going:
            _git_ok(['cherry-pick', '--abort'], workdir)
            continue
        # again as a sequence, so that `git cherry-pick --continue` goes on with the remaining patches
        _git_ok(['cherry-pick', '--abort'], workdir)
        _git(['cherry-pick', '--allow-empty-message', f'{commit}^..{old_commits[-1]}'], workdir,
             extra_env=_COMMITTER)
        for rest, rest_commit in zip(old.patches[index + 1:], old_commits[index + 1:]):
            record(PortedPatch(rest.name, 'pending', rest_commit))
        stopped = True
        break
    return PortResult(workdir, old.version, target.version, tuple(outcomes), stopped)
