"""Grammar state of one speculative step: verification masks from forks, and the commit.

Invariants
----------
* The committed matcher of a request is advanced only by :func:`commit`, with tokens the target accepted.
* Drafting and verification work on forks; they never change the committed matcher.
* Verification mask ``i`` of a request is the bitmask of its grammar state after draft tokens ``0..i-1``.
  Once a draft token is rejected by the grammar, later positions are unreachable: their rows allow every
  token (they are never sampled from, and all-``-inf`` rows would only produce NaNs).
"""
from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch
import xgrammar as xgr

from .bitmask import allocate_bitmask

__all__ = ['fill_bitmask', 'verification_bitmask', 'commit']

logger = logging.getLogger('lmdeploy_guided_spec')

Matchers = Mapping[int, xgr.GrammarMatcher]


def _as_rows(token_ids: torch.Tensor | Sequence) -> list:
    """Token ids as nested Python lists (one device-to-host sync for a tensor)."""
    if isinstance(token_ids, torch.Tensor):
        return token_ids.tolist()
    return [list(r) if isinstance(r, (list, tuple)) else r for r in token_ids]


def fill_bitmask(matchers: Matchers, batch_size: int, vocab_size: int) -> torch.Tensor:
    """Bitmask ``(batch_size, words)`` of the committed states; rows without a matcher allow everything.

    Does not change any matcher.
    """
    bitmask = allocate_bitmask(batch_size, vocab_size)
    for row, matcher in matchers.items():
        matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def verification_bitmask(matchers: Matchers, draft_token_ids: torch.Tensor | Sequence[Sequence[int]],
                         vocab_size: int) -> torch.Tensor:
    """Position-serial bitmasks for the ``num_spec_tokens + 1`` target positions of every request.

    Parameters
    ----------
    matchers : mapping of batch row to GrammarMatcher
        Committed matchers of the guided requests; not changed (each is forked).
    draft_token_ids : LongTensor or nested sequence, ``(batch_size, num_spec_tokens)``
        Draft tokens in the target vocabulary.
    vocab_size : int
        Target vocabulary size (the model's padded size).

    Returns
    -------
    torch.Tensor
        ``(batch_size * (num_spec_tokens + 1), words)`` int32 CPU bitmask; row ``b * (k + 1) + i`` is the mask of
        request ``b`` after its draft tokens ``0..i-1``. Unguided rows and unreachable positions allow every token.

    Pseudocode::

        for b, m in matchers: f = m.fork()
            for i in 0..k: fill(f, row b*(k+1)+i); if i == k or not f.accept(draft[b][i]): break
    """
    drafts = _as_rows(draft_token_ids)
    batch_size = len(drafts)
    num_pos = (len(drafts[0]) if batch_size else 0) + 1
    bitmask = allocate_bitmask(batch_size * num_pos, vocab_size)
    for row, matcher in matchers.items():
        fork = matcher.fork()
        base = row * num_pos
        for i in range(num_pos):
            fork.fill_next_token_bitmask(bitmask, base + i)
            if i == num_pos - 1 or not fork.accept_token(int(drafts[row][i])):
                break
    return bitmask


def commit(matchers: Matchers, token_ids: torch.Tensor | Sequence) -> dict[int, int]:
    """Advance each committed matcher by the tokens the target accepted for its row.

    Parameters
    ----------
    matchers : mapping of batch row to GrammarMatcher
        Committed matchers; advanced in place.
    token_ids : LongTensor or sequence, ``(batch_size,)`` or ``(batch_size, n)``
        Accepted tokens per row in order; ``-1`` (lmdeploy's placeholder) ends a row.

    Returns
    -------
    dict
        Number of tokens each matcher accepted. A terminated matcher stops at the first token it rejects (EOS
        after the end of the grammar); a grammar that may end or go on (``x(yz)?`` after ``x``) keeps accepting.
    """
    rows = _as_rows(token_ids)
    accepted = {}
    for row, matcher in matchers.items():
        tokens = rows[row]
        if not isinstance(tokens, list):
            tokens = [tokens]
        count = 0
        for token in tokens:
            if token < 0:
                break
            if not matcher.accept_token(int(token)):
                if matcher.is_terminated():
                    # lmdeploy's matchers end without a stop token, and report termination wherever the grammar
                    # may end; they still accept what may go on, so only a rejected token ends the commit
                    break
                # The verification masks exclude such tokens, so this means masks and matchers drifted apart.
                logger.error(f'grammar rejected committed token {token} of batch row {row} after {count} '
                             'accepted tokens; the request continues unconstrained from here. Please file an issue.')
                break
            count += 1
        accepted[row] = count
    return accepted
