"""What the CPU op backends of every lmdeploy version share (see :func:`lmdeploy_guided_spec.cpu.backend_module`).

Each version's ``CpuOpsBackend`` subclasses lmdeploy's ``CudaOpsBackend`` with :class:`CpuBackendMixin` first; its
paged attention and fused MoE are lmdeploy's Triton implementation classes with :class:`CpuAttentionKernels` and
:class:`CpuFusedMoEForward` first, so the kernels they launch are the torch ones of :mod:`.kernels`.
"""
from __future__ import annotations

from lmdeploy.pytorch.backends.graph_runner import GraphRunner

from . import kernels

__all__ = ['CpuGraphRunner', 'CpuBackendMixin', 'CpuAttentionKernels', 'CpuFusedMoEForward']


class CpuGraphRunner(GraphRunner):
    """Eager execution; there are no graphs to capture, so warmup decodes no batch sizes."""

    def get_capture_batch_sizes(self) -> list[int]:
        return []


class CpuBackendMixin:
    """The backend's name, eager execution, one device, no Ray, gloo collectives."""

    @staticmethod
    def get_name() -> str:
        return 'cpu'

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


class CpuAttentionKernels:
    """lmdeploy's Triton attention layer with its kernels (fill, paged decode, flatten, varlen prefill) in torch."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fill_kv_cache = kernels.fill_kv_cache
        self.paged_attention_fwd = kernels.flash_attn_with_kvcache
        self.flatten_kv_cache = kernels.flatten_kv_cache
        self.flash_attention_fwd = kernels.flash_attn_varlen_func


class CpuFusedMoEForward:
    """lmdeploy's ``TritonFusedMoEImpl`` running :func:`.kernels.fused_moe`."""

    def forward(self, hidden_states, topk_weights, topk_ids, gate_up_weights, down_weights, gate_up_bias=None,
                down_bias=None, expert_list=None, act_func=None):
        expert_offset = 0 if expert_list is None or len(expert_list) == self.num_experts else expert_list[0]
        return kernels.fused_moe(hidden_states, gate_up_weights, down_weights, topk_weights=topk_weights,
                                 topk_ids=topk_ids, topk=self.top_k, w1_bias=gate_up_bias, w2_bias=down_bias,
                                 expert_offset=expert_offset, renormalize=self.renormalize, act_func=act_func)
