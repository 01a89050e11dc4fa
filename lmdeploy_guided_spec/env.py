"""Settings read from the environment, all refused the same way: a variable that is set but malformed raises
``ValueError`` naming it. Imports nothing heavy: the API process reads settings before the engine exists."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ['positive_from_env', 'warn_bad_setting_once']

T = TypeVar('T', int, float)


def positive_from_env(name: str, default: T, *, parse: Callable[[str], T] = float, kind: str = 'a number') -> T:
    """``parse`` of the variable ``name``, or ``default`` where it is unset or blank; raises ``ValueError`` naming
    the variable where ``parse`` refuses it (it is not ``kind``) or the value is not positive."""
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f'{name}={raw!r} is not {kind}') from None
    if not value > 0:
        raise ValueError(f'{name}={raw!r} must be positive ({kind})')
    return value


# the bad settings already logged in this process: every engine, rank and pipeline reads them again
_WARNED: set[str] = set()


def warn_bad_setting_once(logger: logging.Logger, message: str) -> None:
    """Log ``message`` (a malformed environment variable and what applies instead) once per process."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)
