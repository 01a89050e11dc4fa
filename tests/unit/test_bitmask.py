"""Bitmask packing, unpacking and application against xgrammar's own kernels."""
import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import allocate_bitmask, apply_bitmask_, bitmask_words, pack_bool_mask, unpack_bitmask
from lmdeploy_guided_spec.bitmask import guard_unsampleable_, take_rows

pytestmark = pytest.mark.unit


@pytest.mark.parametrize('rows__vocab_size', [(1, 817), (3, 32001), (2, 32), (4, 128256)])
@pytest.mark.parametrize('density', [0.001, 0.5, 1.0])
def test_pack_unpack_round_trip(rows__vocab_size, density):
    rows, vocab_size = rows__vocab_size
    allowed = torch.rand(rows, vocab_size) < density
    packed = pack_bool_mask(allowed)
    assert packed.dtype == torch.int32 and packed.shape == (rows, bitmask_words(vocab_size))
    assert torch.equal(unpack_bitmask(packed, vocab_size), allowed)
    # xgrammar's reference converter agrees bit for bit
    assert torch.equal(packed, xgr.testing.bool_mask_to_bitmask(allowed))


def test_allocate_allows_everything():
    mask = allocate_bitmask(2, 817)
    assert unpack_bitmask(mask, 817).all()
    assert torch.equal(mask, xgr.allocate_token_bitmask(2, 817))


@pytest.mark.parametrize('vocab_size', [817, 32001])
def test_apply_matches_xgrammar(vocab_size):
    logits = torch.randn(5, vocab_size)
    allowed = torch.rand(5, vocab_size) < 0.1
    bitmask = pack_bool_mask(allowed)
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, bitmask, backend='torch_native')
    ours = apply_bitmask_(logits.clone(), bitmask)
    assert torch.equal(ours, expected)
    assert torch.isinf(ours[~allowed]).all() and torch.equal(ours[allowed], logits[allowed])


def test_apply_rows_leaves_other_rows_untouched():
    logits = torch.randn(6, 817)
    allowed = torch.rand(6, 817) < 0.2
    out = apply_bitmask_(logits.clone(), pack_bool_mask(allowed), rows=[1, 4])
    for r in (0, 2, 3, 5):
        assert torch.equal(out[r], logits[r])
    for r in (1, 4):
        assert torch.equal(torch.isfinite(out[r]), allowed[r])


def test_apply_masks_vocab_padding_beyond_bitmask():
    # logits padded beyond the tokenizer's vocabulary: the padding columns are never allowed
    logits = torch.randn(2, 100)
    bitmask = pack_bool_mask(torch.ones(2, 70, dtype=torch.bool))[:, :2]  # covers 64 tokens
    out = apply_bitmask_(logits.clone(), bitmask)
    assert torch.isfinite(out[:, :64]).all() and torch.isinf(out[:, 64:]).all()


def test_apply_bf16_and_bad_shapes():
    logits = torch.randn(2, 817, dtype=torch.bfloat16)
    allowed = torch.rand(2, 817) < 0.5
    out = apply_bitmask_(logits.clone(), pack_bool_mask(allowed))
    assert torch.equal(torch.isfinite(out), allowed)
    with pytest.raises(ValueError, match='rows'):
        apply_bitmask_(torch.randn(3, 817), pack_bool_mask(allowed))
    with pytest.raises(TypeError, match='int32'):
        unpack_bitmask(torch.zeros(1, 26, dtype=torch.int64), 817)
    with pytest.raises(ValueError, match='cover'):
        unpack_bitmask(torch.zeros(1, 2, dtype=torch.int32), 817)


@pytest.mark.parametrize('vocab__covered', [(817, 817), (1000, 960), (32001, 32001)])
def test_sparse_rows_apply_like_the_bitmask(vocab__covered):
    from lmdeploy_guided_spec.sparse import sparse_rows
    vocab, covered = vocab__covered
    allowed = torch.rand(6, vocab) < 0.5
    allowed[0] = torch.rand(vocab) < 0.01   # few allowed
    allowed[1] = torch.rand(vocab) > 0.01   # few disallowed
    allowed[2] = False
    allowed[3] = True
    bitmask = pack_bool_mask(allowed)[:, :bitmask_words(covered)]
    logits = torch.randn(9, vocab)
    rows = [1, 3, 4, 5, 7, 8]  # logits rows the six bitmask rows address
    expected = logits.clone()
    expected[rows] = apply_bitmask_(logits[rows].clone(), bitmask)
    got = sparse_rows(bitmask, rows, vocab).apply_(logits.clone())
    assert torch.equal(got, expected)
    # non-contiguous logits; one builder addressing two row sets with the same masks, cached the second time
    from lmdeploy_guided_spec.sparse import SparseMaskBuilder
    builder = SparseMaskBuilder(vocab)
    wide = torch.randn(9, vocab * 2)[:, ::2]
    other = [2 * r % 9 for r in rows]
    for _ in range(2):
        first, second = builder.build(bitmask, rows, other)
        expected = wide.clone()
        expected[other] = apply_bitmask_(wide[other].clone(), bitmask)
        assert torch.equal(second.apply_(wide.clone()), expected)
        expected = logits.clone()
        expected[rows] = apply_bitmask_(logits[rows].clone(), bitmask)
        assert torch.equal(first.apply_(logits.clone()), expected)


@pytest.mark.parametrize('vocab__width', [(128257, 128256), (1000, 977)])
def test_sparse_rows_apply_to_logits_narrower_than_the_grammar_vocabulary(vocab__width):
    """lmdeploy 0.18 widens the grammar's vocabulary to ``len(tokenizer)`` (added tokens past the model's
    vocabulary); the logits keep the model's width. Masks of the wider vocabulary apply to the narrower logits as
    the dense bitmask does: tokens past the logits do not exist there."""
    from lmdeploy_guided_spec.sparse import sparse_rows
    vocab, width = vocab__width
    allowed = torch.rand(4, vocab) < 0.5
    allowed[0] = False
    allowed[0, [3, width - 1, vocab - 1]] = True   # few allowed, one of them past the logits
    allowed[1] = True
    allowed[1, [5, vocab - 1]] = False              # few disallowed, one of them past the logits
    bitmask = pack_bool_mask(allowed)
    logits = torch.randn(6, width)
    rows = [0, 2, 3, 5]
    expected = logits.clone()
    expected[rows] = apply_bitmask_(logits[rows].clone(), bitmask)
    got = sparse_rows(bitmask, rows, vocab).apply_(logits.clone())
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match='address logits'):
        sparse_rows(bitmask, rows, vocab).apply_(torch.randn(6, vocab + 1))


def test_take_rows_equals_torch_indexing_of_a_strided_view():
    gen = torch.Generator().manual_seed(0)
    masks = torch.randint(-2**31, 2**31 - 1, (6, 4, 37), dtype=torch.int32, generator=gen)
    view = masks[:, 2]  # one position of a window's (batch, k + 1, words) buffer
    for rows in ([0, 1, 2, 3, 4, 5], [5, 0, 3], [4], []):
        taken = take_rows(view, rows)
        assert taken.is_contiguous() and torch.equal(taken, view[rows] if rows else view[:0])
    # a copy: later fills of the buffer do not change rows already taken
    taken = take_rows(view, [1])
    view[1].fill_(0)
    assert not torch.equal(taken[0], view[1])


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16, torch.float16])
def test_guard_unsampleable_rows(dtype):
    """Rows with a NaN, a ``+inf`` or no finite value are found; their NaN and ``+inf`` logits become 0, and a row
    that banned everything keeps token 0. The others are untouched (a ``-inf`` among finite values is a banned
    token, not a fault). Sampling the guarded batch goes on, and draws the tokens a grammar's mask left."""
    inf, nan = float('inf'), float('nan')
    logits = torch.randn(7, 40).to(dtype)
    logits[0, 3] = nan
    logits[1] = -inf
    logits[2, 7] = inf
    logits[3, :20] = -inf  # banned tokens: sampleable
    logits[5] = nan
    logits[6] = nan  # a processor's NaN, then a grammar's mask that allows tokens 30 to 32
    logits[6, :30] = -inf
    logits[6, 33:] = -inf
    before = logits.clone()
    bad = guard_unsampleable_(logits)
    assert bad.tolist() == [True, True, True, False, False, True, True]
    assert logits[0, 3] == 0 and logits[2, 7] == 0 and (logits[5] == 0).all()
    for row in (0, 2):
        others = torch.ones(40, dtype=torch.bool)
        others[3 if row == 0 else 7] = False
        assert torch.equal(logits[row][others], before[row][others])
    assert logits[1, 0] == 0 and (logits[1, 1:] == -inf).all()
    assert torch.isfinite(logits[6]).nonzero().flatten().tolist() == [30, 31, 32] and (logits[6, 30:33] == 0).all()
    assert torch.equal(logits[3:5], before[3:5])
    draws = torch.multinomial(logits.float().softmax(-1), 50, replacement=True)
    assert (draws[1] == 0).all() and set(draws[6].tolist()) <= {30, 31, 32}
