"""Settings read from the environment, all refused the same way: a variable that is set but malformed raises
``ValueError`` naming it. Imports nothing heavy: the API process reads settings before the engine exists."""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

__all__ = ['positive_from_env']

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
