"""Run lmdeploy's own PyTorch engine (0.14.0 patched by the series, or 0.18.0) on the CPU: for tests, CI and the demo.

This is not part of the patch series: it is applied at run time, to the process that calls :func:`activate` and,
through ``LMDEPLOY_GUIDED_SPEC_DEVICE=cpu`` and a ``.pth`` hook (:mod:`.hook`), to every Python process lmdeploy
starts from it (the api_server's engine process). lmdeploy's engine, scheduler, model code, speculative agent,
proposers, guided decoding and samplers run unchanged; what the CPU path replaces is listed by
:func:`replacements` and in docs/en/cpu.md:

- lmdeploy's ``cuda`` device means the CPU (:mod:`.device`): tensors, streams, events, memory queries;
- lmdeploy's backend selector returns the ``CpuOpsBackend`` of the installed lmdeploy's backend module
  (:func:`backend_module`: :mod:`.lmdeploy_0_14` or :mod:`.lmdeploy_0_18`): torch kernels for attention and MoE
  (:mod:`.kernels`), lmdeploy's default torch layers for the rest, eager execution, and a torch rejection
  sampler; any other Triton kernel lmdeploy launches runs under the Triton interpreter;
- models compute in float32 (``LMDEPLOY_GUIDED_SPEC_CPU_DTYPE``: ``float32``, ``bfloat16``, ``float16`` or
  ``auto`` for lmdeploy's own choice);
- the default rotary embedding runs without ``torch.compile`` (its first CPU compile takes seconds);
- lmdeploy's environment check (which needs CUDA and runs in a spawned process) is skipped;
- the default ``max_batch_size`` is 8, the KV cache sizing halves the prefill budget until the cache fits, memory
  errors name ``LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB``, and the api_server's engine process survives a manager that
  shuts down before its last reply (:mod:`.engine`);
- lmdeploy's multiprocess executor waits for its message barrier off the ranks' event loops, so ranks blocked in
  gloo collectives cannot deadlock with it (:mod:`.ranks`).
"""
from __future__ import annotations

import functools
import os
from types import ModuleType

__all__ = ['activate', 'active', 'replacements', 'backend_module', 'lmdeploy_series', 'ENV', 'DTYPE_ENV',
           'BACKEND_MODULES']

#: Set to ``cpu`` to run lmdeploy on the CPU in this process and in every Python process started from it.
ENV = 'LMDEPLOY_GUIDED_SPEC_DEVICE'
#: Compute dtype of the CPU path.
DTYPE_ENV = 'LMDEPLOY_GUIDED_SPEC_CPU_DTYPE'

#: The backend module of each supported lmdeploy release line (``major.minor``).
BACKEND_MODULES = {'0.14': 'lmdeploy_0_14', '0.18': 'lmdeploy_0_18'}

_active = False


@functools.lru_cache(maxsize=1)
def _installed_lmdeploy() -> str:
    # read once: the backend selector asks at every forward, and reading the package metadata scans site-packages
    # (it was a tenth of the CPU time of a decoding test)
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version('lmdeploy')
    except PackageNotFoundError:
        import lmdeploy
        return lmdeploy.__version__


def lmdeploy_series(version: str | None = None) -> str:
    """The release line (``major.minor``) of ``version``, by default of the installed lmdeploy."""
    if version is None:
        version = _installed_lmdeploy()
    return '.'.join(version.split('.')[:2])


def backend_module(version: str | None = None) -> ModuleType:
    """The CPU path's backend module for the installed lmdeploy (or for ``version``).

    Raises ``RuntimeError`` naming the supported versions when there is none.
    """
    import importlib
    series = lmdeploy_series(version)
    name = BACKEND_MODULES.get(series)
    if name is None:
        raise RuntimeError(f'the CPU path supports lmdeploy {", ".join(f"{v}.x" for v in BACKEND_MODULES)}, '
                           f'not {version or series}')
    return importlib.import_module(f'.{name}', __name__)


def active() -> bool:
    """Whether this process runs lmdeploy on the CPU."""
    return _active


def _cpu_dtype() -> str:
    value = os.environ.get(DTYPE_ENV, 'float32')
    if value not in ('float32', 'bfloat16', 'float16', 'auto'):
        raise ValueError(f'{DTYPE_ENV} must be float32, bfloat16, float16 or auto, not {value!r}')
    return value


def _patch_selector() -> None:
    from lmdeploy.pytorch.backends import selector

    if getattr(selector._get_backend, '__lmdeploy_guided_spec_cpu__', False):
        return
    original = selector._get_backend

    def _get_backend():
        from lmdeploy.pytorch.devices import get_device_manager
        if get_device_manager().current_context().device_type == 'cuda':
            return backend_module().CpuOpsBackend
        return original()

    _get_backend.__lmdeploy_guided_spec_cpu__ = True
    selector._get_backend = _get_backend


def _patch_dtype() -> None:
    from lmdeploy.pytorch import config

    if getattr(config._update_torch_dtype, '__lmdeploy_guided_spec_cpu__', False):
        return
    original = config._update_torch_dtype

    def _update_torch_dtype(model_config, dtype: str, device_type: str = 'auto'):
        import torch
        model_config = original(model_config, dtype, device_type)
        wanted = _cpu_dtype()
        if wanted != 'auto' and getattr(model_config.hf_config, 'quantization_config', None) is None:
            model_config.dtype = getattr(torch, wanted)
        return model_config

    _update_torch_dtype.__lmdeploy_guided_spec_cpu__ = True
    config._update_torch_dtype = _update_torch_dtype


def _patch_rotary() -> None:
    from lmdeploy.pytorch.backends.default import rotary_embedding

    # the default rotary embedding is wrapped in torch.compile, whose first CPU compile takes several seconds
    fwd = rotary_embedding._rotary_embedding_fwd
    rotary_embedding._rotary_embedding_fwd = getattr(fwd, '__wrapped__', fwd)


def _patch_env_check() -> None:
    from lmdeploy.pytorch import envs
    envs.enable_check_env = False


def replacements() -> dict[str, list[str]]:
    """What the CPU path replaces, by kind (for reports and the docs)."""
    from . import device, engine
    return {
        'device arguments redirected to the CPU': [f'torch.{n}' for n in device.REDIRECTED_FACTORIES]
        + ['Tensor.to', 'Tensor.new_*', 'Tensor.cuda', 'Tensor.pin_memory', 'Tensor.record_stream', 'Module.cuda'],
        'torch.cuda calls with CPU equivalents': [f'torch.cuda.{n}' for n in device.REPLACED_CUDA_CALLS],
        **backend_module().replaced(),
        'lmdeploy functions wrapped': ['lmdeploy.pytorch.backends.selector._get_backend',
                                       'lmdeploy.pytorch.config._update_torch_dtype',
                                       'lmdeploy.pytorch.backends.default.rotary_embedding._rotary_embedding_fwd '
                                       '(without torch.compile)'],
        'other lmdeploy settings': ['lmdeploy.pytorch.envs.enable_check_env (off)'],
        "lmdeploy's engine start (defaults, KV cache sizing, the api_server's engine process)": engine.replaced(),
        "lmdeploy's multiprocess executor (tp > 1 over gloo)": [
            'mp_executor.Notifier.wait_async, mp_executor.Notifier.set_async (barrier waits off the event loop)',
            'torch.distributed collectives (an asynchronous one waits for those issued before it on its group, as on '
            'one NCCL stream)'],
    }


def activate() -> None:
    """Run lmdeploy on the CPU in this process and in the Python processes it starts (idempotent)."""
    global _active
    if _active:
        return
    os.environ[ENV] = 'cpu'
    os.environ.setdefault('TRITON_INTERPRET', '1')
    os.environ.setdefault('LMDEPLOY_ENABLE_CHECK_ENV', '0')
    from ..support.harness import enable_cpu_triton
    enable_cpu_triton()
    from . import device
    device.install()
    _patch_selector()
    _patch_dtype()
    _patch_rotary()
    _patch_env_check()
    backend_module().install()
    from . import engine, ranks
    engine.install()
    ranks.install()
    _active = True
