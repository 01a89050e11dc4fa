"""Token finite-state machines (speculative method ``fsm``): a constraint whose deterministic edges are drafts.

The format is vLLM's FSM speculation (``vllm.custom_fsm.CustomFSM``): a JSON object mapping states to their
transitions, ``graph[state][token_id] = next_state``, as ``CustomFSM.save`` writes it (``json.dump(graph)``, so
keys are strings). vLLM's own example::

    {"0": {"15339": 1}, "1": {"1917": 2}, "2": {"1296": 3, "3187": 4}, "3": {"128001": 5}, "4": {"128001": 6}}

The file is read as vLLM's ``CustomFSM`` reads it:

* States and token ids are decimal integers; generation starts in state ``0``.
* A state allows exactly the tokens of its edges, and each token leads to its next state.
* Token id ``-1`` is the wildcard: every token is allowed, EOS included, and a token without an edge of its own
  leads to the wildcard's next state (an explicit edge takes precedence).
* A state that is not in the graph, or has no transitions (``{}``), constrains nothing: every token is allowed,
  EOS included, and generation stays unconstrained from there on. The usual case is the state after EOS (states
  5 and 6 above), which nothing ever reaches.
* EOS ends generation where it is allowed: through an edge of its own, the wildcard, or an unconstrained state.

Where a state allows a single token (one edge and no wildcard), that token is a draft that costs nothing; a
wildcard or unconstrained state allows every token and drafts none, as vLLM's ``FSMProposer``.

What vLLM would also read but is refused here, as malformed: a top level or transitions that are not JSON
objects, a state, token id or next state that is not a decimal integer, a negative state or next state, a token
id below ``-1`` or outside the model's vocabulary, a state or edge given twice, no start state ``0``.

:class:`FsmBuilder` writes such files (``builder.graph[state][token_id] = next_state``, ``builder.save(path)``).
:class:`FsmMatcher` walks an :class:`Fsm` with the methods of ``xgrammar.GrammarMatcher`` the core uses (``fork``,
``accept_token``, ``fill_next_token_bitmask``, ``is_terminated``), so the masks, drafting windows and commits of
:class:`~lmdeploy_guided_spec.SpecGrammarManager` serve FSMs unchanged.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import bitmask_words
from .errors import FsmError

__all__ = ['Fsm', 'FsmBuilder', 'FsmMatcher', 'FsmSessions', 'WILDCARD', 'START_STATE']

#: The token id of a wildcard edge.
WILDCARD = -1
#: The state generation starts in.
START_STATE = 0
#: Per-state bitmask rows an Fsm keeps; others are rebuilt when needed (a row of a 128k vocabulary is 16 KB).
ROW_CACHE_SIZE = 1024
# cache keys of the rows that are not a state's edges
_ALL_ROW = -1
_STOP_ROW = -2


def _integer(value, what: str, where: str) -> int:
    if isinstance(value, bool):
        raise FsmError(f'{where}: {what} {value!r} is not an integer')
    if isinstance(value, int):
        return value
    if isinstance(value, str):
        try:
            return int(value.strip(), 10)
        except ValueError:
            pass
    raise FsmError(f'{where}: {what} {value!r} is not an integer')


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding='utf-8'))
    except FileNotFoundError as err:
        raise FsmError(f'FSM file {path} does not exist; speculative method fsm takes the path of a JSON file as '
                       'its fsm_path') from err
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise FsmError(f'cannot read FSM file {path}: {err}') from err


def _parse(data, source: str) -> dict[int, dict[int, int]]:
    """``{state: {token_id: next_state}}`` with integer keys from a JSON object (string or integer keys)."""
    if not isinstance(data, Mapping):
        raise FsmError(f'{source}: the top level must be a JSON object mapping each state to '
                       f'{{token_id: next_state}}, got {type(data).__name__}')
    transitions: dict[int, dict[int, int]] = {}
    for key, edges in data.items():
        state = _integer(key, 'state', source)
        if state < 0:
            raise FsmError(f'{source}: state {state} is negative; states are non-negative integers')
        if state in transitions:
            raise FsmError(f'{source}: state {state} is defined twice')
        where = f'{source}: state {state}'
        if not isinstance(edges, Mapping):
            raise FsmError(f'{where}: transitions must be a JSON object {{token_id: next_state}}, '
                           f'got {type(edges).__name__}')
        parsed = {}
        for token_key, target in edges.items():
            token = _integer(token_key, 'token id', where)
            if token in parsed:
                raise FsmError(f'{where}: token id {token} has two edges')
            parsed[token] = _integer(target, f'next state of token {token}', where)
        transitions[state] = parsed
    return transitions


class Fsm:
    """A validated token FSM, read as vLLM's ``CustomFSM`` reads it (see the module docstring).

    Parameters
    ----------
    transitions : mapping of int to mapping of int to int
        ``state -> {token_id: next_state}``; token id ``-1`` is the wildcard. States that are not keys, and states
        without transitions, constrain nothing.
    vocab_size : int, optional
        The model's vocabulary size; every token id must be below it. None checks the file's structure only (an
        Fsm without a vocabulary size cannot fill masks).
    stop_token_ids : sequence of int, optional
        The model's stop tokens (EOS): accepting one ends the matcher. None or empty: no token ends it.
    source : str, default: '<fsm>'
        Where the FSM came from, for error messages.

    Raises
    ------
    FsmError
        With the state and token at fault: a token id outside ``[0, vocab_size)`` (other than ``-1``), a negative
        next state, no states at all, or no start state ``0``.
    """

    def __init__(self, transitions: Mapping[int, Mapping[int, int]], *, vocab_size: int | None,
                 stop_token_ids: Sequence[int] | None, source: str = '<fsm>'):
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self.stop_token_ids = tuple(sorted({int(t) for t in stop_token_ids or ()}))
        self.source = source
        self.edges: dict[int, dict[int, int]] = {}
        self.wildcard: dict[int, int] = {}
        for state, edges in transitions.items():
            explicit = {}
            for token, target in edges.items():
                if target < 0:
                    raise FsmError(f'{source}: state {state}: next state {target} of token {token} is negative; '
                                   'states are non-negative integers')
                if token == WILDCARD:
                    self.wildcard[state] = target
                    continue
                if token < 0:
                    raise FsmError(f'{source}: state {state}: token id {token} is negative; {WILDCARD} is the '
                                   'wildcard, every other token id is in the vocabulary')
                if self.vocab_size is not None and token >= self.vocab_size:
                    raise FsmError(f'{source}: state {state}: token id {token} is outside the vocabulary '
                                   f'[0, {self.vocab_size}) of the model')
                explicit[token] = target
            self.edges[state] = explicit
        if not self.edges:
            raise FsmError(f'{source}: the FSM has no states')
        if START_STATE not in self.edges:
            raise FsmError(f'{source}: there is no start state {START_STATE}; generation starts there (an FSM '
                           'without it would constrain nothing)')
        self._stop = frozenset(self.stop_token_ids)
        self._rows: dict[int, np.ndarray] = {}

    @staticmethod
    def builder() -> FsmBuilder:
        """An empty :class:`FsmBuilder`."""
        return FsmBuilder()

    @classmethod
    def from_dict(cls, data, *, vocab_size: int | None, stop_token_ids: Sequence[int] | None,
                  source: str = '<fsm>') -> Fsm:
        """Parse the JSON object of an FSM file (string keys, as JSON writes them, or integers); see :class:`Fsm`."""
        return cls(_parse(data, source), vocab_size=vocab_size, stop_token_ids=stop_token_ids, source=source)

    @classmethod
    def load(cls, path: str | Path, *, vocab_size: int | None, stop_token_ids: Sequence[int] | None) -> Fsm:
        """Read and validate an FSM file; raises :class:`FsmError` naming the file and the fault."""
        path = Path(path)
        return cls.from_dict(_read_json(path), vocab_size=vocab_size, stop_token_ids=stop_token_ids,
                             source=f'FSM file {path}')

    @property
    def num_states(self) -> int:
        """Number of states in the graph."""
        return len(self.edges)

    def constrains(self, state: int) -> bool:
        """Whether ``state`` allows only some tokens: it is in the graph with edges and without a wildcard."""
        return bool(self.edges.get(state)) and state not in self.wildcard

    def matcher(self) -> FsmMatcher:
        """A matcher in the start state."""
        return FsmMatcher(self)

    def allowed_words(self, state: int, terminated: bool = False) -> np.ndarray:
        """Bitmask row ``(words,)`` uint32 of the tokens ``state`` allows (stop tokens only once terminated)."""
        if self.vocab_size is None:
            raise FsmError(f'{self.source}: the FSM was loaded without a vocabulary size and cannot fill masks')
        key = _STOP_ROW if terminated else state if self.constrains(state) else _ALL_ROW
        row = self._rows.get(key)
        if row is not None:
            return row
        words = bitmask_words(self.vocab_size)
        if key == _ALL_ROW:
            allowed = np.ones(self.vocab_size, dtype=bool)
        else:
            allowed = np.zeros(self.vocab_size, dtype=bool)
            tokens = list(self.edges[state]) if key == state else self.stop_token_ids
            allowed[[t for t in tokens if t < self.vocab_size]] = True
        padded = np.zeros(words * 32, dtype=bool)
        padded[:self.vocab_size] = allowed
        row = np.packbits(padded, bitorder='little').view(np.uint32)
        if len(self._rows) >= ROW_CACHE_SIZE:
            self._rows.clear()
        self._rows[key] = row
        return row

    def next_state(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None when ``state`` does not allow it.

        As vLLM's ``CustomFSM.get_next_state``: an explicit edge, else the wildcard. From a state that constrains
        nothing (absent from the graph, or without transitions) every token of the vocabulary stays there.
        """
        if token < 0 or (self.vocab_size is not None and token >= self.vocab_size):
            return None
        edges = self.edges.get(state)
        if not edges and state not in self.wildcard:
            return state
        target = edges.get(token)
        if target is not None:
            return target
        return self.wildcard.get(state)


class FsmBuilder:
    """Builds a token FSM in vLLM's format, so that no one writes the JSON by hand.

    ``graph`` is vLLM's ``CustomFSM.graph``: ``graph[state][token_id] = next_state`` with integer keys; a state is
    created on first use. :meth:`save` writes exactly what ``CustomFSM.save`` writes (``json.dump(graph)``), which
    vLLM and :meth:`Fsm.load` read.

    Parameters
    ----------
    graph : mapping, optional
        Initial transitions (string or integer keys, as :meth:`Fsm.from_dict` takes them).

    Examples
    --------
    >>> b = FsmBuilder()
    >>> b.graph[0] = {15339: 1}        # 'hello'
    >>> b.graph[1][1917] = 2           # ' world'
    >>> b.chain(2, [1296, 128001])     # ' test', then EOS into state 4, which the graph leaves out
    4
    >>> b.graph
    {0: {15339: 1}, 1: {1917: 2}, 2: {1296: 3}, 3: {128001: 4}}
    """

    def __init__(self, graph: Mapping | None = None):
        self.graph: dict[int, dict[int, int]] = _Graph()
        if graph is not None:
            self.graph.update(_parse(graph, '<graph>'))

    @classmethod
    def load(cls, path: str | Path) -> FsmBuilder:
        """A builder holding an FSM file's graph with integer keys (as ``CustomFSM.from_prebuilt`` reads it)."""
        path = Path(path)
        data = _read_json(path)
        Fsm.from_dict(data, vocab_size=None, stop_token_ids=None, source=f'FSM file {path}')
        return cls(data)

    def add(self, state: int, token_id: int, next_state: int) -> FsmBuilder:
        """``graph[state][token_id] = next_state`` (``token_id`` ``-1``: the wildcard); returns the builder."""
        self.graph[int(state)][int(token_id)] = int(next_state)
        return self

    def new_state(self) -> int:
        """A state number no state or edge of the graph uses yet."""
        used = [s for s in self.graph] + [t for edges in self.graph.values() for t in edges.values()]
        return max(used, default=START_STATE) + 1

    def chain(self, state: int, token_ids: Iterable[int], end: int | None = None) -> int:
        """Edges that spell ``token_ids`` from ``state`` through new states; returns the state after the last token.

        Parameters
        ----------
        state : int
            Where the chain starts.
        token_ids : iterable of int
            The tokens in order (e.g. ``tokenizer.encode(text, add_special_tokens=False)``), at least one.
        end : int, optional
            The state the last token leads to; default: a new state.
        """
        token_ids = [int(t) for t in token_ids]
        if not token_ids:
            raise FsmError(f'a chain from state {state} has no token ids')
        for i, token in enumerate(token_ids):
            if i == len(token_ids) - 1 and end is not None:
                target = int(end)
            else:
                # a state of its own, also when end is not in the graph yet
                target = max(self.new_state(), -1 if end is None else int(end) + 1)
            self.add(state, token, target)
            state = target
        return state

    def build(self, *, vocab_size: int | None, stop_token_ids: Sequence[int] | None) -> Fsm:
        """The :class:`Fsm` of the graph (validated as a file would be)."""
        return Fsm.from_dict(self.graph, vocab_size=vocab_size, stop_token_ids=stop_token_ids, source='<builder>')

    def save(self, path: str | Path) -> None:
        """Write the graph as vLLM's ``CustomFSM.save`` does, after checking its structure (nothing is written
        when :meth:`build` would fail without a vocabulary)."""
        self.build(vocab_size=None, stop_token_ids=None)
        with open(path, 'w') as f:
            json.dump(self.graph, f)


class _Graph(dict):
    """``{state: {token_id: next_state}}`` that creates a state's transitions on first use."""

    def __missing__(self, state):
        edges = self[state] = {}
        return edges

    def __repr__(self):
        return repr(dict(self))


class FsmMatcher:
    """One request's position in an :class:`Fsm`, with the ``xgrammar.GrammarMatcher`` methods the core uses.

    Accepting a stop token terminates the matcher, as it ends the request: a terminated matcher allows only stop
    tokens and accepts none, and the core treats it as ended (it constrains nothing more, whatever state the stop
    token led to).
    """

    def __init__(self, fsm: Fsm, state: int = START_STATE, terminated: bool = False):
        self.fsm = fsm
        self.state = state
        self.terminated = terminated

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        """The stop tokens (EOS)."""
        return self.fsm.stop_token_ids

    def fork(self) -> FsmMatcher:
        """An independent copy at the same state."""
        return FsmMatcher(self.fsm, self.state, self.terminated)

    def accept_token(self, token: int) -> bool:
        """Advance by ``token``; False (state unchanged) when the FSM does not allow it."""
        if self.terminated:
            return False
        token = int(token)
        target = self.fsm.next_state(self.state, token)
        if target is None:
            return False
        self.state = target
        if token in self.fsm._stop:
            self.terminated = True
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        """Write the allowed tokens into row ``index`` of an int32 CPU bitmask; returns True (the mask applies)."""
        row = self.fsm.allowed_words(self.state, self.terminated)
        # through numpy, as xgrammar writes: the engine may have allocated the buffer as an inference tensor, which
        # torch lets the grammar worker's thread not write
        words = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
        words[index, :row.shape[0]] = row.view(np.int32)
        # a bitmask of a wider vocabulary (the tokenizer's, past the model's): no token past the FSM's exists
        words[index, row.shape[0]:] = 0
        return True

    def is_terminated(self) -> bool:
        """Whether a stop token was accepted."""
        return self.terminated

    def is_completed(self) -> bool:
        """Whether generation may end here: terminated, or a stop token is allowed."""
        return self.terminated or any(self.fsm.next_state(self.state, t) is not None for t in self.fsm.stop_token_ids)


class FsmSessions:
    """The committed FSM state of every session (the engine side of method ``fsm``).

    A session starts in the start state at its first generated token. Rows of requests with a ``response_format``
    keep their grammar matcher: the request's own format takes precedence over the engine-wide FSM.
    """

    def __init__(self, fsm: Fsm):
        self.fsm = fsm
        self._matchers: dict[int, FsmMatcher] = {}

    def matchers(self, session_ids: Sequence[int],
                 grammar_matchers: Mapping[int, xgr.GrammarMatcher] | None = None) -> dict:
        """``{batch row: matcher}`` for every row: its grammar matcher if it has one, else its session's FSM."""
        out = dict(grammar_matchers or {})
        for row, session_id in enumerate(session_ids):
            if row in out:
                continue
            matcher = self._matchers.get(session_id)
            if matcher is None:
                matcher = self._matchers[session_id] = self.fsm.matcher()
            out[row] = matcher
        return out

    def forget(self, session_ids: Sequence[int]) -> None:
        """Drop the state of finished sessions."""
        for session_id in session_ids:
            self._matchers.pop(session_id, None)

    def __len__(self) -> int:
        return len(self._matchers)
