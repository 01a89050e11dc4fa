"""Running git isolated from the user's configuration and from enclosing repositories."""
from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from .errors import GitNotFoundError

__all__ = ['git_executable', 'git_env']


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

