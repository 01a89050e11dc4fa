"""Tokens a grammar forces: drafts that cost no draft model.

Structured output is full of text the grammar alone decides: property names, quotes, colons, commas, the tails of
enum values, closing brackets. At a grammar state, the *forced token* is

1. the only token the state's bitmask allows (a closing ``}`` at the end, EOS after it, a deterministic edge of an
   FSM), or else
2. the first token of the text xgrammar says must come next (``GrammarMatcher.find_jump_forward_string``),
   tokenized the way the model's tokenizer writes it, as long as no longer token could span the end of that text.

Rule 2 keeps drafts canonical. The jump-forward string ``'{"name": "'`` may be followed by ``John``; a tokenizer
whose vocabulary holds a token that starts inside the forced text and runs past its end (``' "'`` + ``J`` could be
``' "J'``) may write the boundary differently from the forced text's own tokenization, so trailing tokens of the
text that such a token could span are held back (the target writes them itself, as the bonus token of the step).
A held-back token is still forced when no token can start inside it and run past the text, and the grammar allows
no token that extends it (``'}'``), or when nothing but EOS may follow the text.

Forced tokens are only drafts: verification with the grammar masks accepts a draft exactly when the target would
have produced it, so they never change the output.
"""
from __future__ import annotations

import bisect
import os
import threading
import weakref
from collections.abc import Callable, Sequence

import numpy as np
import torch
import xgrammar as xgr

from .bitmask import allocate_bitmask, token_allowed, uint32_words
from .step import has_ended

__all__ = ['ForcedTokenizer', 'JumpForwardMemo', 'single_allowed_token', 'single_allowed_tokens', 'token_allowed',
           'forced_token', 'forced_drafts', 'jump_forward_text']

#: Texts whose tokenization a ForcedTokenizer remembers (jump-forward strings repeat: the same property names
#: come back in every request of a schema).
CACHE_SIZE = 8192
#: Characters of forced text read at a position (the first token of much longer text is decided long before).
MAX_FORCED_CHARS = 512
#: Tokens whose extensions a ForcedTokenizer keeps as bits (at most a mask row each: 48 KiB for 128k tokens).
EXTENSION_CACHE_SIZE = 512

_SHARED: dict[tuple[int, int], tuple[weakref.ref, ForcedTokenizer]] = {}
_SHARED_LOCK = threading.Lock()


def single_allowed_token(mask_row: torch.Tensor | np.ndarray, vocab_size: int) -> int | None:
    """The token a bitmask row allows if it allows exactly one below ``vocab_size``, else None.

    ``mask_row`` is one int32 row ``(words,)`` in xgrammar's layout (CPU tensor or numpy array).
    """
    return single_allowed_tokens(uint32_words(mask_row).reshape(1, -1), vocab_size)[0]


def single_allowed_tokens(mask_rows: torch.Tensor | np.ndarray, vocab_size: int) -> list[int | None]:
    """:func:`single_allowed_token` of every row of ``mask_rows`` ``(rows, words)``, with one scan of the block
    (a window's position of many rows, instead of one scan per row)."""
    words = uint32_words(mask_rows)
    full, rest = divmod(vocab_size, 32)
    body = words[:, :full]
    counts = np.count_nonzero(body, axis=1)
    if rest and full < words.shape[1]:
        tail = words[:, full] & np.uint32((1 << rest) - 1)
    else:
        tail = np.zeros(words.shape[0], dtype=np.uint32)
    out: list[int | None] = [None] * words.shape[0]
    for i in np.flatnonzero(counts + (tail != 0) == 1).tolist():
        if counts[i]:
            index = int(np.flatnonzero(body[i])[0])
            word = int(body[i, index])
        else:
            index, word = full, int(tail[i])
        if not word & (word - 1):
            out[i] = index * 32 + word.bit_length() - 1
    return out


def _next_prefix(prefix: bytes) -> bytes | None:
    """The smallest byte string greater than every string that starts with ``prefix`` (None: no such string)."""
    stripped = prefix.rstrip(b'\xff')
    if not stripped:
        return None
    return stripped[:-1] + bytes([stripped[-1] + 1])


class ForcedTokenizer:
    """Canonical draft tokens for text a grammar forces, for one tokenizer.

    Parameters
    ----------
    encode : callable
        ``text -> list of token ids`` without special tokens, the model tokenizer's own encoding.
    decoded_vocab : sequence of bytes, or a callable returning one
        The bytes every token id stands for (``xgrammar.TokenizerInfo.decoded_vocab``); its length is the model's
        vocabulary size. A callable is called on first use (reading it from xgrammar takes most of a second for
        128k tokens).
    exclude_ids : sequence of int, optional
        Special tokens: never part of forced text and never a token that could span its end.

    Notes
    -----
    The vocabulary and its sorted copy are built on first use, some 0.2 s for 128k tokens on top of reading
    ``decoded_vocab``. :meth:`from_huggingface` shares one instance per tokenizer object.
    """

    def __init__(self, encode: Callable[[str], list[int]],
                 decoded_vocab: Sequence[bytes] | Callable[[], Sequence[bytes]], *, exclude_ids: Sequence[int] = ()):
        self._encode = encode
        self._source = decoded_vocab
        self._exclude = {int(t) for t in exclude_ids}
        self._vocab: list[bytes] | None = None
        self._keys: list[bytes] | None = None
        self._ids: np.ndarray | None = None
        self._max_len = 0
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[tuple[int, ...], int, bool]] = {}
        self._extensions: dict[int, np.ndarray] = {}
        # (token, mask words) -> the words and bits of the tokens that extend it (extended_by_allowed)
        self._extension_bits: dict[tuple[int, int], tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def from_huggingface(cls, tokenizer, tokenizer_info: xgr.TokenizerInfo | None = None, *,
                         vocab_size: int | None = None) -> ForcedTokenizer:
        """The ForcedTokenizer of a Hugging Face tokenizer, shared per tokenizer object and vocabulary size.

        Pass the ``tokenizer_info`` you already have; building one takes most of a second for 128k tokens.
        """
        if tokenizer_info is None:
            tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        key = (id(tokenizer), tokenizer_info.vocab_size)
        with _SHARED_LOCK:
            shared = _SHARED.get(key)
            if shared is not None and shared[0]() is tokenizer:
                return shared[1]
        exclude = set(tokenizer_info.special_token_ids) | set(tokenizer_info.stop_token_ids)
        exclude |= set(getattr(tokenizer, 'all_special_ids', ()))
        for token_id, added in getattr(tokenizer, 'added_tokens_decoder', {}).items():
            if getattr(added, 'special', False):
                exclude.add(token_id)

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

        forced = cls(encode, lambda: tokenizer_info.decoded_vocab, exclude_ids=sorted(exclude))
        try:
            ref = weakref.ref(tokenizer)
        except TypeError:
            return forced
        with _SHARED_LOCK:
            _SHARED[key] = (ref, forced)
        return forced

    # -- the vocabulary -------------------------------------------------------------------------------------------
    @property
    def decoded_vocab(self) -> list[bytes]:
        """The bytes of every token id (loaded on first use)."""
        if self._vocab is None:
            self._build()
        return self._vocab

    @property
    def vocab_size(self) -> int:
        """Number of token ids."""
        return len(self.decoded_vocab)

    def prepare(self) -> None:
        """Read and sort the vocabulary now instead of at first use."""
        self._build()

    def _build(self) -> None:
        with self._lock:
            if self._keys is not None:
                return
            vocab = list(self._source() if callable(self._source) else self._source)
            order = sorted((token for token, data in enumerate(vocab) if data and token not in self._exclude),
                           key=vocab.__getitem__)
            self._ids = np.asarray(order, dtype=np.int64)
            self._max_len = max((len(vocab[token]) for token in order), default=0)
            self._vocab = vocab
            self._keys = [vocab[token] for token in order]

    def _ranges(self, prefix: bytes) -> tuple[int, int]:
        """Indices ``eq <= hi`` of the sorted vocabulary such that ``[eq, hi)`` strictly extend ``prefix``."""
        if self._keys is None:
            self._build()
        keys = self._keys
        eq = bisect.bisect_right(keys, prefix)
        upper = _next_prefix(prefix)
        hi = len(keys) if upper is None else bisect.bisect_left(keys, upper, eq)
        return eq, hi

    def _extendable(self, data: bytes) -> bool:
        """Whether some token's bytes start with ``data`` and are longer."""
        eq, hi = self._ranges(data)
        return hi > eq

    def extensions(self, token: int) -> np.ndarray:
        """Ids of the tokens whose bytes strictly extend ``token``'s bytes (cached)."""
        found = self._extensions.get(token)
        if found is None:
            eq, hi = self._ranges(self.decoded_vocab[token])
            found = self._extensions[token] = self._ids[eq:hi]
        return found

    def extended_by_allowed(self, token: int, mask_row: torch.Tensor | np.ndarray) -> bool:
        """Whether the bitmask row allows a token that strictly extends ``token`` (so ``token`` is not forced)."""
        words = uint32_words(mask_row)
        key = (token, words.shape[0])
        found = self._extension_bits.get(key)
        if found is None:
            # the extensions as bits of the words that hold them: one AND per check instead of a gather of
            # thousands of ids (a short token such as '"' has thousands of extensions)
            ids = self.extensions(token)
            ids = ids[(ids >> 5) < words.shape[0]]
            packed = np.zeros(words.shape[0], dtype=np.uint32)
            np.bitwise_or.at(packed, ids >> 5, np.left_shift(np.uint32(1), (ids & 31).astype(np.uint32)))
            index = np.flatnonzero(packed)
            if len(self._extension_bits) >= EXTENSION_CACHE_SIZE:
                self._extension_bits.clear()
            found = self._extension_bits[key] = (index, packed[index])
        index, bits = found
        return bool(index.size) and bool((words[index] & bits).any())

    # -- tokenization ---------------------------------------------------------------------------------------------
    def _encode_exact(self, text: str) -> list[int] | None:
        """Token ids whose bytes are exactly ``text``; None when the tokenizer cannot write it on its own."""
        data = text.encode('utf-8')
        vocab = self.decoded_vocab
        vocab_size = len(vocab)
        # SentencePiece tokenizers that add a prefix space write '{' as '▁{' at the start of a text; a newline in
        # front absorbs it, and its tokens are cut off again
        for sentinel in ('', '\n'):
            ids = self._encode(sentinel + text)
            if any(t < 0 or t >= vocab_size or t in self._exclude for t in ids):
                continue
            head = sentinel.encode('utf-8')
            start, seen = 0, b''
            while seen != head and start < len(ids) and len(seen) < len(head):
                seen += vocab[ids[start]]
                start += 1
            if seen != head:
                continue
            ids = ids[start:]
            if b''.join(vocab[t] for t in ids) == data:
                return ids
        return None

    def encode(self, text: str) -> list[int] | None:
        """Token ids whose bytes are exactly ``text`` as the tokenizer writes it, or None (not cached)."""
        return self._encode_exact(text)

    def token_bytes(self, token: int) -> bytes:
        """The bytes ``token`` adds to output text: empty for special tokens and ids outside the vocabulary."""
        vocab = self.decoded_vocab
        if token < 0 or token >= len(vocab) or token in self._exclude:
            return b''
        return vocab[token]

    def tokenize(self, text: str) -> tuple[tuple[int, ...], int]:
        """Canonical token ids of ``text`` and how many of them are stable.

        The first ``stable`` ids end before any position where a vocabulary token could start and run past the
        end of ``text``: whatever follows, the tokenizer writes them the same way. Returns ``((), 0)`` when the
        tokenizer cannot write ``text`` on its own.
        """
        return self._tokenize(text)[:2]

    def first_token(self, text: str, mask_row: torch.Tensor | np.ndarray,
                    ends: Callable[[], bool] | None = None) -> int | None:
        """The first canonical token of forced ``text`` if the grammar state ``mask_row`` cannot write the text's
        start differently, else None.

        A stable first token is forced. A first token in the held-back tail is forced only if no token could start
        inside it and run past the end of ``text``, and the mask allows no token that extends it (a closing
        ``'}'`` that nothing may follow); or if ``ends()`` says that nothing but EOS may follow ``text`` (then no
        token can run past its end).
        """
        ids, stable, spanned_inside = self._tokenize(text)
        if not ids or not token_allowed(mask_row, ids[0]):
            return None
        if stable:
            return ids[0]
        if spanned_inside or self.extended_by_allowed(ids[0], mask_row):
            return ids[0] if ends is not None and ends() else None
        return ids[0]

    def _tokenize(self, text: str) -> tuple[tuple[int, ...], int, bool]:
        """``(ids, stable, spanned_inside)``: :meth:`tokenize`, and whether a token could start strictly inside the
        first token and run past the end of ``text``."""
        found = self._cache.get(text)
        if found is not None:
            return found
        ids = self._encode_exact(text)
        if not ids:
            found = ((), 0, False)
        else:
            data = text.encode('utf-8')
            # the first offset from which a token could run past the end of the text
            cut = len(data)
            for offset in range(max(0, len(data) - self._max_len), len(data)):
                if self._extendable(data[offset:]):
                    cut = offset
                    break
            stable, end = 0, 0
            vocab = self.decoded_vocab
            for token in ids:
                end += len(vocab[token])
                if end > cut:
                    break
                stable += 1
            first = len(vocab[ids[0]])
            spanned_inside = any(self._extendable(data[offset:]) for offset in range(max(1, cut), first))
            found = (tuple(ids), stable, spanned_inside)
        if len(self._cache) >= CACHE_SIZE:
            self._cache.clear()
        self._cache[text] = found
        return found


#: Environment variable that turns forced drafts inside draft-model windows off (``0``).
FORCED_DRAFTS_ENV = 'LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS'
#: Set to ``0``: draft models draft without the grammar's masks (:func:`draft_masks_from_env`).
DRAFT_MASKS_ENV = 'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS'


def forced_drafts_from_env() -> bool:
    """Whether forced tokens replace the draft model's choices inside drafting windows: on unless
    ``LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS`` is ``0``."""
    return os.environ.get(FORCED_DRAFTS_ENV, '1') != '0'


def draft_masks_from_env() -> bool:
    """Whether the grammar masks a draft model's logits: on unless ``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS`` is ``0``
    (then drafts are free and only verification is masked)."""
    return os.environ.get(DRAFT_MASKS_ENV, '1') != '0'


class JumpForwardMemo:
    """The jump-forward text of matchers inside long forced literals, kept instead of asked for again.

    xgrammar builds the whole jump-forward string on every call: 0.18 s for the million characters of
    ``a{1000000}``, at every position of every step while the request lasts, on the worker every step waits for.
    Once a state's text is known, a state reached by accepting a strict prefix of it has the rest of that text as its
    own (the text runs to the same branch point or end). Only texts of at least :attr:`MIN_CHARS` characters are
    kept: shorter ones cost xgrammar little. Everything runs on the grammar worker.
    """

    #: Shortest jump-forward text that is kept.
    MIN_CHARS = 256

    def __init__(self):
        # id(matcher) -> (weak reference, the text's bytes, offset of the matcher's state in them)
        self._texts: dict[int, tuple[weakref.ref, bytes, int]] = {}

    def __len__(self) -> int:
        return len(self._texts)

    def _get(self, matcher):
        entry = self._texts.get(id(matcher))
        if entry is not None and entry[0]() is not matcher:
            return None
        return entry

    def _put(self, matcher, data: bytes, offset: int) -> None:
        key = id(matcher)
        texts = self._texts

        def drop(ref, key=key):
            if texts.get(key, (None, ))[0] is ref:
                texts.pop(key, None)

        try:
            texts[key] = (weakref.ref(matcher, drop), data, offset)
        except TypeError:  # a matcher-like object without weak references: nothing kept
            pass

    def read(self, matcher) -> str:
        """The jump-forward text of ``matcher``'s state (at most :data:`MAX_FORCED_CHARS` characters)."""
        entry = self._get(matcher)
        if entry is not None:
            _, data, offset = entry
            head = data[offset:offset + 4 * MAX_FORCED_CHARS]
            # a state inside a character: ask xgrammar
            if head and not 0x80 <= head[0] < 0xC0:
                text = head.decode('utf-8', errors='ignore')
                return text[:MAX_FORCED_CHARS]
            self._texts.pop(id(matcher), None)
        text = jump_forward_text(matcher)
        if len(text) >= self.MIN_CHARS:
            self._put(matcher, text.encode('utf-8'), 0)
        return text[:MAX_FORCED_CHARS]

    def fork(self, source, fork) -> None:
        """``fork`` is at ``source``'s state (forked from it, or its origin): it has the same text."""
        entry = self._get(source)
        if entry is not None:
            self._put(fork, entry[1], entry[2])

    def advance(self, matcher, data: bytes) -> None:
        """``matcher`` accepted ``data``: keep the rest of its text, or forget it (the text ended or was left)."""
        entry = self._get(matcher)
        if entry is None or not data:
            return
        _, text, offset = entry
        end = offset + len(data)
        if end < len(text) and text.startswith(data, offset):
            self._put(matcher, text, end)
        else:
            self._texts.pop(id(matcher), None)


def jump_forward_text(matcher) -> str:
    """xgrammar's jump-forward string of ``matcher``'s state; ``''`` where it does not start with a whole character.

    In a state inside a character whose rest the grammar forces (after the byte token C2 where ``\\s`` takes U+00A0,
    the byte A0), xgrammar hands over the bytes from there, which Python cannot decode (UnicodeDecodeError): nothing
    whole is forced there, and the target writes the rest of the character.
    """
    try:
        return matcher.find_jump_forward_string()
    except UnicodeDecodeError:
        return ''


def forced_token(matcher, mask_row: torch.Tensor | np.ndarray, vocab_size: int,
                 tokenizer: ForcedTokenizer | None = None, *, single: int | None = ...,
                 jumps: JumpForwardMemo | None = None) -> int | None:
    """The token the grammar forces next, or None.

    Parameters
    ----------
    matcher : xgrammar.GrammarMatcher or a matcher-like object
        The grammar state; not changed. Jump-forward text is read from objects with ``find_jump_forward_string``.
    mask_row : int32 tensor or array ``(words,)``
        The state's bitmask, already filled.
    vocab_size : int
        Vocabulary size the mask covers.
    tokenizer : ForcedTokenizer, optional
        Writes jump-forward text as tokens; without it only a mask that allows a single token forces one.
    single : int or None, optional
        :func:`single_allowed_token` of ``mask_row``, where the caller found it already (for many rows at once).
    jumps : JumpForwardMemo, optional
        Where jump-forward text is read, so that a long forced literal is not built again at every position.
    """
    if single is ...:
        single = single_allowed_token(mask_row, vocab_size)
    if single is not None or tokenizer is None:
        return single
    if getattr(matcher, 'find_jump_forward_string', None) is None:
        return None
    # only the start of the text decides its first token: a literal of a million characters (a{1000000}) must not
    # be tokenized and replayed at every position (the cut counts as the text's end, which only holds tokens back)
    text = jumps.read(matcher) if jumps is not None else jump_forward_text(matcher)[:MAX_FORCED_CHARS]
    if not text:
        return None
    return tokenizer.first_token(text, mask_row, lambda: _only_eos_after(matcher, text, mask_row.shape[-1] * 32))


def _only_eos_after(matcher, text: str, vocab_size: int) -> bool:
    """Whether the grammar allows nothing but its stop tokens after ``text`` (``matcher`` is not changed)."""
    fork = matcher.fork()
    if not fork.accept_string(text):
        return False
    # a state where the grammar cannot end yet allows a token other than a stop token: no mask needed (most forced
    # text ends inside the instance, a key's '":' say)
    completed = getattr(fork, 'is_completed', None)
    if completed is not None and not completed() and not fork.is_terminated():
        return False
    # is_terminated() is no answer: lmdeploy's matchers (terminate_without_stop_token) report it wherever the
    # grammar may end, even where it may also go on
    mask = allocate_bitmask(1, vocab_size)
    fork.fill_next_token_bitmask(mask, 0)
    words = uint32_words(mask[0])
    stop = set(getattr(fork, 'stop_token_ids', None) or ())
    nonzero = np.flatnonzero(words)
    if nonzero.size > len(stop):
        return False
    allowed = {int(w) * 32 + bit for w in nonzero for bit in range(32) if (int(words[w]) >> bit) & 1}
    return allowed <= stop


def forced_drafts(matcher, max_tokens: int, vocab_size: int, tokenizer: ForcedTokenizer | None = None) -> list[int]:
    """Up to ``max_tokens`` tokens the grammar forces from ``matcher``'s state, each checked by a fork.

    The matcher itself is not changed. A stop token (EOS) ends the drafts. Pseudocode::

        f = matcher.fork()
        while len(drafts) < max_tokens:
            t = forced_token(f, fill(f)); if t is None: break
            drafts.append(t); if t is a stop token or not f.accept_token(t): break
    """
    fork = matcher.fork()
    stop = set(getattr(fork, 'stop_token_ids', None) or ())
    drafts: list[int] = []
    if has_ended(fork):
        # a stop token was accepted: nothing follows, and xgrammar gives no mask
        return drafts
    mask = allocate_bitmask(1, vocab_size)
    while len(drafts) < max_tokens:
        fork.fill_next_token_bitmask(mask, 0)
        token = forced_token(fork, mask[0], vocab_size, tokenizer)
        if token is None:
            break
        drafts.append(token)
        # a matcher built with terminate_without_stop_token (lmdeploy 0.14's) rejects the EOS it then allows, a plain
        # one (0.15+) accepts it and ends: nothing follows either way
        if token in stop or not fork.accept_token(token):
            break
    return drafts
