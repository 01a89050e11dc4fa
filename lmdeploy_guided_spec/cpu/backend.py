"""The CPU op backend lmdeploy's backend selector hands out on the CPU path.

It subclasses lmdeploy's ``CudaOpsBackend``, so the attention metadata, the step-context update and everything
not listed here stay lmdeploy's own. What changes:

- paged attention: lmdeploy's ``TritonAttentionImpl`` (its own cache filling and prefill/decoding dispatch) with
  its four Triton kernels swapped for the torch implementations in :mod:`.kernels`;
- fused MoE: lmdeploy's ``TritonFusedMoEImpl`` with its Triton kernel swapped for :func:`.kernels.fused_moe`;
- every other layer the CUDA backend builds with Triton (RMS norm, rotary embedding, SiLU-and-mul, multinomial
  sampling, the noaux-tc router) comes from lmdeploy's torch ``DefaultOpsBackend``;
- no CUDA graphs: the plain eager ``GraphRunner``, which captures nothing and so warms up no batch sizes.
"""
from __future__ import annotations

from lmdeploy.pytorch.backends.base import OpType
from lmdeploy.pytorch.backends.cuda.attention import TritonAttentionBuilder
from lmdeploy.pytorch.backends.cuda.attention.default import TritonAttentionImpl
from lmdeploy.pytorch.backends.cuda.op_backend import CudaOpsBackend
from lmdeploy.pytorch.backends.default import DefaultOpsBackend
from lmdeploy.pytorch.backends.graph_runner import GraphRunner

from . import kernels

__all__ = ['CpuOpsBackend', 'CpuAttentionImpl', 'CpuAttentionBuilder', 'CpuGraphRunner', 'TORCH_OPS', 'CPU_OPS']

#: Layers built by lmdeploy's torch ``DefaultOpsBackend`` instead of the CUDA backend's Triton builders.
TORCH_OPS = (OpType.RMSNorm, OpType.ApplyRotaryEmb, OpType.SiluAndMul, OpType.MultinomialSampling,
             OpType.RouterNoauxTC, OpType.Linear, OpType.RotaryEmbedding, OpType.GeluAndMul, OpType.LayerNorm,
             OpType.SoftmaxTopK, OpType.Embedding)
#: Layers built here: lmdeploy's implementation classes with torch kernels.
CPU_OPS = (OpType.PagedAttention, OpType.FusedMoE)


class CpuAttentionImpl(TritonAttentionImpl):
    """lmdeploy's Triton attention layer with its kernels (fill, paged decode, flatten, varlen prefill) in torch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fill_kv_cache = kernels.fill_kv_cache
        self.paged_attention_fwd = kernels.flash_attn_with_kvcache
        self.flatten_kv_cache = kernels.flatten_kv_cache
        self.flash_attention_fwd = kernels.flash_attn_varlen_func


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

        class CpuFusedMoEImpl(cuda_moe.TritonFusedMoEImpl):

            def forward(self, hidden_states, topk_weights, topk_ids, gate_up_weights, down_weights,
                        gate_up_bias=None, down_bias=None, expert_list=None, act_func=None):
                expert_offset = 0 if expert_list is None or len(expert_list) == self.num_experts else expert_list[0]
                return kernels.fused_moe(hidden_states, gate_up_weights, down_weights, topk_weights=topk_weights,
                                         topk_ids=topk_ids, topk=self.top_k, w1_bias=gate_up_bias,
                                         w2_bias=down_bias, expert_offset=expert_offset,
                                         renormalize=self.renormalize, act_func=act_func)

        return CpuFusedMoEImpl(top_k, num_experts, renormalize)


class CpuGraphRunner(GraphRunner):
    """Eager execution; there are no graphs to capture, so warmup decodes no batch sizes."""

    def get_capture_batch_sizes(self) -> list[int]:
        return []


class CpuOpsBackend(CudaOpsBackend):
    """lmdeploy's CUDA op backend with torch kernels and eager execution, for CPU tensors."""

    @staticmethod
    def get_name() -> str:
        return 'cpu'

    @classmethod
    def get_layer_impl_builder(cls, layer_type: OpType):
        if layer_type == OpType.PagedAttention:
            return CpuAttentionBuilder
        if layer_type == OpType.FusedMoE:
            return CpuFusedMoEBuilder
        if layer_type in TORCH_OPS:
            return DefaultOpsBackend.get_layer_impl_builder(layer_type)
        raise NotImplementedError(f'{layer_type} has no CPU implementation')

    @staticmethod
    def build_graph_runner(model, model_config, cache_config, backend_config, device):
        return CpuGraphRunner(model, model_config, cache_config, backend_config, device)

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def support_ray():
        return False

    @staticmethod
    def ccl_backend() -> str:
        return 'gloo'
