"""The seam between an engine and the core: the few calls the lmdeploy patches make.

Every method takes plain tensors, ints and a mapping ``batch row -> xgrammar.GrammarMatcher`` of the guided
requests (the engine owns the committed matchers). With an empty mapping every method returns at once and
allocates nothing, so batches without a guided request pay nothing.

Grammar work runs on one worker thread in submission order (:class:`GrammarWorker`): the engine submits it and
goes on launching device work; it waits only where a mask is needed. One speculative step then costs

* drafting: per draft position, one wait for a bitmask the worker filled during the previous draft forward;
* verification: no fill at all for windows this manager drafted (their masks are reused), one host-to-device
  copy and one masking kernel;
* commit: queued behind verification, overlapping the next window's first draft forward.

Token ids that live on a device (drafts, accepted tokens, first tokens) are read on the worker thread, whose
current stream is not the engine's: every call that takes them also takes ``ready``, an event recorded after the
kernel that wrote them (:func:`lmdeploy_guided_spec.ordering.record_ready`), and the worker waits for it before
reading. Without ``ready`` the call records one itself on the calling thread's current stream.

A committed token the grammar rejects fails its request: :meth:`SpecGrammarManager.pop_failures` hands the engine
``{session id: message}`` to finish those requests with an error.

Tokens the grammar forces (:mod:`lmdeploy_guided_spec.forced`) replace the draft model's choices inside drafting
windows, and are the whole draft where there is no draft model (:meth:`SpecGrammarManager.propose`, methods
``grammar`` and ``fsm``).
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
from collections.abc import Mapping, Sequence

import torch
import xgrammar as xgr

from .bitmask import allocate_bitmask, apply_bitmask_, keep_grammar_tokens_, take_where_empty_
from .draft import BATCH_FILL_MIN_CORES, DraftGrammar
from .forced import ForcedTokenizer, JumpForwardMemo, draft_masks_from_env, forced_drafts_from_env
from .guess import GuessDrafts
from .mask_clock import MaskClock
from .ordering import Ready, host_lists, record_ready
from .sparse import SparseMaskBuilder, SparseRows
from .step import commit, fill_bitmask, verification_bitmask
from .vocab_map import DraftVocabMap
from .worker import GrammarWorker

__all__ = ['SpecGrammarManager']

logger = logging.getLogger('lmdeploy_guided_spec')

Matchers = Mapping[int, xgr.GrammarMatcher]


def _guided_rows(matchers: Matchers, num_positions: int) -> list[int]:
    """The logits rows of the guided requests, ``num_positions`` per batch row."""
    return [row * num_positions + i for row in sorted(matchers) for i in range(num_positions)]


def _log_failure(future: concurrent.futures.Future) -> None:
    # nobody waits on a queued commit: a failure must not pass silently
    if not future.cancelled() and future.exception() is not None:
        logger.error('grammar commit failed; guided requests may drift from their grammar. Please file an issue.',
                     exc_info=future.exception())


class SpecGrammarManager:
    """Grammar masks and commits for speculative decoding, for one engine.

    Parameters
    ----------
    vocab_size : int
        The target model's (padded) vocabulary size; every target bitmask covers it.
    worker : GrammarWorker, optional
        Where grammar work runs; a background thread by default.
    pin_memory : bool, optional
        Page-lock mask buffers; default: when CUDA is available.
    batch_fill : bool, optional
        Fill a draft position of many rows with one ``xgrammar.BatchGrammarMatcher`` call; default: on machines
        with at least ``BATCH_FILL_MIN_CORES`` cores, where it is faster than a loop.
    sparse_masks : bool, optional
        Prepare masks of drafting windows as :class:`SparseRows` on the worker; default: without CUDA, where
        logits live on the CPU and applying a dense bitmask is the expensive part.
    tokenizer : PreTrainedTokenizerBase, optional
        The model's tokenizer: forced text is drafted as the tokens it writes (:class:`ForcedTokenizer`). Without
        it, only positions whose mask allows a single token are forced.
    tokenizer_info : xgrammar.TokenizerInfo, optional
        The tokenizer's xgrammar info, if already built (it takes most of a second for 128k tokens).
    forced_drafts : bool, optional
        Inside drafting windows, draft the token the grammar forces whatever the draft model chose; default: on,
        unless the environment variable ``LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS`` is ``0``. :meth:`propose` always
        drafts forced tokens.
    guess_drafts : bool or sequence of str, optional
        Where the grammar forces nothing, :meth:`propose` drafts guesses (:mod:`lmdeploy_guided_spec.guess`): the
        request's own formatting (``'format'``) and text copied from its prompt and output (``'lookup'``). True:
        both; default: as the environment variable ``LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS`` says (``1``: both, ``0``:
        none, or a comma list; default both). Needs ``tokenizer``.
    window_guesses : bool, optional
        Inside drafting windows (:meth:`begin_draft`, with ``forced_drafts``), draft a guess in place of the draft
        model's choice wherever a guess source has one; default: on wherever forced drafts in windows and guessed
        drafts are (``LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS``, ``LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS``).
    draft_masks : bool, optional
        Mask the draft model's logits in drafting windows; default: on, unless the environment variable
        ``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS`` is ``0``. Off, the draft model drafts freely, the engine thread does not
        wait for the grammar worker while it drafts (only, once per step, for the previous verification's commit),
        and only verification is masked (a draft the grammar rejects is rejected there); forced and guessed drafts
        in windows are off with it. :meth:`propose` is not affected.
    draft_model : bool, optional
        Whether the engine's drafts come from a draft model (MTP, Eagle3: :meth:`begin_draft`) rather than from the
        grammar (methods ``grammar`` and ``fsm``: :meth:`propose`); default: not known. Known to be a draft model with
        ``draft_masks`` off, nothing reads what the grammar forces or what a request wrote: no forced tokenizer is
        built (``tokenizer`` goes unused), the commits keep no guess histories and no jump-forward memo, and ranks that
        do not sample keep no grammar state (:meth:`keeps_grammar`).
    """

    def __init__(self, vocab_size: int, *, worker: GrammarWorker | None = None, pin_memory: bool | None = None,
                 batch_fill: bool | None = None, sparse_masks: bool | None = None, tokenizer=None,
                 tokenizer_info: xgr.TokenizerInfo | None = None, forced_drafts: bool | None = None,
                 guess_drafts: bool | Sequence[str] | None = None, window_guesses: bool | None = None,
                 draft_masks: bool | None = None, draft_model: bool | None = None,
                 mask_limit_ms: float | None = None):
        import os
        self.vocab_size = vocab_size
        self.worker = worker or GrammarWorker()
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        if sparse_masks is None:
            sparse_masks = not torch.cuda.is_available()
        self._sparse = SparseMaskBuilder(vocab_size) if sparse_masks else None
        if batch_fill is None:
            batch_fill = (os.cpu_count() or 1) >= BATCH_FILL_MIN_CORES
        self._batch_matcher = xgr.BatchGrammarMatcher() if batch_fill else None
        self._vocab_maps: dict[int, DraftVocabMap] = {}
        if forced_drafts is None:
            forced_drafts = forced_drafts_from_env()
        self.forced_drafts = forced_drafts
        self.draft_masks = draft_masks_from_env() if draft_masks is None else draft_masks
        self.draft_model = draft_model
        # free drafts of a draft model: forced tokens, guesses and their bookkeeping would go unread
        drafts_from_grammar = not (draft_model and not self.draft_masks)
        #: Forced text as the tokenizer writes it (None without a tokenizer, or where nothing drafts from the grammar)
        self.forced_tokenizer = None
        if tokenizer is not None and drafts_from_grammar:
            self.forced_tokenizer = ForcedTokenizer.from_huggingface(tokenizer, tokenizer_info, vocab_size=vocab_size)
            # reading and sorting the vocabulary takes about a second for 128k tokens: do it before the first request
            self.worker.submit(self.forced_tokenizer.prepare)
        #: Histories and guessed drafts of the guided requests (None without a tokenizer or with no source on)
        self.guesses: GuessDrafts | None = None
        if self.forced_tokenizer is not None and guess_drafts is not False:
            sources = None if guess_drafts in (None, True) else tuple(guess_drafts)
            guesses = GuessDrafts(self.forced_tokenizer, sources=sources)
            self.guesses = guesses if guesses.enabled else None
        self.window_guesses = True if window_guesses is None else window_guesses
        #: Long jump-forward texts of committed matchers and their forks (:class:`JumpForwardMemo`)
        self.jumps = JumpForwardMemo() if self.forced_tokenizer is not None else None
        # session id -> (window, batch row): the masks a later verification step reuses
        self._windows: dict[int, tuple[DraftGrammar, int]] = {}
        # session id -> message: requests whose grammar rejected a committed token (written by the worker)
        self._failures: dict = {}
        self._failures_lock = threading.Lock()
        #: Times every mask filled for a session against the mask limit: a grammar whose masks grow slow after the
        #: compile service's probe is refused (:meth:`pop_slow_grammars`)
        self.clock = MaskClock(mask_limit_ms)

    def submit(self, fn, *args, **kwargs) -> concurrent.futures.Future:
        """Run grammar work on the worker, after everything submitted before."""
        return self.worker.submit(fn, *args, **kwargs)

    # -- first token of a request (prefill) -------------------------------------------------------------------
    def next_token_bitmask(self, matchers: Matchers, batch_size: int,
                           session_ids: Sequence[int] | None = None) -> torch.Tensor | None:
        """Bitmask ``(batch_size, words)`` of the committed states, or None without guided rows (waits). With
        ``session_ids`` (the session of every batch row) a mask over the mask limit refuses its request."""
        if not matchers:
            return None
        return self.worker.run(fill_bitmask, matchers, batch_size, self.vocab_size, pin_memory=self.pin_memory,
                               clock=self.clock, session_ids=list(session_ids) if session_ids is not None else None)

    # -- verification -----------------------------------------------------------------------------------------
    def verification_bitmask(self, matchers: Matchers, draft_token_ids: torch.Tensor | Sequence[Sequence[int]],
                             session_ids: Sequence[int] | None = None, *,
                             ready: Ready | None = None) -> torch.Tensor | SparseRows | None:
        """Verification masks for :meth:`apply_`, or None without guided rows (waits).

        A bitmask ``(batch * (k + 1), words)``, or the window's :class:`SparseRows` with ``sparse_masks``.

        Row ``b * (k + 1) + i`` is the mask of request ``b`` after its draft tokens ``0..i-1``; unguided rows
        and positions after a rejected draft allow every token. Rows of requests whose drafting window this
        manager masked (found by ``session_ids``, with the same draft tokens) are that window's masks; the
        others are filled from forks of the committed matchers (:func:`step.verification_bitmask`). Both give
        identical bits. The worker reads ``draft_token_ids`` after ``ready`` (see the module docstring).
        """
        if not matchers:
            return None
        return self.worker.run(self._verification_bitmask, dict(matchers), draft_token_ids,
                               list(session_ids) if session_ids is not None else None,
                               ready if ready is not None else record_ready(draft_token_ids))

    def _verification_bitmask(self, matchers: dict, draft_token_ids, session_ids, ready) -> torch.Tensor:
        drafts = host_lists(draft_token_ids, ready)
        batch, width = len(drafts), len(drafts[0]) + 1
        found: dict[int, tuple[DraftGrammar, int]] = {}
        for row in matchers:
            entry = self._windows.pop(session_ids[row], None) if session_ids is not None else None
            if entry is None:
                continue
            window, wrow = entry
            if window.num_spec_tokens + 1 == width and window.drafts[wrow] == drafts[row][:len(window.drafts[wrow])]:
                found[row] = entry
        if len(found) == len(matchers):
            window = next(iter(found.values()))[0]
            if (window.batch_size == batch and window.rows == sorted(found)
                    and all(w is window and wrow == row for row, (w, wrow) in found.items())):
                # the common case, the batch of the drafting step: its masks are the verification masks (rows of
                # unguided requests are never applied). Not where a row the window guided holds another request now
                # (one ended or was preempted, an unguided one was prefilled into its place): sparse masks apply
                # every row of the window
                return window.verification_masks()
        missing = {row: m for row, m in matchers.items() if row not in found}
        if missing:
            bitmask = verification_bitmask(missing, drafts, self.vocab_size, pin_memory=self.pin_memory,
                                           clock=self.clock, session_ids=session_ids)
        else:
            bitmask = allocate_bitmask(batch * width, self.vocab_size, pin_memory=self.pin_memory)
        view = bitmask.view(batch, width, -1)
        for row, (window, wrow) in found.items():
            view[row] = window.masks[wrow]
        return bitmask

    def apply_(self, logits: torch.Tensor, bitmask: torch.Tensor | None, matchers: Matchers,
               num_positions: int = 1, *, banned: bool = False) -> torch.Tensor:
        """Mask the rows of guided requests in ``logits`` ``(batch * num_positions, vocab)`` in place.

        One host-to-device copy (non-blocking from page-locked memory) and one masking kernel. ``bitmask`` comes
        from :meth:`next_token_bitmask` (``num_positions=1``) or :meth:`verification_bitmask`
        (``num_positions=k+1``); None leaves the logits untouched.

        ``banned``: processors that ran before may have set tokens to ``-inf``; see :meth:`keep_grammar_tokens_`.
        """
        if bitmask is None or not matchers:
            return logits
        if isinstance(bitmask, SparseRows):
            masked = bitmask.apply_(logits)
        else:
            masked = apply_bitmask_(logits, bitmask, rows=_guided_rows(matchers, num_positions))
        if banned:
            self.keep_grammar_tokens_(masked, bitmask, matchers, num_positions)
        return masked

    def keep_grammar_tokens_(self, logits: torch.Tensor, bitmask: torch.Tensor | None, matchers: Matchers,
                             num_positions: int = 1) -> torch.Tensor:
        """Rows of ``logits`` (masked with ``bitmask`` before or after other processors) that have no finite value
        left take the grammar's tokens, all alike; in place.

        Processors may set tokens to ``-inf``: bad words, the stop tokens of a request with ``ignore_eos`` or short
        of ``min_new_tokens``, lmdeploy's n-gram stop (everything but a stop token). Where they and the grammar leave
        a row nothing, the grammar wins (the stop token at the end of a grammar, for ``ignore_eos``): sampling a row
        without a finite logit fails the whole batch. A few passes over the logits, no device synchronization; call
        it only where a processor may have banned tokens.
        """
        if bitmask is None or not matchers:
            return logits
        rows = _guided_rows(matchers, num_positions)
        if isinstance(bitmask, SparseRows):
            return take_where_empty_(logits, bitmask.apply_(torch.zeros_like(logits)), rows=rows)
        return keep_grammar_tokens_(logits, bitmask, rows=rows)

    # -- commit -----------------------------------------------------------------------------------------------
    def commit(self, matchers: Matchers, token_ids: torch.Tensor | Sequence, *,
               session_ids: Sequence[int] | Mapping[int, int] | None = None,
               ready: Ready | None = None) -> dict[int, int]:
        """Advance committed matchers by the accepted tokens (``-1`` ends a row) and wait; see :meth:`commit_async`.

        Returns the number of tokens each row's matcher accepted.
        """
        if not matchers:
            return {}
        return self.worker.run(self._commit, dict(matchers), token_ids, session_ids,
                               ready if ready is not None else record_ready(token_ids))

    def commit_async(self, matchers: Matchers, token_ids: torch.Tensor | Sequence, *,
                     session_ids: Sequence[int] | Mapping[int, int] | None = None,
                     ready: Ready | None = None) -> concurrent.futures.Future | None:
        """Queue the commit of the accepted tokens; None without guided rows.

        Parameters
        ----------
        matchers : mapping of batch row to GrammarMatcher
            Committed matchers; advanced in place on the worker (:func:`step.commit`).
        token_ids : LongTensor or sequence, ``(batch_size,)`` or ``(batch_size, n)``
            Accepted tokens per row in order; ``-1`` ends a row. Read on the worker, after ``ready``.
        session_ids : sequence or mapping, optional
            Session id of every batch row (``session_ids[row]``): the keys of :meth:`pop_failures`. Default: the
            batch row.
        ready : object with ``synchronize()``, optional
            A ``torch.cuda.Event`` recorded after the kernel that wrote ``token_ids``; default: one recorded here on
            the current stream.

        Returns
        -------
        concurrent.futures.Future or None
            Resolves to ``{row: number of tokens accepted}``. A token a grammar rejects does not fail the future: it
            fails its session (:meth:`pop_failures`).
        """
        if not matchers:
            return None
        ready = ready if ready is not None else record_ready(token_ids)
        future = self.worker.submit(self._commit, dict(matchers), token_ids, session_ids, ready)
        future.add_done_callback(_log_failure)
        return future

    def _commit(self, matchers: dict, token_ids, session_ids, ready) -> dict[int, int]:
        failures: dict = {}
        jumps = self.jumps if self.jumps is not None and len(self.jumps) else None
        if self.guesses is not None or jumps is not None:
            token_ids, ready = host_lists(token_ids, ready), None
        accepted = commit(matchers, token_ids, session_ids=session_ids, failures=failures, vocab_size=self.vocab_size,
                          ready=ready, clock=self.clock)
        if jumps is not None:
            token_bytes = self.forced_tokenizer.token_bytes
            for row, matcher in matchers.items():
                tokens = token_ids[row] if isinstance(token_ids[row], list) else [token_ids[row]]
                jumps.advance(matcher, b''.join(token_bytes(int(t)) for t in tokens[:accepted[row]]))
        if self.guesses is not None:
            self.guesses.committed(matchers, token_ids)
        if failures:
            for key, message in failures.items():
                logger.error(f'guided request {key} fails: {message}')
            with self._failures_lock:
                for key, message in failures.items():
                    self._failures.setdefault(key, message)
        return accepted

    def failures(self) -> dict:
        """``{session id: message}`` of the requests whose grammar rejected a committed token (kept until popped).

        The key is the batch row where a commit had no ``session_ids``. Commits still queued are not included:
        wait for their futures first.
        """
        with self._failures_lock:
            return dict(self._failures)

    def pop_failures(self) -> dict:
        """:meth:`failures`, cleared: the engine finishes these requests with an error (GrammarRejectedError)."""
        with self._failures_lock:
            failures, self._failures = self._failures, {}
        return failures

    def pop_slow_grammars(self, owners: Mapping[int, xgr.GrammarMatcher] | None = None) -> dict:
        """``{session id: message}`` of the requests whose grammar's token masks went over the mask limit
        (:class:`MaskClock`): the engine refuses them as it refuses a grammar the compile service finds slow.

        ``owners``: ``{session id: committed matcher}`` of the guided requests of the step that asks; only theirs
        are handed out (see :meth:`MaskClock.pop`).
        """
        return self.clock.pop(owners)

    # -- drafting ---------------------------------------------------------------------------------------------
    def vocab_map(self, draft_id_to_target_id: torch.Tensor | None) -> DraftVocabMap | None:
        """The cached :class:`DraftVocabMap` for a draft model's map (None for a shared vocabulary)."""
        if draft_id_to_target_id is None:
            return None
        key = id(draft_id_to_target_id)
        vocab_map = self._vocab_maps.get(key)
        if vocab_map is None or vocab_map.target_ids.numel() != draft_id_to_target_id.numel():
            vocab_map = self._vocab_maps[key] = DraftVocabMap(draft_id_to_target_id, self.vocab_size)
        return vocab_map

    def begin_draft(self, matchers: Matchers, batch_size: int, num_spec_tokens: int = 1, *,
                    session_ids: Sequence[int] | None = None,
                    draft_id_to_target_id: torch.Tensor | None = None,
                    prompt_ids: Sequence | None = None) -> DraftGrammar | None:
        """Fork the committed matchers for one drafting window (on the worker), or None without guided rows.

        With ``session_ids`` the window's masks are kept for the next :meth:`verification_bitmask`. With
        ``window_guesses`` (and ``forced_drafts``), guesses take the place of the draft model's choice where a guess
        source has one; ``prompt_ids`` as for :meth:`propose`.
        """
        if not matchers:
            return None
        guesses = None
        # forced and guessed drafts replace the draft model's choice once the position's mask is known: only where
        # the draft logits are masked
        forced = self.forced_drafts and self.draft_masks
        if self.window_guesses and forced:
            guesses = self._guess_window(matchers, session_ids, prompt_ids, num_spec_tokens)
        window = DraftGrammar(matchers, batch_size, self.vocab_size, num_spec_tokens,
                              vocab_map=self.vocab_map(draft_id_to_target_id), worker=self.worker,
                              session_ids=session_ids, pin_memory=self.pin_memory,
                              batch_matcher=self._batch_matcher, sparse=self._sparse, forced=forced,
                              tokenizer=self.forced_tokenizer, guesses=guesses, guess_in_window=guesses is not None,
                              jumps=self.jumps, mask_drafts=self.draft_masks, clock=self.clock)
        self._keep(window, matchers, session_ids)
        return window

    def keeps_grammar(self, *, samples: bool) -> bool:
        """Whether a rank needs the grammar state of the guided requests while it drafts.

        ``samples``: the rank verifies and samples (the first rank of a tensor-parallel group). A rank that samples
        always does. A rank that does not sample drafts beside it and must draft the same tokens: it needs the
        grammar where the drafts depend on it (masked draft logits, forced drafts, drafts the grammar makes, or
        ``draft_model`` not known), not where a draft model drafts freely (``draft_masks`` off): such a rank neither
        compiles nor commits nor fills anything.
        """
        return samples or self.draft_masks or not self.draft_model

    def _keep(self, window: DraftGrammar, matchers: Matchers, session_ids: Sequence[int] | None) -> None:
        if session_ids is not None:
            for row in matchers:
                self._windows[session_ids[row]] = (window, row)

    def propose(self, matchers: Matchers, batch_size: int, num_spec_tokens: int, *,
                session_ids: Sequence[int] | None = None, filler: int = 0,
                prompt_ids: Sequence | None = None, num_model_tokens: int | None = None) -> torch.Tensor:
        """Drafts ``(batch_size, num_spec_tokens)`` LongTensor (CPU) from the grammars alone, with no draft model.

        Guided rows draft the tokens their grammar forces (:meth:`DraftGrammar.propose`); the rest of a guided row
        and every unguided row hold tokens verification rejects or a ``filler``. Waits. With ``session_ids`` the
        window's masks serve the next :meth:`verification_bitmask`, as with a draft model. Where the grammar forces
        nothing, rows draft guesses (``guess_drafts``); ``prompt_ids[row]`` (host token ids of a row's prompt, or
        None; given at prefill) adds to the context they copy from. ``num_model_tokens`` (the model's vocabulary,
        where the grammar's is wider) bounds the tokens drafted to be rejected: ids past it do not exist.
        """
        if not matchers:
            return torch.full((batch_size, num_spec_tokens), int(filler), dtype=torch.long)
        window = DraftGrammar(matchers, batch_size, self.vocab_size, num_spec_tokens, worker=self.worker,
                              session_ids=session_ids, pin_memory=self.pin_memory,
                              batch_matcher=self._batch_matcher, sparse=self._sparse, forced=True,
                              tokenizer=self.forced_tokenizer, guesses=self._guess_window(matchers, session_ids,
                                                                                         prompt_ids, num_spec_tokens),
                              jumps=self.jumps, clock=self.clock)
        self._keep(window, matchers, session_ids)
        return window.propose(filler, num_model_tokens=num_model_tokens)

    def _guess_window(self, matchers: Matchers, session_ids, prompt_ids, num_spec_tokens: int):
        if self.guesses is None:
            return None
        return functools.partial(self.guesses.window, dict(matchers), session_ids, prompt_ids, num_spec_tokens)

    def forget(self, session_ids: Sequence[int]) -> None:
        """Drop kept windows and failures of finished sessions, also the failures of commits queued before (a
        session id comes back: ``pipeline.chat`` reuses it for the next turn)."""
        session_ids = list(session_ids)
        with self._failures_lock:
            for session_id in session_ids:
                self._windows.pop(session_id, None)
                self._failures.pop(session_id, None)
        self.clock.forget(session_ids)
        # after the commits queued before
        self.worker.submit(self._forget_queued, session_ids)

    def _drop_failures(self, session_ids: list[int]) -> None:
        with self._failures_lock:
            for session_id in session_ids:
                self._failures.pop(session_id, None)

    def _forget_queued(self, session_ids: list[int]) -> None:
        self._drop_failures(session_ids)
        self.clock.forget(session_ids)
        if self.guesses is not None:
            self.guesses.forget(session_ids)

    def forced_counts(self, session_ids: Sequence[int]) -> list[int]:
        """Per batch row, the draft tokens of its kept window (the one drafted last) that the grammar forced.

        Rows without a kept window (unguided, or drafted without ``session_ids``) count 0. Call it after drafting
        and before the verification that consumes the windows (:meth:`verification_bitmask`); it does not wait.
        """
        counts = []
        for session_id in session_ids:
            entry = self._windows.get(session_id)
            counts.append(entry[0].forced_count(entry[1]) if entry is not None else 0)
        return counts

    @property
    def num_kept_windows(self) -> int:
        """Sessions with a kept drafting window (for leak checks)."""
        return len(self._windows)
