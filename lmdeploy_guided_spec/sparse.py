"""Masks in index form, built on the grammar worker so that applying them on a CPU device is cheap.

Applying a dense bitmask to CPU logits reads and writes every logit of every row (``masked_fill_``), which costs
more than filling the mask. Most grammar states either allow few tokens (structure: quotes, keys, punctuation) or
disallow few (free text inside a string). :func:`sparse_rows` turns bitmask rows into two index sets ahead of
time; applying them fills the few-allowed rows with ``-inf`` and restores their allowed logits, and writes
``-inf`` at the disallowed positions of the other rows. On CUDA the dense bitmask and xgrammar's kernel are used.
"""
from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ['SparseRows', 'SparseMaskBuilder', 'sparse_rows']


@dataclass
class SparseRows:
    """Grammar masks of some logits rows, as flat indices into ``logits.view(-1)``.

    Attributes
    ----------
    vocab_size : int
        Width of the logits rows the indices address.
    few_allowed_rows : LongTensor
        Logits rows stored by their allowed tokens (the rows with more empty than full 32-token words).
    allowed_flat : LongTensor
        ``row * vocab_size + token`` of every allowed token of ``few_allowed_rows``.
    disallowed_flat : LongTensor
        ``row * vocab_size + token`` of every disallowed token of the other rows.
    """
    vocab_size: int
    few_allowed_rows: torch.Tensor
    allowed_flat: torch.Tensor
    disallowed_flat: torch.Tensor

    def apply_(self, logits: torch.Tensor) -> torch.Tensor:
        """Set disallowed logits to ``-inf`` in place; ``logits`` is ``(rows, vocab_size)``, or narrower where
        the grammar's vocabulary has tokens past the model's (they do not exist in the logits)."""
        if logits.dim() != 2 or logits.shape[1] > self.vocab_size:
            raise ValueError(f'SparseRows address logits (rows, {self.vocab_size}) or narrower, got '
                             f'{tuple(logits.shape)}')
        if logits.shape[1] < self.vocab_size:
            return self.narrowed(logits.shape[1]).apply_(logits)
        if not logits.is_contiguous():
            dense = logits.contiguous()
            logits.copy_(self.apply_(dense))
            return logits
        flat = logits.view(-1)
        device = logits.device
        if self.few_allowed_rows.numel():
            allowed = self.allowed_flat.to(device)
            kept = flat.index_select(0, allowed)
            logits.index_fill_(0, self.few_allowed_rows.to(device), float('-inf'))
            flat.index_copy_(0, allowed, kept)
        if self.disallowed_flat.numel():
            flat.index_fill_(0, self.disallowed_flat.to(device), float('-inf'))
        return logits

    def narrowed(self, width: int) -> SparseRows:
        """The same masks for logits rows of ``width < vocab_size`` tokens (the tokens past them dropped)."""

        def rebase(flat: torch.Tensor) -> torch.Tensor:
            row, token = flat // self.vocab_size, flat % self.vocab_size
            keep = token < width
            return row[keep] * width + token[keep]

        return SparseRows(width, self.few_allowed_rows, rebase(self.allowed_flat), rebase(self.disallowed_flat))

    @staticmethod
    def concat(parts: Sequence[SparseRows]) -> SparseRows:
        """One SparseRows for rows described by several (row sets must not overlap)."""
        vocab_size = parts[0].vocab_size
        return SparseRows(vocab_size, torch.cat([p.few_allowed_rows for p in parts]),
                          torch.cat([p.allowed_flat for p in parts]), torch.cat([p.disallowed_flat for p in parts]))


def _columns(words: np.ndarray, vocab_size: int) -> tuple[bool, np.ndarray]:
    """(few_allowed, tokens) of one bitmask row: its allowed tokens if few_allowed, else its disallowed ones."""
    covered = min(vocab_size, words.shape[0] * 32)
    # whichever list is shorter: rows with more empty than full 32-token words list their allowed tokens
    few = bool((words == 0).sum() > (words == -1).sum())
    want = 1 if few else 0
    word_idx = np.flatnonzero(words != (0 if few else -1))
    bits = np.unpackbits(np.ascontiguousarray(words[word_idx]).view(np.uint8).reshape(-1, 4), axis=1,
                         bitorder='little')
    hit_word, hit_bit = np.nonzero(bits == want)
    tokens = word_idx[hit_word].astype(np.int64) * 32 + hit_bit
    tokens = tokens[tokens < covered]
    if not few and covered < vocab_size:
        tokens = np.concatenate([tokens, np.arange(covered, vocab_size, dtype=np.int64)])
    return few, tokens


class SparseMaskBuilder:
    """Builds :class:`SparseRows` from bitmask rows, remembering the token lists of masks it has seen.

    Grammar states repeat (every position inside a JSON string of a schema has the same mask, and so do the
    states of requests sharing a schema), so most rows cost a hash of their words instead of an unpacking.

    Parameters
    ----------
    vocab_size : int
        Width of the logits rows.
    max_entries : int, default: 4096
        Masks remembered; the oldest are forgotten first.
    """

    def __init__(self, vocab_size: int, max_entries: int = 4096):
        self.vocab_size = vocab_size
        self.max_entries = max_entries
        self._cache: dict[bytes, tuple[bool, np.ndarray]] = {}

    def columns(self, words: np.ndarray) -> tuple[bool, np.ndarray]:
        """(few_allowed, tokens) of one bitmask row, from the cache when the same mask was seen."""
        key = hashlib.blake2b(words.tobytes(), digest_size=16).digest()
        hit = self._cache.get(key)
        if hit is None:
            hit = self._compute(words)
            if len(self._cache) >= self.max_entries:
                self._cache.pop(next(iter(self._cache)))
            self._cache[key] = hit
        return hit

    def _compute(self, words: np.ndarray) -> tuple[bool, np.ndarray]:
        """(few_allowed, tokens) of one bitmask row, uncached."""
        return _columns(words, self.vocab_size)

    def build(self, bitmask_rows: torch.Tensor, *row_sets: Sequence[int]) -> list[SparseRows]:
        """One :class:`SparseRows` per entry of ``row_sets``, each addressing the logits rows it lists.

        ``bitmask_rows`` is a CPU int32 ``(n, words)`` tensor; every row set has ``n`` logits row indices, the
        rows the ``n`` masks apply to (the same masks may address draft logits and verification logits).
        """
        vocab = self.vocab_size
        words = bitmask_rows.contiguous().numpy()
        cols = [self.columns(words[i]) for i in range(words.shape[0])]
        out = []
        for rows in row_sets:
            few_rows, allowed, disallowed = [], [], []
            for row, (few, tokens) in zip(rows, cols):
                if few:
                    few_rows.append(row)
                    allowed.append(tokens + row * vocab)
                else:
                    disallowed.append(tokens + row * vocab)
            out.append(SparseRows(vocab, torch.tensor(few_rows, dtype=torch.long), _cat(allowed), _cat(disallowed)))
        return out


def _cat(parts: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(np.concatenate(parts)) if parts else torch.zeros(0, dtype=torch.long)


def sparse_rows(bitmask_rows: torch.Tensor, logit_rows: Sequence[int], vocab_size: int) -> SparseRows:
    """Index form of ``bitmask_rows`` (CPU int32, one row per entry of ``logit_rows``) for ``vocab_size`` logits.

    Tokens the bitmask does not cover (vocabulary padding beyond ``32 * words``) are disallowed.
    """
    return SparseMaskBuilder(vocab_size).build(bitmask_rows, logit_rows)[0]
