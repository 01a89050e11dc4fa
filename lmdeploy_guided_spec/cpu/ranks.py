"""lmdeploy's multi-rank executors on the CPU path: ``tp > 1`` (and ``dp > 1``) over gloo.

lmdeploy 0.14.0's multiprocess executor (``engine/executor/mp_executor.py``) starts one process per rank; the CPU
path reaches them through the ``.pth`` hook, the backend's ``ccl_backend()`` is ``gloo`` (so lmdeploy's own
``init_process_group`` and ``DistContext.build`` make gloo groups where they would make NCCL ones), and
``torch.cuda.set_device(rank)`` is a no-op. What remains is a deadlock that only blocking collectives expose:

- the executor passes commands to the ranks through a ring of 32 shared-memory blocks; after every 32nd message the
  sender and every rank meet at a ``multiprocessing.Barrier``, and each rank waits for it *synchronously* inside
  its asyncio event loop (``Notifier.wait_async``; the sender's second barrier wait in ``Notifier.set_async`` is
  synchronous too);
- the forward of each step runs in the same event loop, with collectives between the ranks (the broadcast of the
  sampled tokens, the all-reduce of every row-parallel linear layer). On a GPU an NCCL collective is queued on a
  stream and returns at once; a gloo collective blocks the calling thread until every rank has joined it.

So when rank 0 stops at the barrier of message 32 while rank 1 is blocked in the broadcast of the step rank 0 has
not sampled yet, neither moves again (seen within the first request of a tp=2 run). :func:`install` makes the
ranks wait for the barrier in a worker thread, so a rank's event loop keeps running its forward while the other
ranks catch up. The executor side sends synchronously (``collective_rpc_async`` calls ``SharedBuffer.send``), which
is safe: the ranks reach the barrier without needing the executor's loop.

It also holds the per-rank draft log (:func:`install_draft_log`), a debug hook enabled by
``LMDEPLOY_GUIDED_SPEC_DRAFT_LOG=<directory>`` (set before the engine starts; its rank processes inherit it). Each
rank process appends JSON lines to ``<directory>/drafts-rank<R>-pid<P>.jsonl``:

- ``kind: draft``: the result of ``SpecModelAgent.async_model_forward`` (the draft loop, or the grammar's proposal
  for the draft-free methods): the drafts of every row as this rank computed them, before the broadcast. In
  lmdeploy 0.14.0 only ranks with a ``SpecModelAgent`` draft: with a draft tp of 1 (every method but
  ``qwen3_5_mtp``, see ``ConfigBuilder.build_specdecode_config``) that is rank 0 of each TP group; the others get
  a ``BaseSpecModelAgent`` and take rank 0's drafts from the broadcast;
- ``kind: verify``: after ``post_broadcast`` (every non-dummy step, every rank): the drafts this rank's target
  verifies next.

Every rank runs the same steps in the same order, so the ``i``-th record of a kind describes the same step on
every rank.

The same hook writes the errors the core logs in a rank process (a grammar that rejects a committed token: on a rank
that does not sample, a grammar out of step with the sampling rank's) to ``<directory>/errors-pid<P>.jsonl``
(:func:`read_error_logs`).

Two more things that only ``dp > 1`` exposes:

- with attention data-parallel and MLP tensor-parallel (``tp=2, dp=2``: ``attn_tp`` 1, ``mlp_tp`` 2), each rank's
  MLP gathers the tokens of every dp rank with ``gather_by_tp_sizes`` and scatters the sum back with
  ``reduce_scatter_by_tp_sizes``. lmdeploy hands ``torch.distributed.all_gather`` outputs of *different* sizes (a
  rank that serves a 3-token prefill beside an idle rank's 1-token dummy), which NCCL accepts and gloo rejects
  (``ProcessGroupGloo::allgather: invalid tensor size``; its reduce-scatter takes equal sizes only, too). The
  forward raises on both ranks of the first step a request shares with an idle rank. :func:`install` replaces both
  with gloo equivalents (pad to the largest count, gather equal sizes; all-reduce, keep this rank's tokens);
- an exception in a rank's forward loop (the ``ModelAgentLoop`` task) is stored in the task and never looked at:
  the multiprocess executor does not wait for the model agent's tasks, so the rank goes idle and the request never
  finishes (this hid the error above: both ranks sat idle in their event loops). :func:`install` prints the
  traceback and signals the executor's process as lmdeploy does for a failed rank main loop (which stops the
  engine); an error that says a peer process has gone (another dp engine closed first) is printed only.

:func:`call_ranks` runs a function in every rank process of a pipeline's engine (a debug hook: the executor sends
it like any command, each rank writes the result to a file); :func:`grammar_state` is the function that reports
the grammar state a rank holds (matchers, kept drafting windows, failures, FSM sessions), for leak checks.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import json
import logging
import multiprocessing
import os
import sys
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

__all__ = ['install', 'install_draft_log', 'read_draft_logs', 'read_error_logs', 'DRAFT_LOG_ENV', 'call_ranks',
           'grammar_state', 'set_grammar_cleanup', 'gather_by_tp_sizes', 'reduce_scatter_by_tp_sizes']

#: Directory for per-rank draft logs (unset: no log).
DRAFT_LOG_ENV = 'LMDEPLOY_GUIDED_SPEC_DRAFT_LOG'

_MARK = '__lmdeploy_guided_spec_cpu__'


def _patch_notifier() -> None:
    from lmdeploy.pytorch.engine.executor import mp_executor

    notifier = mp_executor.Notifier
    if getattr(notifier.wait_async, _MARK, False):
        return
    last = mp_executor.NUM_SHARED_BLOCK - 1

    @asynccontextmanager
    async def wait_async(self):
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.events[self._event_id].wait)
        yield
        if self._event_id == last:
            # lmdeploy waits here synchronously, which stops this rank's forward (and its gloo collectives)
            await loop.run_in_executor(None, self.bar.wait)
            await loop.run_in_executor(None, self.bar.wait)
        self._update_event_id()

    async def set_async(self):
        loop = asyncio.get_running_loop()
        self.events[self._event_id].set()
        if self._event_id == last:
            await loop.run_in_executor(None, self.bar.wait)
            [event.clear() for event in self.events]
            await loop.run_in_executor(None, self.bar.wait)
        self._update_event_id()

    wait_async.__lmdeploy_guided_spec_cpu__ = True
    notifier.wait_async = wait_async
    notifier.set_async = set_async


def _dp_master() -> tuple[str, str]:
    addr, port = os.environ.get('LMDEPLOY_DP_MASTER_ADDR'), os.environ.get('LMDEPLOY_DP_MASTER_PORT')
    if addr is None or port is None:
        raise RuntimeError('DP > 1 requires "LMDEPLOY_DP_MASTER_ADDR" and "LMDEPLOY_DP_MASTER_PORT".')
    return addr, port


def _dp_executor_class():
    from lmdeploy.pytorch.engine.executor import mp_executor
    from lmdeploy.pytorch.engine.executor.dist_utils import setup_master_addr

    class DPMPExecutor(mp_executor.MPExecutor):
        """lmdeploy's ``MPExecutor`` for one data-parallel rank: it starts that rank's ``attn_tp`` processes.

        lmdeploy 0.14.0 runs ``dp > 1`` only with its Ray executor (``build_executor`` asserts it): each dp rank is
        an engine of its own whose workers take global ranks ``dp_rank * attn_tp + i`` in one process group of
        ``world_size`` ranks, met at ``LMDEPLOY_DP_MASTER_ADDR``/``PORT``. ``MPExecutor`` instead starts
        ``world_size`` processes numbered from 0. This class starts ``attn_tp`` processes with local ids; the
        worker side (:func:`_patch_dp_worker`) offsets their ranks, as the Ray executor does.
        """

        def setup_master_addr(self):
            # MPExecutor.__init__ calls this after ExecutorBase.__init__ and before it sizes its notifier and starts
            # one process per rank of self.world_size: this dp rank owns attn_tp of them
            self.world_size = self.dist_config.attn_tp
            setup_master_addr(*_dp_master())

    return DPMPExecutor


def _patch_dp_worker() -> None:
    from lmdeploy.pytorch.engine.executor import mp_executor

    worker = mp_executor.MPWorkerWrapper
    if getattr(worker.init_process_group, _MARK, False):
        return
    init_process_group = worker.init_process_group

    def dp_init_process_group(self, rank: int, master_addr: str = None, master_port: str = None):
        config = self.dist_config
        if config.dp > 1:
            rank += config.dp_rank * config.attn_tp
            master_addr, master_port = _dp_master()
        return init_process_group(self, rank, master_addr, master_port)

    setattr(dp_init_process_group, _MARK, True)
    worker.init_process_group = dp_init_process_group


def _patch_build_executor() -> None:
    from lmdeploy.pytorch.engine import engine
    from lmdeploy.pytorch.engine.executor import build_executor

    if getattr(engine.build_executor, _MARK, False):
        return

    def cpu_build_executor(model_path, cache_config, backend_config, dist_config, misc_config, *args,
                           distributed_executor_backend: str = None, **kwargs):
        if dist_config.dp == 1 or distributed_executor_backend not in (None, 'mp'):
            return build_executor(model_path, cache_config, backend_config, dist_config, misc_config, *args,
                                  distributed_executor_backend=distributed_executor_backend, **kwargs)
        from lmdeploy.pytorch.config import ModelConfig
        # what build_executor does before it asserts that dp > 1 needs Ray
        dtype = kwargs.pop('dtype', 'auto')
        specdecode_config = kwargs.get('specdecode_config')
        model_config = ModelConfig.from_pretrained(
            model_path, trust_remote_code=kwargs.get('trust_remote_code', False), dtype=dtype,
            hf_overrides=misc_config.hf_overrides,
            dist_config=dist_config, is_draft_model=False,
            spec_method=None if specdecode_config is None else specdecode_config.method,
            num_spec_tokens=0 if specdecode_config is None else specdecode_config.num_speculative_tokens,
            model_format=misc_config.model_format, device_type=kwargs.get('device_type', 'cuda'),
            block_size=cache_config.block_size)
        return _dp_executor_class()(model_path=model_path, model_config=model_config, cache_config=cache_config,
                                    backend_config=backend_config, dist_config=dist_config,
                                    misc_config=misc_config, **kwargs)

    setattr(cpu_build_executor, _MARK, True)
    engine.build_executor = cpu_build_executor


#: Seconds a terminated rank process gets to exit before it is killed.
JOIN_TIMEOUT_S = 10.0


def _patch_proc_join() -> None:
    from lmdeploy.pytorch.engine.executor import mp_executor

    proc_class = mp_executor.ExecutorProc
    if getattr(proc_class.join, _MARK, False):
        return

    def join(self):
        # a rank blocked in a gloo collective (its peers were terminated first) runs its SIGTERM handler only when
        # the collective returns, which with lmdeploy's timeout of 35600 days is never
        if self._proc is None:
            return
        self._proc.join(JOIN_TIMEOUT_S)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()

    setattr(join, _MARK, True)
    proc_class.join = join


class _Done:
    """The handle of a collective that has already completed (what ``async_op=True`` callers wait on)."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


def gather_by_tp_sizes(x, tp_sizes: list[int], group=None, async_op: bool = False):
    """lmdeploy's ``gather_by_tp_sizes`` (all-gather of a different number of tokens per rank) over gloo.

    lmdeploy hands ``torch.distributed.all_gather`` output slices of different sizes, which NCCL accepts and gloo
    rejects (``ProcessGroupGloo::allgather: invalid tensor size``). Here every rank pads its tokens to the largest
    count, gathers equal sizes and keeps each rank's own tokens.
    """
    import torch
    import torch.distributed as dist
    assert all(size >= 0 for size in tp_sizes), f'Invalid tp sizes: {tp_sizes}'
    width = max(tp_sizes)
    padded = x.new_zeros((*x.shape[:-2], width, x.shape[-1]))
    padded[..., :x.shape[-2], :] = x
    parts = [torch.empty_like(padded) for _ in tp_sizes]
    dist.all_gather(parts, padded, group=group)
    new_x = torch.cat([part[..., :size, :] for part, size in zip(parts, tp_sizes)], dim=-2)
    if async_op:
        return new_x, _Done()
    return new_x


def reduce_scatter_by_tp_sizes(out, rank: int, tp_sizes: list[int], group):
    """lmdeploy's ``reduce_scatter_by_tp_sizes`` over gloo, whose reduce-scatter takes equal sizes only: the sum
    over the ranks of every rank's output (an all-reduce), of which this rank keeps the tokens of its data-parallel
    rank."""
    import torch.distributed as dist
    from lmdeploy.pytorch.distributed import get_dist_manager
    attn_tp = get_dist_manager().current_config().attn_tp
    dist.all_reduce(out, group=group)
    return out.split(tp_sizes, -2)[rank // attn_tp]


def _patch_dp_collectives() -> None:
    from lmdeploy.pytorch import distributed
    from lmdeploy.pytorch.nn.linear import base as linear_base

    # the module attribute serves ``dist.gather_by_tp_sizes(...)`` callers and lazy imports (the default linear
    # backend's row-parallel layers); nn.linear.base imported both by name
    for module in (distributed, linear_base):
        module.gather_by_tp_sizes = gather_by_tp_sizes
        module.reduce_scatter_by_tp_sizes = reduce_scatter_by_tp_sizes


#: The collectives of ``torch.distributed`` whose asynchronous works the CPU path orders (:func:`_patch_in_order`).
ORDERED_COLLECTIVES = ('broadcast', 'all_reduce', 'reduce', 'all_gather', 'all_gather_into_tensor', 'gather',
                       'scatter', 'reduce_scatter', 'reduce_scatter_tensor', 'all_to_all', 'all_to_all_single')


class _InOrderWork:
    """An asynchronous gloo work that completes, for whoever waits for it, after the works issued before it on its
    group: ``wait`` waits for them first, ``get_future`` resolves once they have finished too."""

    def __init__(self, work, earlier: list):
        self._work = work
        self._earlier = earlier

    def wait(self, *args, **kwargs):
        for work in self._earlier:
            work.wait(*args, **kwargs)
        self._earlier = []
        return self._work.wait(*args, **kwargs)

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self._earlier) and self._work.is_completed()

    def get_future(self):
        import torch
        own = self._work.get_future()
        earlier = [work for work in self._earlier if not work.is_completed()]
        if not earlier:
            return own
        every = torch.futures.collect_all([work.get_future() for work in earlier] + [own])
        return every.then(lambda done: done.value()[-1].value())

    def __getattr__(self, name):
        return getattr(self._work, name)


def _patch_in_order() -> None:
    """NCCL's order for gloo's asynchronous collectives.

    NCCL runs the collectives of a group on one stream, in the order they were issued, so lmdeploy waits for the
    last of several: ``broadcast_next_token`` of the speculative strategy issues four broadcasts (the sampled
    tokens, their indices, the accepted tokens, the rejected counts) and waits for the last one only. Gloo runs
    asynchronous collectives on a pool of threads and they finish in any order: a rank that does not sample then
    read, about once in fifty steps, the zeros it made for the accepted tokens instead of the broadcast ones, drafted
    from them and committed them to its grammar. Here an asynchronous work of a group, when waited for, waits for
    the works issued on that group before it, and a blocking collective returns once they have finished as well.
    """
    import threading

    import torch.distributed as dist
    if getattr(dist.broadcast, _MARK, False):
        return
    lock = threading.Lock()
    pending: dict = {}  # group -> works issued and not known to be done
    illegal = getattr(dist.distributed_c10d, '_IllegalWork', ())  # what a collective returns inside a coalescing block

    def ordered(collective):
        signature = inspect.signature(collective)

        @functools.wraps(collective)
        def call(*args, **kwargs):
            work = collective(*args, **kwargs)
            if isinstance(work, illegal):
                return work
            group = signature.bind_partial(*args, **kwargs).arguments.get('group')
            if group is None:
                group = dist.group.WORLD
            if work is None:
                # blocking: finished, and so are the works issued before it (as on one stream)
                with lock:
                    earlier = pending.pop(group, [])
                for done in earlier:
                    done.wait()
                return work
            with lock:
                earlier = [w for w in pending.get(group, ()) if not w.is_completed()]
                pending[group] = [*earlier, work]
            return _InOrderWork(work, earlier)

        setattr(call, _MARK, True)
        return call

    for name in ORDERED_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, ordered(getattr(dist, name)))


#: What gloo says when a peer process of a collective has gone.
_PEER_GONE = ('Connection closed by peer', 'Connection reset by peer')


def _patch_loop_failures() -> None:
    from lmdeploy.pytorch.engine.model_agent.agent import BaseModelAgent

    start = BaseModelAgent.start
    if getattr(start, _MARK, False):
        return

    def report(task: asyncio.Task) -> None:
        if task.cancelled() or task.exception() is None:
            return
        import signal
        import traceback
        exc = task.exception()
        if any(peer in str(exc) for peer in _PEER_GONE):
            # a rank of another engine (dp) closed first while this one waited in a collective: shutdown, not a fault
            print(f'lmdeploy-guided-spec: rank process {os.getpid()}: task {task.get_name()} ended: {exc}',
                  file=sys.stderr, flush=True)
            return
        print(f'lmdeploy-guided-spec: rank process {os.getpid()}: task {task.get_name()} failed:\n'
              + ''.join(traceback.format_exception(exc)), file=sys.stderr, flush=True)
        # what ExecutorProc does when its own main loop fails: the executor's process stops the engine
        os.kill(os.getppid(), signal.SIGUSR1)

    def start_reporting(self, forward_event: asyncio.Event = None):
        start(self, forward_event)
        if not multiprocessing.parent_process():
            return
        for task in (self._background_task, self._preprocess_task):
            task.add_done_callback(report)

    setattr(start_reporting, _MARK, True)
    BaseModelAgent.start = start_reporting


def _rank_call(self, func, args: tuple, directory: str) -> None:
    """``MPWorkerWrapper.guided_spec_call``: ``func(model_agent, *args)`` in this rank process, its result written
    as JSON to ``<directory>/rank<R>.json`` (see :func:`call_ranks`)."""
    try:
        result = {'rank': self.rank, 'pid': os.getpid(), 'result': func(self.model_agent, *args)}
    except Exception as exc:  # the caller reports it; the rank keeps serving
        result = {'rank': self.rank, 'pid': os.getpid(), 'error': f'{type(exc).__name__}: {exc}'}
    path = Path(directory) / f'rank{self.rank}.json'
    tmp = path.with_suffix('.tmp')
    tmp.write_text(json.dumps(result))
    tmp.replace(path)


def _patch_rank_call() -> None:
    from lmdeploy.pytorch.engine.executor import mp_executor

    mp_executor.MPWorkerWrapper.guided_spec_call = _rank_call


def call_ranks(pipe, func, *args, timeout: float = 60.0) -> dict:
    """``{rank: func(model_agent, *args)}`` over the ranks of a pipeline's engine, each run in its rank process.

    ``func`` must be importable by the rank processes (a module-level function: it travels pickled) and return
    something JSON can write. With lmdeploy's multiprocess executor the call is one more command in the executor's
    ring, sent from the engine's event loop so it cannot interleave with the engine's own commands; each rank runs
    it between the steps of its event loop. Call it while no request is in flight. With the in-process executor
    (one rank) it runs here.
    """
    import tempfile
    import time
    executor = pipe.async_engine.engine.executor
    if not hasattr(executor, 'collective_rpc_async'):
        return {0: func(executor.model_agent, *args)}
    with tempfile.TemporaryDirectory(prefix='lmdeploy-guided-spec-ranks-') as directory:
        sent = asyncio.run_coroutine_threadsafe(
            executor.collective_rpc_async('guided_spec_call', args=(func, tuple(args), directory), return_mask=0),
            pipe.internal_thread.loop)
        sent.result(timeout)
        deadline = time.monotonic() + timeout
        while len(list(Path(directory).glob('rank*.json'))) < executor.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f'{len(list(Path(directory).glob("rank*.json")))} of {executor.world_size} '
                                   f'ranks answered {getattr(func, "__name__", func)} in {timeout} s')
            time.sleep(0.05)
        answers = [json.loads(path.read_text()) for path in Path(directory).glob('rank*.json')]
    errors = {a['rank']: a['error'] for a in answers if 'error' in a}
    if errors:
        raise RuntimeError(f'{getattr(func, "__name__", func)} failed on ranks {errors}')
    return {a['rank']: a['result'] for a in sorted(answers, key=lambda a: a['rank'])}


def grammar_state(model_agent) -> dict:
    """The grammar state a rank holds, by kind (for :func:`call_ranks`): session ids with matchers in the
    ``GuidedDecodingManager``, the number of kept drafting windows and the session ids with recorded failures in
    the spec agent's ``SpecGrammarManager``, the number of FSM sessions (method ``fsm``), and which spec agent the
    rank has (ranks with a ``BaseSpecModelAgent`` take their drafts from the broadcast and keep no grammar state)."""
    manager = model_agent.guided_decoding_manager
    spec = model_agent.spec_agent
    guided_spec = getattr(spec, 'guided_spec', None)
    fsm_sessions = getattr(spec, 'fsm_sessions', None)
    return {
        'spec_agent': type(spec).__name__,
        'matchers': sorted(manager.processors) if manager is not None else [],
        'windows': guided_spec.num_kept_windows if guided_spec is not None else 0,
        'failures': sorted(guided_spec.failures()) if guided_spec is not None else [],
        'fsm_sessions': len(fsm_sessions) if fsm_sessions is not None else 0,
    }


def set_grammar_cleanup(model_agent, enabled: bool) -> bool:
    """Switch off (and back on) the spec agent's cleanup of finished sessions' grammar state in this rank (for
    :func:`call_ranks`: a leak check proves that it sees a leak). Returns whether the rank has such a cleanup."""
    spec = model_agent.spec_agent
    if not hasattr(type(spec), '_cleanup_guided_sessions'):
        return False
    if enabled:
        spec.__dict__.pop('_cleanup_guided_sessions', None)
    else:
        spec._cleanup_guided_sessions = lambda *args, **kwargs: None
    return True


def install() -> None:
    """Let lmdeploy's multiprocess executor run its ranks over gloo without deadlock (idempotent)."""
    _patch_notifier()
    _patch_in_order()
    _patch_loop_failures()
    _patch_dp_collectives()
    _patch_rank_call()
    _patch_proc_join()
    _patch_dp_worker()
    _patch_build_executor()
    if os.environ.get(DRAFT_LOG_ENV):
        install_draft_log()


def install_draft_log() -> None:
    """Log every rank's drafts per step to ``$LMDEPLOY_GUIDED_SPEC_DRAFT_LOG`` (idempotent)."""
    from lmdeploy.pytorch.spec_decode.base import BaseSpecModelAgent
    from lmdeploy.pytorch.spec_decode.spec_agent import SpecModelAgent

    forward = SpecModelAgent.async_model_forward
    if getattr(forward, _MARK, False):
        return

    async def async_model_forward(self, model_inputs, extra_inputs, sampling_inputs):
        out = await forward(self, model_inputs, extra_inputs, sampling_inputs)
        ctx = getattr(sampling_inputs, 'session_ctx', None) if sampling_inputs is not None else None
        _append(self, 'draft', out.output_draft_token_ids, model_inputs=model_inputs,
                sessions=[int(c.get('session_id', -1)) for c in ctx] if ctx else None)
        return out

    post_broadcast = BaseSpecModelAgent.post_broadcast

    @contextmanager
    def logged_post_broadcast(self, extra_inputs, dist_ctx, need_broadcast: bool):
        with post_broadcast(self, extra_inputs, dist_ctx, need_broadcast) as handle:
            yield handle
        # rank 0's drafts have arrived (the broadcast's handle has been waited for): what this rank verifies next
        if self.is_enabled():
            _append(self, 'verify', getattr(extra_inputs, 'output_draft_token_ids', None))

    setattr(async_model_forward, _MARK, True)
    SpecModelAgent.async_model_forward = async_model_forward
    BaseSpecModelAgent.post_broadcast = logged_post_broadcast
    logging.getLogger('lmdeploy_guided_spec').addHandler(_ErrorLog())


class _ErrorLog(logging.Handler):
    """Errors of the core in this process (a grammar that rejects a committed token) to
    ``<directory>/errors-pid<P>.jsonl``, one JSON string per line, as they are logged."""

    def __init__(self):
        super().__init__(logging.ERROR)

    def emit(self, record: logging.LogRecord) -> None:
        directory = os.environ.get(DRAFT_LOG_ENV)
        if directory:
            # the message, with its traceback where it has one
            with (Path(directory) / f'errors-pid{os.getpid()}.jsonl').open('a') as f:
                f.write(json.dumps(self.format(record)) + '\n')


def _append(agent, kind: str, drafts, model_inputs=None, sessions=None) -> None:
    directory = os.environ.get(DRAFT_LOG_ENV)
    if not directory:
        return
    counter = f'_draft_log_{kind}'
    step = getattr(agent, counter, 0)
    setattr(agent, counter, step + 1)
    record = {'kind': kind, 'step': step, 'drafts': None if drafts is None else drafts.tolist()}
    if model_inputs is not None:
        record.update(dummy=bool(model_inputs.is_dummy), decoding=bool(model_inputs.is_decoding), sessions=sessions)
    path = Path(directory) / f'drafts-rank{agent.rank}-pid{os.getpid()}.jsonl'
    with path.open('a') as f:
        f.write(json.dumps(record) + '\n')


def read_error_logs(directory: str | Path) -> list[str]:
    """The core's errors logged by the rank processes of a draft-log directory (none when every rank's grammar
    accepted every committed token)."""
    return [json.loads(line) for path in sorted(Path(directory).glob('errors-pid*.jsonl'))
            for line in path.read_text().splitlines() if line]


def read_draft_logs(directory: str | Path) -> dict[int, list[dict]]:
    """The draft logs of a directory by rank (one engine's ranks per directory)."""
    logs: dict[int, list[dict]] = {}
    for path in sorted(Path(directory).glob('drafts-rank*-pid*.jsonl')):
        rank = int(path.name[len('drafts-rank'):].split('-', 1)[0])
        logs.setdefault(rank, []).extend(json.loads(line) for line in path.read_text().splitlines() if line)
    return logs
