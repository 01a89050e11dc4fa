"""Causal multi-token paged decoding in lmdeploy's Triton kernel, against a plain torch reference.

Speculative verification runs the target model on a window of ``s`` tokens per request (the last committed token
plus the drafts) against the paged KV cache; token ``t`` of the window may attend to the KV positions
``< kv_seqlen - s + t + 1``. The series teaches ``flash_attn_with_kvcache`` that mask (``causal=True``) so
speculative decoding runs without FlashAttention-3. Every case fills the cache with lmdeploy's own
``fill_kv_cache`` (which quantizes for the int4/int8/fp8 policies) and reads it back with lmdeploy's
``flatten_kv_cache`` for the reference, so the reference attends to exactly the values the kernel dequantizes.

The kernels run under the Triton interpreter on CPU tensors; sizes are tiny so the module stays fast.
"""
import math

import pytest
import torch
import triton
import triton.language as tl

pytestmark = [
    pytest.mark.engine,
    # lmdeploy's int8/int4 fill kernel divides 0 by 0 (and casts the nan) on the padding lanes of a block; those
    # lanes are never stored
    pytest.mark.filterwarnings('ignore:invalid value encountered:RuntimeWarning'),
]

#: (batch, kv lengths) used by most cases: a short request, one spanning several blocks, one just over a block
KV_LENS = (9, 37, 17)


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


@pytest.fixture(scope='module')
def pa():
    """lmdeploy's paged attention module, made runnable by the Triton interpreter.

    lmdeploy binds ``tl.log2``/``tl.exp2`` and libdevice's ``tanh`` to module-level names when it is imported;
    the interpreter only swaps in its CPU implementations for names it reaches through ``tl``, and has no
    libdevice at all. The kernels also ask CUDA for the device capability and SM count to pick launch
    parameters. Stand-ins for those five names, for this module only.
    """
    from lmdeploy.pytorch.kernels.cuda import pagedattention

    if 'causal' not in pagedattention._fwd_grouped_split_quant_kernel.arg_names:
        pytest.fail('the installed lmdeploy lacks the causal paged decode patch; run `lmdeploy-guided-spec apply`')
    patch = pytest.MonkeyPatch()
    patch.setattr(pagedattention, 'tl_log2', _log2)
    patch.setattr(pagedattention, 'tl_exp2', _exp2)
    patch.setattr(pagedattention, 'tanh', _tanh)
    # launch parameters of an SM90 part with few SMs: SPLIT_K = 4, so windows straddle split boundaries
    # (lmdeploy 0.14 caches the capability in _nv_cap; 0.18 reads it from the device properties)
    patch.setattr(pagedattention, '_nv_cap', (9, 0), raising=False)
    patch.setattr(pagedattention, 'get_device_props',
                  lambda device=None: dict(multi_processor_count=4, warps_per_sm=64, blocks_per_sm=32,
                                           compute_capability=(9, 0)))
    yield pagedattention
    patch.undo()


def _alibi_slopes(num_heads: int) -> torch.Tensor:
    # lmdeploy's own recipe is for powers of two; any positive slopes exercise the kernel
    return torch.tensor([2**(-8 * (h + 1) / num_heads) for h in range(num_heads)], dtype=torch.float32)


def _build_cache(kv_lens, num_kv_heads: int, head_dim: int, head_dim_v: int, block_size: int, quant: str,
                 shared_kv: bool, dtype=torch.float16, device='cpu'):
    """Random K/V written into a shuffled paged cache by lmdeploy's fill_kv_cache; returns the cache and the
    dequantized contiguous K/V ``[kv_heads, total, dim]`` that lmdeploy's flatten_kv_cache reads back."""
    from lmdeploy.messages import QuantPolicy
    from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache
    from lmdeploy.pytorch.kernels.cuda.flatten_kv_cache import flatten_kv_cache

    policy = {'none': QuantPolicy.NONE, 'int4': QuantPolicy.INT4, 'int8': QuantPolicy.INT8,
              'fp8': QuantPolicy.FP8}[quant]
    kv_lens_t = torch.tensor(kv_lens, dtype=torch.long, device=device)
    batch = len(kv_lens)
    total = int(kv_lens_t.sum())
    blocks_per_req = max(math.ceil(n / block_size) for n in kv_lens)
    num_blocks = batch * blocks_per_req + 1
    # a shuffled page table: request pages are neither contiguous nor in order
    page_table = (torch.randperm(num_blocks - 1)[:batch * blocks_per_req] + 1).view(batch, blocks_per_req).to(device)

    k_states = torch.randn(total, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_states = k_states[..., :head_dim_v] if shared_kv else torch.randn(total, num_kv_heads, head_dim_v,
                                                                        dtype=dtype, device=device)
    pack = 2 if policy == QuantPolicy.INT4 else 1
    cache_dtype = {'none': dtype, 'int4': torch.uint8, 'int8': torch.uint8, 'fp8': torch.float8_e4m3fn}[quant]
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim // pack, dtype=cache_dtype, device=device)
    if shared_kv:
        v_cache = k_cache[..., :head_dim_v]
        v_fill = None
    else:
        v_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim_v // pack, dtype=cache_dtype,
                              device=device)
        v_fill = v_states
    k_sz = v_sz = None
    if policy in (QuantPolicy.INT4, QuantPolicy.INT8):
        k_sz = torch.zeros(num_blocks, block_size, num_kv_heads, 2, dtype=dtype, device=device)
        v_sz = torch.zeros(num_blocks, block_size, num_kv_heads, 2, dtype=dtype, device=device)
    elif policy == QuantPolicy.FP8:
        k_sz = torch.tensor(k_states.abs().max().item() / 448.0, dtype=torch.float32, device=device)
        v_sz = torch.tensor(v_states.abs().max().item() / 448.0, dtype=torch.float32, device=device)
    start = kv_lens_t.cumsum(0) - kv_lens_t
    fill_kv_cache(k_states, v_fill, k_cache, v_cache, start, kv_lens_t, kv_seq_length=kv_lens_t,
                  max_q_seq_length=max(kv_lens), block_offsets=page_table, k_scales_zeros=k_sz,
                  v_scales_zeros=v_sz, quant_policy=policy)
    if shared_kv:
        k_flat = flatten_kv_cache(k_cache, k_cache, kv_lens_t, page_table, out_dtype=dtype)[0]
        v_flat = k_flat[..., :head_dim_v]
    else:
        k_flat, v_flat = flatten_kv_cache(k_cache, v_cache, kv_lens_t, page_table, out_dtype=dtype,
                                          k_scales_zeros=k_sz, v_scales_zeros=v_sz, quant_policy=policy)
    return dict(k_cache=k_cache, v_cache=v_cache, k_sz=k_sz, v_sz=v_sz, policy=policy, page_table=page_table,
                kv_lens=kv_lens_t, start=start, k_flat=k_flat.float(), v_flat=v_flat.float())


def _reference(q, cache, window_len: int, *, causal: bool, scale: float, window: int = -1, softcap: float = -1,
               alibi_slopes=None, sinks=None):
    """Plain torch attention of every window token over the KV positions it may see."""
    num_heads = q.size(1)
    num_kv_heads = cache['k_flat'].size(0)
    group = num_heads // num_kv_heads
    out = []
    for b, (kv_len, start) in enumerate(zip(cache['kv_lens'].tolist(), cache['start'].tolist())):
        k = cache['k_flat'][:, start:start + kv_len].repeat_interleave(group, 0)  # [heads, kv_len, d]
        v = cache['v_flat'][:, start:start + kv_len].repeat_interleave(group, 0)
        for t in range(window_len):
            qt = q[b * window_len + t].float()  # [heads, d]
            q_pos = kv_len - window_len + t if causal else kv_len - 1
            pos = torch.arange(kv_len, device=q.device)
            visible = pos <= q_pos
            if window > 0:
                visible &= pos >= q_pos - window
            s = torch.einsum('hd,hnd->hn', qt, k) * scale
            if softcap > 0:
                s = torch.tanh(s / softcap) * softcap
            if alibi_slopes is not None:
                s = s - alibi_slopes[:, None] * (q_pos - pos).abs()[None, :]
            s = s.masked_fill(~visible[None, :], float('-inf'))
            if sinks is not None:
                s = torch.cat([s, sinks.float()[:, None]], dim=1)
            p = torch.softmax(s, dim=-1)[:, :kv_len]
            out.append(torch.einsum('hn,hnd->hd', p, v))
    return torch.stack(out)


def _run(pa, *, window_len: int, num_heads: int, num_kv_heads: int, head_dim: int = 32, head_dim_v: int = None,
         block_size: int = 16, quant: str = 'none', shared_kv: bool = False, causal: bool = True, window: int = -1,
         softcap: float = -1, alibi: bool = False, sinks: bool = False, kv_lens=KV_LENS,
         seqlens_dtype=torch.long, atol: float = 2e-2, dtype=torch.float16, device='cpu'):
    """Fill a cache, run the kernel on a window of ``window_len`` tokens per request and compare; also used by
    ``tests/gpu`` with ``device='cuda'``."""
    head_dim_v = head_dim if head_dim_v is None else head_dim_v
    cache = _build_cache(kv_lens, num_kv_heads, head_dim, head_dim_v, block_size, quant, shared_kv, dtype=dtype,
                         device=device)
    batch = len(kv_lens)
    q = torch.randn(batch * window_len, num_heads, head_dim, dtype=dtype, device=device)
    scale = head_dim**-0.5
    alibi_slopes = _alibi_slopes(num_heads).to(device) if alibi else None
    sink_values = torch.randn(num_heads, dtype=torch.float32, device=device) if sinks else None
    out = pa.flash_attn_with_kvcache(q, cache['k_cache'], cache['v_cache'],
                                     cache_seqlens=cache['kv_lens'].to(seqlens_dtype),
                                     page_table=cache['page_table'], max_seqlen_q=window_len, softmax_scale=scale,
                                     causal=causal, window_size=window, softcap=softcap, alibi_slopes=alibi_slopes,
                                     sinks=sink_values, quant_policy=cache['policy'], k_scales_zeros=cache['k_sz'],
                                     v_scales_zeros=cache['v_sz'])
    ref = _reference(q, cache, window_len, causal=causal, scale=scale, window=window, softcap=softcap,
                     alibi_slopes=alibi_slopes, sinks=sink_values)
    assert out.shape == (batch * window_len, num_heads, head_dim_v)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=2e-2)
    return out, ref


# window length x (heads, kv heads) x block size x kv length dtype: each window length once, the GQA ratios 1, 2, 4
# and 8, both block sizes and both kv length dtypes (int32 in CUDA graph buffers, int64 in eager steps) spread
# over them
BASE = [
    (1, 4, 4, 16, torch.long),
    (2, 4, 2, 32, torch.int32),
    (3, 8, 2, 16, torch.long),
    (4, 8, 1, 16, torch.int32),
    (5, 4, 4, 32, torch.long),
    (6, 4, 1, 16, torch.int32),
    (7, 8, 4, 32, torch.int32),
    (8, 8, 2, 16, torch.long),
]


@pytest.mark.parametrize('window_len,num_heads,num_kv_heads,block_size,seqlens_dtype', BASE,
                         ids=[f's{w}-h{h}-kv{kv}-bs{bs}-{str(d).split(".")[-1]}' for w, h, kv, bs, d in BASE])
def test_causal_window_matches_reference(pa, window_len, num_heads, num_kv_heads, block_size, seqlens_dtype):
    _run(pa, window_len=window_len, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
         seqlens_dtype=seqlens_dtype)


def test_window_rows_differ_from_the_non_causal_kernel(pa):
    """Regression for the unpatched behaviour: every window token used to see the whole cache."""
    out, _ = _run(pa, window_len=4, num_heads=4, num_kv_heads=2)
    torch.manual_seed(0)
    out_nc, _ = _run(pa, window_len=4, num_heads=4, num_kv_heads=2, causal=False)
    # same seed, same inputs: the tokens before the last of each window see less of the cache than before
    last = torch.arange(out.size(0)) % 4 == 3
    assert not torch.allclose(out[~last], out_nc[~last], atol=1e-2)
    from lmdeploy import __version__
    if __version__.startswith('0.14.'):
        # lmdeploy 0.14's non-causal multi-token decode is full-cache attention for every token, so the last
        # window token agrees; 0.18's differs from that (and the series leaves it as the pristine kernel computes it)
        torch.testing.assert_close(out[last], out_nc[last])


@pytest.mark.parametrize('window_len', [1, 4])
def test_non_causal_block_decoding_is_unchanged(pa, window_len):
    """``causal=False`` keeps lmdeploy's block-sparse (dLLM) decoding: every token sees the whole cache."""
    _run(pa, window_len=window_len, num_heads=4, num_kv_heads=2, causal=False)


@pytest.mark.parametrize('window_len,window', [(3, 8), (8, 5), (5, 20)])
def test_sliding_window(pa, window_len, window):
    # each window token has its own window start; 20 spans a block boundary of the 37-token request
    _run(pa, window_len=window_len, num_heads=4, num_kv_heads=2, window=window)


@pytest.mark.parametrize('window_len', [2, 6])
def test_softcap(pa, window_len):
    _run(pa, window_len=window_len, num_heads=4, num_kv_heads=2, softcap=2.0)


@pytest.mark.parametrize('window_len', [3, 8])
def test_alibi(pa, window_len):
    _run(pa, window_len=window_len, num_heads=8, num_kv_heads=8, alibi=True)


@pytest.mark.parametrize('window_len', [4, 7])
def test_sinks(pa, window_len):
    _run(pa, window_len=window_len, num_heads=4, num_kv_heads=2, sinks=True)


@pytest.mark.parametrize('window_len', [1, 4])
def test_shared_kv_split_head_dim(pa, window_len):
    """MLA layout without FlashMLA: V is the leading part of K, K's dim is not a power of two (48 = 32 + 16)."""
    _run(pa, window_len=window_len, num_heads=8, num_kv_heads=1, head_dim=48, head_dim_v=32, shared_kv=True)


@pytest.mark.parametrize('quant,window_len,num_heads,num_kv_heads,block_size', [
    ('int8', 1, 4, 2, 16),
    ('int8', 5, 8, 2, 32),
    ('int4', 3, 4, 4, 16),
    ('int4', 8, 8, 1, 16),
    ('fp8', 2, 4, 2, 16),
    ('fp8', 6, 8, 4, 32),
])
def test_quantized_cache(pa, quant, window_len, num_heads, num_kv_heads, block_size):
    _run(pa, window_len=window_len, num_heads=num_heads, num_kv_heads=num_kv_heads, block_size=block_size,
         quant=quant)


@pytest.mark.parametrize('quant', ['int8', 'int4'])
def test_quantized_cache_with_window_and_softcap(pa, quant):
    _run(pa, window_len=4, num_heads=4, num_kv_heads=2, quant=quant, window=12, softcap=2.0)


@pytest.mark.parametrize('window_len,num_heads,num_kv_heads', [(1, 4, 2), (4, 4, 2), (6, 8, 1)])
def test_backend_decodes_a_speculative_window_causally(pa, window_len, num_heads, num_kv_heads):
    """The attention backend without FA3: a decoding step of ``window_len`` tokens per request writes the window's
    K/V into the cache and each token attends causally, exactly as the last rows of a causal prefill would."""
    from lmdeploy.pytorch.backends.cuda.attention import TritonAttentionBuilder, use_fa3_spec_decoding
    from lmdeploy.pytorch.backends.cuda.attention.default import TritonAttentionImpl, TritonAttentionMetadata
    from lmdeploy.pytorch.kernels.cuda.fill_kv_cache import fill_kv_cache

    assert not use_fa3_spec_decoding()
    head_dim, block_size = 32, 16
    impl = TritonAttentionBuilder.build(num_heads=num_heads, head_size=head_dim, num_kv_heads=num_kv_heads)
    assert type(impl) is TritonAttentionImpl
    history = torch.tensor([5, 30, 16])
    kv_lens = history + window_len
    batch = len(history)
    blocks_per_req = math.ceil(int(kv_lens.max()) / block_size)
    page_table = (torch.randperm(batch * blocks_per_req) + 1).view(batch, blocks_per_req)
    k_cache = torch.zeros(batch * blocks_per_req + 1, block_size, num_kv_heads, head_dim, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    keys = [torch.randn(int(n), num_kv_heads, head_dim, dtype=torch.float16) for n in kv_lens]
    values = [torch.randn(int(n), num_kv_heads, head_dim, dtype=torch.float16) for n in kv_lens]
    # the history was written by earlier steps
    hist_start = history.cumsum(0) - history
    fill_kv_cache(torch.cat([k[:h] for k, h in zip(keys, history.tolist())]),
                  torch.cat([v[:h] for v, h in zip(values, history.tolist())]), k_cache, v_cache, hist_start, history,
                  kv_seq_length=history, max_q_seq_length=int(history.max()), block_offsets=page_table)

    query = torch.randn(batch * window_len, num_heads, head_dim, dtype=torch.float16)
    q_seqlens = torch.full((batch, ), window_len)
    meta = TritonAttentionMetadata(is_decoding=True, block_offsets=page_table,
                                   q_start_loc=torch.arange(batch) * window_len, q_seqlens=q_seqlens,
                                   kv_seqlens=kv_lens, cu_seqlens_q=torch.arange(batch + 1) * window_len)
    out = impl.forward(query, torch.cat([k[-window_len:] for k in keys]), torch.cat([v[-window_len:] for v in values]),
                       k_cache, v_cache, meta)

    group = num_heads // num_kv_heads
    ref = []
    for b in range(batch):
        k = keys[b].float().repeat_interleave(group, 1)
        v = values[b].float().repeat_interleave(group, 1)
        for t in range(window_len):
            q_pos = int(history[b]) + t
            s = torch.einsum('hd,nhd->hn', query[b * window_len + t].float(), k[:q_pos + 1]) * head_dim**-0.5
            ref.append(torch.einsum('hn,nhd->hd', torch.softmax(s, -1), v[:q_pos + 1]))
    torch.testing.assert_close(out.float(), torch.stack(ref), atol=2e-2, rtol=2e-2)
