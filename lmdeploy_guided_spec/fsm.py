"""Token finite-state machines (speculative method ``fsm``): a constraint whose deterministic edges are drafts.

The file format follows vLLM's FSM speculation: a JSON object mapping every state to its transitions,
``{token_id: next_state}``::

    {
      "0": {"5018": 1, "9642": 2},
      "1": {"-1": 1, "128001": 3},
      "2": {"25": 3},
      "3": {}
    }

* States and token ids are decimal integers (JSON object keys are strings); generation starts in state ``0``.
* Token id ``-1`` is the wildcard: any token without an edge of its own takes it, except the stop tokens (EOS).
* EOS ends generation. It is allowed where a state has an edge for it, and in a state without transitions, which
  allows nothing but EOS.
* Only the FSM's edges are allowed: the FSM constrains generation exactly as a grammar does. Where a state allows
  a single token (one edge and no wildcard, or a state without transitions and one stop token), that token is a
  draft that costs nothing.

:class:`FsmMatcher` walks an :class:`Fsm` with the methods of ``xgrammar.GrammarMatcher`` the core uses (``fork``,
``accept_token``, ``fill_next_token_bitmask``, ``is_terminated``), so the masks, drafting windows and commits of
:class:`~lmdeploy_guided_spec.SpecGrammarManager` serve FSMs unchanged.
"""
from __future__ import annotations

import json
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import bitmask_words
from .errors import FsmError

__all__ = ['Fsm', 'FsmMatcher', 'FsmSessions', 'WILDCARD', 'START_STATE']

#: The token id of a wildcard edge.
WILDCARD = -1
#: The state generation starts in.
START_STATE = 0
#: Per-state bitmask rows an Fsm keeps; others are rebuilt when needed (a row of a 128k vocabulary is 16 KB).
ROW_CACHE_SIZE = 1024


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


class Fsm:
    """A validated token FSM.

    Parameters
    ----------
    transitions : mapping of int to mapping of int to int
        ``state -> {token_id: next_state}``; token id ``-1`` is the wildcard.
    vocab_size : int, optional
        The model's vocabulary size; every token id must be below it. None checks the file's structure only (an
        Fsm without a vocabulary size cannot fill masks).
    stop_token_ids : sequence of int, optional
        The model's stop tokens (EOS). None (not known yet) skips the check that a state without transitions has
        a stop token to allow.
    source : str, default: '<fsm>'
        Where the FSM came from, for error messages.

    Raises
    ------
    FsmError
        With the state and token at fault: a token id outside ``[0, vocab_size)`` (other than ``-1``), an edge to a
        state the FSM does not define, no start state ``0``, states that cannot be reached from it, or a state
        without transitions when no stop token is known.
    """

    def __init__(self, transitions: Mapping[int, Mapping[int, int]], *, vocab_size: int | None,
                 stop_token_ids: Sequence[int] | None, source: str = '<fsm>'):
        self.vocab_size = None if vocab_size is None else int(vocab_size)
        self._stop_known = stop_token_ids is not None
        self.stop_token_ids = tuple(sorted({int(t) for t in stop_token_ids or ()}))
        self.source = source
        self.edges: dict[int, dict[int, int]] = {}
        self.wildcard: dict[int, int] = {}
        for state, edges in transitions.items():
            explicit = {}
            for token, target in edges.items():
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
        self._validate()
        self._stop = frozenset(self.stop_token_ids)
        self._rows: dict[int, np.ndarray] = {}

    @classmethod
    def from_dict(cls, data, *, vocab_size: int | None, stop_token_ids: Sequence[int] | None,
                  source: str = '<fsm>') -> Fsm:
        """Parse the JSON object of an FSM file (string keys, as JSON writes them); see :class:`Fsm`."""
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
        return cls(transitions, vocab_size=vocab_size, stop_token_ids=stop_token_ids, source=source)

    @classmethod
    def load(cls, path: str | Path, *, vocab_size: int | None, stop_token_ids: Sequence[int] | None) -> Fsm:
        """Read and validate an FSM file; raises :class:`FsmError` naming the file and the fault."""
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding='utf-8'))
        except FileNotFoundError as err:
            raise FsmError(f'FSM file {path} does not exist; speculative method fsm takes the path of a JSON '
                           'file as its model') from err
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise FsmError(f'cannot read FSM file {path}: {err}') from err
        return cls.from_dict(data, vocab_size=vocab_size, stop_token_ids=stop_token_ids, source=f'FSM file {path}')

    def _validate(self) -> None:
        source = self.source
        if not self.edges:
            raise FsmError(f'{source}: the FSM has no states')
        if START_STATE not in self.edges:
            raise FsmError(f'{source}: there is no start state {START_STATE}; generation starts there')
        for state in sorted(self.edges):
            targets = [(token, target) for token, target in self.edges[state].items()]
            if state in self.wildcard:
                targets.append((WILDCARD, self.wildcard[state]))
            for token, target in targets:
                if target not in self.edges:
                    raise FsmError(f'{source}: state {state}: token {token} leads to unknown state {target}; every '
                                   'next state must be a state of the file (a state without transitions ends '
                                   'generation)')
            if not targets and self._stop_known and not self.stop_token_ids:
                raise FsmError(f'{source}: state {state} has no transitions, so only EOS may follow it, but no stop '
                               'token ids are known')
        seen = {START_STATE}
        queue = deque([START_STATE])
        while queue:
            state = queue.popleft()
            nexts = list(self.edges[state].values())
            if state in self.wildcard:
                nexts.append(self.wildcard[state])
            for target in nexts:
                if target not in seen:
                    seen.add(target)
                    queue.append(target)
        unreachable = sorted(set(self.edges) - seen)
        if unreachable:
            shown = ', '.join(str(s) for s in unreachable[:10]) + (', ...' if len(unreachable) > 10 else '')
            raise FsmError(f'{source}: {len(unreachable)} state(s) cannot be reached from the start state '
                           f'{START_STATE}: {shown}')

    @property
    def num_states(self) -> int:
        """Number of states."""
        return len(self.edges)

    def matcher(self) -> FsmMatcher:
        """A matcher in the start state."""
        return FsmMatcher(self)

    def allowed_words(self, state: int, terminated: bool = False) -> np.ndarray:
        """Bitmask row ``(words,)`` uint32 of the tokens ``state`` allows (stop tokens only once terminated)."""
        if self.vocab_size is None:
            raise FsmError(f'{self.source}: the FSM was loaded without a vocabulary size and cannot fill masks')
        key = -1 if terminated else state
        row = self._rows.get(key)
        if row is not None:
            return row
        words = bitmask_words(self.vocab_size)
        edges = {} if terminated else self.edges[state]
        if not terminated and state in self.wildcard:
            allowed = np.ones(self.vocab_size, dtype=bool)
            allowed[[t for t in self.stop_token_ids if t not in edges and t < self.vocab_size]] = False
        else:
            allowed = np.zeros(self.vocab_size, dtype=bool)
            tokens = list(edges)
            if terminated or not edges:
                tokens += [t for t in self.stop_token_ids if t < self.vocab_size]
            allowed[tokens] = True
        padded = np.zeros(words * 32, dtype=bool)
        padded[:self.vocab_size] = allowed
        row = np.packbits(padded, bitorder='little').view(np.uint32)
        if len(self._rows) >= ROW_CACHE_SIZE:
            self._rows.clear()
        self._rows[key] = row
        return row

    def next_state(self, state: int, token: int) -> int | None:
        """The state after ``token``, or None when ``state`` does not allow it."""
        edges = self.edges[state]
        target = edges.get(token)
        if target is not None:
            return target
        if token in self._stop:
            # EOS through an explicit edge only, or in a state without transitions (it stays there)
            return state if not edges and state not in self.wildcard else None
        if state in self.wildcard and token >= 0 and (self.vocab_size is None or token < self.vocab_size):
            return self.wildcard[state]
        return None


class FsmMatcher:
    """One request's position in an :class:`Fsm`, with the ``xgrammar.GrammarMatcher`` methods the core uses.

    Accepting a stop token terminates the matcher; a terminated matcher allows only stop tokens and accepts none.
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
        target = self.fsm.next_state(self.state, int(token))
        if target is None:
            return False
        self.state = target
        if int(token) in self.fsm._stop:
            self.terminated = True
        return True

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int = 0) -> bool:
        """Write the allowed tokens into row ``index`` of an int32 CPU bitmask; returns True (the mask applies)."""
        row = self.fsm.allowed_words(self.state, self.terminated)
        bitmask[index, :row.shape[0]] = torch.from_numpy(row.view(np.int32))
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
