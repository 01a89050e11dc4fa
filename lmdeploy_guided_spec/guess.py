"""Guessed drafts for the draft-free methods: the request's own formatting, and text copied from its context.

The grammar forces little under any-whitespace JSON grammars (lmdeploy's default): optional whitespace may follow
every structural character. Two more draft sources fill the positions where nothing is forced:

* **formatting**: where the grammar allows whitespace and then forces text (a property name, ``:``, a closing
  bracket), draft the whitespace this request wrote at the same grammatical place before (or its most common
  choice, then the engine's; :mod:`lmdeploy_guided_spec.layout`), then the forced text after it, and on through
  further whitespace places; where several bytes may follow a run (a key's quote or a closing bracket), the one that
  followed this kind of place most often. The text is written as the tokenizer writes it
  (:meth:`ForcedTokenizer.tokenize`), except that punctuation is split into the punctuation tokens the request wrote
  (:meth:`RequestHistory.as_written`);
* **context**: for values the grammar does not force, the continuation of the longest recent suffix of the output
  found earlier in the output or in the prompt (prompt lookup), as the tokenizer writes it; a position whose mask
  disallows the next token ends the guess. A copy from the output that runs to the output's end leaves its last
  token out (the output's end is no token boundary of the copy).

Per position, :class:`GuessWindow` drafts the token the grammar forces, else the next token of the current guess
while the grammar allows it, else a new formatting guess, else a new context guess, else nothing. Guesses are
only drafts: verification keeps the output exactly what guided non-speculative decoding writes. Each request keeps
an acceptance rate per source, and a source whose guesses are rejected drafts fewer tokens per window.

Everything here runs on the grammar worker thread: commits, windows and forgetting are ordered there.
"""
from __future__ import annotations

import math
import os
import weakref
from collections import Counter, deque
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import uint32_words
from .forced import ForcedTokenizer, jump_forward_text, token_allowed
from .layout import WHITESPACE, JsonLayout, WhitespaceMemory

__all__ = ['SOURCES', 'GUESS_DRAFTS_ENV', 'GuessDrafts', 'GuessWindow', 'RequestHistory', 'guess_sources_from_env']

#: The guessed draft sources, in the order a position tries them.
SOURCES = ('format', 'lookup')
#: Most bytes of text one formatting guess writes ahead.
MAX_FORMAT_BYTES = 96
#: Suffix lengths (bytes) a context lookup tries, longest first, and the bytes of context it copies.
LOOKUP_NEEDLES = (32, 16, 8, 4, 3)
MAX_LOOKUP_BYTES = 48
#: Longest punctuation token a request's pieces keep (:meth:`RequestHistory.learn`).
MAX_PIECE_BYTES = 16
#: Weight of the newest window in a source's acceptance rate, and the rate a request starts with.
RATE_WEIGHT = 0.3
INITIAL_RATE = 0.75


#: The guess sources on: ``1`` both, ``0`` none, or a comma list (:func:`guess_sources_from_env`).
GUESS_DRAFTS_ENV = 'LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS'


def guess_sources_from_env(default: str = 'format,lookup') -> tuple[str, ...]:
    """Sources named by ``LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS``: ``1`` both, ``0`` none, or a comma list."""
    value = os.environ.get(GUESS_DRAFTS_ENV, default).strip()
    if value == '1':
        value = default
    names = tuple(name.strip() for name in value.split(',') if name.strip() and name.strip() != '0')
    unknown = [name for name in names if name not in SOURCES]
    if unknown:
        raise ValueError(f'{GUESS_DRAFTS_ENV}: unknown sources {unknown}; known: {", ".join(SOURCES)}')
    return names


def _decode(data: bytes) -> str | None:
    """``data`` as text, an incomplete character at the end cut off; None if it starts inside a character."""
    if data and 0x80 <= data[0] < 0xC0:
        return None
    for cut in range(min(4, len(data))):
        try:
            return data[:len(data) - cut].decode('utf-8')
        except UnicodeDecodeError:
            continue
    return None


def _has_word(data: bytes) -> bool:
    return any(48 <= b <= 57 or 65 <= b <= 90 or 97 <= b <= 122 or b >= 0x80 for b in data)


#: Where a value copied into a JSON string ends: at a quote (the source's string ends too) or a line break
#: (:data:`VALUE_END_BYTES`), and at the punctuation prose puts after a name or a figure when whitespace follows it
#: (:data:`PROSE_END_BYTES`; so not inside a URL, a time or a number).
VALUE_END_BYTES = frozenset(b'"\n')
PROSE_END_BYTES = frozenset(b':;.)]}')
_NUMBER_BYTES = frozenset(b'0123456789+-.eE')
#: The bytes a formatting guess may take as the one after a whitespace run where several may follow.
STRUCTURAL = frozenset(b'"{}[],:')


def _value_end(found: bytes, layout: JsonLayout, last: int | None, ends: bool = True) -> int | None:
    """Where the value the output is writing ends in copied text ``found``: the offset of the first byte that does
    not belong to it, or None when it runs to the end of ``found``.

    In a string (``layout.in_string``) the value ends at :data:`VALUE_END_BYTES`, or at :data:`PROSE_END_BYTES`
    followed by whitespace (or by the end of the source, where ``ends``): what the copy's source writes after it is
    prose or another JSON value, while the output closes its string. A comma does not end it (values hold commas: a
    place, a list in prose). Outside a string (a number) it ends at the first byte a number does not hold (a full stop
    only before a digit); ``last`` is the output's last byte, so a number is being written when it is a digit.
    """
    if layout.in_string:
        if layout.escape:
            return None
        for index, byte in enumerate(found):
            if byte == 0x5C:
                return None
            if byte in VALUE_END_BYTES:
                return index
            if byte in PROSE_END_BYTES and (found[index + 1] in WHITESPACE if index + 1 < len(found) else ends):
                return index
        return None
    if layout.run or last is None or not 48 <= last <= 57:
        return None
    for index, byte in enumerate(found):
        if byte not in _NUMBER_BYTES or (byte == 0x2E and not found[index + 1:index + 2].isdigit()):
            return index
    return None


class RequestHistory:
    """What one guided request wrote: prompt and output bytes, its layout, its whitespace, its guess acceptance."""

    def __init__(self, memory_fallback: WhitespaceMemory | None = None):
        self.prompt = bytearray()
        self.output = bytearray()
        self.layout = JsonLayout()
        self.memory = WhitespaceMemory(memory_fallback)
        self.rates = dict.fromkeys(SOURCES, INITIAL_RATE)
        # (token, source) of the last window's drafts, compared with the next commit
        self.pending: list[tuple[int, str]] | None = None
        #: Bytes -> token of every token without letters or digits this request wrote (its way of splitting JSON's
        #: punctuation and whitespace into tokens, see :meth:`as_written`)
        self.pieces: dict[bytes, int] = {}

    def budget(self, source: str, num_spec_tokens: int) -> int:
        """Guess tokens ``source`` may draft in one window: about the run its acceptance rate expects, at least 1."""
        rate = self.rates[source]
        if rate >= INITIAL_RATE:
            return num_spec_tokens
        return max(1, min(num_spec_tokens, math.floor(rate / (1.0 - rate)) + 1))

    def write(self, data: bytes) -> None:
        """Committed output bytes."""
        self.output += data
        self.layout.feed(data, self.memory)

    def learn(self, tokens: Sequence[int], pieces: Sequence[bytes]) -> None:
        """Remember the punctuation tokens among committed ``tokens`` (``pieces``: the bytes of each)."""
        for token, data in zip(tokens, pieces):
            if data and not _has_word(data) and len(data) <= MAX_PIECE_BYTES:
                self.pieces[data] = token

    def as_written(self, ids: Sequence[int], token_bytes) -> list[int]:
        """``ids`` (a canonical tokenization) with every punctuation token this request never wrote split into
        punctuation tokens it did write, where they spell it exactly (fewest pieces).

        A model writes JSON's punctuation in pieces of its own: SmolLM2 writes ``":`` then ``"`` where the canonical
        tokenization of ``":"`` is one token, and it keeps doing so within a request. Tokens of whitespace alone are
        kept whole.
        """
        pieces = self.pieces
        out: list[int] = []
        for token in ids:
            data = token_bytes(token)
            split = None
            # whitespace alone is left whole: a model writes an indentation as the tokenizer does
            if (pieces and len(data) > 1 and data not in pieces and not _has_word(data)
                    and not all(byte in WHITESPACE for byte in data)):
                split = _spell(data, pieces)
            out.extend(split if split is not None else (token, ))
        return out

    def verified(self, tokens: Sequence[int], stats: Counter) -> None:
        """Compare the last window's drafts with the tokens committed after it; update rates and ``stats``."""
        drafts, self.pending = self.pending, None
        if drafts is None:
            return
        stats['steps'] += 1
        if not drafts:
            return
        accepted = 0
        while accepted < len(drafts) and accepted < len(tokens) and tokens[accepted] == drafts[accepted][0]:
            accepted += 1
        stats['windows'] += 1
        if accepted < len(drafts) and accepted < len(tokens):
            stats['rejected'] += 1
        for source in ('forced', *SOURCES):
            drafted = sum(1 for _, s in drafts if s == source)
            if not drafted:
                continue
            stats[f'{source}_drafted'] += drafted
            hits = sum(1 for _, s in drafts[:accepted] if s == source)
            stats[f'{source}_accepted'] += hits
            tried = sum(1 for _, s in drafts[:accepted + 1] if s == source)
            if source in self.rates and tried:
                self.rates[source] = (1 - RATE_WEIGHT) * self.rates[source] + RATE_WEIGHT * hits / tried


def _spell(data: bytes, pieces: Mapping[bytes, int]) -> list[int] | None:
    """The fewest ``pieces`` (bytes -> token) that spell ``data`` exactly, in order, or None."""
    best: list[list[int] | None] = [[]] + [None] * len(data)
    for end in range(1, len(data) + 1):
        for start in range(end):
            piece = pieces.get(data[start:end])
            if piece is not None and best[start] is not None and (best[end] is None
                                                                  or len(best[start]) + 1 < len(best[end])):
                best[end] = best[start] + [piece]
    return best[-1]


class _Row:
    """One request's guessing state within a window."""

    __slots__ = ('history', 'layout', 'tail', 'plan', 'source', 'used', 'budgets', 'drafts')

    def __init__(self, history: RequestHistory, num_spec_tokens: int, sources: Sequence[str]):
        self.history = history
        self.layout = history.layout.copy()
        self.tail = bytearray(history.output)
        self.plan: deque[int] = deque()
        self.source = ''
        self.used = dict.fromkeys(sources, 0)
        self.budgets = {source: history.budget(source, num_spec_tokens) for source in sources}
        self.drafts: list[tuple[int, str]] = []


class GuessWindow:
    """Guessed drafts for the rows of one draft-free window (built and used on the worker).

    :meth:`choose` is asked at every position of every live row, after the position's mask is filled and before the
    row's fork accepts the chosen token.
    """

    def __init__(self, guesses: GuessDrafts, histories: Mapping[int, RequestHistory], num_spec_tokens: int):
        self.guesses = guesses
        self.num_spec_tokens = num_spec_tokens
        self.rows = {row: _Row(history, num_spec_tokens, guesses.sources) for row, history in histories.items()}

    def choose(self, row: int, fork, mask_row: torch.Tensor | np.ndarray, forced: int | None) -> int | None:
        """The draft of ``row`` at the current position: ``forced`` if given, else a guessed token, else None."""
        state = self.rows.get(row)
        if state is None:
            return forced
        if forced is not None:
            if state.plan and state.plan[0] == forced:
                state.plan.popleft()
            else:
                state.plan.clear()
            return self._take(state, forced, 'forced')
        if state.plan:
            token = state.plan.popleft()
            if token_allowed(mask_row, token) and state.used[state.source] < state.budgets[state.source]:
                return self._take(state, token, state.source)
            state.plan.clear()
        for source in self.guesses.sources:
            if state.used[source] >= state.budgets[source]:
                continue
            plan = (self._format_plan(state, fork, mask_row) if source == 'format' else
                    self._lookup_plan(state, fork))
            if plan and token_allowed(mask_row, plan[0]):
                state.plan = deque(plan[1:])
                state.source = source
                return self._take(state, plan[0], source)
        return None

    def observe(self, row: int, token: int) -> None:
        """A draft model's choice at a position where :meth:`choose` had no guess: read it as the row's draft."""
        state = self.rows.get(row)
        if state is not None:
            state.plan.clear()
            self._take(state, token, 'model')

    def finish(self) -> None:
        """Keep every row's drafts for comparison with its next commit."""
        for state in self.rows.values():
            state.history.pending = state.drafts

    def _take(self, state: _Row, token: int, source: str) -> int:
        data = self.guesses.tokenizer.token_bytes(token)
        state.layout.feed(data)
        state.tail += data
        state.drafts.append((token, source))
        if source in state.used:
            state.used[source] += 1
        return token

    # -- formatting ---------------------------------------------------------------------------------------------
    def _format_text(self, state: _Row, fork, layout: JsonLayout | None = None,
                     mask_row: torch.Tensor | np.ndarray | None = None) -> bytes:
        """Whitespace as the request writes it and the text the grammar forces around it, from the fork's state
        (and ``layout``, the row's by default). ``mask_row``: the fork's bitmask, already filled (saves a fill
        where nothing is forced at the fork's own state)."""
        layout = (state.layout if layout is None else layout).copy()
        # inside a string only text the grammar forces can follow (the end of a key: '":')
        probe = fork.fork()
        memory = state.history.memory
        text = bytearray()
        while len(text) < MAX_FORMAT_BYTES:
            jump = jump_forward_text(probe)
            if jump:
                # a guess writes at most MAX_FORMAT_BYTES: the rest of a long forced literal is not replayed
                data = jump[:MAX_FORMAT_BYTES].encode('utf-8')
                if not probe.accept_string(data):
                    break
                text += data
                layout.feed(data)
                continue
            if layout.in_string:
                break
            # the probe is still at the fork's state until text is taken: its mask is known
            allowed = self.guesses.allowed_bytes(probe, mask_row if not text else None, needs=WHITESPACE)
            if not allowed & WHITESPACE:
                break
            others = allowed - WHITESPACE
            after = next(iter(others)) if len(others) == 1 else None
            structural = others & STRUCTURAL
            if after is None and structural:
                # several bytes may follow (a key or a closing bracket): the one this kind of place had most often;
                # not a digit (a number may go on or end here)
                after = memory.likely_after(layout.last, structural)
            run = memory.predict(layout.last, layout.depth, after)
            if run is None or not run.startswith(layout.run):
                break
            rest = run[len(layout.run):]
            if rest:
                if not probe.accept_string(rest):
                    break
                text += rest
                layout.feed(rest)
            if after is None:
                break
            data = bytes((after, ))
            if not probe.accept_string(data):
                break
            text += data
            layout.feed(data)
        return bytes(text)

    def _format_plan(self, state: _Row, fork, mask_row: torch.Tensor | np.ndarray | None = None) -> list[int]:
        text = _decode(self._format_text(state, fork, mask_row=mask_row))
        if not text:
            return []
        # the tail that could be written together with what follows is a guess too (the structural character alone,
        # as models write it, is the usual choice)
        return self._as_written(state, self.guesses.tokenizer.tokenize(text)[0])

    def _as_written(self, state: _Row, ids: Sequence[int]) -> list[int]:
        return state.history.as_written(ids, self.guesses.tokenizer.token_bytes)

    # -- context lookup -----------------------------------------------------------------------------------------
    def _lookup_text(self, state: _Row) -> tuple[bytes, bool, bool]:
        """Context that followed the longest recent suffix of the output elsewhere, whether it reaches the end of
        the prompt it was copied from (so that its last token is whole), and whether it was cut where the output's
        value ends (:func:`_value_end`)."""
        out = bytes(state.tail)
        prompt = state.history.prompt
        for size in LOOKUP_NEEDLES:
            if len(out) < size:
                continue
            needle = out[-size:]
            if size <= 4 and not _has_word(needle):
                continue
            source = out
            pos = out.rfind(needle, 0, len(out) - 1)
            if pos < 0:
                source = prompt
                pos = prompt.rfind(needle)
            if pos < 0:
                continue
            start = pos + size
            found = bytes(source[start:start + MAX_LOOKUP_BYTES])
            if not found:
                continue
            # a copy that runs to the end of the prompt ends where the prompt does; one that runs to the end of the
            # output ends where the output's last token does, which says nothing of where the copy's tokens end
            complete = source is prompt and start + MAX_LOOKUP_BYTES >= len(source)
            end = _value_end(found, state.layout, out[-1], ends=complete)
            if end is not None:
                return found[:end], False, True
            return found, complete, False
        return b'', False, False

    def _lookup_plan(self, state: _Row, fork) -> list[int]:
        data, complete, ends = self._lookup_text(state)
        if ends:
            # the value ends where the copy was cut: close the string the output is in, and go on as the request
            # writes its formatting; all of it tokenized as one text, as the model writes the copied value's end and
            # the punctuation after it together
            layout = state.layout.copy()
            close = b'"' if layout.in_string else b''
            probe = fork.fork()
            if (data and _decode(data) is None) or not probe.accept_string(data + close):
                return []
            layout.feed(data + close)
            text = _decode(data + close + self._format_text(state, probe, layout))
            return self._as_written(state, self.guesses.tokenizer.tokenize(text)[0]) if text else []
        text = _decode(data)
        if not text:
            return []
        ids = self.guesses.tokenizer.encode(text)
        if not ids:
            return []
        # the copied text was cut at a byte count: its last token may be written differently
        return ids if complete or len(ids) == 1 else ids[:-1]


class GuessDrafts:
    """Request histories and guessed draft windows of one engine.

    Parameters
    ----------
    tokenizer : ForcedTokenizer
        The model's tokenizer: token bytes, canonical tokenization.
    sources : sequence of str, optional
        Guess sources to use, from :data:`SOURCES`; default: :func:`guess_sources_from_env`.
    """

    def __init__(self, tokenizer: ForcedTokenizer, *, sources: Sequence[str] | None = None):
        self.tokenizer = tokenizer
        self.sources = tuple(guess_sources_from_env() if sources is None else sources)
        self.memory = WhitespaceMemory()
        # id(matcher) -> (weak reference, history); matchers are not hashable, and a history goes with its matcher
        self._histories: dict[int, tuple[weakref.ref, RequestHistory]] = {}
        self._sessions: dict[int, weakref.ref] = {}
        # ASCII byte -> a token of that byte alone, and the same as arrays (read from the vocabulary on first use)
        self._byte_tokens: dict[int, int] = {}
        self._byte_values: np.ndarray | None = None
        self._byte_ids: np.ndarray | None = None
        #: Counters over every window: ``steps`` (verification steps of guided requests), ``windows`` (those that
        #: drafted anything), ``rejected`` (windows whose first rejected draft was a real draft),
        #: ``<source>_drafted`` and ``<source>_accepted`` for ``forced`` and each guess source.
        self.stats: Counter = Counter()

    @property
    def enabled(self) -> bool:
        """Whether any guess source is on."""
        return bool(self.sources)

    def history(self, matcher, create: bool = True) -> RequestHistory | None:
        """The history of the request a committed matcher belongs to."""
        if not isinstance(matcher, xgr.GrammarMatcher):
            return None
        key = id(matcher)
        found = self._histories.get(key)
        if found is not None and found[0]() is matcher:
            return found[1]
        if not create:
            return None
        history = RequestHistory(self.memory)
        histories = self._histories

        def drop(ref, key=key):
            if histories.get(key, (None, ))[0] is ref:
                histories.pop(key, None)

        self._histories[key] = (weakref.ref(matcher, drop), history)
        return history

    def committed(self, matchers: Mapping, rows: Sequence) -> None:
        """Record the tokens committed for every guided row (``rows[row]``: an int or a list, ``-1`` ends it)."""
        vocab_bytes = self.tokenizer.token_bytes
        for row, matcher in matchers.items():
            history = self.history(matcher)
            if history is None:
                continue
            tokens = rows[row] if isinstance(rows[row], list) else [rows[row]]
            tokens = [int(t) for t in tokens]
            if -1 in tokens:
                tokens = tokens[:tokens.index(-1)]
            history.verified(tokens, self.stats)
            pieces = [vocab_bytes(t) for t in tokens]
            history.write(b''.join(pieces))
            history.learn(tokens, pieces)

    def window(self, matchers: Mapping, session_ids: Sequence[int] | None, prompt_ids: Sequence | None,
               num_spec_tokens: int) -> GuessWindow | None:
        """A :class:`GuessWindow` for the guided rows (on the worker); ``prompt_ids[row]`` adds prompt tokens."""
        if not self.sources:
            return None
        histories = {}
        for row, matcher in matchers.items():
            history = self.history(matcher)
            if history is None:
                continue
            histories[row] = history
            if session_ids is not None:
                self._sessions[session_ids[row]] = weakref.ref(matcher)
            ids = prompt_ids[row] if prompt_ids is not None and row < len(prompt_ids) else None
            if ids is not None:
                ids = ids.tolist() if isinstance(ids, torch.Tensor) else ids
                history.prompt += b''.join(self.tokenizer.token_bytes(int(t)) for t in ids)
        return GuessWindow(self, histories, num_spec_tokens) if histories else None

    def forget(self, session_ids: Sequence[int]) -> None:
        """Drop the histories of finished sessions."""
        for session_id in session_ids:
            ref = self._sessions.pop(session_id, None)
            matcher = ref() if ref is not None else None
            if matcher is not None:
                self._histories.pop(id(matcher), None)

    @property
    def num_histories(self) -> int:
        """Requests with a history (for leak checks)."""
        return len(self._histories)

    def allowed_bytes(self, matcher, mask_row: torch.Tensor | np.ndarray | None = None, *,
                      needs: frozenset[int] = frozenset()) -> set[int]:
        """The ASCII bytes the matcher's state allows next (its single-byte tokens the mask allows).

        ``mask_row``, the matcher's bitmask if it is already filled, is read. Otherwise the matcher accepts each
        single-byte token in turn and rolls it back: a tenth of the time of filling a mask of a 128k vocabulary at
        the states a formatting guess reaches. With ``needs``, those bytes are tried first, and where none of them
        is allowed the empty set comes back without trying the others.
        """
        if self._byte_ids is None:
            vocab = self.tokenizer.decoded_vocab
            found: dict[int, int] = {}
            for token, data in enumerate(vocab):
                if len(data) == 1 and data[0] < 0x80 and data[0] not in found and self.tokenizer.token_bytes(token):
                    found[data[0]] = token
            self._byte_tokens = dict(sorted(found.items()))
            self._byte_values = np.asarray(list(self._byte_tokens), dtype=np.int64)
            self._byte_ids = np.asarray(list(self._byte_tokens.values()), dtype=np.int64)
        if mask_row is not None:
            words = uint32_words(mask_row)
            ids = self._byte_ids
            bits = (words[ids >> 5] >> (ids & 31).astype(np.uint32)) & 1
            allowed = set(self._byte_values[bits.astype(bool)].tolist())
            return allowed if not needs or allowed & needs else set()
        tokens = self._byte_tokens
        allowed = {byte for byte in needs if byte in tokens and _accepts(matcher, tokens[byte])}
        if needs and not allowed:
            return allowed
        allowed.update(byte for byte, token in tokens.items() if byte not in needs and _accepts(matcher, token))
        return allowed


def _accepts(matcher: xgr.GrammarMatcher, token: int) -> bool:
    """Whether the matcher's state allows ``token``, the state left as it was."""
    if not matcher.accept_token(token):
        return False
    matcher.rollback(1)
    return True
