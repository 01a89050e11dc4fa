"""The causal multi-token paged decode kernel compiled for the GPU, against the same torch reference as the CPU
engine tests (``tests/engine/test_paged_decode_causal.py``), at realistic sizes; and against FlashAttention-3 on
the same cache where FA3 is installed."""
import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA is not available')]

KV_LENS = (1, 37, 300, 1025, 4097, 64)


@pytest.fixture(scope='module')
def cpu_tests():
    """The CPU test module, for its cache builder and reference."""
    path = Path(__file__).parents[1] / 'engine' / 'test_paged_decode_causal.py'
    spec = importlib.util.spec_from_file_location('paged_decode_causal_reference', path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope='module')
def pa():
    from lmdeploy.pytorch.kernels.cuda import pagedattention
    if 'causal' not in pagedattention._fwd_grouped_split_quant_kernel.arg_names:
        pytest.fail('the installed lmdeploy lacks the causal paged decode patch; run `lmdeploy-guided-spec apply`')
    return pagedattention


def _kv_lens(window_len: int):
    # every request holds at least its window
    return tuple(max(n, window_len) for n in KV_LENS)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('window_len', range(1, 9))
@pytest.mark.parametrize('num_heads,num_kv_heads,head_dim,block_size', [
    (32, 8, 128, 64),
    (16, 16, 64, 16),
    (64, 8, 128, 32),
])
def test_causal_window(cpu_tests, pa, dtype, window_len, num_heads, num_kv_heads, head_dim, block_size):
    atol = 2e-2 if dtype == torch.float16 else 6e-2
    cpu_tests._run(pa, window_len=window_len, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, kv_lens=_kv_lens(window_len), dtype=dtype, device='cuda', atol=atol)


@pytest.mark.parametrize('window_len', [1, 4, 8])
@pytest.mark.parametrize('variant', [
    dict(window=256), dict(window=1000), dict(softcap=30.0), dict(alibi=True), dict(sinks=True),
    dict(quant='int8'), dict(quant='int4'), dict(quant='fp8'), dict(quant='int8', window=300, softcap=30.0),
], ids=lambda v: '-'.join(f'{k}={x}' for k, x in v.items()))
def test_variants(cpu_tests, pa, window_len, variant):
    cpu_tests._run(pa, window_len=window_len, num_heads=32, num_kv_heads=8, head_dim=128, block_size=64,
                   kv_lens=_kv_lens(window_len), device='cuda', atol=3e-2, **variant)


@pytest.mark.parametrize('window_len', [1, 2, 4])
def test_mla_layout_without_flashmla(cpu_tests, pa, window_len):
    """DeepSeek MLA without FlashMLA: one shared K/V head of 576 dims, V its leading 512."""
    cpu_tests._run(pa, window_len=window_len, num_heads=16, num_kv_heads=1, head_dim=576, head_dim_v=512,
                   shared_kv=True, block_size=64, kv_lens=_kv_lens(window_len), device='cuda', atol=3e-2)


@pytest.mark.parametrize('window_len', [2, 4, 8])
def test_non_causal_block_decoding_is_unchanged(cpu_tests, pa, window_len):
    cpu_tests._run(pa, window_len=window_len, num_heads=32, num_kv_heads=8, head_dim=128, block_size=64,
                   kv_lens=_kv_lens(window_len), causal=False, device='cuda')


@pytest.mark.parametrize('window_len', [2, 4, 8])
def test_matches_flash_attention_3(cpu_tests, pa, window_len):
    from lmdeploy.pytorch.backends.cuda.attention import use_fa3
    if not use_fa3:
        pytest.skip('FlashAttention-3 is not installed')
    from lmdeploy.pytorch.third_party.flash_attn_interface import flash_attn_with_kvcache as fa3
    kv_lens = _kv_lens(window_len)
    cache = cpu_tests._build_cache(kv_lens, 8, 128, 128, 64, 'none', False, dtype=torch.bfloat16, device='cuda')
    batch = len(kv_lens)
    q = torch.randn(batch * window_len, 32, 128, dtype=torch.bfloat16, device='cuda')
    triton_out = pa.flash_attn_with_kvcache(q, cache['k_cache'], cache['v_cache'], cache_seqlens=cache['kv_lens'],
                                           page_table=cache['page_table'], max_seqlen_q=window_len, causal=True)
    fa3_out = fa3(q.unflatten(0, (batch, window_len)), cache['k_cache'], cache['v_cache'],
                  cache_seqlens=cache['kv_lens'].to(torch.int32), page_table=cache['page_table'].to(torch.int32),
                  causal=True)
    torch.testing.assert_close(triton_out.float(), fa3_out.flatten(0, 1).float(), atol=3e-2, rtol=3e-2)
