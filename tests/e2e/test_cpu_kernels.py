"""The torch kernels of the CPU path against the lmdeploy Triton kernels they replace (run by the interpreter)."""
import pytest
import torch
import triton
import triton.language as tl

from lmdeploy_guided_spec.cpu import kernels


@triton.jit
def _log2(x):
    return tl.log2(x)


@triton.jit
def _exp2(x):
    return tl.exp2(x)


@triton.jit
def _tanh(x):
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x >= 0, t, -t)


@pytest.fixture
def interpretable(monkeypatch):
    """lmdeploy's attention kernel modules, runnable by the Triton interpreter: lmdeploy binds ``tl.log2``,
    ``tl.exp2`` and libdevice's ``tanh`` to module names the interpreter does not swap for its own."""
    from lmdeploy.pytorch.kernels.cuda import flashattention, pagedattention
    for module in (pagedattention, flashattention):
        monkeypatch.setattr(module, 'tl_log2', _log2)
        monkeypatch.setattr(module, 'tl_exp2', _exp2)
        monkeypatch.setattr(module, 'tanh', _tanh)
    monkeypatch.setattr(pagedattention, 'get_device_props',
                        lambda device=None: dict(multi_processor_count=4, warps_per_sm=64, blocks_per_sm=32))


def _triton(name):
    from lmdeploy.pytorch.spec_decode import reject_sampler
    kernel = getattr(reject_sampler, name)
    return kernel.replaced if isinstance(kernel, kernels.TorchLaunch) else kernel


@pytest.fixture(autouse=True)
def _cpu(cpu_path):
    return cpu_path


@pytest.mark.parametrize('greedy_rows', [None, [True, False, True, False, False]])
def test_rejection_greedy_kernel(greedy_rows):
    g = torch.Generator().manual_seed(1)
    batch, k = 5, 4
    target = torch.randint(0, 6, (batch, k), generator=g)
    draft = torch.where(torch.rand(batch, k, generator=g) < 0.7, target, torch.randint(0, 6, (batch, k), generator=g))
    bonus = torch.randint(0, 6, (batch, ), generator=g)
    is_greedy = None if greedy_rows is None else torch.tensor(greedy_rows)
    ours, theirs = (torch.full((batch, k + 1), -1, dtype=torch.long) for _ in range(2))
    kernels.rejection_greedy_sample(ours, draft, target, bonus, is_greedy, k)
    _triton('rejection_greedy_sample_kernel')[(batch, )](theirs, draft, target, bonus, is_greedy, k)
    assert torch.equal(ours, theirs)


def test_rejection_kernels_refuse_flags_of_draft_positions():
    """Defect 1 of the deployment issue: one greedy flag per draft position (batch x k) would be misread by the
    Triton kernels, which index the flags by request; the CPU path says so instead of guessing."""
    batch, k = 2, 3
    draft = torch.zeros(batch, k, dtype=torch.long)
    out = torch.full((batch, k + 1), -1, dtype=torch.long)
    flags = torch.tensor([True] * k + [False] * k)
    with pytest.raises(ValueError, match='one flag per request'):
        kernels.rejection_greedy_sample(out, draft, draft, torch.zeros(batch, dtype=torch.long), flags, k)
    probs = torch.full((batch, k, 8), 1 / 8)
    with pytest.raises(ValueError, match='one flag per request'):
        kernels.rejection_random_sample(out, draft, None, probs, torch.zeros(batch, dtype=torch.long), draft,
                                        torch.rand(batch, k, dtype=torch.float64), flags, k, 8)


@pytest.mark.parametrize('with_draft_probs', [False, True])
@pytest.mark.parametrize('greedy_rows', [None, [False, True, False, False]])
def test_rejection_random_and_recovered_kernels(with_draft_probs, greedy_rows):
    g = torch.Generator().manual_seed(2)
    batch, k, vocab = 4, 3, 300
    target_probs = torch.rand(batch, k, vocab, generator=g).softmax(-1).contiguous()
    draft_probs = torch.rand(batch, k, vocab, generator=g).softmax(-1).contiguous() if with_draft_probs else None
    draft = torch.randint(0, vocab, (batch, k), generator=g)
    bonus = torch.randint(0, vocab, (batch, ), generator=g)
    no_draft = draft_probs is None
    # thresholds around the acceptance ratios, so that some windows are accepted in part and some rejected at once
    uniform = torch.rand(batch, k, generator=g, dtype=torch.float64) * (2.0 / vocab if no_draft else 2.0)
    inv_q = torch.empty(batch, vocab).exponential_(generator=g).reciprocal()
    is_greedy = None if greedy_rows is None else torch.tensor(greedy_rows)

    recovered = [torch.empty(batch, k, dtype=torch.long) for _ in range(2)]
    kernels.sample_recovered_tokens(recovered[0], draft, draft_probs, target_probs, inv_q, k, vocab, 64,
                                    NO_DRAFT_PROBS=no_draft)
    _triton('sample_recovered_tokens_kernel')[(batch, k)](recovered[1], draft, draft_probs, target_probs, inv_q, k,
                                                          vocab, 64, NO_DRAFT_PROBS=no_draft)
    assert torch.equal(recovered[0], recovered[1])

    outputs = [torch.full((batch, k + 1), -1, dtype=torch.long) for _ in range(2)]
    kernels.rejection_random_sample(outputs[0], draft, draft_probs, target_probs, bonus, recovered[0], uniform,
                                    is_greedy, k, vocab, NO_DRAFT_PROBS=no_draft)
    _triton('rejection_random_sample_kernel')[(batch, )](outputs[1], draft, draft_probs, target_probs, bonus,
                                                         recovered[0], uniform, is_greedy, k, vocab,
                                                         NO_DRAFT_PROBS=no_draft)
    assert torch.equal(outputs[0], outputs[1])
    # the case mix this test is about: some windows accepted in part, some rejected at once
    accepted = (outputs[0] >= 0).sum(1)
    assert len(set(accepted.tolist())) > 1


def _paged(batch_lens, heads, dim, block, gen, dim_v=None):
    """Random keys/values of the given lengths, written into a shuffled paged cache."""
    dim_v = dim_v or dim
    blocks_per = [(n + block - 1) // block for n in batch_lens]
    order = torch.randperm(sum(blocks_per) + 2, generator=gen)
    offsets = torch.zeros(len(batch_lens), max(blocks_per), dtype=torch.long)
    used = 0
    for b, nb in enumerate(blocks_per):
        offsets[b, :nb] = order[used:used + nb]
        used += nb
    k_cache = torch.zeros(order.numel(), block, heads, dim)
    v_cache = torch.zeros(order.numel(), block, heads, dim_v)
    keys = [torch.randn(n, heads, dim, generator=gen) for n in batch_lens]
    values = [torch.randn(n, heads, dim_v, generator=gen) for n in batch_lens]
    for b, n in enumerate(batch_lens):
        for pos in range(n):
            k_cache[offsets[b, pos // block], pos % block] = keys[b][pos]
            v_cache[offsets[b, pos // block], pos % block] = values[b][pos]
    return k_cache, v_cache, offsets, keys, values


@pytest.mark.parametrize('window', [1, 3])
def test_paged_decode_attention(interpretable, window):
    from lmdeploy.pytorch.kernels.cuda.pagedattention import flash_attn_with_kvcache
    g = torch.Generator().manual_seed(3)
    lens = [5, 19, 33]
    k_cache, v_cache, offsets, _, _ = _paged(lens, heads=2, dim=32, block=16, gen=g)
    q = torch.randn(len(lens) * window, 4, 32, generator=g)
    seqlens = torch.tensor(lens)
    args = dict(cache_seqlens=seqlens, page_table=offsets, max_seqlen_q=window, softmax_scale=0.2, causal=True)
    ours = kernels.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    theirs = flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    torch.testing.assert_close(ours, theirs, atol=2e-5, rtol=1e-4)


def test_fill_kv_cache():
    from lmdeploy.pytorch.kernels.cuda import fill_kv_cache
    g = torch.Generator().manual_seed(4)
    q_lens, history = torch.tensor([3, 1, 7]), torch.tensor([14, 0, 20])
    kv_lens = q_lens + history
    _, _, offsets, _, _ = _paged(kv_lens.tolist(), heads=2, dim=16, block=8, gen=g)
    k_states = torch.randn(int(q_lens.sum()), 2, 16, generator=g)
    v_states = torch.randn(int(q_lens.sum()), 2, 16, generator=g)
    start = q_lens.cumsum(0) - q_lens
    caches = [(torch.zeros(offsets.max() + 1, 8, 2, 16), torch.zeros(offsets.max() + 1, 8, 2, 16)) for _ in range(2)]
    kernels.fill_kv_cache(k_states, v_states, *caches[0], start, q_lens, kv_lens, 7, offsets)
    fill_kv_cache(k_states, v_states, *caches[1], start, q_lens, kv_lens, 7, offsets)
    assert torch.equal(caches[0][0], caches[1][0]) and torch.equal(caches[0][1], caches[1][1])


def test_prefill_attention_over_the_flattened_cache(interpretable):
    from lmdeploy.pytorch.kernels.cuda import flash_attn_varlen_func, flatten_kv_cache
    g = torch.Generator().manual_seed(5)
    kv_lens, q_lens = torch.tensor([9, 30]), torch.tensor([4, 30])
    k_cache, v_cache, offsets, _, _ = _paged(kv_lens.tolist(), heads=1, dim=32, block=16, gen=g)
    start = kv_lens.cumsum(0) - kv_lens
    q = torch.randn(int(q_lens.sum()), 2, 32, generator=g)
    cu_q = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).int()
    cu_k = torch.nn.functional.pad(kv_lens.cumsum(0), (1, 0)).int()
    outs = []
    for flatten, attend in ((kernels.flatten_kv_cache, kernels.flash_attn_varlen_func),
                            (flatten_kv_cache, flash_attn_varlen_func)):
        k, v = flatten(k_cache, v_cache, kv_lens, offsets, start_loc=start, out_size=64, flatten_kv_layout='hsd')
        outs.append(attend(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=30, max_seqlen_k=30,
                           softmax_scale=0.15, causal=True, kv_layout='hsd'))
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=1e-4)


def test_fused_moe():
    # lmdeploy's Triton MoE kernel autotunes, which needs a GPU benchmarker; compare with the plain definition
    g = torch.Generator().manual_seed(6)
    tokens, hidden, inter, experts, topk = 5, 32, 16, 4, 2
    x = torch.randn(tokens, hidden, generator=g)
    w1 = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    w2 = torch.randn(experts, hidden, inter, generator=g) * 0.1
    weights, ids = torch.rand(tokens, experts, generator=g).softmax(-1).topk(topk)
    ours = kernels.fused_moe(x, w1, w2, weights, ids, topk, renormalize=True)
    expected = torch.zeros(tokens, hidden)
    for t in range(tokens):
        for slot in range(topk):
            e = int(ids[t, slot])
            gate, up = (w1[e] @ x[t]).chunk(2)
            expected[t] += weights[t, slot] / weights[t].sum() * (w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-4)
