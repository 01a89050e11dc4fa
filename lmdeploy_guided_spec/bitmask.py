"""Token bitmasks: allocation, packing, unpacking and applying them to logits.

A bitmask has shape ``(rows, ceil(vocab_size / 32))`` and dtype ``int32`` (xgrammar's layout; int32 because
older PyTorch has no uint32). Bit ``j % 32`` of word ``j // 32`` is 1 when token ``j`` is allowed.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import xgrammar as xgr

from .ordering import to_device

__all__ = [
    'allocate_bitmask', 'bitmask_words', 'unpack_bitmask', 'pack_bool_mask', 'apply_bitmask_', 'take_rows',
    'uint32_words', 'no_token_allowed', 'token_allowed', 'keep_grammar_tokens_', 'take_where_empty_',
    'guard_unsampleable_', 'ALL_ALLOWED'
]

#: The value of a bitmask word that allows all 32 of its tokens.
ALL_ALLOWED = -1

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def take_rows(bitmask: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows ``rows`` of a CPU bitmask ``(n, words)`` (a strided view too) as a new contiguous tensor.

    numpy's fancy indexing: torch's advanced indexing of a CPU tensor by a list of rows takes about 20 times as
    long for bitmask rows (8.6 ms against 0.46 ms for 128 rows of a 128k vocabulary on one core), time the engine
    thread would wait.
    """
    return torch.from_numpy(bitmask.numpy()[list(rows)])


def uint32_words(bitmask: torch.Tensor | np.ndarray) -> np.ndarray:
    """A CPU bitmask (a row or a block of rows, tensor or array) as uint32 words: a view, no copy."""
    if isinstance(bitmask, torch.Tensor):
        bitmask = bitmask.numpy()
    return bitmask.view(np.uint32)


#: Words of a row read first by :func:`no_token_allowed` (2048 tokens: a row that allows any of them is settled).
_HEAD_WORDS = 64


def no_token_allowed(bitmask: torch.Tensor | np.ndarray, vocab_size: int,
                     rows: Sequence[int] | None = None) -> np.ndarray:
    """Which rows of a CPU bitmask ``(n, words)`` (a strided view too) allow no token below ``vocab_size``: a bool
    array, one entry per row of ``rows`` (default: every row).

    The first words settle almost every row (and only they are copied); a row that allows none of the first 2048
    tokens is read whole.
    """
    words = uint32_words(bitmask)
    rows = list(range(words.shape[0])) if rows is None else list(rows)
    full, rest = divmod(vocab_size, 32)
    head = min(_HEAD_WORDS, full)
    empty = ~words[rows, :head].any(axis=1) if head else np.ones(len(rows), dtype=bool)
    for i in np.flatnonzero(empty).tolist():
        row = words[rows[i]]
        if row[head:full].any() or (rest and full < row.shape[0] and int(row[full]) & ((1 << rest) - 1)):
            empty[i] = False
    return empty


def token_allowed(mask_row: torch.Tensor | np.ndarray, token: int) -> bool:
    """Whether a bitmask row allows ``token``."""
    words = uint32_words(mask_row)
    return token >= 0 and (token >> 5) < words.shape[0] and bool((int(words[token >> 5]) >> (token & 31)) & 1)


def _shifts(device: torch.device) -> torch.Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def bitmask_words(vocab_size: int) -> int:
    """Number of int32 words one bitmask row needs for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin_memory: bool = False) -> torch.Tensor:
    """Allocate a CPU bitmask of ``rows`` rows with every token allowed.

    Parameters
    ----------
    rows : int
        Number of rows.
    vocab_size : int
        Vocabulary size the rows cover (the model's padded vocabulary size).
    pin_memory : bool, default: False
        Allocate page-locked memory so host-to-device copies can be issued without blocking.
    """
    mask = torch.full((rows, bitmask_words(vocab_size)), ALL_ALLOWED, dtype=torch.int32, pin_memory=pin_memory)
    return mask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack a bitmask into a bool tensor of shape ``(rows, vocab_size)``; True means allowed.

    Pseudocode: ``allowed[r, j] = (bitmask[r, j // 32] >> (j % 32)) & 1``.
    """
    if bitmask.dtype != torch.int32:
        raise TypeError(f'bitmask.dtype must be torch.int32, got {bitmask.dtype}')
    if bitmask.shape[-1] * 32 < vocab_size:
        raise ValueError(f'bitmask has {bitmask.shape[-1]} words, which cover {bitmask.shape[-1] * 32} tokens, '
                         f'fewer than vocab_size={vocab_size}')
    rows = bitmask.reshape(-1, bitmask.shape[-1])
    if rows.device.type == 'cpu':
        # numpy's unpackbits is some fifty times faster than shifting int32 words in torch
        bits = np.unpackbits(rows.contiguous().numpy().view(np.uint8), axis=1, bitorder='little')[:, :vocab_size]
        return torch.from_numpy(bits.view(np.bool_))
    bits = (rows.unsqueeze(-1) >> _shifts(bitmask.device)) & 1
    return bits.reshape(rows.shape[0], -1)[:, :vocab_size].bool()


def pack_bool_mask(allowed: torch.Tensor) -> torch.Tensor:
    """Pack a bool mask ``(rows, vocab_size)`` into an int32 bitmask ``(rows, ceil(vocab_size / 32))``.

    Bits past ``vocab_size`` in the last word are set, as xgrammar sets them.
    """
    rows, vocab_size = allowed.shape
    words = bitmask_words(vocab_size)
    padded = torch.ones((rows, words * 32), dtype=torch.int64, device=allowed.device)
    padded[:, :vocab_size] = allowed.to(torch.int64)
    shifts = _shifts(allowed.device).to(torch.int64)
    packed = (padded.view(rows, words, 32) << shifts).sum(-1)
    # Bit 31 set makes the int64 sum exceed int32: wrap it to the two's-complement int32 value.
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)
    return packed.to(torch.int32)


def apply_bitmask_(logits: torch.Tensor,
                   bitmask: torch.Tensor,
                   *,
                   rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf`` in place.

    Parameters
    ----------
    logits : torch.Tensor
        ``(num_rows, vocab)`` logits on any device, any floating dtype. Columns beyond what the bitmask covers
        (padding of the model's vocabulary) are disallowed as well.
    bitmask : torch.Tensor
        ``(num_rows, words)`` int32 bitmask, on any device; it is copied to the logits' device without blocking
        the host when it is page-locked.
    rows : sequence of int or LongTensor, optional
        Only these rows of ``logits`` (and of ``bitmask``) are masked; the default masks every row, and then both
        must have the same number of rows.

    Returns
    -------
    torch.Tensor
        ``logits``, modified in place.
    """
    if logits.dim() != 2 or bitmask.dim() != 2:
        raise ValueError(f'logits {tuple(logits.shape)} and bitmask {tuple(bitmask.shape)} must both be 2-D')
    if rows is None and logits.shape[0] != bitmask.shape[0]:
        raise ValueError(f'logits have {logits.shape[0]} rows and bitmask {bitmask.shape[0]}; pass rows= to mask '
                         'a subset')
    if rows is not None and len(rows) == 0:
        return logits
    device = logits.device
    bitmask = bitmask.to(device, non_blocking=True)
    vocab = logits.shape[1]
    covered = min(vocab, bitmask.shape[1] * 32)
    if device.type == 'cuda' and covered == vocab and logits.is_contiguous():
        # xgrammar would copy a list of indices from pageable memory, which waits for the copy
        indices = None if rows is None else to_device([int(r) for r in rows], torch.int32, device)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices)
        return logits
    # On the CPU, unpacking with torch and masked_fill_ is faster than xgrammar's CPU kernel for sparse masks;
    # it also serves any other device.
    if rows is None:
        allowed = unpack_bitmask(bitmask, covered)
        logits[:, :covered].masked_fill_(~allowed, float('-inf'))
        logits[:, covered:] = float('-inf')
    else:
        index = torch.as_tensor(rows, dtype=torch.long, device=device)
        allowed = unpack_bitmask(bitmask.index_select(0, index), covered)
        sub = logits.index_select(0, index)
        sub[:, :covered].masked_fill_(~allowed, float('-inf'))
        sub[:, covered:] = float('-inf')
        logits.index_copy_(0, index, sub)
    return logits


def keep_grammar_tokens_(logits: torch.Tensor, bitmask: torch.Tensor, *,
                         rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``logits`` left without a finite value take the tokens ``bitmask`` allows, all alike; in place.

    For logits masked with ``bitmask`` (:func:`apply_bitmask_`, same ``rows``) before or after processors that set
    tokens to ``-inf``: bad words, the stop tokens of a request that ignores them, an n-gram stop. Where they and the
    grammar leave a row nothing, the grammar wins; sampling a row without a finite logit fails the whole batch.
    Three passes over the logits and no device synchronization: call it only where a processor may have banned
    tokens. With ``rows``, only those rows are guided: the others keep what they have, an empty row too (a row
    without a grammar that processors left nothing is the caller's to fail, see :func:`guard_unsampleable_`; it
    was given every token, and sampled from the vocabulary at random).
    """
    return take_where_empty_(logits, apply_bitmask_(torch.zeros_like(logits), bitmask, rows=rows), rows=rows)


def take_where_empty_(logits: torch.Tensor, grammar_only: torch.Tensor, *,
                      rows: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Rows of ``logits`` without a finite value take the rows of ``grammar_only`` (zeros where the grammar allows
    a token, ``-inf`` elsewhere); in place, without a device synchronization. With ``rows``, only those rows
    (the guided ones) take theirs."""
    emptied = logits.amax(-1, keepdim=True) == float('-inf')
    if rows is not None:
        guided = torch.zeros_like(emptied)
        if len(rows):
            guided[to_device([int(r) for r in rows], torch.int64, logits.device)] = True
        emptied &= guided
    return logits.copy_(torch.where(emptied, grammar_only, logits))


def guard_unsampleable_(logits: torch.Tensor) -> torch.Tensor:
    """Rows of ``logits`` that cannot be sampled, as a bool tensor ``(rows,)``: a NaN or ``+inf`` anywhere in the
    row, or no finite value. In place, so that sampling the batch goes on, a NaN or ``+inf`` logit becomes 0 and a row
    that banned every token (``-inf``) keeps token 0 alone.

    One such row failed the whole batch: ``torch.multinomial`` raises on it (on CUDA a sampling kernel draws from
    garbage) and greedy ``argmax`` returns an arbitrary token. It comes of a user's logits processor, of bans that
    leave a row nothing, or of a model's own NaN. The caller fails the requests of the rows returned; the token drawn
    for them is one their grammar allows where its mask went over the NaN (a grammar rejecting the token would log
    a second, misleading failure). Two passes over the logits (no temporary of their size) and no device
    synchronization.
    """
    largest = logits.amax(-1)  # NaN where the row holds one, -inf where it holds nothing else
    unsampleable = ~torch.isfinite(largest)
    torch.nan_to_num_(logits, nan=0.0, posinf=0.0, neginf=float('-inf'))  # rows without NaN or +inf keep their values
    logits[:, 0].masked_fill_(largest == float('-inf'), 0.0)
    return unsampleable
