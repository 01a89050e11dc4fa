"""The cost of each token mask of a running request, against the limit the compile service probes grammars with.

The compile service fills the masks of a grammar's first 16 tokens before the engine takes it
(``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS``, :func:`lmdeploy_guided_spec.compile.grammar_cost`), and no more. A grammar
whose masks grow slow later passes: xgrammar's parser keeps more items the more an ambiguous repetition has read, so
a fixed prefix and then ``([a-z]+ ?){1,300}`` costs microseconds a mask for the prefix, then 0.8 s after the second
word and 3 s after the sixth. Every request of the batch waited for each of those masks, for as long as the request
ran. A :class:`MaskClock` times each mask it fills (the CPU time of the filling thread, as the probe measures, so that
a busy machine does not count) and keeps the requests with two masks over the limit: the engine refuses such a
request after its step, with the cost and the limit, as the compile service refuses a grammar its probe finds slow
(HTTP 400 through the api_server), and the others go on.

The clock only records: every mask is still filled as before, so that ranks which fill the same masks (drafts that
every rank of a tensor-parallel group must draft alike) never disagree because one of them was slower.
"""
from __future__ import annotations

import math
import threading
import time
from collections.abc import Hashable, Iterable, Mapping
from typing import Any

__all__ = ['MaskClock']


class MaskClock:
    """Fills token masks, timing each, and keeps ``{key: message}`` of the requests whose masks went over the limit.

    A request is over the limit at its second mask over it: the probe takes the fastest of three measures of a slow
    mask, and a single measure that a busy core stretched does not end a long output. A grammar whose masks grow
    slow goes over at its next mask again.

    Each record names its ``owner``, the committed matcher of the request whose masks were timed: a session id
    comes back (the next turn of a chat, a client's own ``session_id``), and a mask filled late for a request that
    has ended (a drafting window the engine scheduled before it read the refusal) must not refuse the next one.

    Parameters
    ----------
    limit_ms : float, optional
        The most CPU time one mask may take, in milliseconds; ``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS`` by default
        (250; ``inf`` turns the clock off).
    """

    #: masks over the limit that refuse a request
    STRIKES = 2

    def __init__(self, limit_ms: float | None = None):
        from .compile import mask_limit_ms_from_env
        self.limit_ms = float(limit_ms) if limit_ms is not None else mask_limit_ms_from_env()
        if not self.limit_ms > 0:
            raise ValueError(f'limit_ms must be positive, got {limit_ms!r}')
        self.limit_s = self.limit_ms / 1000
        # key -> (owner, masks over the limit so far)
        self._strikes: dict[Hashable, tuple[Any, int]] = {}
        # key -> (owner, message): the requests over the limit, not handed out yet
        self._over: dict[Hashable, tuple[Any, str]] = {}
        self._lock = threading.Lock()

    def fill(self, matcher, bitmask, index: int, key: Hashable | None, owner: Any = None) -> bool:
        """``matcher.fill_next_token_bitmask(bitmask, index)``, timed against the limit for the request ``key``
        (None: not timed) whose committed matcher is ``owner``. True where this mask went over the limit."""
        if key is None or self.limit_s == math.inf:
            matcher.fill_next_token_bitmask(bitmask, index)
            return False
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, index)
        return self.charge(key, time.thread_time() - start, owner)

    def charge(self, key: Hashable, seconds: float, owner: Any = None, what: str = 'a mask') -> bool:
        """Count a mask (or other grammar work of one token, ``what``: 'an accept') of ``seconds`` CPU time for the
        request ``key`` (its committed matcher ``owner``); True where it is over the limit. At :attr:`STRIKES` such
        measures of one owner the request is over the limit."""
        if not seconds > self.limit_s:
            return False
        from .compile import MASK_LIMIT_ENV
        with self._lock:
            previous, count = self._strikes.get(key, (owner, 0))
            count = count + 1 if previous is owner else 1
            self._strikes[key] = (owner, count)
            if count >= self.STRIKES and key not in self._over:
                self._over[key] = (owner, (
                    f'the grammar costs {seconds * 1e3:.0f} ms per token to match ({what} of the running request), '
                    f'more than the limit of {self.limit_ms:g} ms ({MASK_LIMIT_ENV}): every request of the batch '
                    'waited for it at every step. Simplify the schema or regex; counted repetitions of groups that '
                    'can match the same text in several ways, such as ([a-z]+ ?){1,300}, are the usual cause'))
        return True

    @property
    def pending(self) -> bool:
        """Whether a record waits to be handed out: a caller that derives ``owners`` for :meth:`pop` from its batch
        need not, at every step, while none does."""
        return bool(self._over)

    def pop(self, owners: Mapping[Hashable, Any] | None = None) -> dict[Hashable, str]:
        """``{key: message}`` of the requests over the limit, handed out once.

        ``owners``: the requests of the step that asks, ``{key: committed matcher}``. Only their records are handed
        out; a record of another owner under one of their keys (an earlier request of that session id) is dropped,
        and the records of other keys wait for a step of theirs. None hands out every record.
        """
        with self._lock:
            if owners is None:
                over, self._over = self._over, {}
                return {key: message for key, (_, message) in over.items()}
            found = {}
            for key in [key for key in self._over if key in owners]:
                owner, message = self._over.pop(key)
                if owner is owners[key]:
                    found[key] = message
            return found

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop what is kept for requests that ended."""
        with self._lock:
            for key in keys:
                self._over.pop(key, None)
                self._strikes.pop(key, None)
