"""One background thread that runs a manager's grammar work in submission order.

Order is the invariant: a commit submitted before a fork is applied before the fork is taken, and the fills of
a drafting window finish before its verification masks are read. Work that is submitted while the device runs
a forward pass is hidden behind it.
"""
from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from typing import Any

__all__ = ['GrammarWorker']


class GrammarWorker:
    """A single worker thread; :meth:`submit` returns a ``concurrent.futures.Future``.

    Parameters
    ----------
    inline : bool, default: False
        Run every job at submission on the calling thread (for debugging and for the reference timings).
    """

    def __init__(self, *, inline: bool = False):
        self.inline = inline
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)`` behind every job submitted before it."""
        if self.inline:
            future: concurrent.futures.Future = concurrent.futures.Future()
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: B036 - handed to the waiter, as the pool does
                future.set_exception(err)
            return future
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                   thread_name_prefix='guided-spec-grammar')
            return self._pool.submit(fn, *args, **kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Queue ``fn`` and wait for its result."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Finish queued jobs and stop the thread (a later submit starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
