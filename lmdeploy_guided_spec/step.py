"""Grammar state of one speculative step: verification masks from forks, and the commit.

Invariants
----------
* The committed matcher of a request is advanced only by :func:`commit`, with tokens the target accepted.
* Drafting and verification work on forks; they never change the committed matcher.
* Verification mask ``i`` of a request is the bitmask of its grammar state after draft tokens ``0..i-1``.
  Once a draft token is rejected by the grammar, or a stop token accepted, later positions are unreachable: their
  rows allow every token (they are never sampled from, and all-``-inf`` rows would only produce NaNs).
* A committed matcher that has ended (it accepted a stop token) and is still asked for masks belongs to a request
  that ignores its stop tokens (``ignore_eos``, ``min_new_tokens``): its rows allow only stop tokens
  (:func:`stop_only`), so the output's text stays what the grammar accepted.
* A state that allows no token at all (an empty character class after a prefix) gets a row that allows every
  token, never an all-``-inf`` one that fails sampling for the whole batch; the commit of what is sampled there
  fails that request (the grammar allows no token at all).
* A committed token the grammar rejects is a failure of its request, never a silent fallback (:func:`commit`).

Two kinds of matchers meet the core. lmdeploy 0.14 builds them with ``terminate_without_stop_token=True``: they
report termination wherever the grammar may end, never accept a stop token and always give a mask. lmdeploy 0.15+
builds plain ones: they accept a stop token and have then *ended* (:func:`has_ended`); xgrammar refuses to give
an ended matcher's mask or jump-forward string.
"""
from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import ALL_ALLOWED, allocate_bitmask, no_token_allowed, token_allowed, unpack_bitmask
from .errors import GrammarRejectedError
from .mask_clock import MaskClock
from .ordering import Ready, host_lists

__all__ = [
    'fill_bitmask', 'verification_bitmask', 'commit', 'has_ended', 'stop_tokens', 'stop_only', 'grammar_is_empty'
]

Matchers = Mapping[int, xgr.GrammarMatcher]


def stop_tokens(matcher) -> frozenset[int]:
    """The stop tokens (EOS) of a matcher."""
    return frozenset(getattr(matcher, 'stop_token_ids', None) or ())


def has_ended(matcher) -> bool:
    """Whether ``matcher`` accepted a stop token: it allows nothing more, and xgrammar refuses its mask.

    A matcher built with ``terminate_without_stop_token=True`` never ends: it reports termination wherever the
    grammar may end, yet still gives masks there (the grammar may go on, or EOS is the one token allowed).
    """
    if not matcher.is_terminated():
        return False
    if not isinstance(matcher, xgr.GrammarMatcher):
        # FSM matchers terminate only by accepting a stop token
        return True
    # xgrammar keeps the matcher's kind to itself; only an ended matcher refuses a jump-forward string
    try:
        matcher.find_jump_forward_string()
    except RuntimeError:
        return True
    except UnicodeDecodeError:
        pass  # a jump-forward string inside a character (forced.jump_forward_text): the grammar goes on
    return False


def grammar_is_empty(grammar: xgr.CompiledGrammar | xgr.GrammarMatcher, vocab_size: int | None = None) -> bool:
    """Whether a grammar allows no token and cannot end (its language is empty), so no request can follow it.

    Parameters
    ----------
    grammar : xgrammar.CompiledGrammar or a matcher
        A compiled grammar (a fresh matcher is built), or a matcher whose current state is checked (not changed).
    vocab_size : int, optional
        Vocabulary size of the masks; default: the compiled grammar's tokenizer's (needed for a matcher).

    Notes
    -----
    The JSON schema ``{"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}`` compiles to
    ``defs_a ::= defs_a``: it compiles, and its first mask allows nothing.
    """
    if isinstance(grammar, xgr.CompiledGrammar):
        if vocab_size is None:
            vocab_size = grammar.tokenizer_info.vocab_size
        grammar = xgr.GrammarMatcher(grammar)
    elif vocab_size is None:
        vocab_size = getattr(getattr(grammar, 'fsm', None), 'vocab_size', None)
        if vocab_size is None:
            raise ValueError('grammar_is_empty needs vocab_size to check a matcher')
    if grammar.is_terminated() or grammar.is_completed():
        return False
    mask = allocate_bitmask(1, vocab_size)
    grammar.fill_next_token_bitmask(mask, 0)
    return not bool(unpack_bitmask(mask, vocab_size).any())


def fill_bitmask(matchers: Matchers, batch_size: int, vocab_size: int, *, pin_memory: bool = False,
                 clock: MaskClock | None = None, session_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Bitmask ``(batch_size, words)`` of the committed states; rows without a matcher, or whose state allows no
    token, allow everything; those whose matcher has ended (:func:`has_ended`) allow its stop tokens only.

    Does not change any matcher. ``pin_memory`` page-locks the bitmask, for a copy to the device that does not
    block the host. With ``clock`` and ``session_ids`` (the session of every batch row) each mask is timed against
    the mask limit (:class:`lmdeploy_guided_spec.mask_clock.MaskClock`).
    """
    bitmask = allocate_bitmask(batch_size, vocab_size, pin_memory=pin_memory)
    for row, matcher in matchers.items():
        if has_ended(matcher):
            stop_only(bitmask, row, matcher, vocab_size)
        else:
            _fill(matcher, bitmask, row, clock, session_ids, row, matcher)
            _settle_empty(bitmask, row, vocab_size)
    return bitmask


def _fill(matcher, bitmask: torch.Tensor, index: int, clock: MaskClock | None, session_ids, row: int,
          committed) -> None:
    """Fill ``bitmask[index]`` from ``matcher`` (the committed matcher of batch row ``row``, or a fork of it), timed
    by ``clock`` where there is one and the session ids."""
    if clock is None or session_ids is None:
        matcher.fill_next_token_bitmask(bitmask, index)
    else:
        clock.fill(matcher, bitmask, index, session_ids[row], committed)


def stop_only(bitmask: torch.Tensor, rows, matcher, vocab_size: int) -> None:
    """Let ``bitmask[rows]`` allow only the stop tokens of a matcher that has ended (:func:`has_ended`).

    A request goes on after its grammar ended only when it ignores its stop tokens (``ignore_eos``, or
    ``min_new_tokens`` not reached): what follows may only be stop tokens, which output text leaves out, so the
    text stays what the grammar accepted. Rows stay as they are for a matcher without stop tokens.
    """
    stops = [t for t in stop_tokens(matcher) if 0 <= t < vocab_size]
    if not stops:
        return
    words = np.zeros(bitmask.shape[-1], dtype=np.uint32)
    for token in stops:
        words[token >> 5] |= np.uint32(1 << (token & 31))
    # through numpy: the engine may have allocated the buffer as an inference tensor, which torch lets no other
    # thread write outside inference mode (xgrammar's fills write it the same way, below torch)
    bitmask.numpy()[rows] = words.view(np.int32)


def _settle_empty(bitmask: torch.Tensor, row: int, vocab_size: int) -> bool:
    """Let a filled row that allows no token allow every token instead (True if it did).

    Logits without a finite value fail sampling for the whole batch; the commit of whatever is sampled at such a
    state fails its request instead (:func:`commit`: the grammar allows no token at all).
    """
    if not no_token_allowed(bitmask, vocab_size, (row, ))[0]:
        return False
    bitmask.numpy()[row] = ALL_ALLOWED  # through numpy: see stop_only
    return True


def verification_bitmask(matchers: Matchers, draft_token_ids: torch.Tensor | Sequence[Sequence[int]],
                         vocab_size: int, *, ready: Ready | None = None, pin_memory: bool = False,
                         clock: MaskClock | None = None, session_ids: Sequence[int] | None = None) -> torch.Tensor:
    """Position-serial bitmasks for the ``num_spec_tokens + 1`` target positions of every request.

    Parameters
    ----------
    matchers : mapping of batch row to GrammarMatcher
        Committed matchers of the guided requests; not changed (each is forked).
    draft_token_ids : LongTensor or nested sequence, ``(batch_size, num_spec_tokens)``
        Draft tokens in the target vocabulary.
    vocab_size : int
        Target vocabulary size (the model's padded size).
    ready : object with ``synchronize()``, optional
        Waited for before ``draft_token_ids`` is read (a ``torch.cuda.Event`` recorded after the kernel that wrote
        them; see :mod:`lmdeploy_guided_spec.ordering`).
    pin_memory : bool, default: False
        Page-lock the bitmask, for a copy to the device that does not block the host.
    clock : MaskClock, optional
        With ``session_ids`` (the session of every batch row): each mask is timed against the mask limit.

    Returns
    -------
    torch.Tensor
        ``(batch_size * (num_spec_tokens + 1), words)`` int32 CPU bitmask; row ``b * (k + 1) + i`` is the mask of
        request ``b`` after its draft tokens ``0..i-1``. Unguided rows, states that allow no token, and unreachable
        positions (after a draft the grammar rejects) allow every token; positions after a drafted stop token the
        grammar allows, and every row of a request whose matcher has ended, allow its stop tokens only.

    Pseudocode::

        for b, m in matchers: if m ended: continue
            f = m.fork()
            for i in 0..k: fill(f, row b*(k+1)+i)
                if i == k or draft[b][i] is a stop token or not f.accept(draft[b][i]): break
            (after a stop token that fill allowed, the rows that follow allow stop tokens only)
    """
    drafts = host_lists(draft_token_ids, ready)
    batch_size = len(drafts)
    num_pos = (len(drafts[0]) if batch_size else 0) + 1
    bitmask = allocate_bitmask(batch_size * num_pos, vocab_size, pin_memory=pin_memory)
    for row, matcher in matchers.items():
        if has_ended(matcher):
            stop_only(bitmask, slice(row * num_pos, (row + 1) * num_pos), matcher, vocab_size)
            continue
        fork = matcher.fork()
        stop = stop_tokens(fork)
        base = row * num_pos
        for i in range(num_pos):
            _fill(fork, bitmask, base + i, clock, session_ids, row, matcher)
            if i == num_pos - 1 or _settle_empty(bitmask, base + i, vocab_size):
                break
            token = int(drafts[row][i])
            # the request ends at a stop token, whether the matcher accepts it (and ends) or not; one that ignores
            # its stop tokens writes only stop tokens after one the grammar allowed
            if token in stop:
                if token_allowed(bitmask[base + i], token):
                    stop_only(bitmask, slice(base + i + 1, base + num_pos), fork, vocab_size)
                break
            if not fork.accept_token(token):
                break
    return bitmask


def _rejection(matcher, token: int, count: int, vocab_size: int | None) -> str:
    """Why a matcher that has not ended rejected a committed token (its state is unchanged)."""
    if vocab_size is None:
        vocab_size = getattr(getattr(matcher, 'fsm', None), 'vocab_size', None)
    if vocab_size is not None and grammar_is_empty(matcher, vocab_size):
        return (f'the grammar allows no token at all after {count} accepted tokens, so committed token {token} '
                'cannot follow (is the language of the grammar empty?)')
    return f'the grammar rejected committed token {token} after {count} accepted tokens'


def commit(matchers: Matchers, token_ids: torch.Tensor | Sequence, *,
           session_ids: Sequence[int] | Mapping[int, int] | None = None, failures: dict | None = None,
           vocab_size: int | None = None, ready: Ready | None = None, clock: MaskClock | None = None
           ) -> dict[int, int]:
    """Advance each committed matcher by the tokens the target accepted for its row.

    Parameters
    ----------
    matchers : mapping of batch row to GrammarMatcher
        Committed matchers; advanced in place.
    token_ids : LongTensor or sequence, ``(batch_size,)`` or ``(batch_size, n)``
        Accepted tokens per row in order; ``-1`` (lmdeploy's placeholder) ends a row.
    session_ids : sequence or mapping, optional
        Session id of every batch row (``session_ids[row]``), the key of ``failures``; default: the batch row.
    failures : dict, optional
        Where a failure is recorded, ``{session id: message}`` (the first failure of a session is kept): a token
        the grammar rejects while its matcher has not ended, naming the token and how many tokens were accepted
        before it, or a state that allows no token at all. Without it a failure raises
        :class:`GrammarRejectedError` once every row is committed.
    vocab_size : int, optional
        The model's vocabulary size, so that a failure can say the grammar allows no token at all.
    ready : object with ``synchronize()``, optional
        Waited for before ``token_ids`` is read (see :mod:`lmdeploy_guided_spec.ordering`).
    clock : MaskClock, optional
        With ``session_ids``, each accept is timed against the mask limit, as masks are: xgrammar's accepts of an
        ambiguous grammar can grow slow faster than its masks (``((x|xx)+ ?){1,300}``: 264 ms an accept beside
        65 ms a mask).

    Returns
    -------
    dict
        Number of tokens each matcher accepted. The row ends where its matcher ends: after an accepted stop token
        (plain matchers), or at a stop token rejected after the end of the grammar (matchers built with
        ``terminate_without_stop_token``, which still accept what may go on where the grammar may end).

    Raises
    ------
    GrammarRejectedError
        Without ``failures``, when a row failed.
    """
    rows = host_lists(token_ids, ready)
    accepted = {}
    found = {} if failures is None else failures
    timed = clock is not None and session_ids is not None
    for row, matcher in matchers.items():
        tokens = rows[row]
        if not isinstance(tokens, list):
            tokens = [tokens]
        count = 0
        for token in tokens:
            token = int(token)
            if token < 0 or has_ended(matcher):
                # an ended matcher accepts nothing more (and xgrammar would print a warning per token)
                break
            if timed:
                start = time.thread_time()
                taken = matcher.accept_token(token)
                clock.charge(session_ids[row], time.thread_time() - start, matcher, 'an accept')
            else:
                taken = matcher.accept_token(token)
            if not taken:
                # a terminating matcher rejects the stop token after the end of its grammar: the row ended (an ended
                # matcher was not asked above)
                if not (matcher.is_terminated() and token in stop_tokens(matcher)):
                    # verification masks exclude such tokens: masks and matchers drifted apart, or the grammar
                    # allows nothing here
                    key = row if session_ids is None else session_ids[row]
                    found.setdefault(key, f'batch row {row}: {_rejection(matcher, token, count, vocab_size)}')
                break
            count += 1
        accepted[row] = count
    if failures is None and found:
        raise GrammarRejectedError('; '.join(found.values()))
    return accepted
