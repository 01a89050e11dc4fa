"""lmdeploy's CUDA device, mapped onto the CPU.

lmdeploy 0.14.0's PyTorch engine only knows accelerator device types (``cuda``, ``ascend``, ``maca``, ``camb``) and
writes ``'cuda'`` into many call sites: tensors created with ``device='cuda'``, ``.cuda()``, compute streams, events,
``torch.cuda.mem_get_info`` to size the KV cache. Rather than touching each call site, this module makes the
``cuda`` device *mean* the CPU for the whole process:

- ``device=`` arguments naming a CUDA device (``'cuda'``, ``'cuda:0'``, ``torch.device('cuda')``, an index) become
  ``'cpu'`` in torch's tensor factories and in ``Tensor.to``/``Tensor.new_*``; ``Tensor.cuda()`` and
  ``Module.cuda()`` return CPU objects; ``pin_memory`` is dropped;
- ``torch.cuda.Stream``/``Event``/``stream``/``current_stream``/``synchronize``/``empty_cache`` become CPU
  equivalents (work on the CPU is synchronous, so every stream is always idle and every event always complete);
- ``torch.cuda.mem_get_info``/``get_device_properties``/``get_device_capability``/``current_device``/
  ``set_device``/``device_count``/``get_device_name`` describe one CPU "device" with a memory budget
  (``LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB``, default 2) from which lmdeploy sizes its KV cache.

``torch.cuda.is_available()`` stays ``False``, so torch itself and other libraries keep treating the machine as
CPU-only. Nothing is changed until :func:`install` runs; the patches last for the process.
"""
from __future__ import annotations

import contextlib
import functools
import os
from dataclasses import dataclass

import torch

__all__ = ['install', 'installed', 'REPLACED_CUDA_CALLS', 'REDIRECTED_FACTORIES']

#: torch functions whose ``device=`` argument is rewritten (the tensor factories lmdeploy calls).
REDIRECTED_FACTORIES = (
    'empty', 'zeros', 'ones', 'full', 'arange', 'tensor', 'as_tensor', 'empty_like', 'zeros_like', 'ones_like',
    'full_like', 'rand', 'randn', 'randint', 'randperm', 'empty_strided', 'linspace', 'eye', 'rand_like',
    'randn_like', 'randint_like', 'tril_indices', 'triu_indices', 'scalar_tensor', 'frombuffer',
)
_TENSOR_NEW = ('new_empty', 'new_zeros', 'new_ones', 'new_full', 'new_tensor', 'new_empty_strided')

#: The ``torch.cuda`` attributes replaced by CPU equivalents.
REPLACED_CUDA_CALLS = (
    'Stream', 'Event', 'stream', 'current_stream', 'default_stream', 'synchronize', 'empty_cache', 'mem_get_info',
    'current_device', 'set_device', 'device_count', 'get_device_properties', 'get_device_capability',
    'get_device_name', 'memory_allocated', 'max_memory_allocated', 'memory_reserved', 'reset_peak_memory_stats',
    'ipc_collect', 'device',
)

_installed = False


def installed() -> bool:
    """Whether the CUDA device is mapped onto the CPU in this process."""
    return _installed


def _memory_budget() -> int:
    gib = float(os.environ.get('LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB', '2'))
    return int(gib * (1 << 30))


def _is_cuda(device) -> bool:
    if isinstance(device, torch.device):
        return device.type == 'cuda'
    if isinstance(device, str):
        return device.startswith('cuda')
    # a bare index names an accelerator ordinal
    return isinstance(device, int) and not isinstance(device, bool)


def _cpu_kwargs(kwargs: dict) -> dict:
    device = kwargs.get('device')
    if device is not None and _is_cuda(device):
        kwargs['device'] = 'cpu'
    if kwargs.get('pin_memory'):
        kwargs['pin_memory'] = False
    return kwargs


def _redirect(fn):

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if kwargs:
            kwargs = _cpu_kwargs(kwargs)
        return fn(*args, **kwargs)

    wrapper.__lmdeploy_guided_spec_cpu__ = fn
    return wrapper


def _tensor_to(fn):

    @functools.wraps(fn)
    def to(self, *args, **kwargs):
        if args and _is_cuda(args[0]):
            args = ('cpu', ) + args[1:]
        if kwargs:
            kwargs = _cpu_kwargs(kwargs)
        return fn(self, *args, **kwargs)

    to.__lmdeploy_guided_spec_cpu__ = fn
    return to


def _identity(self, *args, **kwargs):
    return self


class CpuStream:
    """A CUDA stream stand-in: the CPU runs every operation synchronously, so a stream is always idle."""

    def __init__(self, device=None, priority: int = 0, **kwargs):
        self.device = torch.device('cpu')
        self.priority = priority

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        event = event or CpuEvent()
        event.record(self)
        return event

    def __eq__(self, other) -> bool:
        return self is other

    def __hash__(self) -> int:
        return id(self)


class CpuEvent:
    """A CUDA event stand-in: complete as soon as it is recorded; ``elapsed_time`` measures wall time."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time = None

    def record(self, stream=None) -> None:
        import time
        self._time = time.perf_counter()

    def query(self) -> bool:
        return True

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: CpuEvent) -> float:
        return (end._time - self._time) * 1000.0


_DEFAULT_STREAM = CpuStream()


@dataclass
class CpuDeviceProperties:
    """What ``torch.cuda.get_device_properties`` reports for the CPU device.

    ``major``/``minor`` 8.0 keep capability checks on their common path; features that need more (FlashMLA,
    FlashAttention-3) are not installed on a CPU machine, and their imports fail as usual.
    """
    name: str = 'cpu'
    major: int = 8
    minor: int = 0
    total_memory: int = 0
    multi_processor_count: int = 1
    is_integrated: bool = False
    is_multi_gpu_board: bool = False


def _stream_context(stream=None):
    return contextlib.nullcontext(stream)


def _mem_get_info(device=None) -> tuple[int, int]:
    budget = _memory_budget()
    return budget, budget


def _cuda_replacements() -> dict:
    return {
        'Stream': CpuStream,
        'Event': CpuEvent,
        'stream': _stream_context,
        'current_stream': lambda device=None: _DEFAULT_STREAM,
        'default_stream': lambda device=None: _DEFAULT_STREAM,
        'synchronize': lambda device=None: None,
        'empty_cache': lambda: None,
        'mem_get_info': _mem_get_info,
        'current_device': lambda: 0,
        'set_device': lambda device: None,
        'device_count': lambda: 1,
        'get_device_properties': lambda device=None: CpuDeviceProperties(total_memory=_memory_budget()),
        'get_device_capability': lambda device=None: (8, 0),
        'get_device_name': lambda device=None: 'cpu',
        'memory_allocated': lambda device=None: 0,
        'max_memory_allocated': lambda device=None: 0,
        'memory_reserved': lambda device=None: 0,
        'reset_peak_memory_stats': lambda device=None: None,
        'ipc_collect': lambda: None,
        'device': lambda device=None: contextlib.nullcontext(),
    }


def install() -> None:
    """Map lmdeploy's CUDA device onto the CPU in this process (idempotent)."""
    global _installed
    if _installed:
        return
    for name in REDIRECTED_FACTORIES:
        fn = getattr(torch, name, None)
        if fn is not None:
            setattr(torch, name, _redirect(fn))
    for name in _TENSOR_NEW:
        setattr(torch.Tensor, name, _redirect(getattr(torch.Tensor, name)))
    torch.Tensor.to = _tensor_to(torch.Tensor.to)
    torch.Tensor.cuda = _identity
    torch.Tensor.pin_memory = _identity
    torch.Tensor.record_stream = lambda self, stream: None
    torch.nn.Module.cuda = _identity
    for name, value in _cuda_replacements().items():
        setattr(torch.cuda, name, value)
    # lmdeploy's Engine.close frees cuBLAS workspaces; a CPU build of torch has no such function
    if not hasattr(torch._C, '_cuda_clearCublasWorkspaces'):
        torch._C._cuda_clearCublasWorkspaces = lambda: None
    _installed = True
