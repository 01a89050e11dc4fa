"""Draft-to-target vocabulary translation for drafts with their own vocabulary (Eagle3, some Eagle heads)."""
from __future__ import annotations

import numpy as np
import torch

from .bitmask import pack_bool_mask
from .errors import VocabMapError
from .sparse import SparseMaskBuilder

__all__ = ['DraftVocabMap', 'DraftSparseBuilder']


class DraftVocabMap:
    """Translate target-vocabulary bitmasks into draft-vocabulary masks.

    A draft id ``d`` is allowed exactly when its target id ``draft_id_to_target_id[d]`` is allowed. All work is
    vectorised on the device of the map (no Python loop over the vocabulary).

    Parameters
    ----------
    draft_id_to_target_id : torch.Tensor
        ``(draft_vocab,)`` integer tensor of absolute target ids.
    target_vocab_size : int
        Size of the target vocabulary the bitmasks cover.
    """

    def __init__(self, draft_id_to_target_id: torch.Tensor, target_vocab_size: int):
        if draft_id_to_target_id.dim() != 1:
            raise VocabMapError(f'draft_id_to_target_id must be 1-D, got shape {tuple(draft_id_to_target_id.shape)}')
        ids = draft_id_to_target_id.to(torch.int64)
        if ids.numel() > 0:
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= target_vocab_size:
                raise VocabMapError(f'draft_id_to_target_id holds target ids in [{lo}, {hi}], outside the target '
                                    f'vocabulary [0, {target_vocab_size}); the map must hold absolute target ids '
                                    '(convert an offset map d2t with `torch.arange(len(d2t)) + d2t`)')
        self.target_ids = ids
        self.target_vocab_size = target_vocab_size
        self._word = ids >> 5
        self._shift = (ids & 31).to(torch.int32)
        self._copies: dict[torch.device, DraftVocabMap] = {ids.device: self}
        self._sparse_builder: DraftSparseBuilder | None = None

    @property
    def draft_vocab_size(self) -> int:
        """Number of ids in the draft vocabulary."""
        return self.target_ids.numel()

    def to(self, device: torch.device | str) -> DraftVocabMap:
        """Return this map with its index tensors on ``device``."""
        device = torch.device(device)
        copy = self._copies.get(device)
        if copy is None:
            copy = self._copies[device] = DraftVocabMap(self.target_ids.to(device), self.target_vocab_size)
        return copy

    def sparse_builder(self) -> DraftSparseBuilder:
        """The map's :class:`DraftSparseBuilder` (one per map, so its cache of translated masks is shared)."""
        if self._sparse_builder is None:
            self._sparse_builder = DraftSparseBuilder(self)
        return self._sparse_builder

    def draft_allowed(self, target_bitmask: torch.Tensor) -> torch.Tensor:
        """Bool mask ``(rows, draft_vocab)``: draft id allowed iff its target id is allowed.

        Pseudocode: ``allowed[r, d] = (target_bitmask[r, t // 32] >> (t % 32)) & 1`` with ``t = map[d]``.
        """
        words = target_bitmask.to(self._word.device, non_blocking=True).index_select(1, self._word)
        return ((words >> self._shift) & 1).bool()

    def draft_bitmask(self, target_bitmask: torch.Tensor) -> torch.Tensor:
        """Int32 bitmask over the draft vocabulary equivalent to ``target_bitmask``."""
        return pack_bool_mask(self.draft_allowed(target_bitmask))

    def mask_draft_logits_(self, logits: torch.Tensor, target_bitmask: torch.Tensor) -> torch.Tensor:
        """Set draft logits whose target id is disallowed to ``-inf`` in place; returns ``logits``."""
        if logits.shape[-1] != self.draft_vocab_size:
            raise VocabMapError(f'draft logits have {logits.shape[-1]} columns but the map has '
                                f'{self.draft_vocab_size} rows; build the map from the draft model\'s '
                                'draft_id_to_target_id')
        allowed = self.to(logits.device).draft_allowed(target_bitmask)
        logits.masked_fill_(~allowed, float('-inf'))
        return logits


class DraftSparseBuilder(SparseMaskBuilder):
    """Draft-vocabulary masks in index form (:class:`~lmdeploy_guided_spec.sparse.SparseRows` over draft logits),
    built from *target*-vocabulary bitmask rows.

    Meant for the grammar worker: the translation (:meth:`DraftVocabMap.draft_allowed`) then runs off the engine
    thread, which only applies the index form. A target mask seen before costs a hash (grammar states repeat).

    Parameters
    ----------
    vocab_map : DraftVocabMap
        The map whose draft vocabulary the built rows address (its CPU copy does the translation).
    max_entries : int, default: 4096
        Translated masks remembered; the oldest are forgotten first.
    """

    def __init__(self, vocab_map: DraftVocabMap, max_entries: int = 4096):
        super().__init__(vocab_map.draft_vocab_size, max_entries)
        self.vocab_map = vocab_map.to('cpu')

    def _compute(self, words: np.ndarray) -> tuple[bool, np.ndarray]:
        allowed = self.vocab_map.draft_allowed(torch.from_numpy(words).view(1, -1))[0].numpy()
        # whichever list is shorter, as for target masks
        few = int(allowed.sum()) * 2 < allowed.shape[0]
        return few, np.flatnonzero(allowed if few else ~allowed).astype(np.int64)
