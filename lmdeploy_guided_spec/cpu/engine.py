"""lmdeploy's engine start on the CPU path: defaults that fit a CPU, and an api_server start that survives load.

- **Batch size.** lmdeploy sizes ``max_batch_size`` by GPU model (128 for an unknown one). On the CPU path the
  default is :data:`DEFAULT_MAX_BATCH_SIZE`; ``--max-batch-size`` / ``PytorchEngineConfig(max_batch_size=...)``
  still win.
- **KV cache sizing.** lmdeploy reserves ``(max_prefill_token_num + 2 * max_batch_size) * vocab_size * 2`` bytes
  of "device" memory for logits before it gives the KV cache its share, and means to halve
  ``max_prefill_token_num`` until at least 16 KV blocks fit; but its block count raises as soon as the reserve
  leaves two blocks or fewer, so the halving never happens (128k-vocabulary models on the CPU path's 2 GiB device
  died with ``No enough gpu memory for kv cache``). Here the halving happens, and an engine that still does not fit
  fails with a message that names :data:`MEMORY_ENV` and the options that fix it.
- **The api_server's engine process.** lmdeploy's ``ZMQMPEngine._start_mp_proc`` starts the engine process and
  waits, under a ``multiprocessing.Manager`` condition, for the port it publishes; as soon as the port is there it
  leaves the ``with mp.Manager()`` block, which shuts the manager process down. The engine process is then still
  inside its own ``with condition:``: the manager has carried out its ``release`` (the parent could not have
  woken otherwise) but may not have sent the reply yet. Under load the manager exits first, the engine process
  dies with ``EOFError`` in ``Condition.__exit__`` and the api_server reports "PyTorch ZMQ engine process is not
  alive". The engine process here takes a lost reply to that last ``release`` as done.
"""
from __future__ import annotations

import os
import sys

__all__ = ['install', 'memory_hint', 'replaced', 'DEFAULT_MAX_BATCH_SIZE', 'MEMORY_ENV', 'NO_MEMORY']

#: ``max_batch_size`` when neither the user nor the command line sets one.
DEFAULT_MAX_BATCH_SIZE = 8
#: The CPU path's device memory in GiB (see :mod:`.device`), from which lmdeploy sizes its KV cache.
MEMORY_ENV = 'LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB'
#: How lmdeploy's memory errors begin.
NO_MEMORY = 'No enough gpu memory'

_MARK = '__lmdeploy_guided_spec_cpu__'
_lmdeploy_mp_proc = None


def _marked(fn) -> bool:
    return getattr(fn, _MARK, False)


def _patch_max_batch_size() -> None:
    from lmdeploy import utils

    original = utils.get_max_batch_size
    if _marked(original):
        return

    def get_max_batch_size(device_type: str) -> int:
        return DEFAULT_MAX_BATCH_SIZE if device_type == 'cuda' else original(device_type)

    setattr(get_max_batch_size, _MARK, True)
    utils.get_max_batch_size = get_max_batch_size
    # modules that imported the name before this ran (later imports see the new one)
    for name in ('lmdeploy.pytorch.engine.config_builder', 'lmdeploy.cli.serve'):
        module = sys.modules.get(name)
        if module is not None and getattr(module, 'get_max_batch_size', None) is original:
            module.get_max_batch_size = get_max_batch_size


def memory_hint() -> str:
    """What fixes a memory error on the CPU path."""
    gib = os.environ.get(MEMORY_ENV, '2')
    return (f'the CPU path gives the engine {MEMORY_ENV}={gib} GiB of device memory; to fix: raise it (for example '
            f'{MEMORY_ENV}=4), or lower max_batch_size (--max-batch-size) or max_prefill_token_num '
            '(--max-prefill-token-num); cache_max_entry_count (--cache-max-entry-count) is the share of what is '
            'left that the KV cache takes')


def _patch_cache_sizing() -> None:
    from lmdeploy.pytorch.engine.executor.base import ExecutorBase

    runtime_size = ExecutorBase._get_runtime_size
    if _marked(runtime_size):
        return
    update_configs = ExecutorBase.update_configs

    def _get_runtime_size(self, *args, **kwargs):
        # (free_mems, cache_block_size(s), vocab_size): 0.18 passes per-rank cache plans
        config = self.cache_config
        asked = config.max_prefill_token_num
        try:
            while True:
                try:
                    return runtime_size(self, *args, **kwargs)
                except RuntimeError as err:
                    if NO_MEMORY not in str(err) or config.max_prefill_token_num <= 1:
                        raise
                    config.max_prefill_token_num //= 2
        finally:
            # lmdeploy compares the result with the asked value to log and apply the change
            config.max_prefill_token_num = asked

    def _update_configs(self):
        try:
            return update_configs(self)
        except (RuntimeError, AssertionError) as err:
            if NO_MEMORY not in str(err):
                raise
            raise RuntimeError(f'{err} ({memory_hint()})') from err

    for fn in (_get_runtime_size, _update_configs):
        setattr(fn, _MARK, True)
    ExecutorBase._get_runtime_size = _get_runtime_size
    ExecutorBase.update_configs = _update_configs


class _PortCondition:
    """The manager's condition as the engine process uses it, with a lost reply to its last release taken as done."""

    def __init__(self, condition):
        self._condition = condition

    def __enter__(self):
        return self._condition.__enter__()

    def __exit__(self, *exc_info):
        try:
            return self._condition.__exit__(*exc_info)
        except (EOFError, ConnectionError):
            # the parent woke from its wait, so the manager did release the lock before it shut down
            return False

    def __getattr__(self, name):
        return getattr(self._condition, name)


def _engine_process(shared_dict, condition, **kwargs):
    """``ZMQMPEngine._mp_proc`` with :class:`_PortCondition` (runs in the engine process)."""
    _patch_engine_process()
    _lmdeploy_mp_proc(shared_dict, _PortCondition(condition), **kwargs)


def _patch_engine_process() -> None:
    global _lmdeploy_mp_proc
    from lmdeploy.pytorch.engine.mp_engine import zmq_engine

    current = zmq_engine.ZMQMPEngine.__dict__['_mp_proc'].__func__
    if current is not _engine_process:
        _lmdeploy_mp_proc = current
        zmq_engine.ZMQMPEngine._mp_proc = staticmethod(_engine_process)


def install() -> None:
    """Apply the three changes above to this process (idempotent)."""
    _patch_max_batch_size()
    _patch_cache_sizing()
    _patch_engine_process()


def replaced() -> list[str]:
    """The lmdeploy functions this module wraps (for :func:`lmdeploy_guided_spec.cpu.replacements`)."""
    return ['lmdeploy.utils.get_max_batch_size (8 for the CPU path)',
            'ExecutorBase._get_runtime_size (halves max_prefill_token_num until the KV cache fits)',
            'ExecutorBase.update_configs (memory errors name LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB)',
            'ZMQMPEngine._mp_proc (survives the manager shutting down before its last reply)']
