"""The CPU path's backend for lmdeploy 0.14: the op backend the selector hands out, and the rejection sampler.

The op backend subclasses lmdeploy's ``CudaOpsBackend``, so the attention metadata, the step-context update and
everything not listed here stay lmdeploy's own. What changes:

- paged attention: lmdeploy's ``TritonAttentionImpl`` (its own cache filling and prefill/decoding dispatch) with
  its four Triton kernels swapped for the torch implementations in :mod:`.kernels`;
- fused MoE: lmdeploy's ``TritonFusedMoEImpl`` with its Triton kernel swapped for :func:`.kernels.fused_moe`;
- every other layer the CUDA backend builds with Triton (RMS norm, rotary embedding, SiLU-and-mul, multinomial
  sampling, the noaux-tc router) comes from lmdeploy's torch ``DefaultOpsBackend``;
- no CUDA graphs: the plain eager ``GraphRunner``, which captures nothing and so warms up no batch sizes.

The rejection sampler (``lmdeploy/pytorch/spec_decode/reject_sampler.py``) launches three Triton kernels; their
torch equivalents in :mod:`.kernels` are launched instead (:func:`install`).
"""
from __future__ import annotations

from lmdeploy.pytorch.backends.base import OpType
from lmdeploy.pytorch.backends.cuda.attention import TritonAttentionBuilder
from lmdeploy.pytorch.backends.cuda.attention.default import TritonAttentionImpl
from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend
from lmdeploy.pytorch.backends.default import DefaultOpsBackend

from . import kernels
from .backend_common import CpuAttentionKernels, CpuBackendMixin, CpuFusedMoEForward, CpuGraphRunner

__all__ = ['CpuOpsBackend', 'CpuAttentionImpl', 'CpuAttentionBuilder', 'CpuGraphRunner', 'TORCH_OPS', 'CPU_OPS',
           'install', 'replaced']

#: Layers built by lmdeploy's torch ``DefaultOpsBackend`` instead of the CUDA backend's Triton builders.
TORCH_OPS = (OpType.RMSNorm, OpType.ApplyRotaryEmb, OpType.SiluAndMul, OpType.MultinomialSampling,
             OpType.RouterNoauxTC, OpType.Linear, OpType.RotaryEmbedding, OpType.GeluAndMul, OpType.LayerNorm,
             OpType.SoftmaxTopK, OpType.Embedding)
#: Layers built here: lmdeploy's implementation classes with torch kernels.
CPU_OPS = (OpType.PagedAttention, OpType.FusedMoE)


class CpuAttentionImpl(CpuAttentionKernels, TritonAttentionImpl):
    """lmdeploy's Triton attention layer with its kernels (fill, paged decode, flatten, varlen prefill) in torch."""


class CpuAttentionBuilder(TritonAttentionBuilder):
    """Builds :class:`CpuAttentionImpl` (FlashMLA and FlashAttention-3 do not exist on a CPU)."""

    @staticmethod
    def build(num_heads: int, head_size: int, scale: float = None, num_kv_heads: int = None,
              v_head_size: int = None, alibi: bool = False, sliding_window: int = None,
              logit_softcapping: float = 0.0, causal: bool = True, use_flash_mla: bool = False,
              learnable_sink: bool = False, block_sparse_size: int = 1, **kwargs) -> CpuAttentionImpl:
        from lmdeploy.pytorch.backends.cuda.attention import _normalize_sliding_window
        if alibi or learnable_sink or block_sparse_size != 1 or use_flash_mla:
            raise NotImplementedError('the CPU attention supports plain causal attention (with sliding window and '
                                      'softcapping) only')
        return CpuAttentionImpl(num_heads=num_heads, head_size=head_size, scale=scale, num_kv_heads=num_kv_heads,
                                v_head_size=v_head_size, alibi=alibi,
                                sliding_window=_normalize_sliding_window(sliding_window),
                                logit_softcapping=logit_softcapping, causal=causal,
                                block_sparse_size=block_sparse_size, **kwargs)


class CpuFusedMoEBuilder:
    """Builds lmdeploy's ``TritonFusedMoEImpl`` running :func:`.kernels.fused_moe`."""

    @staticmethod
    def build(top_k: int, num_experts: int, renormalize: bool = False, hidden_dim: int = 1, ep_size: int = 1,
              ep_group=None, layer_idx: int = 0, out_dtype=None):
        from lmdeploy.pytorch.backends.cuda.moe import default as cuda_moe
        if ep_size > 1:
            raise NotImplementedError('the CPU path has no expert parallelism')

        class CpuFusedMoEImpl(CpuFusedMoEForward, cuda_moe.TritonFusedMoEImpl):
            pass

        return CpuFusedMoEImpl(top_k, num_experts, renormalize)


class CpuOpsBackend(CpuBackendMixin, CudaOpsBackend):
    """lmdeploy's CUDA op backend with torch kernels and eager execution, for CPU tensors."""

    @classmethod
    def get_layer_impl_builder(cls, layer_type: OpType):
        if layer_type == OpType.PagedAttention:
            return CpuAttentionBuilder
        if layer_type == OpType.FusedMoE:
            return CpuFusedMoEBuilder
        if layer_type in TORCH_OPS:
            return DefaultOpsBackend.get_layer_impl_builder(layer_type)
        raise NotImplementedError(f'{layer_type} has no CPU implementation')


def _patch_rejection_sampler() -> None:
    from lmdeploy.pytorch.spec_decode import reject_sampler

    for name, fn in (('rejection_greedy_sample_kernel', kernels.rejection_greedy_sample),
                     ('rejection_random_sample_kernel', kernels.rejection_random_sample),
                     ('sample_recovered_tokens_kernel', kernels.sample_recovered_tokens)):
        current = getattr(reject_sampler, name)
        if not isinstance(current, kernels.TorchLaunch):
            setattr(reject_sampler, name, kernels.TorchLaunch(fn, replaced=current))


def install() -> None:
    """What lmdeploy 0.14 needs beyond the shared CPU path (idempotent): the rejection sampler's kernels."""
    _patch_rejection_sampler()


def replaced() -> dict[str, list[str]]:
    """What this module replaces, by kind (for :func:`lmdeploy_guided_spec.cpu.replacements`)."""
    return {
        'ops with torch kernels (lmdeploy implementation classes kept)': [op.name for op in CPU_OPS],
        "ops from lmdeploy's default torch backend": [op.name for op in TORCH_OPS],
        "Triton kernels launched by lmdeploy's rejection sampler, as torch": [
            'reject_sampler.rejection_greedy_sample_kernel', 'reject_sampler.rejection_random_sample_kernel',
            'reject_sampler.sample_recovered_tokens_kernel'],
    }
