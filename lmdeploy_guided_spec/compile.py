"""Grammar compilation that never stalls the engine: a killable compiler process, a timeout and a bounded cache.

xgrammar compiles some schemas for a long time (an enum of 40,000 strings: minutes; thousands of properties or deep
nesting: tens of seconds), and a compile running in a thread cannot be stopped. :class:`GrammarCompileService`
hands every compile to a child process (forked from a fork server that imported xgrammar once, :mod:`.forkserver`;
never a fork of the engine process, which holds CUDA and threads), waits for it on a background thread and kills
the child when it runs past the limit. The caller gets a
:class:`concurrent.futures.Future` at once and polls ``future.done()`` each engine step, so a request waits for its
grammar while the others keep decoding.

Moving a compiled grammar between processes costs more than compiling it when the grammar is big:
``CompiledGrammar.serialize_json`` writes the token-mask cache as JSON (a 1,000-property object compiles in 1.8 s
into 14 MB but serializes in 69 s to 643 MB, and deserializes in 23 s). So the child sends back only grammars
whose ``memory_size_bytes`` is at most ``transfer_limit_bytes`` (a small schema: about 0.2 MB of JSON, 10 ms each
way); for a bigger one it reports success and the parent compiles the same source again in its background thread.
That second compile is known to finish (the child just did it within the limit) and xgrammar releases the GIL
while compiling, so the engine loop keeps running. Compiled grammars are kept in an LRU cache bounded by bytes,
so a repeated schema costs nothing.
"""
from __future__ import annotations

import asyncio
import atexit
import collections
import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import json
import logging
import math
import multiprocessing.connection
import os
import re
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import xgrammar as xgr

from . import regular
from .depth import tag_schemas
from .env import positive_from_env, warn_bad_setting_once
from .errors import (
    CheckAbandoned,
    GrammarCompileBusy,
    GrammarCompileError,
    GrammarCompilerUnavailable,
    GrammarCompileTimeout,
    xgrammar_reason,
)
from .forkserver import ForkedProcess, end_with_parent, fork_server, start_interpreter
from .language import required_text_length
from .tool_calls import document_or_calls_tag
from .wide import wide_objects

__all__ = [
    'GrammarCompileService', 'COMPILE_TIMEOUT_ENV', 'DEFAULT_COMPILE_TIMEOUT_S', 'MASK_LIMIT_ENV',
    'DEFAULT_MASK_LIMIT_MS', 'MATCHER_LIMIT_ENV', 'DEFAULT_MATCHER_LIMIT_MB', 'KINDS', 'GrammarCost', 'ForcedTextCost',
    'grammar_stop_token_ids', 'grammar_cost', 'mask_limit_ms_from_env', 'matcher_limit_mb_from_env',
    'compile_timeout_s_from_env', 'grammar_is_empty', 'grammar_checker', 'conversion_cost', 'SLOW_CONVERSION_COST',
    'SLOW_QUEUED', 'SLOW_QUEUED_ENV', 'slow_queued_from_env', 'entry_check_executor', 'run_entry_check',
    'DISCONNECT_POLL_S', 'COMPILE_CACHE_ENV', 'DEFAULT_COMPILE_CACHE_MB', 'compile_cache_limit_bytes_from_env'
]

logger = logging.getLogger(__name__)

#: Environment variable with the compile time limit in seconds.
COMPILE_TIMEOUT_ENV = 'LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT'
#: Compile time limit when neither the argument nor the environment variable gives one.
DEFAULT_COMPILE_TIMEOUT_S = 30.0

#: Environment variable with the most milliseconds one token mask of a grammar may cost where a probe walks it.
MASK_LIMIT_ENV = 'LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS'
#: Mask cost limit when neither the argument nor the environment variable gives one, in CPU time of the probing
#: thread: an ordinary schema costs up to about 12 ms per mask (inside a string with maxLength, on two cores); the
#: regexes this guards against cost 0.5 to 3.5 s per mask, and hold up every request at every step.
DEFAULT_MASK_LIMIT_MS = 250.0
#: Environment variable with the most megabytes a matcher of a grammar may hold where a probe walks it.
MATCHER_LIMIT_ENV = 'LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB'
#: Matcher memory limit when neither the argument nor the environment variable gives one. xgrammar's matcher of an
#: object with thousands of optional properties holds gigabytes once it has read one key (8,000 properties: 1.9 GB,
#: and as much again for each fork; 4,000: 0.24 GB), while the schemas of JSONSchemaBench stay under 15 MB. The
#: engine keeps one matcher per guided row and forks it for every draft window, so one such request took the
#: engine's process past 8 GB.
DEFAULT_MATCHER_LIMIT_MB = 64.0
#: Environment variable with the bound, in megabytes, of a cache of compiled grammars (an engine's compile service
#: and its compiler's own cache each have one).
COMPILE_CACHE_ENV = 'LMDEPLOY_GUIDED_SPEC_COMPILE_CACHE_MB'
#: Bound of a cache of compiled grammars when the environment variable gives none. The largest of the JSONSchemaBench
#: schemas xgrammar compiles takes 76 MB compiled (Llama-3's tokenizer); a grammar bigger than the bound is refused.
DEFAULT_COMPILE_CACHE_MB = 256.0
#: Token positions a probe walks through a compiled grammar.
PROBE_TOKENS = 16
#: Most characters of fixed text one part of a grammar may require (:func:`.language.required_text_length`): a text
#: the grammar forces is built whole by xgrammar at each read of its jump-forward string, wherever it sits (the probe
#: reads those of its first tokens only). a{1000000} takes 0.18 s a read; JSONSchemaBench's schemas require <= 2,656.
FORCED_TEXT_LIMIT_CHARS = 10 ** 6
#: Walks of a probe (each from the grammar's start, with its own random choices).
PROBE_WALKS = 3
#: CPU seconds after which a probe stops walking (the schemas of JSONSchemaBench take up to 0.06 s): a grammar
#: whose masks cost just under the limit would otherwise spend the compile's time limit in its probe.
PROBE_BUDGET_S = 2.0


#: :func:`conversion_cost` from which a grammar source looks slow to parse: one counted repetition of about 2,000
#: (xgrammar converts ``^[a-z]{1,2000}$`` of a JSON schema in 0.3 s, ``^(ab|cd){1,2000}$`` in about 1.5 s; the
#: conversion grows as the square of the count). The patterns of JSONSchemaBench count up to 255.
SLOW_CONVERSION_COST = 2000 ** 2
#: Sources that look slow to parse a service queues at most, unless ``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED`` says
#: otherwise; one more is refused at once (:class:`GrammarCompileBusy`), so that clients sending such sources cannot
#: hold every waiting thread of a server.
SLOW_QUEUED = 16
SLOW_QUEUED_ENV = 'LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED'

_COUNTED = re.compile(r'\{\s*(\d{1,9})\s*(?:,\s*(\d{0,9})\s*)?\}')


def conversion_cost(source: str | None) -> int:
    """A cheap estimate of how long xgrammar takes to parse a grammar source: the sum of the squares of its counted
    repetitions (``{n}``, ``{m,n}``, ``{m,}`` anywhere in the text). xgrammar converts the pattern of a JSON schema in
    time that grows as the square of its count (``^[a-z]{1,20000}$``: 18 s, ``{1,40000}``: over a minute on two
    cores); counts elsewhere only make the estimate high, which costs a source nothing but its place in the queue."""
    if not source:
        return 0
    return sum(max(int(low), int(high or 0)) ** 2 for low, high in _COUNTED.findall(source))


def slow_queued_from_env() -> int:
    """``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``, else :data:`SLOW_QUEUED`; ``ValueError`` naming it."""
    return positive_from_env(SLOW_QUEUED_ENV, SLOW_QUEUED, parse=int, kind='a whole number')


def compile_timeout_s_from_env() -> float:
    """``LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT``, else :data:`DEFAULT_COMPILE_TIMEOUT_S`; ``ValueError`` naming it."""
    return positive_from_env(COMPILE_TIMEOUT_ENV, DEFAULT_COMPILE_TIMEOUT_S, kind='a number of seconds')


def mask_limit_ms_from_env() -> float:
    """``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS``, else :data:`DEFAULT_MASK_LIMIT_MS`; ``ValueError`` naming it."""
    return positive_from_env(MASK_LIMIT_ENV, DEFAULT_MASK_LIMIT_MS, kind='a number of milliseconds')


def compile_cache_limit_bytes_from_env() -> int:
    """``LMDEPLOY_GUIDED_SPEC_COMPILE_CACHE_MB`` in bytes, else :data:`DEFAULT_COMPILE_CACHE_MB`. A value that is not a
    positive finite number is logged once and the default applies (without a cache, the engine would compile every
    grammar again where it builds the matcher, on its loop; and the caller builds a grammar manager, which must not
    fail for it)."""
    try:
        megabytes = positive_from_env(COMPILE_CACHE_ENV, DEFAULT_COMPILE_CACHE_MB, kind='a number of megabytes')
        if not math.isfinite(megabytes) or megabytes * (1 << 20) >= 1 << 62:
            raise ValueError(f'{COMPILE_CACHE_ENV}={os.environ[COMPILE_CACHE_ENV]!r} must be a finite number of '
                             f'megabytes, below 2**42')
    except ValueError as err:
        warn_bad_setting_once(logger, f'{err}; using the default, {DEFAULT_COMPILE_CACHE_MB:g} MB')
        megabytes = DEFAULT_COMPILE_CACHE_MB
    return int(megabytes * (1 << 20))


def matcher_limit_mb_from_env() -> float:
    """``LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB``, else :data:`DEFAULT_MATCHER_LIMIT_MB`; ``ValueError`` naming it."""
    return positive_from_env(MATCHER_LIMIT_ENV, DEFAULT_MATCHER_LIMIT_MB, kind='a number of megabytes')


#: Grammar kinds and the keyword options each accepts (those of the matching ``GrammarCompiler`` method).
KINDS = {
    'json_schema': frozenset({'any_whitespace', 'indent', 'separators', 'strict_mode', 'max_whitespace_cnt',
                              'any_order'}),
    'regex': frozenset(),
    'builtin_json': frozenset(),
    'ebnf': frozenset({'root_rule_name'}),
    'structural_tag': frozenset(),
    # a document or tool calls (tool_calls.py): the source of tool_calls.document_or_calls_source
    'document_or_calls': frozenset(),
}

# A child of the fork server (forkserver.py), else a plain interpreter; not multiprocessing's spawn: spawn re-imports
# the parent's ``__main__`` in the child, which re-runs a user's script without a main guard; fork would copy CUDA
# state and held locks.
_CHILD_TARGET = 'lmdeploy_guided_spec.compile:_child_main'
_CHILD_CODE = ('import sys; from lmdeploy_guided_spec.compile import _child_main; '
               '_child_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))')

# starting a child reads the tokenizer info, and a fresh interpreter imports xgrammar first (a few seconds on a
# loaded machine at most); this is not the compile limit, only a guard against a child that never comes up
_STARTUP_TIMEOUT_S = 120.0

# answers of checks a service keeps (a digest and a bool or an error each)
_CHECKED_ENTRIES = 4096
# holders of grammars a service keeps (GrammarCompileService.hold): far more requests than an engine admits at once;
# a bound only against holds never released
_HOLDERS = 4096
# seconds a check stopped at the limit is remembered: the same source sent again is refused without a process
# spending the limit on it again; a source that was slow only on a loaded machine is checked again after this
_TIMED_OUT_REMEMBERED_S = 600.0
# seconds a compile stopped at the limit is remembered (other failed compiles: _TIMED_OUT_REMEMBERED_S): a grammar
# that timed out only because the host was busy is compiled again sooner
_COMPILE_TIMED_OUT_REMEMBERED_S = 120.0


def grammar_stop_token_ids(tokenizer, engine_stop_token_ids, vocab_size: int) -> list[int]:
    """The stop tokens to build a grammar's ``xgrammar.TokenizerInfo`` with: the engine's (a model's EOS tokens, a
    list or one id; ``<|eot_id|>`` and ``<|eom_id|>`` of Llama 3, say) and the tokenizer's EOS, below ``vocab_size``.

    xgrammar finds the tokenizer's EOS alone. Another token the engine stops at is text to the grammar (its bytes
    spell ``<|eot_id|>``), allowed inside a JSON string: the engine would end the request there, in the middle of
    the JSON. As a stop token of the grammar it is allowed only where the grammar may end.
    """
    if engine_stop_token_ids is None or isinstance(engine_stop_token_ids, int):
        engine_stop_token_ids = [] if engine_stop_token_ids is None else [engine_stop_token_ids]
    ids = {int(t) for t in engine_stop_token_ids if t is not None}
    eos = getattr(tokenizer, 'eos_token_id', None)
    if eos is not None:
        ids.add(int(eos))
    return sorted(t for t in ids if 0 <= t < vocab_size)


class ForcedTextCost(Exception):
    """A probe found a state whose forced text (its jump-forward string) costs more than the limit to build:
    ``seconds`` of CPU time, or None where an allocation failed under the probe's memory cap."""

    def __init__(self, seconds: float | None):
        super().__init__(seconds)
        self.seconds = seconds


class GrammarCost(NamedTuple):
    """What a probe of a compiled grammar found (:func:`grammar_cost`)."""
    #: CPU seconds of the slowest token along the walk: its mask fill and its accept
    seconds: float
    #: the position (from 0) of that token
    position: int
    #: most bytes the process's resident memory grew by over the walk, read after each accept and again with a
    #: fork of the matcher held (0 where the platform does not say)
    state_bytes: int
    #: the position where the memory was highest
    state_position: int


class ProbeTokens(NamedTuple):
    """Boolean arrays over a vocabulary that steer a probe's walk (:func:`probe_tokens`)."""
    #: text of whitespace alone, or empty
    blank: Any
    #: text that closes an object or an array
    closes: Any
    #: text with a double quote: it opens a key or a string, or ends one
    quotes: Any
    #: bytes of text, whitespace around it not counted
    length: Any


def probe_tokens(info: xgr.TokenizerInfo) -> ProbeTokens:
    """The :class:`ProbeTokens` of ``info``'s vocabulary (about a second for a 150k vocabulary, most of it xgrammar's
    ``decoded_vocab``: a compile service works them out once and hands them to each compiler process it starts)."""
    import numpy as np

    vocab = info.decoded_vocab[:info.vocab_size]
    count = len(vocab)
    blank, closes, quotes = np.zeros((3, info.vocab_size), dtype=bool)
    length = np.zeros(info.vocab_size, dtype=np.int32)
    length[:count] = np.fromiter(map(len, map(bytes.strip, vocab)), dtype=np.int32, count=count)
    blank[:count] = length[:count] == 0
    # every byte of the vocabulary, and the token it belongs to
    data = np.frombuffer(b''.join(vocab), dtype=np.uint8)
    owner = np.repeat(np.arange(count), np.fromiter(map(len, vocab), dtype=np.int64, count=count))
    closes[owner[(data == ord('}')) | (data == ord(']'))]] = True
    quotes[owner[data == ord('"')]] = True
    return ProbeTokens(blank, closes, quotes, length)


#: Memory a probe in the compiler process may allocate beyond twice the matcher limit (a matcher and a fork), for
#: its own arrays and the allocator's arenas
_PROBE_SLACK_BYTES = 256 << 20


def _status_bytes(field: str) -> int:
    """A size of this process from ``/proc/self/status`` (``VmRSS``: resident, ``VmData``: data segment); 0 where
    the platform does not say."""
    try:
        with open('/proc/self/status') as f:
            for line in f:
                if line.startswith(f'{field}:'):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return 0


@contextlib.contextmanager
def _memory_cap(extra_bytes: float):
    """Cap this process's data segment at its present size plus ``extra_bytes`` (Linux's ``RLIMIT_DATA``), so that
    an allocation past it fails in xgrammar with ``RuntimeError: std::bad_alloc`` instead of taking the machine's
    memory: one accept of a key of an 8,000-property object allocates 1.9 GB at once. Only for the compiler
    process, whose other threads are idle while it probes; nothing where the limit cannot be set."""
    previous = None
    try:
        import resource
        now = _status_bytes('VmData')
        if now and extra_bytes != float('inf'):
            soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
            cap = now + int(extra_bytes)
            if hard != resource.RLIM_INFINITY:
                cap = min(cap, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (cap, hard))
            previous = (soft, hard)
    except (ImportError, AttributeError, ValueError, OSError):
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            resource.setrlimit(resource.RLIMIT_DATA, previous)


def _trim() -> None:
    """Give freed heap memory back to the system, so that what a matcher allocates next shows in the resident size
    (glibc only; elsewhere nothing)."""
    try:
        import ctypes
        ctypes.CDLL('libc.so.6').malloc_trim(0)
    except (OSError, AttributeError):
        pass


def grammar_cost(grammar: xgr.CompiledGrammar, *, tokens: int = PROBE_TOKENS, walks: int = PROBE_WALKS,
                 limit_s: float | None = None, state_limit_bytes: float | None = None, seed: int = 0,
                 kinds: ProbeTokens | None = None, budget_s: float = PROBE_BUDGET_S) -> GrammarCost:
    """Walk ``walks`` times ``tokens`` positions through ``grammar`` and measure what a matcher of it costs the
    engine.

    At each position the mask is filled and timed (CPU time of the calling thread; again up to twice where it took
    more than ``limit_s`` but less than ten times that, the fastest fill counting) with the state's jump-forward text
    (which forced drafts read), then a token the mask allows is
    taken at random (``seed``, then the next seed for each walk) and accepted (timed too). The walk is steered into
    a grammar's structure (``kinds``, from :func:`probe_tokens`): it prefers tokens other than whitespace (a
    tokenizer has hundreds, and a walk of those reads no key of a JSON object), then tokens that close no object or
    array, at about half the positions (at random) tokens with a double quote (which open keys and end strings: a
    walk inside a free string reads no further key), and of those one of the 3 longest (so that 16 tokens reach a
    nested key). It never takes a stop token, and takes back a token after which only stop tokens are allowed while
    it has other tokens to try. After each accept the process's resident memory is read, and again with a fork of
    the matcher held, as the engine forks it for a draft window. Stops at the first token over ``limit_s``, at the
    first memory reading over ``state_limit_bytes`` and once the walks have taken ``budget_s`` CPU seconds. Raises
    :class:`ForcedTextCost` where a state's jump-forward text alone takes more than ``limit_s``, or fails to allocate
    (under the compile service's memory cap).
    """
    import numpy as np

    info = grammar.tokenizer_info
    vocab, stops = info.vocab_size, [t for t in info.stop_token_ids if 0 <= t < info.vocab_size]
    if kinds is None:
        kinds = probe_tokens(info)
    bitmask = xgr.allocate_token_bitmask(1, vocab)

    def fill(matcher) -> tuple[float, np.ndarray]:
        """CPU seconds of the mask (the fastest of up to three fills) and the tokens it allows, stop tokens not; the
        state's jump-forward text is timed on its own (:class:`ForcedTextCost`)."""
        seconds = []
        for _ in range(3):
            # CPU time of this thread: a busy machine does not make a grammar slow (a mask of 12 ms took 65 ms of
            # wall time beside two engines on two cores)
            start = time.thread_time()
            matcher.fill_next_token_bitmask(bitmask)
            seconds.append(time.thread_time() - start)
            if limit_s is not None and not limit_s < seconds[-1] < 10 * limit_s:
                break
        bits = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder='little')[:vocab].astype(bool)
        bits[stops] = False
        # the speculative path reads the text the grammar forces at each position (forced drafts): xgrammar builds
        # all of it, ten million characters (1 to 4 s, 0.7 GB) for ((a{100}){100}){1000}, whose masks cost
        # microseconds; the memory cap stops a bigger one (an allocation fails: RuntimeError bad_alloc)
        start = time.thread_time()
        try:
            matcher.find_jump_forward_string()
        except UnicodeDecodeError:
            pass  # a state inside a character (forced.jump_forward_text)
        except RuntimeError as exc:
            if 'bad_alloc' in str(exc):
                raise ForcedTextCost(None) from exc
            raise
        forced_s = time.thread_time() - start
        if limit_s is not None and forced_s > limit_s:
            raise ForcedTextCost(forced_s)
        return min(seconds), bits

    def choose(allowed: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Up to 8 tokens to try, in order: the steered choice first, then any token the walk prefers."""
        steers = [~kinds.blank, ~kinds.closes] + ([kinds.quotes] if rng.random() < 0.5 else [])
        pools = [allowed]
        for steer in steers:
            narrower = pools[-1] & steer
            if narrower.any():
                pools.append(narrower)
        steered = np.flatnonzero(pools[-1])
        if len(steered) > 3:  # the longest: a key of the schema is often one token, or a few
            steered = steered[np.argpartition(-kinds.length[steered], 3)[:3]]
        tries = [rng.permutation(steered), rng.permutation(np.flatnonzero(pools[1 if len(pools) > 1 else 0]))[:8]]
        return np.concatenate(tries)[:8]

    cost = GrammarCost(0.0, 0, 0, 0)
    _trim()
    base = _status_bytes('VmRSS')

    def with_state(cost: GrammarCost, position: int) -> GrammarCost:
        grown = _status_bytes('VmRSS') - base if base else 0
        return cost._replace(state_bytes=grown, state_position=position) if grown > cost.state_bytes else cost

    until = time.thread_time() + budget_s
    for walk in range(walks):
        rng = np.random.default_rng(seed + walk)
        matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
        mask_s, allowed = fill(matcher)
        for position in range(tokens):
            if limit_s is not None and mask_s > limit_s:
                return cost._replace(seconds=mask_s, position=position)
            if not allowed.any():
                break
            tries = choose(allowed, rng)
            for tried, token in enumerate(tries, 1):
                start = time.thread_time()
                accepted = matcher.accept_token(int(token))
                accept_s = time.thread_time() - start
                if not accepted:
                    return cost  # xgrammar refused a token its own mask allowed: nothing to measure here
                next_mask_s, next_allowed = fill(matcher)
                if limit_s is not None and next_mask_s > limit_s:
                    return cost._replace(seconds=next_mask_s, position=position + 1)
                if next_allowed.any() or tried == len(tries):
                    break
                matcher.rollback(1)  # only stop tokens after this one: the walk tries another
            if mask_s + accept_s > cost.seconds:
                cost = cost._replace(seconds=mask_s + accept_s, position=position)
            if limit_s is not None and cost.seconds > limit_s:
                return cost
            # read before the fork too: a matcher over the limit is not copied (8,000 optional properties: 1.9 GB)
            cost = with_state(cost, position)
            if state_limit_bytes is not None and cost.state_bytes > state_limit_bytes:
                return cost
            fork = matcher.fork()
            cost = with_state(cost, position)
            del fork
            if state_limit_bytes is not None and cost.state_bytes > state_limit_bytes:
                return cost
            if time.thread_time() > until:
                return cost
            mask_s, allowed = next_mask_s, next_allowed
        del matcher
    return cost


def _compile(compiler: xgr.GrammarCompiler, kind: str, source: str | None, options: dict) -> xgr.CompiledGrammar:
    if kind == 'json_schema':
        # with exact rules for the patterns xgrammar 0.2.8 does not compile exactly (regular.py)
        return regular.compile_json_schema(compiler, source, **options)
    if kind == 'regex':
        # as a deterministic grammar where it can be: xgrammar's own rules of a regex with nested quantifiers cost
        # more per token the longer the output (regular.py)
        return regular.compile_regex(compiler, source)
    if kind == 'builtin_json':
        return compiler.compile_builtin_json_grammar()
    if kind == 'structural_tag':
        return compiler.compile_structural_tag(source)
    if kind == 'document_or_calls':
        return compiler.compile_structural_tag(json.dumps(document_or_calls_tag(source)))
    return compiler.compile_grammar(source, **options)


def _parse(kind: str, source: str | None, options: dict) -> xgr.Grammar:
    """The grammar of a source as xgrammar reads it, without a tokenizer (what a check parses)."""
    if kind == 'json_schema':
        return xgr.Grammar.from_json_schema(source, **options)
    if kind == 'regex':
        return xgr.Grammar.from_regex(source)
    if kind == 'builtin_json':
        return xgr.Grammar.builtin_json_grammar()
    if kind == 'structural_tag':
        return xgr.Grammar.from_structural_tag(source)
    if kind == 'document_or_calls':
        return xgr.Grammar.from_structural_tag(json.dumps(document_or_calls_tag(source)))
    return xgr.Grammar.from_ebnf(source, **options)


def _check(kind: str, source: str | None, options: dict) -> tuple:
    """The reply of the compiler process to a check: ``('checked', empty)`` or why the source does not parse."""
    from .language import language_is_empty
    try:
        return ('checked', language_is_empty(_parse(kind, source, options)))
    except (RuntimeError, ValueError) as exc:  # xgrammar raises RuntimeError for every bad source
        return ('error', xgrammar_reason(exc))
    except Exception as exc:  # a fault of this package or of xgrammar, not of the source
        return ('internal', f'{type(exc).__name__}: {exc}'.strip())


def _child_main(fd: int, max_threads: int, parent_pid: int | None = None) -> None:
    """Body of the compiler process: compile and check what the parent sends over socket ``fd`` until it closes.
    ``parent_pid``: the serving process, where this is a fresh interpreter it started (a child of the fork server
    is tied to the fork server already)."""
    if parent_pid is not None:
        end_with_parent(parent_pid)
    conn = multiprocessing.connection.Connection(fd)
    try:
        tokenizer = conn.recv()
    except (EOFError, OSError):
        return
    compiler = kinds = None
    if tokenizer is not None:  # None: a checker, which parses grammars without a tokenizer
        # the tokenizer and the parent's probe_tokens of it (worked out once there, not at each start of a child)
        info_json, kinds = tokenizer
        info = xgr.TokenizerInfo.deserialize_json(info_json)
        # the parent keeps the cache; a child may be killed any time and its cache would only grow
        compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)
    conn.send(('ready',))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        if message[0] == 'check':
            conn.send(_check(*message[1:]))
            continue
        kind, source, options, transfer_limit, mask_limit_s, state_limit_bytes, cache_limit = message
        start = time.perf_counter()
        try:
            grammar = _compile(compiler, kind, source, options)
            seconds = time.perf_counter() - start
            if cache_limit and grammar.memory_size_bytes > cache_limit:
                # refused whatever its masks cost: no probe of a grammar of hundreds of megabytes
                conn.send(('huge', grammar.memory_size_bytes))
                continue
            # the engine fills the masks of all guided rows each step: a grammar whose mask is slow holds up
            # everyone; and it keeps a matcher per guided row, forked for each draft window
            cost, cap, where = None, 2 * state_limit_bytes + _PROBE_SLACK_BYTES, [None]
            if kinds is not None:  # (None: a service that probes nothing, GrammarCompileService.probes)
                # a text forced past the probe's tokens (behind a free prefix) is built whole all the same
                required = required_text_length(grammar.grammar)
                if required > FORCED_TEXT_LIMIT_CHARS:
                    conn.send(('long', required))
                    continue
                try:
                    with _memory_cap(cap):
                        cost = grammar_cost(grammar, limit_s=mask_limit_s, state_limit_bytes=state_limit_bytes,
                                            kinds=kinds)
                    if cost.seconds <= mask_limit_s and cost.state_bytes <= state_limit_bytes:
                        # the wide objects the walk may not have reached, each on its own
                        cost = _probe_wide_objects(compiler, kind, source, options, cost, where, cap=cap,
                                                   limit_s=mask_limit_s, state_limit_bytes=state_limit_bytes,
                                                   kinds=kinds)
                except ForcedTextCost as exc:
                    conn.send(('forced', exc.seconds, cap, where[0]))
                    continue
                except RuntimeError as exc:
                    if 'bad_alloc' not in str(exc):
                        raise
                    # the cap stopped an allocation: more than that, somewhere
                    conn.send(('big', cap, None, where[0]))
                    continue
        except (RuntimeError, ValueError) as exc:  # xgrammar raises RuntimeError for every bad source
            conn.send(('error', f'{type(exc).__name__}: {xgrammar_reason(exc)}' if str(exc).strip() else
                       xgrammar_reason(exc)))
            continue
        except Exception as exc:  # a fault of this package or of xgrammar, not of the source
            conn.send(('internal', f'{type(exc).__name__}: {exc}'.strip()))
            continue
        if cost is not None and cost.seconds > mask_limit_s:
            conn.send(('slow', cost.seconds, cost.position, where[0]))
            continue
        if cost is not None and cost.state_bytes > state_limit_bytes:
            conn.send(('big', cost.state_bytes, cost.state_position, where[0]))
            continue
        size = grammar.memory_size_bytes
        payload = grammar.serialize_json() if size <= transfer_limit else None
        conn.send(('ok', payload, seconds, size))


def _probe_wide_objects(compiler, kind: str, source, options: dict, cost: GrammarCost, where: list, *, cap: float,
                        limit_s: float, state_limit_bytes: float, kinds: ProbeTokens) -> GrammarCost:
    """Probe each wide object of a source's schemas on its own (:func:`.wide.wide_objects`): the probe of the whole
    grammar walks its first tokens, and text that takes more (a ``const`` of twenty words, the header of a tool call)
    hides an object whose matcher grows by gigabytes once it has read a key. The cost of the first object over a
    limit, with ``where[0]`` its place and width; else ``cost``, with ``where[0]`` None. An object whose schema does
    not compile alone (a ``$ref`` into the schema around it) is probed with integer values (its keys are what
    grow); one that compiles neither way is skipped, its source's own compile stands."""
    for wide in wide_objects(kind, source):
        grammar = None
        for schema in (wide.schema, wide.skeleton):
            try:
                grammar = _compile(compiler, 'json_schema', json.dumps(schema),
                                   options if kind == 'json_schema' else {})
                break
            except (RuntimeError, ValueError, TypeError):
                continue
        if grammar is None:
            continue
        where[0] = (wide.place, wide.optional)
        try:
            with _memory_cap(cap):
                alone = grammar_cost(grammar, limit_s=limit_s, state_limit_bytes=state_limit_bytes, kinds=kinds)
        except RuntimeError as exc:
            if 'bad_alloc' in str(exc):
                raise  # over the cap: the object's place goes with the refusal
            continue  # the object alone is not the source: its own compile and probe stand
        finally:
            del grammar
        if alone.seconds > limit_s or alone.state_bytes > state_limit_bytes:
            return alone
    where[0] = None
    return cost


def _of_object(wide: tuple[str, int] | None) -> str:
    """Where a probe of a wide object on its own (:func:`_probe_wide_objects`) found its cost, for a message."""
    if wide is None:
        return ''
    place, optional = wide
    return f' of the object at {place or "/"} alone, which has {optional} optional properties'


#: Signals that end a compiler process by a fault of its own (of xgrammar on the source it was given), not by a kill
_CRASH_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGFPE, signal.SIGABRT})


class _TimedOut(NamedTuple):
    """A check stopped at ``limit_s`` (or a compile that failed under that limit), remembered since ``at``
    (``time.monotonic``)."""
    error: GrammarCompileTimeout | GrammarCompileError
    limit_s: float
    at: float


def _digest(key: tuple) -> bytes:
    """A short key of a compile's key (whose source can be megabytes)."""
    return hashlib.blake2b(json.dumps(key).encode(), digest_size=16).digest()


def _copy_error(error: BaseException) -> BaseException:
    """A fresh exception with the message (and ``reason``) of a remembered one, for another caller."""
    if isinstance(error, GrammarCompileError):
        return GrammarCompileError(str(error), reason=error.reason)
    return type(error)(str(error))


@dataclass
class _Job:
    key: tuple
    kind: str
    source: str | None
    options: dict
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    #: a check (:meth:`GrammarCompileService.check`), with its time limit, rather than a compile
    check_timeout_s: float | None = None
    #: the source looks slow to parse (:func:`conversion_cost`): it waits behind other jobs and never takes the
    #: last process, which stays free for the others
    slow: bool = field(init=False)
    #: when it was queued (``time.monotonic``): a slow job that waited longer than the limit goes first
    queued_at: float = field(default_factory=time.monotonic)
    #: every caller left (:meth:`GrammarCompileService.abandon`): it is not sent to a process, or its process killed
    abandoned: bool = field(default=False, init=False)
    #: sent to its slot's process: from then on, that process is this job's to kill (under ``_gate``)
    sent: bool = field(default=False, init=False)
    #: its process crashed once (a signal of :data:`_CRASH_SIGNALS`): it ran once more in a fresh one
    crashed: bool = field(default=False, init=False)

    def __post_init__(self):
        self.slow = conversion_cost(self.source) >= SLOW_CONVERSION_COST


class _Child:
    """One compiler process and the parent's end of its socket."""

    def __init__(self, tokenizer: tuple[str, ProbeTokens | None] | None, max_threads: int, fork: bool = True):
        parent_sock, child_sock = socket.socketpair()
        self._tokenizer = tokenizer
        try:
            self.process = (fork and self._fork(child_sock, max_threads)) or self._spawn(child_sock, max_threads)
        finally:
            # only the child holds its end now, so a dead child shows up as EOF here
            child_sock.close()
        self.conn = multiprocessing.connection.Connection(parent_sock.detach())
        self.ready = False

    @staticmethod
    def _fork(child_sock: socket.socket, max_threads: int) -> ForkedProcess | None:
        """A child of this process's fork server (milliseconds: xgrammar is imported there already), or None where
        there is none (another platform) or it failed, said in the log."""
        server = fork_server(__name__)
        if server is None:
            return None
        try:
            return server.fork(_CHILD_TARGET, child_sock.fileno(), max_threads)
        except OSError as exc:
            logger.warning('the grammar compiler\'s fork server failed (%s); starting a compiler process of its own',
                           exc)
            return None

    @staticmethod
    def _spawn(child_sock: socket.socket, max_threads: int) -> subprocess.Popen:
        return start_interpreter(_CHILD_CODE, child_sock.fileno(), max_threads, os.getpid())

    def wait_ready(self) -> None:
        """Hand the child its tokenizer (None: it checks only) and wait until it can compile."""
        try:
            self.conn.send(self._tokenizer)
            if self.conn.poll(_STARTUP_TIMEOUT_S):
                self.conn.recv()
                self.ready = True
        except (EOFError, OSError):
            pass
        if not self.ready:
            code = self.kill()
            raise GrammarCompilerUnavailable(f'the grammar compiler process did not start (exit code {code})')

    def kill(self) -> int | None:
        """Stop the process now and return its exit code."""
        if self.process.poll() is None:
            self.process.kill()
        try:
            code = self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = None
        self.conn.close()
        return code


class GrammarCompileService:
    """Compile grammars in a killable child process, with a time limit and a bounded cache.

    Parameters
    ----------
    tokenizer_info : xgrammar.TokenizerInfo or str or None
        The tokenizer the grammars are for, or its ``serialize_json()`` string. None makes a checker: a service
        that only checks grammar sources with :meth:`check` (what a serving process needs before it hands a
        request on).
    timeout_s : float, optional
        Longest a single compile or check may run (in the child, queueing not counted). Defaults to the
        environment variable ``LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT`` (seconds), else 30.
    mask_limit_ms : float, optional
        Most a token of a compiled grammar (its mask and its accept) may cost along a probe of its first
        :data:`PROBE_TOKENS` positions (:func:`grammar_cost`, in the child after the compile); a slower grammar
        fails with :class:`GrammarCompileError` instead of holding up every request at every step. Defaults to the
        environment variable ``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS``, else 250; ``inf`` turns this check off.
    matcher_limit_mb : float, optional
        Most megabytes a matcher of a compiled grammar (and a fork of it) may hold along the same probe; a grammar
        whose matcher grows bigger fails with :class:`GrammarCompileError` instead of taking the engine's memory.
        Defaults to the environment variable ``LMDEPLOY_GUIDED_SPEC_MATCHER_LIMIT_MB``, else 64; ``inf`` turns
        this check off.
    slow_queued : int, optional
        Most jobs that look slow to parse (:func:`conversion_cost`) waiting at once; one more is refused at once with
        :class:`GrammarCompileBusy`. Defaults to the environment variable ``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``,
        else 16; ``inf`` refuses none (a service that compiles what another one admitted: a rank's, beside its
        engine's).
    cache_limit_bytes : int
        Bound of the cache of compiled grammars, by ``CompiledGrammar.memory_size_bytes``; least recently used
        grammars go first. A grammar bigger than the bound fails its compile with :class:`GrammarCompileError`
        (the engine, not finding it, would compile it again on its loop for each request). 0 disables the cache,
        and this check.
    max_threads : int
        Threads xgrammar uses for one compile.
    max_workers : int
        Compiler processes (compiles that run at the same time). One slow schema then holds one worker until its
        limit while the others keep compiling. The first process starts with the service, the others with the
        first compile that arrives while all before them are busy. A compile goes to a process that is ready
        before one that would have to start (the first's again after a kill, or a later one).
    transfer_limit_bytes : int
        Biggest grammar the child sends back serialized; a bigger one is compiled again in the parent, which is
        faster than its JSON round trip (see the module docstring).
    fork : bool
        Fork the compiler processes from this process's fork server (:mod:`.forkserver`: it imports xgrammar once,
        and a process starts in milliseconds, also after a kill); False starts each as a fresh interpreter, which
        takes seconds. Where the platform has no fork server (not Linux) or it fails, processes start fresh.

    Notes
    -----
    ``submit`` never blocks on a compile. The returned future fails with :class:`GrammarCompileError` (a
    ``ValueError``) for a source xgrammar rejects or crashes on (in two processes, by SIGSEGV, SIGFPE or SIGABRT),
    whose mask costs more than the limit, or whose compiled grammar is bigger than the cache;
    :class:`GrammarCompileTimeout` when the compile ran past the
    limit (the child is killed and a fresh one starts with the next compile), and
    :class:`GrammarCompilerUnavailable` when the child died or the service was closed.
    """

    def __init__(self, tokenizer_info: xgr.TokenizerInfo | str | None, *, timeout_s: float | None = None,
                 cache_limit_bytes: int = 256 << 20, max_threads: int = 2, max_workers: int = 2,
                 transfer_limit_bytes: int = 1 << 20, mask_limit_ms: float | None = None,
                 matcher_limit_mb: float | None = None, slow_queued: float | None = None, fork: bool = True):
        if tokenizer_info is None:
            self._info = self._info_json = None
        elif isinstance(tokenizer_info, str):
            self._info_json = tokenizer_info
            self._info = xgr.TokenizerInfo.deserialize_json(tokenizer_info)
        else:
            self._info = tokenizer_info
            self._info_json = tokenizer_info.serialize_json()
        self.timeout_s = float(timeout_s) if timeout_s is not None else compile_timeout_s_from_env()
        if not self.timeout_s > 0:
            raise ValueError(f'timeout_s must be positive, got {timeout_s!r}')
        self.mask_limit_ms = float(mask_limit_ms) if mask_limit_ms is not None else mask_limit_ms_from_env()
        if not self.mask_limit_ms > 0:
            raise ValueError(f'mask_limit_ms must be positive, got {mask_limit_ms!r}')
        self.matcher_limit_mb = (float(matcher_limit_mb) if matcher_limit_mb is not None else
                                 matcher_limit_mb_from_env())
        if not self.matcher_limit_mb > 0:
            raise ValueError(f'matcher_limit_mb must be positive, got {matcher_limit_mb!r}')
        if cache_limit_bytes < 0:
            raise ValueError(f'cache_limit_bytes must be >= 0 (a bounded cache), got {cache_limit_bytes}')
        if max_workers < 1 or max_threads < 1:
            raise ValueError(f'max_workers and max_threads must be >= 1, got {max_workers} and {max_threads}')
        self.cache_limit_bytes = cache_limit_bytes
        if slow_queued is not None and not slow_queued >= 1:
            raise ValueError(f'slow_queued must be >= 1, got {slow_queued!r}')
        if slow_queued is None:
            self.slow_queued = slow_queued_from_env()
        else:
            self.slow_queued = slow_queued if slow_queued == float('inf') else int(slow_queued)
        self.max_threads = max_threads
        self.transfer_limit_bytes = transfer_limit_bytes
        self.fork = fork
        self._kinds: ProbeTokens | None = None
        self._kinds_lock = threading.Lock()
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[tuple, tuple[xgr.CompiledGrammar, int]] = collections.OrderedDict()
        self._cache_bytes = 0
        # grammars that requests admitted but not yet stepped will read (hold): kept in the cache past its bound,
        # by holder (a session), and how many holders each key has
        self._holds: collections.OrderedDict[Any, tuple] = collections.OrderedDict()
        self._held: collections.Counter[tuple] = collections.Counter()
        # answers of checks, by a digest of what was checked (sources can be megabytes): whether the language is
        # empty, why the source does not parse, or a recent timeout
        self._checked: collections.OrderedDict[bytes, bool | GrammarCompileError | _TimedOut] = \
            collections.OrderedDict()
        # compiles that failed (past the limit, or refused: mask cost, matcher or compiled size, a crash), by a
        # digest of their key, for _TIMED_OUT_REMEMBERED_S seconds (past the limit: _COMPILE_TIMED_OUT_REMEMBERED_S):
        # a client that sends the grammar again is refused
        # at once instead of holding a compiler process for up to the limit again
        self._failed: collections.OrderedDict[bytes, _TimedOut] = collections.OrderedDict()
        self._inflight: dict[tuple | bytes, concurrent.futures.Future] = {}
        # callers of jobs that look slow to parse, by key (a caller usually holds a thread while it waits: copies of
        # one slow source are one job but as many waiting threads), and their sum, bounded by twice slow_queued
        self._sharers: dict[tuple | bytes, int] = {}
        self._slow_waiters = 0
        # callers of each job in flight that have not left it (abandon): a job none waits for is dropped or stopped
        self._callers: dict[tuple | bytes, int] = {}
        # jobs waiting for a compiler thread, and which threads run one, under one condition: a thread after the
        # first takes a job only while all before it are busy, so its process starts only when compiles overlap
        # (each holds about 100 MB of its own for a 128k vocabulary beside the fork server, 240 MB started fresh)
        self._jobs: collections.deque[_Job] = collections.deque()
        self._busy = [False] * max_workers
        # the job each slot runs (under _gate, set when it leaves the queue)
        self._running: list[_Job | None] = [None] * max_workers
        # slot 0 starts its process (again, after a kill) outside any job: a thread after it whose process is ready
        # takes jobs meanwhile instead of waiting seconds for that start
        self._starting = [False] * max_workers
        # a slot has taken a job that looks slow to parse: the last slot, kept for the others, starts its process
        self._slow_taken = False
        self._gate = threading.Condition()
        self._children: list[_Child | None] = [None] * max_workers
        self._local: xgr.GrammarCompiler | None = None
        self._closed = False
        self._threads = [threading.Thread(target=self._serve, args=(slot,), name=f'guided-spec-compile-{slot}',
                                          daemon=True) for slot in range(max_workers)]
        for thread in self._threads:
            thread.start()

    # -- public API --------------------------------------------------------------------------------------------

    @property
    def tokenizer_info(self) -> xgr.TokenizerInfo | None:
        """The tokenizer info compiled grammars belong to (None for a checker)."""
        return self._info

    @property
    def probes(self) -> bool:
        """Whether a compile probes the cost of the grammar's masks and matcher (:func:`grammar_cost`): False where
        both limits are infinite (a rank's service, beside an engine that probed the grammar already)."""
        return not self.mask_limit_ms == self.matcher_limit_mb == float('inf')

    @property
    def cache_size_bytes(self) -> int:
        """Bytes of compiled grammars held in the cache."""
        with self._lock:
            return self._cache_bytes

    @property
    def cache_entries(self) -> int:
        """Number of compiled grammars held in the cache."""
        with self._lock:
            return len(self._cache)

    def submit(self, kind: str, source: str | dict | None = None, **options: Any) -> concurrent.futures.Future:
        """Start compiling a grammar and return a future of its ``xgrammar.CompiledGrammar`` at once.

        Parameters
        ----------
        kind : {'json_schema', 'regex', 'builtin_json', 'ebnf', 'structural_tag', 'document_or_calls'}
            What ``source`` is. ``builtin_json`` (any JSON value) takes no source.
        source : str or dict, optional
            The JSON schema (text or parsed), regex, EBNF grammar or xgrammar structural tag (text or parsed: the
            whole tag, ``{"type": "structural_tag", "format": ...}``); for ``document_or_calls``, a document or
            tool calls (:func:`~lmdeploy_guided_spec.tool_calls.document_or_calls_source`).
        **options
            Keywords of the matching ``GrammarCompiler`` method: for ``json_schema`` ``any_whitespace``,
            ``indent``, ``separators``, ``strict_mode``, ``max_whitespace_cnt``, ``any_order``; for ``ebnf``
            ``root_rule_name``.

        Returns
        -------
        concurrent.futures.Future
            Done at once for a cached grammar, and failed at once, with the same error, for a grammar whose
            compile failed within the last :data:`_TIMED_OUT_REMEMBERED_S` seconds (refused) or
            :data:`_COMPILE_TIMED_OUT_REMEMBERED_S` (past the limit);
            the same future for a compile of the same grammar in flight.

        Raises
        ------
        ValueError
            Unknown ``kind``, or a missing source.
        TypeError
            An option the kind does not take.
        GrammarCompilerUnavailable
            The service is closed.
        RuntimeError
            The service is a checker (it has no tokenizer).
        """
        if self._info is None:
            raise RuntimeError('this grammar service has no tokenizer: it checks grammars, it does not compile them')
        kind, source, options = self._normalize(kind, source, options)
        key = (kind, source, json.dumps(options, sort_keys=True))
        digest = _digest(key)  # (a source can be megabytes: not under the lock)
        with self._lock:
            failed = self._failed.get(digest)
            remembered_s = (_COMPILE_TIMED_OUT_REMEMBERED_S if isinstance(getattr(failed, 'error', None),
                                                                          GrammarCompileTimeout)
                            else _TIMED_OUT_REMEMBERED_S)
            if failed is not None and failed.limit_s >= self.timeout_s and time.monotonic() - failed.at < remembered_s:
                future = concurrent.futures.Future()
                future.set_exception(_copy_error(failed.error))
                return future
        return self._start(key, self._cache, lambda cached: cached[0], lambda: _Job(key, kind, source, options))

    def check(self, kind: str, source: str | dict | None = None, *, timeout_s: float | None = None,
              **options: Any) -> concurrent.futures.Future:
        """Start checking a grammar source and return a future of whether its language is empty, at once.

        The compiler process parses the source as xgrammar does without a tokenizer (``Grammar.from_json_schema``,
        ``from_regex``, ...; some take minutes: the conversion of a pattern ``^[a-z]{1,20000}$`` takes about 18 s)
        and runs :func:`~lmdeploy_guided_spec.language.language_is_empty` on it, under the time limit. The thread that
        waits holds no lock xgrammar needs, so a serving process that checks many requests keeps answering others.

        Parameters
        ----------
        kind, source, **options
            As :meth:`submit`.
        timeout_s : float, optional
            The limit of this check; defaults to the service's ``timeout_s``.

        Returns
        -------
        concurrent.futures.Future
            Of True when the grammar derives no string (a ``$ref`` to itself, say), False when it does. It fails
            with :class:`GrammarCompileError` (``reason``: xgrammar's, without its log prefix) for a source that
            does not parse, :class:`GrammarCompileTimeout` past the limit, :class:`GrammarCompilerUnavailable` when
            the process died or the service closed. Answers are remembered, a timeout for
            :data:`_TIMED_OUT_REMEMBERED_S` seconds (a client that sends the same source again is refused at once,
            without holding a process for the limit again), and a check of the same source in flight is shared.
        """
        kind, source, options = self._normalize(kind, source, options)
        limit = self.timeout_s if timeout_s is None else float(timeout_s)
        if not limit > 0:
            raise ValueError(f'timeout_s must be positive, got {timeout_s!r}')
        key = hashlib.blake2b(json.dumps(['check', kind, source, options], sort_keys=True).encode(),
                              digest_size=16).digest()

        def answer(known):
            if isinstance(known, _TimedOut):  # stopped at a limit no shorter than this one, a short while ago
                fresh = known.limit_s >= limit and time.monotonic() - known.at < _TIMED_OUT_REMEMBERED_S
                return known.error if fresh else None
            return known

        return self._start(key, self._checked, answer, lambda: _Job(key, kind, source, options, check_timeout_s=limit))

    def lookup(self, kind: str, source: str | dict | None = None, *, wait_s: float = 0.0,
               **options: Any) -> xgr.CompiledGrammar | None:
        """The cached grammar, or None when it is not cached (never starts a compile).

        An engine gates a request on :meth:`submit` and builds its matcher with this once the future is done; a
        grammar evicted in between is None, and the caller compiles it as it would without the service.

        ``wait_s``: how long to wait for a compile of the grammar in flight (a :meth:`submit` started it); its
        grammar, or None when that compile fails or is not done by then. A process that compiles what another one
        gates its requests on (a rank of a tensor-parallel group, beside its engine) waits for what is left of its
        own compile instead of compiling the grammar again. The wait does not count as a caller of the job: when
        every caller of :meth:`submit` abandons it, it is stopped, and this returns None.
        """
        if self._info is None:
            return None
        kind, source, options = self._normalize(kind, source, options)
        key = (kind, source, json.dumps(options, sort_keys=True))
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                return cached[0]
            inflight = self._inflight.get(key) if wait_s > 0 else None
        if inflight is None:
            return None
        try:
            return inflight.result(timeout=wait_s)
        except Exception:  # failed, or still running: the caller compiles it as without the service
            return None

    def abandon(self, future: concurrent.futures.Future) -> None:
        """A caller of :meth:`submit` or :meth:`check` stops waiting for ``future`` (its client went away); once per
        call, and nothing for a future that is done.

        The job goes on while other callers wait for it. Once none is left it is dropped from the queue, or stopped
        where it runs (its process killed: the next job starts a fresh one, in milliseconds from the fork server),
        and ``future`` fails with :class:`GrammarCompilerUnavailable`. The caller no longer counts against the bound
        of requests waiting for grammars that look slow to parse, at once: requests that went away left live ones
        refused with :class:`GrammarCompileBusy` until their grammars reached the limit.
        """
        with self._gate, self._lock:  # (nothing takes _gate while it holds _lock)
            key = next((key for key, inflight in self._inflight.items() if inflight is future), None)
            if key is None:
                return
            self._callers[key] -= 1
            if self._sharers.get(key, 0) > 0:
                self._sharers[key] -= 1
                self._slow_waiters -= 1
            if self._callers[key] > 0:
                return
            self._release(key, future)  # a caller that comes now starts a fresh job
            job = next((job for job in self._jobs if job.future is future), None)
            if job is None:
                slot = next((slot for slot, running in enumerate(self._running)
                             if running is not None and running.future is future), None)
                if slot is not None:
                    job = self._running[slot]
                    job.abandoned = True
                    child = self._children[slot]
                    if job.sent and child is not None and child.process.poll() is None:
                        child.process.kill()  # its thread reads the death, finishes the job and drops the child
                return
            job.abandoned = True
            self._jobs.remove(job)
        self._finish(job, error=self._abandoned(job))

    def _abandoned(self, job: _Job) -> GrammarCompilerUnavailable:
        doing = 'checking' if job.check_timeout_s is not None else 'compiling'
        return GrammarCompilerUnavailable(f'{doing} a {self._describe(job)} was stopped: every caller left')

    def hold(self, holder: Hashable, kind: str, source: str | dict | None = None, **options: Any) -> None:
        """Keep a grammar in the cache for ``holder`` until :meth:`release`, whatever else is compiled meanwhile.

        An engine admits a request once its grammar is compiled, and builds its matcher with :meth:`lookup` when the
        request is first stepped; a request that waits for room in the KV cache meanwhile saw its grammar evicted by
        others, and the step compiled it again while every request of the batch waited (seconds, for a schema near
        the limit). A held grammar stays, past the cache's bound where it must (what the requests admitted need,
        as their matchers will); one compiled later is held when it is remembered. One grammar per holder: a new
        hold replaces the holder's last. At most :data:`_HOLDERS` holders; the oldest is let go past that.
        """
        if self._info is None:
            return
        kind, source, options = self._normalize(kind, source, options)
        key = (kind, source, json.dumps(options, sort_keys=True))
        with self._lock:
            self._unhold(holder)
            self._holds[holder] = key
            self._held[key] += 1
            while len(self._holds) > _HOLDERS:
                oldest = next(iter(self._holds))
                logger.warning('more than %d requests hold a compiled grammar; the oldest hold is let go (its '
                               'request compiles its grammar again if it was evicted)', _HOLDERS)
                self._unhold(oldest)
            self._evict()

    def release(self, holder: Hashable) -> None:
        """Let go of the grammar ``holder`` held (:meth:`hold`): its request built its matcher, or ended; nothing
        for a holder that holds none. The cache shrinks back to its bound."""
        with self._lock:
            if self._unhold(holder):
                self._evict()

    @property
    def holders(self) -> int:
        """Number of holders of grammars (:meth:`hold`)."""
        with self._lock:
            return len(self._holds)

    def compile(self, kind: str, source: str | dict | None = None, **options: Any) -> xgr.CompiledGrammar:
        """Blocking :meth:`submit`: wait for the grammar (for tools and tests, never for an engine loop)."""
        return self.submit(kind, source, **options).result()

    def close(self) -> None:
        """Kill the compiler processes and fail every compile not finished yet; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            children = list(self._children)
        with self._gate:
            self._gate.notify_all()
        for child in children:
            # a kill unblocks the thread waiting on this child's socket (or for it to start)
            if child is not None and child.process.poll() is None:
                child.process.kill()
        for thread in self._threads:
            thread.join(timeout=30)
        for slot, child in enumerate(self._children):
            if child is not None:
                child.kill()
                self._children[slot] = None
        # a job no thread took before the close
        with self._gate:
            left, self._jobs = list(self._jobs), collections.deque()
        for job in left:
            self._finish(job, error=GrammarCompilerUnavailable('the grammar compile service was closed'))

    def __enter__(self) -> GrammarCompileService:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: modules may be gone already
            pass

    # -- internals ---------------------------------------------------------------------------------------------

    def _start(self, key, answers: collections.OrderedDict, answer: Callable[[Any], Any],
               job: Callable[[], _Job]) -> concurrent.futures.Future:
        """The future of ``key``: done at once where ``answers`` holds it (``answer`` of the entry: a grammar, a
        check's answer, an exception to raise, or None where the entry does not answer), the job in flight for it,
        or a new ``job()``."""
        with self._lock:
            if self._closed:
                raise GrammarCompilerUnavailable('the grammar compile service is closed')
            known = answers.get(key)
            value = None if known is None else answer(known)
            if value is not None:
                answers.move_to_end(key)
                future = concurrent.futures.Future()
                if isinstance(value, BaseException):  # a fresh one: an exception keeps its traceback
                    future.set_exception(_copy_error(value))
                else:
                    future.set_result(value)
                return future
            inflight = self._inflight.get(key)
            if inflight is not None and key not in self._sharers:
                self._callers[key] += 1
                return inflight
            new = job() if inflight is None else None
            if key in self._sharers or new.slow:
                if self._slow_waiters >= 2 * self.slow_queued:
                    future = concurrent.futures.Future()
                    future.set_exception(self._refusal(new, f'{self._slow_waiters} requests for such grammars'))
                    return future
                self._sharers[key] = self._sharers.get(key, 0) + 1
                self._slow_waiters += 1
                if inflight is not None:
                    self._callers[key] += 1
                    return inflight
            self._inflight[key] = new.future
            self._callers[key] = 1
        with self._gate:
            refused = None
            if self._closed:  # close() took the queue after the check above: nothing would take this job
                refused = GrammarCompilerUnavailable('the grammar compile service was closed')
            elif new.slow and sum(job.slow for job in self._jobs) >= self.slow_queued:
                refused = self._refusal(new, f'{self.slow_queued} such grammars')
            else:
                self._jobs.append(new)
                self._gate.notify_all()
        if refused is not None:
            self._finish(new, error=refused)
        return new.future

    def _refusal(self, job: _Job | None, waiting: str) -> GrammarCompileBusy:
        """The refusal of ``job`` (None: a copy of a job in flight), which looks slow to parse, while ``waiting``
        (who waits, and how many) wait already."""
        what = 'grammar' if job is None else self._describe(job)
        return GrammarCompileBusy(
            f'the {what} looks slow to parse (counted repetitions such as {{1,20000}} in its patterns) and {waiting} '
            f'wait already; it was not started. Send it again later, or simplify its patterns')

    @staticmethod
    def _normalize(kind: str, source, options: dict) -> tuple[str, str | None, dict]:
        allowed = KINDS.get(kind)
        if allowed is None:
            raise ValueError(f'unknown grammar kind {kind!r}; expected one of {sorted(KINDS)}')
        unknown = set(options) - allowed
        if unknown:
            raise TypeError(f'grammar kind {kind!r} takes no option(s) {sorted(unknown)}; it takes {sorted(allowed)}')
        if kind == 'builtin_json':
            return kind, None, {}
        if isinstance(source, (dict, list, bool)) and kind in ('json_schema', 'structural_tag', 'document_or_calls'):
            source = json.dumps(source, sort_keys=kind == 'document_or_calls')
        if not isinstance(source, str):
            raise ValueError(f'a {kind} grammar needs its source as a string, got {type(source).__name__}')
        if 'separators' in options and options['separators'] is not None:
            # the key is JSON; a tuple and a list of the same separators are the same grammar
            options = {**options, 'separators': tuple(options['separators'])}
        return kind, source, options

    def _serve(self, slot: int) -> None:
        kept = self._kept(slot)
        while True:
            if (slot == 0 or (kept and self._slow_taken)) and self._children[slot] is None and not self._closed:
                # start the first child before a job asks for it: the fork server (or a fresh interpreter) takes
                # seconds to import xgrammar (and torch with it), which would otherwise add to the first compile
                # (and to the first after a kill, without a fork server). The others start with the first compile
                # that overlaps, but the kept slot's with the first slow job: a job that arrives beside slow ones
                # then finds it ready (a start beside slow parses that take every core took 20 s)
                self._set_starting(slot, True)
                try:
                    self._child(slot)
                except Exception as exc:  # noqa: BLE001 - also OSError of a full process table: the thread serves on
                    if kept:
                        with self._gate:
                            self._slow_taken = False  # tried again with the next slow job, not at once
                    if not self._closed:
                        # (a child that close() killed while it started is no failure)
                        logger.warning('%s; trying again with the next compile', exc)
                finally:
                    self._set_starting(slot, False)
            with self._gate:
                self._gate.wait_for(lambda: self._closed or self._next_job(slot) is not None or (
                    kept and self._slow_taken and self._children[slot] is None))
                if self._closed:
                    return
                job = self._next_job(slot)
                if job is None:  # the kept slot starts its process
                    continue
                self._jobs.remove(job)
                self._busy[slot] = True
                self._running[slot] = job
                if job.slow and not self._slow_taken:
                    self._slow_taken = True
                # the next thread takes a job only while this one is busy: it must look again now, or a job queued
                # beside this one waits until this job ends (the whole limit, for a slow grammar)
                self._gate.notify_all()
            try:
                self._serve_job(slot, job)
            finally:
                with self._gate:
                    self._running[slot] = None
                    killed = job.abandoned and job.sent
                if killed:  # (also where its answer came first: not a process that died while idle)
                    self._drop_child(slot)
                with self._gate:
                    self._busy[slot] = False
                    self._gate.notify_all()

    def _next_job(self, slot: int) -> _Job | None:
        """The job ``slot`` takes now (under ``_gate``), or None: the first that does not look slow to parse, else
        the first; none for the last of several slots, which is kept for the jobs that do not look slow (a few
        sources that parse for the whole limit then delay no other grammar). A slow job that has waited longer
        than the limit goes first, so that steady traffic of others does not hold it back for ever (they keep the
        last slot). A slot whose process is not ready leaves the job to a later one whose process is ready and
        idle (the kept slot's, started with the first slow job): its start would take seconds."""
        if not self._jobs or not self._may_take(slot):
            return None
        job = self._choose(slot)
        if job is not None and not self._ready(slot) and any(
                not self._busy[later] and self._ready(later) and not (job.slow and self._kept(later))
                for later in range(slot + 1, len(self._busy))):
            return None
        return job

    def _choose(self, slot: int) -> _Job | None:
        first = self._jobs[0]
        if first.slow and not self._kept(slot) and time.monotonic() - first.queued_at > self.timeout_s:
            return first
        for job in self._jobs:
            if not job.slow:
                return job
        return None if self._kept(slot) else first

    def _ready(self, slot: int) -> bool:
        child = self._children[slot]
        return child is not None and child.ready

    def _kept(self, slot: int) -> bool:
        """Whether ``slot`` is the one kept for jobs that do not look slow: the last of several."""
        return 0 < slot == len(self._busy) - 1

    def _may_take(self, slot: int) -> bool:
        """Whether ``slot`` takes the next job (under ``_gate``): while every slot before it is busy, or where this
        slot's process is ready, starting its process or without one."""
        ready = self._ready(slot)
        return all(self._busy[i] or (ready and (self._starting[i] or not self._ready(i))) for i in range(slot))

    def _set_starting(self, slot: int, starting: bool) -> None:
        with self._gate:
            self._starting[slot] = starting
            self._gate.notify_all()

    def _serve_job(self, slot: int, job: _Job) -> None:
        if self._closed:
            self._finish(job, error=GrammarCompilerUnavailable('the grammar compile service was closed'))
            return
        if not job.future.set_running_or_notify_cancel():
            with self._lock:
                self._release(job.key, job.future)
            return
        try:
            result = self._run(slot, job)
        except BaseException as exc:  # every failure belongs to this job's future, the thread serves on
            self._finish(job, error=self._abandoned(job) if job.abandoned else exc)
        else:
            self._finish(job, result=result)

    def _child(self, slot: int) -> _Child:
        """``slot``'s process, started where it has none or its process died while idle (the OOM killer picks big
        processes: not the next job's fault)."""
        child = self._children[slot]
        if child is not None and child.process.poll() is not None:
            logger.warning('a grammar compiler process died while idle (exit code %s); starting a fresh one',
                           child.process.returncode)
            self._drop_child(slot)
            child = None
        if child is None:
            if self._closed:
                raise GrammarCompilerUnavailable('the grammar compile service was closed')
            # started outside the lock: the first start of a fork server (or a fresh one after it died) takes seconds,
            # and submit(), check() and close() take the lock
            child = _Child(self._child_tokenizer(), self.max_threads, self.fork)
            with self._lock:
                closed = self._closed
                if not closed:
                    # registered before it is ready, so that close() can kill a child that is still starting
                    self._children[slot] = child
            if closed:
                child.kill()
                raise GrammarCompilerUnavailable('the grammar compile service was closed')
            try:
                child.wait_ready()
            except GrammarCompilerUnavailable:
                self._children[slot] = None
                raise
        return child

    def _child_tokenizer(self) -> tuple[str, ProbeTokens | None] | None:
        """What a compiler process gets at its start: the tokenizer's JSON and its :func:`probe_tokens` (worked out
        by the first start that needs them; None where both limits turn the probe off), or None for a checker."""
        if self._info_json is None:
            return None
        if not self.probes:
            return self._info_json, None
        with self._kinds_lock:
            if self._kinds is None:
                self._kinds = probe_tokens(self._info)
        return self._info_json, self._kinds

    def _drop_child(self, slot: int) -> int | None:
        child, self._children[slot] = self._children[slot], None
        return child.kill() if child is not None else None

    def _describe(self, job: _Job) -> str:
        return 'builtin JSON grammar' if job.source is None else f'{job.kind} grammar ({len(job.source):,} bytes)'

    def _run(self, slot: int, job: _Job) -> xgr.CompiledGrammar | bool:
        waited = time.monotonic() - job.queued_at
        with self._gate:
            if job.abandoned:
                raise self._abandoned(job)
        child = self._child(slot)
        with self._gate:  # abandon() kills the process only once the job is sent to it
            if job.abandoned:
                raise self._abandoned(job)
            job.sent = True
        checks = job.check_timeout_s is not None
        doing, limit = ('checking', job.check_timeout_s) if checks else ('compiling', self.timeout_s)
        try:
            if checks:
                child.conn.send(('check', job.kind, job.source, job.options))
            else:
                child.conn.send((job.kind, job.source, job.options, self.transfer_limit_bytes,
                                 self.mask_limit_ms / 1e3, self.matcher_limit_mb * (1 << 20), self.cache_limit_bytes))
            answered = child.conn.poll(limit)
            reply = child.conn.recv() if answered else None
        except (EOFError, OSError):
            code = self._drop_child(slot)
            if self._closed:
                raise GrammarCompilerUnavailable('the grammar compile service was closed') from None
            if code is not None and -code in _CRASH_SIGNALS:
                crash = signal.Signals(-code).name
                logger.warning('the grammar compiler process crashed (%s) while %s a %s%s', crash, doing,
                               self._describe(job), '' if job.crashed else '; trying it once more in a fresh one')
                if not job.crashed:
                    # a fault left by an earlier job in the same process would not come back in a fresh one
                    job.crashed = True
                    return self._run(slot, job)
                # xgrammar crashed on this source twice (a chain of thousands of $ref overflows its parser's stack):
                # the source's fault, remembered as a check's answer; a process killed from outside stays the
                # server's, as does an illegal instruction or a bus error (a build for another CPU, a replaced file)
                hint = ' (a chain of thousands of $ref is one)' if checks else ''
                raise GrammarCompileError(
                    f'the grammar compiler crashed ({crash}) twice while {doing} a {self._describe(job)}: xgrammar '
                    f'cannot take this source{hint}. Simplify it') from None
            raise GrammarCompilerUnavailable(
                f'the grammar compiler process died (exit code {code}) while {doing} a {self._describe(job)}; a '
                f'fresh one starts with the next compile') from None
        if reply is None:
            self._drop_child(slot)
            message = (f'{doing} a {self._describe(job)} took longer than {limit:g} s and was stopped; raise the limit '
                       f'with the environment variable {COMPILE_TIMEOUT_ENV} (seconds) or simplify the schema')
            if waited < 1:
                raise GrammarCompileTimeout(message)
            # the caller waited longer than the limit says: behind other grammars, for a free compiler process
            error = GrammarCompileTimeout(f'{message} (before that it waited {waited:.0f} s for a free compiler '
                                          f'process, behind other grammars)')
            error.remembered = GrammarCompileTimeout(message)  # what a later request of this source is told
            raise error
        if reply[0] == 'checked':
            return reply[1]
        if reply[0] == 'error':  # a check's reason is xgrammar's alone; a compile's starts with its type
            raise GrammarCompileError(f'invalid {self._describe(job)}: {reply[1]}', reason=reply[1] if checks else None)
        if reply[0] == 'internal':
            raise GrammarCompilerUnavailable(f'the grammar compiler failed on a {self._describe(job)}: {reply[1]}')
        if reply[0] == 'slow':
            raise GrammarCompileError(
                f'the {self._describe(job)} costs {reply[1] * 1e3:.0f} ms per token to match (token {reply[2] + 1} '
                f'of a probe{_of_object(reply[3])}), more than the limit of {self.mask_limit_ms:g} ms '
                f'({MASK_LIMIT_ENV}): every guided '
                f'request would wait for it at every step. Simplify the schema or regex; counted repetitions of '
                f'groups that can match the same text in several ways, such as ([a-z]+ ?){{1,300}}, are the '
                f'usual cause')
        if reply[0] == 'big':
            # a fresh child for the next compile: this one may have been cut off in the middle of an allocation
            self._drop_child(slot)
            _, size, position, wide = reply
            took = (f'more than {size / (1 << 20):.0f} MB of memory within {PROBE_TOKENS} tokens' if position is None
                    else f'{size / (1 << 20):.0f} MB of memory after {position + 1} tokens')
            raise GrammarCompileError(
                f'matching the {self._describe(job)} took {took} of a probe{_of_object(wide)}, more than the limit of '
                f'{self.matcher_limit_mb:g} MB ({MATCHER_LIMIT_ENV}): the engine keeps a matcher per guided request '
                f'and copies it for every draft window. Simplify the schema; an object with thousands of optional '
                f'properties is the usual cause (list them as required, or split the object)')
        if reply[0] == 'forced':
            _, seconds, cap, wide = reply
            if seconds is None:  # a fresh child: this one was cut off in the middle of an allocation
                self._drop_child(slot)
            took, limit = ((f'more than {cap / (1 << 20):.0f} MB of memory',
                            f'{self.matcher_limit_mb:g} MB ({MATCHER_LIMIT_ENV})') if seconds is None else
                           (f'{seconds * 1e3:.0f} ms', f'{self.mask_limit_ms:g} ms ({MASK_LIMIT_ENV})'))
            raise GrammarCompileError(
                f'the text the {self._describe(job)} forces takes {took} to build (within {PROBE_TOKENS} tokens of a '
                f'probe{_of_object(wide)}), more than the limit of {limit}: xgrammar builds all of it each time a '
                f'speculative step reads what the grammar forces. Simplify the schema or regex; nested counted '
                f'repetitions of fixed text, such as ((a{{100}}){{100}}){{1000}}, force millions of characters')
        if reply[0] == 'long':
            raise GrammarCompileError(
                f'the {self._describe(job)} requires at least {reply[1]:,} characters of fixed text in one part, '
                f'more than the limit of {FORCED_TEXT_LIMIT_CHARS:,}: where the grammar forces such a text, xgrammar '
                f'builds all of it each time a speculative step reads what the grammar forces (ten million '
                f'characters: 1 to 4 s and 0.7 GB each time), and no output holds it. Simplify the schema or regex; '
                f'nested counted repetitions, such as ((a{{100}}){{100}}){{1000}}, are the usual cause')
        if reply[0] == 'huge':
            # not cached, the engine would compile it again where it builds the matcher: on its loop, for every
            # request that sends it, stalling every other request meanwhile (the child checks it before its probe)
            size = reply[1]
            raise GrammarCompileError(
                f'the {self._describe(job)} takes {size / (1 << 20):.1f} MB compiled, more than the '
                f'{self.cache_limit_bytes / (1 << 20):.1f} MB the compile cache holds ({COMPILE_CACHE_ENV}). Simplify '
                f'the schema: many properties with wide numeric ranges or long bounded strings are the usual cause')
        _, payload, seconds, size = reply
        if payload is not None:
            return xgr.CompiledGrammar.deserialize_json(payload, self._info)
        logger.debug('compiling a %s again in-process: %d bytes compiled in %.2f s are cheaper to compile than '
                     'to transfer', self._describe(job), size, seconds)
        if self._local is None:
            self._local = xgr.GrammarCompiler(self._info, max_threads=self.max_threads, cache_enabled=False)
        return _compile(self._local, job.kind, job.source, job.options)

    def _finish(self, job: _Job, *, result: xgr.CompiledGrammar | bool | None = None,
                error: BaseException | None = None) -> None:
        with self._lock:
            self._release(job.key, job.future)
            if job.abandoned:  # nothing is remembered of a job stopped for nobody
                pass
            elif job.check_timeout_s is None:
                if error is None:
                    self._remember(job.key, result)
                elif isinstance(error, (GrammarCompileError, GrammarCompileTimeout)) and \
                        not isinstance(error, GrammarCompileBusy):
                    self._remember_failure(job.key, getattr(error, 'remembered', error))
            elif error is None or isinstance(error, GrammarCompileError):
                self._remember_check(job.key, result if error is None else error)
            elif isinstance(error, GrammarCompileTimeout) and not isinstance(error, GrammarCompileBusy):
                self._remember_check(job.key, _TimedOut(getattr(error, 'remembered', error), job.check_timeout_s,
                                                        time.monotonic()))
        if job.future.done():
            return
        if not job.future.running() and not job.future.set_running_or_notify_cancel():
            return  # the caller cancelled it before it ran
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(result)

    def _release(self, key, future: concurrent.futures.Future) -> None:
        """Forget the job of ``key`` in flight, whose future is ``future``, and its callers (under ``_lock``)."""
        if self._inflight.get(key) is not future:
            return  # left by its callers: a fresh job of the same key may be in flight
        self._inflight.pop(key, None)
        self._callers.pop(key, None)
        self._slow_waiters -= self._sharers.pop(key, 0)

    def _remember_check(self, key: bytes, answer) -> None:
        self._checked[key] = answer
        self._checked.move_to_end(key)
        while len(self._checked) > _CHECKED_ENTRIES:
            self._checked.popitem(last=False)

    def _remember_failure(self, key: tuple, error: BaseException) -> None:
        digest = _digest(key)
        self._failed[digest] = _TimedOut(error, self.timeout_s, time.monotonic())
        self._failed.move_to_end(digest)
        while len(self._failed) > _CHECKED_ENTRIES:
            self._failed.popitem(last=False)

    def _remember(self, key: tuple, grammar: xgr.CompiledGrammar) -> None:
        size = grammar.memory_size_bytes
        if size > self.cache_limit_bytes:
            return
        self._cache[key] = (grammar, size)
        self._cache_bytes += size
        self._evict()

    def _evict(self) -> None:
        """Drop the least recently used grammars that no holder holds until the cache is within its bound (under
        ``_lock``)."""
        if self._cache_bytes <= self.cache_limit_bytes:
            return
        for key in [key for key in self._cache if key not in self._held]:
            _, size = self._cache.pop(key)
            self._cache_bytes -= size
            if self._cache_bytes <= self.cache_limit_bytes:
                return

    def _unhold(self, holder) -> bool:
        """Forget ``holder``'s hold (under ``_lock``); whether it held one."""
        key = self._holds.pop(holder, None)
        if key is None:
            return False
        self._held[key] -= 1
        if self._held[key] <= 0:
            del self._held[key]
        return True


#: Processes of a checker (:func:`grammar_checker`): the first starts with the first check, each other one when a
#: check arrives while all before it are busy (a few MB each beside the fork server). A check waits for a free one,
#: so this many sources that parse up to the limit delay the checks of the others by up to that long
CHECKER_PROCESSES = 4

# the checker of this process (grammar_is_empty), and the pid it belongs to: a forked child starts its own
_checker: GrammarCompileService | None = None
_checker_pid: int | None = None
_checker_lock = threading.Lock()
# checkers a fork left behind: never closed (their threads and processes are the parent's), never collected
_inherited: list[GrammarCompileService] = []


def grammar_checker() -> GrammarCompileService:
    """This process's checker (a :class:`GrammarCompileService` without a tokenizer), started on first use: a
    server can call this at start-up, so that its first request does not wait for the checker process."""
    global _checker, _checker_pid
    with _checker_lock:
        if _checker is None or _checker_pid != os.getpid() or _checker._closed:
            if _checker is not None and _checker_pid != os.getpid():
                _inherited.append(_checker)
            # limits of the checks come with each call (grammar_is_empty); a checker compiles nothing
            _checker = GrammarCompileService(None, timeout_s=DEFAULT_COMPILE_TIMEOUT_S, cache_limit_bytes=0,
                                             max_threads=1, max_workers=CHECKER_PROCESSES,
                                             mask_limit_ms=float('inf'), matcher_limit_mb=float('inf'))
            _checker_pid = os.getpid()
            atexit.register(_checker.close)
        return _checker


#: Threads of :func:`run_entry_check`: each waits for a check (or an engine's check and compile) without working.
ENTRY_CHECK_THREADS = 64

_entry_checks: concurrent.futures.ThreadPoolExecutor | None = None
_entry_checks_pid: int | None = None


def entry_check_executor() -> concurrent.futures.ThreadPoolExecutor:
    """This process's threads for the entry checks of requests (:func:`run_entry_check`), started on first use."""
    global _entry_checks, _entry_checks_pid
    with _checker_lock:
        if _entry_checks is None or _entry_checks_pid != os.getpid():
            _entry_checks = concurrent.futures.ThreadPoolExecutor(ENTRY_CHECK_THREADS,
                                                                  thread_name_prefix='guided-spec-entry-check')
            _entry_checks_pid = os.getpid()
        return _entry_checks


#: How often (seconds) :func:`run_entry_check` asks whether the client of a check that is not answered yet went away
DISCONNECT_POLL_S = 0.5


class _EntryCheck:
    """The request one :func:`run_entry_check` runs for, as the checks it waits for see it (a context variable of
    its thread): when it goes away, each wait ends with :class:`CheckAbandoned` and leaves its job
    (:meth:`GrammarCompileService.abandon`)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._waits: list[tuple[GrammarCompileService, concurrent.futures.Future, threading.Event]] = []
        self.abandoned = False

    def result(self, service: GrammarCompileService, future: concurrent.futures.Future) -> Any:
        """The result of ``future`` (a job of ``service``), waited for while the request is there."""
        woken = threading.Event()
        wait = (service, future, woken)
        with self._lock:
            abandoned = self.abandoned
            if not abandoned:
                self._waits.append(wait)
        if abandoned:
            service.abandon(future)
        else:
            future.add_done_callback(lambda _: woken.set())
            woken.wait()
            with self._lock:
                self._waits.remove(wait)
        if self.abandoned or not future.done():
            raise CheckAbandoned('the request went away before its grammar was checked')
        return future.result()

    def abandon(self) -> None:
        with self._lock:
            self.abandoned = True
            waits = list(self._waits)
        for service, future, woken in waits:
            service.abandon(future)
            woken.set()


_entry_check: contextvars.ContextVar[_EntryCheck | None] = contextvars.ContextVar('guided_spec_entry_check',
                                                                                  default=None)


def _retrieve(future: asyncio.Future) -> None:
    """Take the outcome of a future nobody awaits any more (asyncio logs an exception never retrieved)."""
    if not future.cancelled():
        future.exception()


async def run_entry_check(func: Callable[..., Any], *args: Any,
                          disconnected: Callable[[], Awaitable[bool]] | None = None, **kwargs: Any) -> Any:
    """``func(*args, **kwargs)`` on a thread of :func:`entry_check_executor`, awaited: the entry check of a request
    (it waits for :func:`grammar_is_empty`) off the event loop.

    Not ``asyncio.to_thread``: the loop's default executor has ``cpu_count + 4`` threads (6 on two cores), and a
    check of a source slow to parse holds its thread for up to the compile limit, so a few such requests held every
    thread, and every other request that needs one (a guided request whose grammar was checked before, a
    multimodal request's preprocessing) waited behind them.

    A request that goes away leaves its check: where ``disconnected`` (a server's ``Request.is_disconnected``,
    asked every :data:`DISCONNECT_POLL_S` s while the check is not answered) says so, this raises
    :class:`CheckAbandoned` (a ``disconnected`` that raises is logged and not asked again: the request waits for its
    answer), and where the awaiting task is cancelled, the cancellation goes on. Either way the
    thread stops waiting at once, and a check nobody else waits for is dropped or stopped: requests whose clients
    closed their connections held the queue of grammars slow to parse for the whole limit, and live clients were
    refused with HTTP 429 meanwhile.
    """
    loop = asyncio.get_running_loop()
    entry = _EntryCheck()
    context = contextvars.copy_context()
    context.run(_entry_check.set, entry)
    future = loop.run_in_executor(entry_check_executor(), context.run, functools.partial(func, *args, **kwargs))
    try:
        if disconnected is None:
            await asyncio.wait((future,))
        while not future.done():
            await asyncio.wait((future,), timeout=DISCONNECT_POLL_S)
            if future.done():
                break
            try:
                gone = await disconnected()
            except Exception:  # noqa: BLE001 - the server's probe failed, not the request: it waits for its answer
                logger.warning('asking whether the client of an entry check disconnected failed; the check waits '
                               'for its answer without asking again', exc_info=True)
                await asyncio.wait((future,))
                break
            if gone:
                raise CheckAbandoned('the client disconnected before its grammar was checked')
    finally:
        if not future.done():  # (a cancelled wait leaves the future to the thread, which ends at once now)
            entry.abandon()
        future.add_done_callback(_retrieve)
    return future.result()


def grammar_is_empty(kind: str, source: str | dict | None = None, **options: Any) -> bool:
    """Parse a grammar source in this process's checker (:func:`grammar_checker`) and say whether its language is
    empty, within the compile time limit (``LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT``, read on each call).

    The entry check of a request, before it reaches an engine: xgrammar's conversion of a source has no time limit
    of its own and can take minutes, and a thread running it cannot be stopped. Arguments as
    :meth:`GrammarCompileService.check`, which says what it raises (:class:`GrammarCompileError` for a source
    that does not parse, :class:`GrammarCompileTimeout` past the limit, :class:`GrammarCompilerUnavailable` where
    the checker's process died: a fault of the server, not of the source); a malformed limit raises ``ValueError``
    naming the variable. The answer of a source is remembered, so a serving process and an engine in it parse it
    once. Blocks: call it from a worker thread, never from an event loop.
    """
    limit = compile_timeout_s_from_env()
    checker = grammar_checker()
    future = checker.check(kind, source, timeout_s=limit, **options)
    entry = _entry_check.get()
    # in run_entry_check, the wait ends (CheckAbandoned) when the request goes away
    return future.result() if entry is None else entry.result(checker, future)


def tag_schema_is_empty(tag: dict) -> bool:
    """Whether a ``json_schema`` format inside a structural tag admits no instance (each checked with
    :func:`grammar_is_empty`, which says what it raises; blocks like it).

    lmdeploy 0.18 builds a structural tag of the tools' parameters for ``tool_choice="required"``. The language of a
    whole tag says little (text outside its tags is free, and the check does not see through its tag dispatch), but
    a request that enters a tag whose schema has no instance can only meet a dead end: its grammar allows no token
    after the tag's opening.
    """
    return any(grammar_is_empty('json_schema', schema) for schema in tag_schemas(tag))
