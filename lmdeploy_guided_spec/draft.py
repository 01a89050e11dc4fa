"""Grammar state of one drafting window, filled one position ahead in a worker thread.

Per draft position the proposer calls :meth:`DraftGrammar.mask_logits_` (waits for that position's bitmask,
masks the draft logits) and :meth:`DraftGrammar.advance` with the chosen target ids (returns at once; the
worker reads the ids, advances the forks and fills the next position while the device runs the next draft
forward). After the last draft token the worker fills one more position, the bonus position, so the window
holds exactly the ``num_spec_tokens + 1`` verification masks of the next target step: verification mask ``i``
is the state after draft tokens ``0..i-1``, which is the state draft position ``i`` was masked with.

All masks live in one host buffer ``(batch, num_spec_tokens + 1, words)`` (page-locked when a GPU is present),
so verification needs one host-to-device copy and one masking kernel.

With ``forced=True`` the worker also finds, at every filled draft position, the token the grammar forces there
(:func:`lmdeploy_guided_spec.forced.forced_token`): :meth:`DraftGrammar.advance` puts it in place of the draft
model's choice, and :meth:`DraftGrammar.propose` drafts a whole window from forced tokens alone (methods
``grammar`` and ``fsm``, no draft model).

With ``mask_drafts=False`` the draft model drafts freely: :meth:`DraftGrammar.mask_logits_` returns at once and the
engine thread does not wait while it drafts. The worker still advances the forks by the drafted tokens and fills the
verification masks behind the device; a draft the grammar rejects ends its row's window there, and verification
rejects it.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import ALL_ALLOWED, allocate_bitmask, apply_bitmask_, no_token_allowed, take_rows, token_allowed
from .forced import ForcedTokenizer, JumpForwardMemo, forced_token, single_allowed_tokens
from .guess import GuessWindow
from .mask_clock import MaskClock
from .ordering import Ready, host_lists, record_ready, to_device
from .sparse import SparseMaskBuilder, SparseRows
from .step import has_ended, stop_only, stop_tokens
from .vocab_map import DraftVocabMap
from .worker import GrammarWorker

__all__ = ['DraftGrammar', 'BATCH_FILL_MIN_ROWS']

Matchers = Mapping[int, xgr.GrammarMatcher]

#: Live rows from which one BatchGrammarMatcher call fills a position instead of a Python loop; it pays only with
#: enough cores (see benchmarks/mask_overhead.py), so it is used when os.cpu_count() >= BATCH_FILL_MIN_CORES.
BATCH_FILL_MIN_ROWS = 16
BATCH_FILL_MIN_CORES = 8


def _first(value):
    return value[0] if isinstance(value, list) else value


def _disallowed_token(mask_row: torch.Tensor, vocab_size: int) -> int | None:
    """The smallest token a bitmask row disallows, or None."""
    words = mask_row.numpy().view(np.uint32)
    partial = np.flatnonzero(words != 0xFFFFFFFF)
    if partial.size == 0:
        return None
    index = int(partial[0])
    word = int(words[index])
    token = index * 32 + ((~word & (word + 1)).bit_length() - 1)
    return token if token < vocab_size else None


def _override(token_ids, forced: dict[int, int]) -> None:
    """Write forced tokens into the chosen draft ids in place (tensor ``(rows,)`` / ``(rows, 1)`` or a list).

    On a device the rows and tokens are copied from page-locked memory without blocking the host; the write is
    queued on the current stream after the kernel that chose the ids.
    """
    if isinstance(token_ids, torch.Tensor):
        column = token_ids if token_ids.dim() == 1 else token_ids[:, 0]
        rows = [row for row in forced if row < column.shape[0]]
        index = to_device(rows, torch.long, column.device)
        column[index] = to_device([forced[row] for row in rows], column.dtype, column.device)
        return
    for row, token in forced.items():
        token_ids[row] = [token] if isinstance(token_ids[row], list) else token


class DraftGrammar:
    """Forks of the committed matchers that constrain one drafting window.

    Parameters
    ----------
    matchers : mapping of batch row to GrammarMatcher
        Committed matchers of the guided requests. They are forked on the worker, after every job submitted
        earlier (the commit of this step's accepted tokens); the committed matchers are never advanced here.
    batch_size : int
        Rows of the draft batch.
    vocab_size : int
        Target vocabulary size.
    num_spec_tokens : int
        Draft positions of the window; the buffer holds one more (the bonus position).
    vocab_map : DraftVocabMap, optional
        For drafts with their own vocabulary.
    worker : GrammarWorker, optional
        Where grammar work runs; a private inline worker (synchronous) by default.
    session_ids : sequence of int, optional
        Session of every batch row, so a later step finds this window's masks whatever its batch order.
    pin_memory : bool, default: False
        Page-lock the mask buffer for non-blocking host-to-device copies.
    batch_matcher : xgrammar.BatchGrammarMatcher, optional
        Fill a position of many rows in one call (multi-threaded in xgrammar).
    sparse : SparseMaskBuilder, optional
        Also turn every filled position into :class:`SparseRows` on the worker (for logits on the CPU, where
        applying a dense bitmask costs more than filling it).
    forced : bool, default: False
        Find the token the grammar forces at every draft position; :meth:`advance` drafts it whatever the draft
        model chose, and :meth:`propose` needs it.
    tokenizer : ForcedTokenizer, optional
        Writes forced text (xgrammar's jump-forward string) as tokens; without it only positions whose mask allows
        a single token are forced. Matchers are xgrammar ``GrammarMatcher`` objects or behave like one
        (:class:`lmdeploy_guided_spec.fsm.FsmMatcher`).
    guesses : callable, optional
        Called on the worker when :meth:`propose` starts: a :class:`GuessWindow` that drafts guesses (the request's
        formatting, text from its context) where the grammar forces nothing.
    guess_in_window : bool, default: False
        With a draft model: call ``guesses`` when the window starts, and at every draft position where a guess
        source has a token, :meth:`advance` drafts it in place of the draft model's choice (as a forced token).
    jumps : JumpForwardMemo, optional
        The engine's memo of long jump-forward texts: the forks start with their committed matcher's text and keep
        it as they accept drafts (needs ``tokenizer``).
    mask_drafts : bool, default: True
        Mask the draft logits (:meth:`mask_logits_`). False: the draft model drafts freely and the engine thread does
        not wait for the worker while it drafts; needs ``forced=False``.
    clock : MaskClock, optional
        With ``session_ids``: each mask is timed against the mask limit (it records only; every mask is filled).
    """

    def __init__(self, matchers: Matchers, batch_size: int, vocab_size: int, num_spec_tokens: int, *,
                 vocab_map: DraftVocabMap | None = None, worker: GrammarWorker | None = None,
                 session_ids: Sequence[int] | None = None, pin_memory: bool = False,
                 batch_matcher: xgr.BatchGrammarMatcher | None = None,
                 sparse: SparseMaskBuilder | None = None, forced: bool = False,
                 tokenizer: ForcedTokenizer | None = None, guesses: Callable[[], GuessWindow | None] | None = None,
                 guess_in_window: bool = False, jumps: JumpForwardMemo | None = None, mask_drafts: bool = True,
                 clock: MaskClock | None = None):
        if forced and not mask_drafts:
            raise ValueError('forced drafts replace the draft model\'s choice after waiting for the position\'s '
                             'mask: they need mask_drafts=True')
        self.mask_drafts = mask_drafts
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.num_spec_tokens = num_spec_tokens
        self.vocab_map = vocab_map
        self.worker = worker or GrammarWorker(inline=True)
        self.session_ids = list(session_ids) if session_ids is not None else None
        self.clock = clock if self.session_ids is not None else None
        # whether a batch fill over the mask limit was timed again row by row in this window
        self._retimed = False
        self.rows = sorted(matchers)
        # xgrammar's batch fill takes its own matchers only (not FSM matchers)
        if not all(isinstance(m, xgr.GrammarMatcher) for m in matchers.values()):
            batch_matcher = None
        self.batch_matcher = batch_matcher
        self.forced = forced
        self.tokenizer = tokenizer
        self.jumps = jumps if tokenizer is not None else None
        self.guesses = guesses
        # per draft position: {row: the token the grammar forces there}
        self._forced: list[dict[int, int]] = []
        # with guesses in a draft model's window: the window's guesses, and per draft position {row: guessed token}
        # (forced ones excluded) and the rows that took the draft model's choice
        self.guess_in_window = guess_in_window and guesses is not None and forced
        self._window_guesses: GuessWindow | None = None
        self._guessed: list[dict[int, int]] = []
        self._model_rows: list[set[int]] = []
        self._pin_memory = pin_memory
        #: The window's masks ``(batch, k + 1, words)``. Free drafts (``mask_drafts=False``) leave the engine thread at
        #: once: their buffer (megabytes at batch 128 of a 128k vocabulary, every word written) is allocated on the
        #: worker, None until the window's first job there has run.
        self.masks: torch.Tensor | None = self._allocate() if mask_drafts else None
        self.forks: dict[int, xgr.GrammarMatcher] = {}
        # Rows whose fork rejected a draft token, drafted a stop token or has ended: later positions are never
        # accepted, so they stay all-allowed.
        self.dead: set[int] = set()
        self.drafts: dict[int, list[int]] = {row: [] for row in self.rows}
        self.position = 0
        self.sparse = sparse
        self._live_at: list[list[int]] = []
        self._draft_sparse: list[SparseRows] = []
        # per draft position, with a vocabulary map and dense masks: the live rows' masks, contiguous
        self._draft_rows: list[torch.Tensor] = []
        self._verify_sparse: list[SparseRows] = []
        self._pending = self.worker.submit(self._start, dict(matchers))

    def _allocate(self) -> torch.Tensor:
        return allocate_bitmask(self.batch_size * (self.num_spec_tokens + 1), self.vocab_size,
                                pin_memory=self._pin_memory).view(self.batch_size, self.num_spec_tokens + 1, -1)

    # -- worker side ----------------------------------------------------------------------------------------
    def _start(self, matchers: dict) -> None:
        if self.masks is None:
            self.masks = self._allocate()
        self.forks = {row: matchers[row].fork() for row in self.rows}
        self._committed = matchers
        if self.jumps is not None and len(self.jumps):
            for row, fork in self.forks.items():
                self.jumps.fork(matchers[row], fork)
        # read once per window (xgrammar converts the list on every read)
        self._stops = {row: stop_tokens(fork) for row, fork in self.forks.items()}
        # a committed matcher that accepted a stop token gives no mask: its request ends, or (ignoring its stop
        # tokens) writes nothing but stop tokens
        for row, fork in self.forks.items():
            if has_ended(fork):
                self.dead.add(row)
                self._stop_only(row, 0)
        if self.guess_in_window:
            self._window_guesses = self.guesses()
        self._fill(0)

    def _fill(self, position: int) -> None:
        live = [row for row in self.rows if row not in self.dead]
        flat = self.masks.view(-1, self.masks.shape[-1])
        width = self.num_spec_tokens + 1
        if self.batch_matcher is not None and len(live) >= BATCH_FILL_MIN_ROWS:
            start = time.perf_counter()
            self.batch_matcher.batch_fill_next_token_bitmask([self.forks[r] for r in live], flat,
                                                             [r * width + position for r in live])
            if (self.clock is not None and not self._retimed
                    and time.perf_counter() - start > self.clock.limit_s):
                # xgrammar's threads filled the rows: each again, timed alone, to find the one over the limit. Once
                # a window: a big batch of ordinary grammars may take that long too, and would be filled twice at
                # every position
                self._retimed = True
                for row in live:
                    self._timed_fill(row, flat, row * width + position)
        elif self.clock is not None:
            for row in live:
                self._timed_fill(row, flat, row * width + position)
        else:
            for row in live:
                self.forks[row].fill_next_token_bitmask(flat, row * width + position)
        if live:
            live = self._settle_empty(live, position)
        self._live_at.append(live)
        # the live rows' masks of this position, gathered once for those of the steps below that read them
        draft_position = position < self.num_spec_tokens
        # masks of the draft logits are made only where the draft logits are masked
        draft_masks = draft_position and self.mask_drafts
        if self.sparse is not None or (draft_position and self.forced) or (draft_masks and self.vocab_map is not None):
            rows = take_rows(self.masks[:, position], live)
        if self.vocab_map is not None and self.sparse is None and draft_masks:
            # a draft with its own vocabulary masks with them on the engine thread: gathered here, not there
            self._draft_rows.append(rows)
        if self.sparse is not None:
            # the same masks address row b of the draft logits and row b * (k + 1) + position of the flattened
            # verification logits
            verify_rows = [row * width + position for row in live]
            if self.vocab_map is None and self.mask_drafts:
                # every position, the bonus one included, as before masks could be off
                draft, verify = self.sparse.build(rows, live, verify_rows)
            else:
                verify, = self.sparse.build(rows, verify_rows)
                # a draft with its own vocabulary: translate here, on the worker, not on the engine thread
                draft = (self.vocab_map.sparse_builder().build(rows, live)[0]
                         if draft_masks and self.vocab_map is not None else None)
            self._draft_sparse.append(draft)
            self._verify_sparse.append(verify)
        if self.forced and draft_position:
            found = {}
            # rows whose mask allows one token, found with one scan of the position's masks
            block = rows.numpy()
            singles = single_allowed_tokens(block, self.vocab_size)
            for index, (row, single) in enumerate(zip(live, singles)):
                token = forced_token(self.forks[row], block[index], self.vocab_size, self.tokenizer, single=single,
                                     jumps=self.jumps)
                if token is not None:
                    found[row] = token
            if position == 0 and self.jumps is not None and len(self.jumps):
                # a long text read at the committed state stays with the committed matcher for later windows
                for row in live:
                    self.jumps.fork(self.forks[row], self._committed[row])
            self._forced.append(found)
            if self._window_guesses is not None:
                self._guess_position(live, block, found)
        elif self._window_guesses is not None and position == self.num_spec_tokens:
            self._window_guesses.finish()

    def _stop_only(self, row: int, start: int) -> None:
        """Positions ``start..k`` of ``row`` allow its stop tokens only: its request goes on after its grammar ended
        only when it ignores its stop tokens, and then writes nothing else (its draft logits are not masked)."""
        width = self.num_spec_tokens + 1
        stop_only(self.masks, (row, slice(start, width)), self.forks[row], self.vocab_size)
        if self.sparse is not None:
            rows = [row * width + i for i in range(start, width)]
            self._verify_sparse += self.sparse.build(take_rows(self.masks.view(-1, self.masks.shape[-1]), rows), rows)

    def _timed_fill(self, row: int, flat: torch.Tensor, index: int) -> None:
        self.clock.fill(self.forks[row], flat, index, self.session_ids[row], self._committed[row])

    def _settle_empty(self, live: list[int], position: int) -> list[int]:
        """Rows whose state allows no token (a grammar with an empty character class after a prefix) would leave
        their logits without a finite value, and sampling them fails for the whole batch: such a row allows every
        token instead and takes no more part in the window; the commit of what is sampled there fails its request
        (:func:`lmdeploy_guided_spec.step.commit`: the grammar allows no token at all). Returns the other rows."""
        empty = no_token_allowed(self.masks[:, position], self.vocab_size, live)
        if not empty.any():
            return live
        for row in np.asarray(live)[empty].tolist():
            # through numpy: the buffer may be an inference tensor of the engine thread (see step.stop_only)
            self.masks.numpy()[row, position] = ALL_ALLOWED
            self.dead.add(row)
        return [row for row, gone in zip(live, empty.tolist()) if not gone]

    def _guess_position(self, live: list[int], block: np.ndarray, found: dict[int, int]) -> None:
        """Guesses of the live rows at a draft position; ``block[i]`` is the mask row of ``live[i]``."""
        guessed, model = {}, set()
        for row, mask_row in zip(live, block):
            token = self._window_guesses.choose(row, self.forks[row], mask_row, found.get(row))
            if token is None:
                model.add(row)
            elif token != found.get(row):
                guessed[row] = token
        self._guessed.append(guessed)
        self._model_rows.append(model)

    def _advance(self, token_ids, position: int, ready: Ready | None = None) -> None:
        rows = host_lists(token_ids, ready)
        for row in self.rows:
            if row in self.dead:
                continue
            token = int(_first(rows[row]))
            self.drafts[row].append(token)
            if self._window_guesses is not None and row in self._model_rows[position]:
                self._window_guesses.observe(row, token)
            fork = self.forks[row]
            # the request ends at a drafted stop token, whether the fork accepts it (and ends) or not; after one the
            # grammar allows, a request that ignores its stop tokens writes only stop tokens
            if token in self._stops[row]:
                self.dead.add(row)
                if token_allowed(self.masks[row, position], token):
                    self._stop_only(row, position + 1)
            elif not fork.accept_token(token):
                self.dead.add(row)
            elif self.jumps is not None and len(self.jumps):
                self.jumps.advance(fork, self.tokenizer.token_bytes(token))
        self._fill(position + 1)

    # -- engine side ----------------------------------------------------------------------------------------
    def wait(self) -> None:
        """Wait until every submitted job of this window is done (re-raises a worker error)."""
        self._pending.result()

    def mask_logits_(self, logits: torch.Tensor) -> torch.Tensor:
        """Mask draft logits ``(rows, draft_vocab)`` of the current position in place.

        ``logits`` may have more rows than the batch (padding); only rows of live guided requests change. With
        ``mask_drafts=False`` nothing changes and nothing waits.
        """
        if not self.mask_drafts:
            return logits
        self.wait()
        if self.position > self.num_spec_tokens:
            raise RuntimeError(f'the window has {self.num_spec_tokens} draft positions; mask_logits_ was called '
                               'after the last one')
        live = self._live_at[self.position]
        if not live:
            return logits
        masks = self.masks[:, self.position]
        if self.vocab_map is None:
            if self.sparse is not None and logits.shape[-1] == self.vocab_size:
                return self._draft_sparse[self.position].apply_(logits)
            return apply_bitmask_(logits, masks, rows=live)
        draft_sparse = self._draft_sparse[self.position] if self.sparse is not None else None
        if draft_sparse is not None and logits.shape[-1] == self.vocab_map.draft_vocab_size:
            return draft_sparse.apply_(logits)
        index = to_device(live, torch.long, logits.device)
        rows = (self._draft_rows[self.position] if self.position < len(self._draft_rows) else
                take_rows(masks, live))
        sub = self.vocab_map.mask_draft_logits_(logits.index_select(0, index), rows)
        logits.index_copy_(0, index, sub)
        return logits

    def advance(self, token_ids: torch.Tensor | Sequence[int], *, ready: Ready | None = None) -> None:
        """Advance the forks by the chosen draft tokens (target ids) and fill the next position, on the worker.

        Returns at once; the device-to-host read of ``token_ids`` happens on the worker, after ``ready``. With
        ``forced``, the tokens the grammar forces at this position first replace the chosen ones in ``token_ids``,
        in place (even a token the draft vocabulary lacks).

        Parameters
        ----------
        token_ids : LongTensor ``(rows,)`` / ``(rows, 1)``, or a sequence
            The chosen draft tokens in the target vocabulary.
        ready : object with ``synchronize()``, optional
            A ``torch.cuda.Event`` recorded after the kernel that wrote ``token_ids``
            (:func:`lmdeploy_guided_spec.ordering.record_ready`); the worker waits for it before reading them.
            Default: an event recorded here, on the calling thread's current stream (right when the kernel ran
            on that stream).
        """
        position = self.position
        if self.forced:
            self.wait()
            overrides = self._forced[position] if position < len(self._forced) else {}
            if position < len(self._guessed) and self._guessed[position]:
                overrides = {**overrides, **self._guessed[position]}
            if overrides:
                _override(token_ids, overrides)
                # the override is queued on the current stream, after the kernel that chose the ids: the worker
                # reads after the override
                ready = record_ready(token_ids) or ready
        if ready is None:
            ready = record_ready(token_ids)
        self.position += 1
        self._pending = self.worker.submit(self._advance, token_ids, position, ready)

    def forced_tokens(self, position: int) -> dict[int, int]:
        """``{row: token}`` the grammar forces at a filled draft position (waits; needs ``forced``)."""
        self.wait()
        return dict(self._forced[position]) if position < len(self._forced) else {}

    def forced_count(self, row: int) -> int:
        """How many of ``row``'s draft tokens the grammar forced, over the positions found so far.

        Does not wait: after the last :meth:`advance` (which waited for its position) or :meth:`propose`, every draft
        position is known. Zero without ``forced``.
        """
        return sum(row in found for found in list(self._forced))

    def propose(self, filler: int = 0, *, num_model_tokens: int | None = None) -> torch.Tensor:
        """Draft the whole window from the grammar alone and return the drafts ``(batch, k)`` LongTensor (waits).

        Each guided row drafts the tokens its grammar forces, position by position (and, with ``guesses``, guessed
        tokens where nothing is forced); at the first position with no draft it drafts a token the grammar
        disallows there, which verification always rejects, and its
        later positions are unreachable. Unguided rows draft ``filler``. Needs ``forced`` and a fresh window; the
        masks are kept for verification as with a draft model. Tokens drafted to be rejected stay below
        ``num_model_tokens`` (the model's vocabulary, where the grammar's is wider).
        """
        if not self.forced:
            raise RuntimeError('propose needs a window built with forced=True')
        if self.position != 0:
            raise RuntimeError(f'propose drafts a fresh window; this one has {self.position} draft positions')
        limit = self.vocab_size if num_model_tokens is None else min(self.vocab_size, int(num_model_tokens))
        self._pending = self.worker.submit(self._propose, int(filler), limit)
        drafts = self._pending.result()
        self.position = self.num_spec_tokens
        return drafts

    def _propose(self, filler: int, limit: int) -> torch.Tensor:
        drafts = torch.full((self.batch_size, self.num_spec_tokens), filler, dtype=torch.long)
        guesses = self.guesses() if self.guesses is not None else None
        for position in range(self.num_spec_tokens):
            forced = self._forced[position]
            for row in self.rows:
                if row in self.dead:
                    continue
                token = forced.get(row)
                if guesses is not None:
                    token = guesses.choose(row, self.forks[row], self.masks[row, position], token)
                if token is None:
                    token = _disallowed_token(self.masks[row, position], limit)
                drafts[row, position] = filler if token is None else token
            self._advance(drafts[:, position].tolist(), position)
        if guesses is not None:
            guesses.finish()
        return drafts

    def verification_masks(self) -> torch.Tensor | SparseRows:
        """The verification masks once every position is filled (waits).

        :class:`SparseRows` addressing the flattened ``(batch * (k + 1), vocab)`` target logits when the window is
        sparse, else the ``(batch * (k + 1), words)`` bitmask.
        """
        self.wait()
        if self.position != self.num_spec_tokens:
            raise RuntimeError(f'verification needs all {self.num_spec_tokens} draft positions, '
                               f'the window has {self.position}')
        if self.sparse is not None:
            return SparseRows.concat(self._verify_sparse)
        return self.masks.view(self.batch_size * (self.num_spec_tokens + 1), -1)
