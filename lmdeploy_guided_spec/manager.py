"""The seam between an engine and the core: the few calls the lmdeploy patches make.

Every method takes plain tensors, ints and a mapping ``batch row -> xgrammar.GrammarMatcher`` of the guided
requests (the engine owns the committed matchers). With an empty mapping every method returns at once and
allocates nothing, so batches without a guided request pay nothing.

Grammar work (``*_bitmask``, :meth:`commit`, :meth:`DraftGrammar.advance`) is CPU-bound and may run in a worker
thread; applying masks (``apply_*``) touches device tensors and belongs on the thread that owns the stream.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import xgrammar as xgr

from .bitmask import apply_bitmask_
from .step import DraftGrammar, commit, fill_bitmask, verification_bitmask
from .vocab_map import DraftVocabMap

__all__ = ['SpecGrammarManager']

Matchers = Mapping[int, xgr.GrammarMatcher]


class SpecGrammarManager:
    """Grammar masks and commits for speculative decoding, for one engine.

    Parameters
    ----------
    vocab_size : int
        The target model's (padded) vocabulary size; every target bitmask covers it.
    """

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._vocab_maps: dict[int, DraftVocabMap] = {}

    # -- first token of a request (prefill) and plain one-token steps ------------------------------------------
    def next_token_bitmask(self, matchers: Matchers, batch_size: int) -> torch.Tensor | None:
        """Bitmask ``(batch_size, words)`` of the committed states, or None without guided rows."""
        if not matchers:
            return None
        return fill_bitmask(matchers, batch_size, self.vocab_size)

    # -- verification -----------------------------------------------------------------------------------------
    def verification_bitmask(self, matchers: Matchers,
                             draft_token_ids: torch.Tensor | Sequence[Sequence[int]]) -> torch.Tensor | None:
        """Position-serial verification bitmask ``(batch * (k + 1), words)``, or None without guided rows.

        See :func:`lmdeploy_guided_spec.step.verification_bitmask`.
        """
        if not matchers:
            return None
        return verification_bitmask(matchers, draft_token_ids, self.vocab_size)

    def apply_(self, logits: torch.Tensor, bitmask: torch.Tensor | None, matchers: Matchers,
               num_positions: int = 1) -> torch.Tensor:
        """Mask the rows of guided requests in ``logits`` ``(batch * num_positions, vocab)`` in place.

        ``bitmask`` comes from :meth:`next_token_bitmask` (``num_positions=1``) or :meth:`verification_bitmask`
        (``num_positions=k+1``); None leaves the logits untouched.
        """
        if bitmask is None or not matchers:
            return logits
        rows = [row * num_positions + i for row in sorted(matchers) for i in range(num_positions)]
        return apply_bitmask_(logits, bitmask, rows=rows)

    # -- commit -----------------------------------------------------------------------------------------------
    def commit(self, matchers: Matchers, token_ids: torch.Tensor | Sequence) -> dict[int, int]:
        """Advance committed matchers by the accepted tokens (``-1`` ends a row); see :func:`step.commit`."""
        if not matchers:
            return {}
        return commit(matchers, token_ids)

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

    def begin_draft(self, matchers: Matchers, batch_size: int, *,
                    draft_id_to_target_id: torch.Tensor | None = None) -> DraftGrammar | None:
        """Fork the committed matchers for one drafting window, or None without guided rows."""
        if not matchers:
            return None
        return DraftGrammar(matchers, batch_size, self.vocab_size, vocab_map=self.vocab_map(draft_id_to_target_id))
