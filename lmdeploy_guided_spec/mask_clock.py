"""The cost of each token mask of a running request, against the limit the compile service probes grammars with.

The compile service fills the masks of a grammar's first 16 tokens before the engine takes it
(``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS``, :func:`lmdeploy_guided_spec.compile.grammar_cost`), and no more. A grammar
whose masks grow slow later passes: xgrammar's parser keeps more items the more an ambiguous repetition has read, so
a fixed prefix and then ``([a-z]+ ?){1,300}`` costs microseconds a mask for the prefix, then 0.8 s after the second
word and 3 s after the sixth. Every request of the batch waited for each of those masks, for as long as the request
ran. A :class:`MaskClock` times each mask it fills (the CPU time of the filling thread, as the probe measures, so that
a busy machine does not count) and keeps, per request, the first one over the limit: the engine refuses that request
after its step, with the cost and the limit, as the compile service refuses a grammar its probe finds slow (HTTP
400 through the api_server), and the others go on.

The clock only records: every mask is still filled as before, so that ranks which fill the same masks (drafts that
every rank of a tensor-parallel group must draft alike) never disagree because one of them was slower.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Hashable, Iterable

__all__ = ['MaskClock']


class MaskClock:
    """Fills token masks, timing each, and keeps ``{key: message}`` of the requests whose mask went over the limit.

    Parameters
    ----------
    limit_ms : float, optional
        The most CPU time one mask may take, in milliseconds; ``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS`` by default
        (250; ``inf`` turns the clock off).
    """

    def __init__(self, limit_ms: float | None = None):
        from .compile import mask_limit_ms_from_env
        self.limit_ms = float(limit_ms) if limit_ms is not None else mask_limit_ms_from_env()
        if not self.limit_ms > 0:
            raise ValueError(f'limit_ms must be positive, got {limit_ms!r}')
        self.limit_s = self.limit_ms / 1000
        self._over: dict[Hashable, str] = {}
        self._lock = threading.Lock()

    def fill(self, matcher, bitmask, index: int, key: Hashable | None) -> bool:
        """``matcher.fill_next_token_bitmask(bitmask, index)``, timed against the limit for the request ``key``
        (None: not timed). True where this mask went over the limit."""
        if key is None or self.limit_s == float('inf'):
            matcher.fill_next_token_bitmask(bitmask, index)
            return False
        start = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask, index)
        return self.charge(key, time.thread_time() - start)

    def charge(self, key: Hashable, seconds: float) -> bool:
        """Count a mask of ``seconds`` CPU time for the request ``key``; True where it is over the limit (the first
        such mask of a request is the one its message names)."""
        if not seconds > self.limit_s:
            return False
        from .compile import MASK_LIMIT_ENV
        message = (f'the grammar costs {seconds * 1e3:.0f} ms per token to match (a token mask later in the output), '
                   f'more than the limit of {self.limit_ms:g} ms ({MASK_LIMIT_ENV}): every guided request waited for '
                   'it at every step. Simplify the schema or regex; counted repetitions of groups that can match the '
                   'same text in several ways, such as ([a-z]+ ?){1,300}, are the usual cause')
        with self._lock:
            self._over.setdefault(key, message)
        return True

    def pop(self) -> dict[Hashable, str]:
        """``{key: message}`` of the requests over the limit since the last call."""
        with self._lock:
            over, self._over = self._over, {}
        return over

    def forget(self, keys: Iterable[Hashable]) -> None:
        """Drop what is kept for requests that ended."""
        with self._lock:
            for key in keys:
                self._over.pop(key, None)
