"""One background thread that runs a manager's grammar work in submission order.

Order is the invariant: a commit submitted before a fork is applied before the fork is taken, and the fills of
a drafting window finish before its verification masks are read. Work that is submitted while the device runs
a forward pass is hidden behind it.

The worker shares the process's GIL with the engine's threads. Its work is thousands of short calls into xgrammar
per step, each of which releases the GIL and takes it back; while another thread runs pure Python, each taking back
waits for the interpreter's switch interval (5 ms by default), and a step of grammar work takes a hundred times
longer (``benchmarks/gil_share.py``). ``LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS`` sets a shorter interval for the
process when the worker thread starts (:func:`switch_interval_from_env`); unset, Python's stays.
"""
from __future__ import annotations

import concurrent.futures
import logging
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from .env import warn_bad_setting_once

__all__ = ['GrammarWorker', 'SWITCH_INTERVAL_ENV', 'switch_interval_from_env']

logger = logging.getLogger('lmdeploy_guided_spec')

#: Milliseconds: the interpreter's switch interval (``sys.setswitchinterval``) for the engine's process, set when a
#: grammar worker thread starts; unset: Python's own (5 ms).
SWITCH_INTERVAL_ENV = 'LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS'


def switch_interval_from_env() -> float | None:
    """Seconds of ``LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS``, or None where it is unset.

    Raises
    ------
    ValueError
        A value that is not a positive number of milliseconds, naming the variable.
    """
    value = os.environ.get(SWITCH_INTERVAL_ENV, '').strip()
    if not value:
        return None
    try:
        ms = float(value)
    except ValueError:
        ms = float('nan')
    if not 0 < ms < float('inf'):
        raise ValueError(f'{SWITCH_INTERVAL_ENV}={value!r} is not a positive number of milliseconds')
    return ms / 1000.0


def _apply_switch_interval() -> None:
    """Set the process's switch interval from the environment (once a worker thread starts); a bad value is logged
    (once per process and value) and Python's interval stays."""
    try:
        seconds = switch_interval_from_env()
    except ValueError as err:
        warn_bad_setting_once(logger, f'{err}; the switch interval stays {sys.getswitchinterval() * 1e3:g} ms')
        return
    if seconds is not None and seconds != sys.getswitchinterval():
        sys.setswitchinterval(seconds)
        logger.info(f'switch interval of this process set to {seconds * 1e3:g} ms ({SWITCH_INTERVAL_ENV})')


def _interpreter_exits() -> bool:
    """Whether concurrent.futures has begun stopping its threads for the interpreter's exit."""
    import concurrent.futures.thread as pool_module
    return bool(getattr(pool_module, '_shutdown', False))


def _run_here(fn: Callable[..., Any], args: tuple, kwargs: dict) -> concurrent.futures.Future:
    """``fn(*args, **kwargs)`` run on the calling thread, as a done future."""
    future: concurrent.futures.Future = concurrent.futures.Future()
    try:
        future.set_result(fn(*args, **kwargs))
    except BaseException as err:  # noqa: B036 - handed to the waiter, as the pool does
        future.set_exception(err)
    return future


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
        #: the interpreter exits: jobs run on the calling thread, one at a time, under this lock
        self._exiting: threading.Lock | None = None
        self._last: concurrent.futures.Future | None = None

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        """Queue ``fn(*args, **kwargs)`` behind every job submitted before it; once the interpreter exits, run it on
        the calling thread, after them."""
        if self.inline:
            return _run_here(fn, args, kwargs)
        with self._lock:
            if self._exiting is None:
                if self._pool is None:
                    _apply_switch_interval()
                    self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                                       thread_name_prefix='guided-spec-grammar')
                try:
                    self._last = self._pool.submit(fn, *args, **kwargs)
                    return self._last
                except RuntimeError:
                    # the interpreter exits while an engine nobody closed still steps on its daemon thread:
                    # concurrent.futures refuses new jobs (shutdown() drops the pool before it stops one, so no
                    # other stop of ours is seen here). Any other failure (no thread can start) is raised
                    if not (_interpreter_exits() or self._pool._shutdown):
                        raise
                    self._exiting = threading.Lock()
            exiting, last = self._exiting, self._last
        with exiting:
            if last is not None:
                # the thread may still run the jobs submitted before: the work stays in order
                concurrent.futures.wait([last])
            return _run_here(fn, args, kwargs)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Queue ``fn`` and wait for its result."""
        return self.submit(fn, *args, **kwargs).result()

    def shutdown(self) -> None:
        """Finish queued jobs and stop the thread (a later submit starts a new one)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
