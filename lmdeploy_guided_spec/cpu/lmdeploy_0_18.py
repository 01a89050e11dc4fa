"""The CPU path's backend for lmdeploy 0.18: the op backend the selector hands out.

lmdeploy 0.18 builds every layer through ``OpsBackend.build_op(BuildSpec)`` (0.14 had per-type layer builders),
prepares each step's metadata through a plan collected while the model is built (``CudaStepMetaPlan``), runs
rejection sampling as a backend op, and keeps its graph runners in a package whose ``CUDAGraphRunner`` refuses
speculative decoding without FlashAttention-3, eager mode included. The op backend here subclasses lmdeploy's
``CudaOpsBackend``; what changes:

- paged attention: lmdeploy's ``TritonAttentionImpl`` (its own cache filling and prefill/decoding dispatch) with
  its four Triton kernels swapped for the torch implementations in :mod:`.kernels`. A decoding step may carry a
  speculative window of several tokens per request; each token sees the cache up to its own position (causal
  window), which is what lmdeploy hands to FlashAttention-3 on a GPU;
- fused MoE: lmdeploy's ``TritonFusedMoEImpl`` with its Triton kernel swapped for :func:`.kernels.fused_moe`;
- rejection sampling: lmdeploy's own torch implementation from the ``DefaultOpsBackend``;
- every other layer the CUDA backend builds with Triton (RMS norm, rotary embedding, SiLU-and-mul, multinomial
  sampling, the noaux-tc router) comes from lmdeploy's torch ``DefaultOpsBackend``;
- step metadata: lmdeploy's Triton attention metadata; the FlashMLA/FlashAttention-3 preparation (and its FA3
  requirement for speculative decoding) is not reached, since neither exists on a CPU;
- no CUDA graphs and no kernel warmup: the plain eager ``GraphRunner``, which captures nothing and so warms up no
  batch sizes.
"""
from __future__ import annotations

from lmdeploy.pytorch.backends.attention import PagedAttentionBuildSpec
from lmdeploy.pytorch.backends.cuda.attention.default import TritonAttentionImpl, TritonAttentionMetaBuilder
from lmdeploy.pytorch.backends.cuda.moe.default import TritonFusedMoEImpl
from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend
from lmdeploy.pytorch.backends.default import DefaultOpsBackend
from lmdeploy.pytorch.backends.moe import FusedMoEBuildSpec

from .backend_common import CpuAttentionKernels, CpuBackendMixin, CpuFusedMoEForward, CpuGraphRunner

__all__ = ['CpuOpsBackend', 'CpuAttentionImpl', 'CpuFusedMoEImpl', 'CpuGraphRunner', 'CPU_OPS', 'install',
           'replaced']

#: Build specs built here: lmdeploy's implementation classes with torch kernels. Every other spec goes to
#: lmdeploy's torch ``DefaultOpsBackend`` (which refuses what it does not know).
CPU_OPS = (PagedAttentionBuildSpec, FusedMoEBuildSpec)


class CpuAttentionImpl(CpuAttentionKernels, TritonAttentionImpl):
    """lmdeploy's Triton attention layer with its kernels (fill, paged decode, flatten, varlen prefill) in torch."""

    def get_step_metadata_provider(self):
        # the Triton layer's metadata contract (lmdeploy gives it to TritonAttentionImpl itself only)
        return TritonAttentionMetaBuilder()

    def _forward_decoding(self, query, k_cache, v_cache, attn_metadata, max_q_seqlen, k_scales_zeros=None,
                          v_scales_zeros=None, learnable_sink=None):
        # a decoding step of speculative decoding verifies a window of tokens per request: every token sees the
        # cache up to its own position (lmdeploy's Triton decoding sees one token per request)
        return self.paged_attention_fwd(query, k_cache, v_cache, cache_seqlens=attn_metadata.kv_seqlens,
                                        page_table=attn_metadata.block_offsets,
                                        cu_seqlens_q=attn_metadata.cu_seqlens_q, max_seqlen_q=max_q_seqlen,
                                        softmax_scale=self.scale, causal=True, window_size=self.sliding_window,
                                        softcap=self.logit_softcapping, sinks=learnable_sink,
                                        alibi_slopes=self.alibi_slopes, quant_policy=attn_metadata.quant_policy,
                                        k_scales_zeros=k_scales_zeros, v_scales_zeros=v_scales_zeros)


def _build_attention(spec: PagedAttentionBuildSpec) -> CpuAttentionImpl:
    from lmdeploy.pytorch.backends.cuda.attention import _normalize_sliding_window
    if spec.alibi or spec.learnable_sink or spec.block_sparse_size != 1 or spec.use_flash_mla:
        raise NotImplementedError('the CPU attention supports plain causal attention (with sliding window and '
                                  'softcapping) only')
    return CpuAttentionImpl(num_heads=spec.num_heads, head_size=spec.head_dim, scale=spec.scale,
                            num_kv_heads=spec.num_kv_heads, v_head_size=spec.v_head_dim, alibi=spec.alibi,
                            sliding_window=_normalize_sliding_window(spec.sliding_window),
                            logit_softcapping=spec.logit_softcapping, causal=spec.causal,
                            block_sparse_size=spec.block_sparse_size)


class CpuFusedMoEImpl(CpuFusedMoEForward, TritonFusedMoEImpl):
    """lmdeploy's ``TritonFusedMoEImpl`` running :func:`.kernels.fused_moe`."""


def _build_fused_moe(spec: FusedMoEBuildSpec) -> CpuFusedMoEImpl:
    if spec.ep_size > 1:
        raise NotImplementedError('the CPU path has no expert parallelism')
    return CpuFusedMoEImpl(top_k=spec.top_k, num_experts=spec.num_experts, renormalize=spec.renormalize)


class CpuOpsBackend(CpuBackendMixin, CudaOpsBackend):
    """lmdeploy's CUDA op backend with torch kernels and eager execution, for CPU tensors."""

    @classmethod
    def build_op(cls, spec, *, enable_deterministic: bool = False):
        if isinstance(spec, PagedAttentionBuildSpec):
            return _build_attention(spec)
        if isinstance(spec, FusedMoEBuildSpec):
            return _build_fused_moe(spec)
        try:
            return DefaultOpsBackend.build_op(spec, enable_deterministic=enable_deterministic)
        except RuntimeError as err:
            raise NotImplementedError(f'{type(spec).__name__} has no CPU implementation') from err

    @classmethod
    def update_step_context(cls, step_context):
        from lmdeploy.pytorch.backends.cuda.attention.default import build_triton_attention_metadata
        from lmdeploy.pytorch.backends.cuda.step_metadata import CudaSequenceMetadata

        sequence_metadata = CudaSequenceMetadata.from_step_context(step_context)
        attn_metadata = build_triton_attention_metadata(cls.get_attention_metadata_cls(), step_context,
                                                        sequence_metadata)
        plan = cls._resolve_step_meta_plan()
        if plan is not None:
            plan.prepare(step_context, sequence_metadata, attn_metadata)
        step_context.attn_metadata = attn_metadata
        return step_context


def install() -> None:
    """What lmdeploy 0.18 needs beyond the shared CPU path: nothing (its rejection sampler is a backend op)."""


def replaced() -> dict[str, list[str]]:
    """What this module replaces, by kind (for :func:`lmdeploy_guided_spec.cpu.replacements`)."""
    return {
        'ops with torch kernels (lmdeploy implementation classes kept)': [s.__name__ for s in CPU_OPS],
        "ops from lmdeploy's default torch backend": ['every other BuildSpec DefaultOpsBackend builds (rejection '
                                                      'sampling included)'],
        "step metadata (CudaOpsBackend.update_step_context)": [
            "Triton attention metadata only: no FlashMLA/FlashAttention-3 preparation, so no FA3 requirement"],
    }
