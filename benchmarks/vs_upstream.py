"""lmdeploy 0.18.0's own guided speculative decoding against the 0.18.0 series, on the same engine.

Two Python environments with lmdeploy 0.18.0 run the same requests through lmdeploy's own ``pipeline``, each in a
worker process of its own that lives for the whole run (one engine per method):

* **upstream**: lmdeploy 0.18.0 as released (its ``GuidedSpecHelper`` masks the drafts position by position on
  forks, masks the verification logits position by position on new forks, and accepts the committed tokens, each
  fill and accept loop awaited in ``asyncio.to_thread`` on the engine's critical path);
* **ours**: lmdeploy 0.18.0 with ``patches/lmdeploy-0.18.0/`` applied (``SpecGrammarManager``: drafting windows on
  the core's grammar worker, verification masks reused from the window, queued commits, forced drafts and guesses
  in windows), with the core's defaults.

Same model, draft, requests, JSON schemas, ``k`` and batch sizes on both sides, greedy; on the CPU path by default
(``--device cuda`` runs the same code on a GPU, without the CPU path). The requests are the prompts and schemas of
``benchmarks/data/forced_schemas/`` (extraction records), ``response_format`` ``json_schema``, one batch of ``B``
requests started together.

Instrumentation: the worker process wraps, before the engine starts and without changing lmdeploy's files, the
grammar entry points on the engine's critical path:

* upstream: ``GuidedSpecHelper``'s methods (``prepare_bitmask``, ``apply_bitmask``, ``accept_draft_tokens``,
  ``apply_serial_bitmask``, ``accept_rejection_sampled_tokens``, ``get_processors``, ``cleanup_sessions``), the
  ``GrammarMatcher.fork`` calls the spec agent makes before drafting, and Eagle3's ``_translate_bitmask``;
* ours: ``SpecGrammarManager.begin_draft``/``apply_``/``commit_async``/``forget``, ``DraftGrammar.mask_logits_``/
  ``advance``, the spec agent's ``_get_guided_matchers``, ``_cleanup_guided_sessions`` and ``pop_guided_errors``
  (which waits for the last queued commit), and its awaited ``asyncio.to_thread`` calls (verification masks);
* both: ``GuidedDecodingManager.get_processors`` / ``allocate_batched_bitmap`` / ``apply_batched_bitmap``.

Per verification step (the interval from one decoding ``SpecModelAgent.async_sampling_logits`` call to the next:
rejection sampling, drafting, engine bookkeeping and the next target forward), measured only where the whole batch
of ``B`` requests is running:

* ``exposed``: wall time (``perf_counter``) the engine thread spends inside those entry points, awaits included
  (thread hops, waits for the grammar worker, blocking device reads), outermost calls only;
* ``grammar CPU``: CPU time (``thread_time``) of grammar work on any thread: the entry points on the engine thread,
  every ``asyncio.to_thread`` job they start, and every job of the core's grammar worker (outermost per thread). Python
  glue inside the spec agent between two entry points (reading the draft ids, for instance) is not counted;
* ``wall``: median wall time of a step;
* ``tok/fwd``: tokens a request gets per target forward (accepted drafts plus one), over every decoding step of the
  run.

Outputs are compared token for token between the two sides (greedy); a difference is reported and makes the exit
status 1. Every (method, batch) cell runs on one side right after the other (``--reps N`` runs it N times per side,
alternating which side goes first, and pools the steps), so drifts of a shared machine fall on both. On the CPU
the forward and the grammar threads share the host's cores (``--threads`` torch threads, default 1, leaves the
other core of a 2-core machine to grammar work); compare the two sides as ratios. ``--breakdown`` adds the exposed
time per entry point. ``--device cuda`` runs the same code on a GPU without the CPU path (``--model``/``--draft``
for real checkpoints; lmdeploy 0.18.0 as released needs FlashAttention-3 there).

Needs two environments, e.g. ``bash scripts/setup.sh`` (``.venv/``, ours, the default
``--ours-python``) and the same with ``--venv .venv-0.18.0-upstream`` followed by
``.venv-0.18.0-upstream/bin/lmdeploy-guided-spec revert`` (the default ``--upstream-python``).

Last line: ``vs_upstream_exposed_ratio <ours / upstream exposed time per step, eagle3, batch 32, k=3>``.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import contextvars
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCHEMAS = ROOT / 'benchmarks' / 'data' / 'forced_schemas'
SIDES = ('upstream', 'ours')
#: method -> (target, draft) of the CPU path's named models (None: the draft lives in the target checkpoint)
METHODS = {'eagle3': ('tiny-llama', 'tiny-llama-eagle3'), 'deepseek_mtp': ('tiny-deepseek-mtp', None)}
HEADLINE = ('eagle3', 32)


# -- per-step samples and the table (pure; tests/unit/test_vs_upstream.py) ------------------------------------------
@dataclass
class Step:
    """One verification step of one side: from a decoding sampling call to the next."""
    rows: int
    wall: float
    exposed: float
    cpu: float


@dataclass
class Cell:
    """What one side measured for one (method, batch)."""
    steps: list[Step] = field(default_factory=list)
    #: tokens committed and request-forwards (one per row of every decoding step)
    tokens: int = 0
    row_forwards: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    #: exposed seconds per entry point, summed over the steps where the whole batch ran
    breakdown: dict[str, float] = field(default_factory=dict)
    #: pooled runs of this cell gave different outputs
    unstable: bool = False

    def full(self, batch: int) -> list[Step]:
        """The steps where the whole batch ran."""
        return [s for s in self.steps if s.rows == batch]

    def summary(self, batch: int) -> dict:
        """Per-step means of ``exposed`` and ``cpu``, median ``wall`` (seconds), tokens per forward, step count."""
        full = self.full(batch)
        if not full:
            return dict(steps=0, wall=float('nan'), exposed=float('nan'), cpu=float('nan'),
                        tok_per_fwd=self.tokens_per_forward())
        return dict(steps=len(full), wall=statistics.median(s.wall for s in full),
                    exposed=statistics.fmean(s.exposed for s in full), cpu=statistics.fmean(s.cpu for s in full),
                    tok_per_fwd=self.tokens_per_forward())

    def tokens_per_forward(self) -> float:
        return self.tokens / self.row_forwards if self.row_forwards else float('nan')

    def merge(self, other: Cell) -> None:
        """Pool another run of the same cell; outputs that differ from this run's are kept as a differing run."""
        self.steps += other.steps
        self.tokens += other.tokens
        self.row_forwards += other.row_forwards
        for name, spent in other.breakdown.items():
            self.breakdown[name] = self.breakdown.get(name, 0.0) + spent
        self.unstable = self.unstable or other.outputs != self.outputs or other.unstable

    def to_json(self) -> dict:
        return dict(steps=[[s.rows, s.wall, s.exposed, s.cpu] for s in self.steps], tokens=self.tokens,
                    row_forwards=self.row_forwards, outputs=self.outputs, breakdown=self.breakdown)

    @classmethod
    def from_json(cls, data: dict) -> Cell:
        return cls([Step(*s) for s in data['steps']], data['tokens'], data['row_forwards'], data['outputs'],
                   data.get('breakdown', {}))


def ratio(ours: float, upstream: float) -> float:
    """``ours / upstream``; NaN where upstream is zero or missing."""
    if not upstream or upstream != upstream or ours != ours:
        return float('nan')
    return ours / upstream


def differing(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Indices of the requests whose token ids differ (a missing request differs)."""
    return [i for i in range(max(len(a), len(b))) if i >= len(a) or i >= len(b) or a[i] != b[i]]


def same_outputs(up: Cell, ours: Cell) -> str:
    """``yes``, or ``NO (differing/requests)``, or ``NO (repetitions differ)``."""
    if up.unstable or ours.unstable:
        return 'NO (repetitions differ)'
    diff = differing(up.outputs, ours.outputs)
    return f'NO ({len(diff)}/{max(len(up.outputs), len(ours.outputs))})' if diff else 'yes'


def table(results: dict, methods: list[str], batches: list[int], k: int) -> list[str]:
    """Lines of the side-by-side table. ``results[side][(method, batch)]`` is a :class:`Cell`."""
    head = (f'{"method":<13} {"B":>3} {"k":>2} | {"exposed ms/step":^19} | {"grammar CPU ms/step":^19} | '
            f'{"wall ms/step":^19} | {"tok/fwd":^11} | {"steps":^9} | {"exposed":>7} {"CPU":>5} {"wall":>5} | same')
    sub = (f'{"":<13} {"":>3} {"":>2} | {"upstream":>9} {"ours":>9} | {"upstream":>9} {"ours":>9} | '
           f'{"upstream":>9} {"ours":>9} | {"up":>5} {"ours":>5} | {"up":>4} {"ours":>4} | {"ratio":>7} '
           f'{"ratio":>5} {"ratio":>5} | output')
    lines = [head, sub]
    for method in methods:
        for batch in batches:
            up, ours = results['upstream'].get((method, batch)), results['ours'].get((method, batch))
            if up is None or ours is None:
                continue
            u, o = up.summary(batch), ours.summary(batch)
            same = same_outputs(up, ours)
            lines.append(
                f'{method:<13} {batch:>3} {k:>2} | {u["exposed"] * 1e3:>9.2f} {o["exposed"] * 1e3:>9.2f} | '
                f'{u["cpu"] * 1e3:>9.2f} {o["cpu"] * 1e3:>9.2f} | {u["wall"] * 1e3:>9.1f} {o["wall"] * 1e3:>9.1f} | '
                f'{u["tok_per_fwd"]:>5.2f} {o["tok_per_fwd"]:>5.2f} | {u["steps"]:>4} {o["steps"]:>4} | '
                f'{ratio(o["exposed"], u["exposed"]):>7.3f} {ratio(o["cpu"], u["cpu"]):>5.2f} '
                f'{ratio(o["wall"], u["wall"]):>5.2f} | {same}')
    return lines


def one_side_table(cells: dict, side: str, methods: list[str], batches: list[int], k: int) -> list[str]:
    """Lines of one side's table (``--sides``): ``cells[(method, batch)]`` is a :class:`Cell`."""
    lines = [f'{side}: {"method":<13} {"B":>3} {"k":>2} | {"exposed ms/step":>15} | {"grammar CPU ms/step":>19} | '
             f'{"wall ms/step":>12} | {"tok/fwd":>7} | {"steps":>5}']
    for method in methods:
        for batch in batches:
            cell = cells.get((method, batch))
            if cell is None:
                continue
            c = cell.summary(batch)
            lines.append(f'{side}: {method:<13} {batch:>3} {k:>2} | {c["exposed"] * 1e3:>15.2f} | '
                         f'{c["cpu"] * 1e3:>19.2f} | {c["wall"] * 1e3:>12.1f} | {c["tok_per_fwd"]:>7.2f} | '
                         f'{c["steps"]:>5}')
    return lines


def breakdown(results: dict, methods: list[str], batches: list[int]) -> list[str]:
    """Lines: exposed ms per step of every entry point, per side and cell, largest first."""
    lines = []
    for method in methods:
        for batch in batches:
            for side in SIDES:
                c = results[side].get((method, batch))
                steps = len(c.full(batch)) if c is not None else 0
                if not steps:
                    continue
                parts = sorted(c.breakdown.items(), key=lambda item: -item[1])
                lines.append(f'{method} B={batch} {side}: ' +
                             ', '.join(f'{name} {spent / steps * 1e3:.2f}' for name, spent in parts))
    return lines


def headline(results: dict, method: str = HEADLINE[0], batch: int = HEADLINE[1]) -> float:
    """Exposed time per step, ours / upstream, of one cell (NaN when it was not run)."""
    up, ours = results['upstream'].get((method, batch)), results['ours'].get((method, batch))
    if up is None or ours is None:
        return float('nan')
    return ratio(ours.summary(batch)['exposed'], up.summary(batch)['exposed'])


def goals(results: dict, methods: list[str], batches: list[int]) -> list[str]:
    """The goals that were missed: exposed ratio <= 0.25 at the headline cell, ours' wall per step below upstream's at
    every batch >= 8, identical outputs."""
    missed = []
    value = headline(results)
    if not value <= 0.25:
        missed.append(f'exposed ratio at {HEADLINE[0]} B={HEADLINE[1]} is {value:.3f} (goal <= 0.25)')
    for method in methods:
        for batch in batches:
            up, ours = results['upstream'].get((method, batch)), results['ours'].get((method, batch))
            if up is None or ours is None:
                continue
            if batch >= 8 and not ours.summary(batch)['wall'] < up.summary(batch)['wall']:
                missed.append(f'{method} B={batch}: wall per step is not lower than upstream\'s')
            if same_outputs(up, ours) != 'yes':
                missed.append(f'{method} B={batch}: outputs differ from upstream\'s')
    return missed


# -- instrumentation (in the worker process) --------------------------------------------------------------------------
class Meter:
    """Exposed wall time on the engine thread and grammar CPU time on any thread, outermost calls only."""

    def __init__(self):
        self.exposed = 0.0
        self.cpu = 0.0
        self.engine_thread: int | None = None
        #: exposed seconds per entry point name (for --breakdown)
        self.by_name: dict[str, float] = collections.defaultdict(float)
        self._exposed_depth = contextvars.ContextVar('vs_upstream_exposed_depth', default=0)
        self._cpu_depth = threading.local()
        self._lock = threading.Lock()

    def _on_engine(self) -> bool:
        return threading.get_ident() == self.engine_thread

    # grammar CPU: per thread, the outermost timed call counts
    def cpu_wrap(self, fn):
        meter = self

        def timed(*args, **kwargs):
            depth = getattr(meter._cpu_depth, 'n', 0)
            meter._cpu_depth.n = depth + 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                meter._cpu_depth.n = depth
                if depth == 0:
                    spent = time.thread_time() - start
                    with meter._lock:
                        meter.cpu += spent
        return timed

    # exposed: on the engine thread, per asyncio task, the outermost timed call (sync or awaited) counts
    def _enter(self):
        if not self._on_engine():
            return None
        depth = self._exposed_depth.get()
        return self._exposed_depth.set(depth + 1), depth, time.perf_counter()

    def _leave(self, entered, name: str) -> None:
        if entered is None:
            return
        token, depth, start = entered
        self._exposed_depth.reset(token)
        if depth == 0:
            spent = time.perf_counter() - start
            self.exposed += spent
            self.by_name[name] += spent

    def wrap(self, fn):
        """Time a sync entry point: exposed on the engine thread, and its CPU time."""
        cpu_timed, meter, name = self.cpu_wrap(fn), self, fn.__qualname__

        def timed(*args, **kwargs):
            entered = meter._enter()
            try:
                return cpu_timed(*args, **kwargs)
            finally:
                meter._leave(entered, name)
        timed.__wrapped__ = fn
        return timed

    def wrap_async(self, fn, name: str | None = None):
        """Time an awaited entry point (its CPU is counted by the sync calls and thread jobs inside it)."""
        meter, name = self, name or fn.__qualname__

        async def timed(*args, **kwargs):
            entered = meter._enter()
            try:
                return await fn(*args, **kwargs)
            finally:
                meter._leave(entered, name)
        timed.__wrapped__ = fn
        return timed


class _TimedAsyncio:
    """Stands in for the ``asyncio`` module inside one lmdeploy module: ``to_thread`` jobs count as grammar CPU and,
    with ``exposed``, their awaits as exposed time."""

    def __init__(self, meter: Meter, exposed: bool):
        self._meter = meter
        self._exposed = exposed

    def __getattr__(self, name):
        return getattr(asyncio, name)

    async def to_thread(self, fn, /, *args, **kwargs):
        job = asyncio.to_thread(self._meter.cpu_wrap(fn), *args, **kwargs)
        if not self._exposed:
            return await job

        async def waited():
            return await job
        return await self._meter.wrap_async(waited, f'to_thread({getattr(fn, "__qualname__", fn)})')()


def _patch(owner, name: str, wrapper) -> None:
    setattr(owner, name, wrapper(getattr(owner, name)))


def instrument(meter: Meter, side: str) -> None:
    """Wrap the grammar entry points of ``side`` (see the module docstring)."""
    import xgrammar as xgr
    from lmdeploy.pytorch.engine import guided_process
    from lmdeploy.pytorch.spec_decode import spec_agent

    manager = guided_process.GuidedDecodingManager
    for name in ('get_processors', 'allocate_batched_bitmap', 'apply_batched_bitmap', 'remove_processor'):
        _patch(manager, name, meter.wrap)
    if side == 'upstream':
        from lmdeploy.pytorch.spec_decode import guided_spec_helper
        from lmdeploy.pytorch.spec_decode.proposers import eagle3
        helper = guided_spec_helper.GuidedSpecHelper
        for name in ('prepare_bitmask', 'accept_draft_tokens', 'apply_serial_bitmask',
                     'accept_rejection_sampled_tokens'):
            _patch(helper, name, meter.wrap_async)
        for name in ('apply_bitmask', 'get_processors', 'cleanup_sessions'):
            _patch(helper, name, meter.wrap)
        # the spec agent forks the committed matchers on the engine thread before drafting
        _patch(xgr.GrammarMatcher, 'fork', meter.wrap)
        _patch(eagle3.Eagle3, '_translate_bitmask', meter.wrap)
        guided_spec_helper.asyncio = _TimedAsyncio(meter, exposed=False)
    else:
        from lmdeploy_guided_spec import manager as core_manager
        from lmdeploy_guided_spec import worker as core_worker
        from lmdeploy_guided_spec.draft import DraftGrammar
        core = core_manager.SpecGrammarManager
        for name in ('begin_draft', 'apply_', 'commit_async', 'forget'):
            _patch(core, name, meter.wrap)
        for name in ('mask_logits_', 'advance'):
            _patch(DraftGrammar, name, meter.wrap)
        agent = spec_agent.SpecModelAgent
        for name in ('_get_guided_matchers', '_cleanup_guided_sessions', 'pop_guided_errors'):
            _patch(agent, name, meter.wrap)
        submit = core_worker.GrammarWorker.submit

        def timed_submit(self, fn, *args, **kwargs):
            return submit(self, meter.cpu_wrap(fn), *args, **kwargs)
        core_worker.GrammarWorker.submit = timed_submit
        spec_agent.asyncio = _TimedAsyncio(meter, exposed=True)


class StepClock:
    """Cuts the run into verification steps at every decoding ``SpecModelAgent.async_sampling_logits`` call."""

    def __init__(self, meter: Meter, k: int):
        self.meter, self.k = meter, k
        self.cell = Cell()
        self.batch = 0
        self._open = None  # (rows, start wall, exposed, cpu, exposed per entry point) of the step in progress

    def begin(self, batch: int) -> Cell:
        self.cell, self.batch, self._open = Cell(), batch, None
        return self.cell

    def end(self) -> Cell:
        self._open = None
        return self.cell

    def install(self) -> None:
        from lmdeploy.pytorch.spec_decode.spec_agent import SpecModelAgent
        original, clock = SpecModelAgent.async_sampling_logits, self

        async def async_sampling_logits(agent, model_inputs, extra_inputs, sampling_inputs):
            clock.meter.engine_thread = threading.get_ident()
            clock._cut(model_inputs)
            out = await original(agent, model_inputs, extra_inputs, sampling_inputs)
            if model_inputs.is_decoding and not model_inputs.is_dummy:
                rejected = out.num_rejected_tokens.tolist()
                clock.cell.tokens += sum(clock.k + 1 - r for r in rejected)
                clock.cell.row_forwards += len(rejected)
            return out

        SpecModelAgent.async_sampling_logits = async_sampling_logits

    def _cut(self, model_inputs) -> None:
        now, meter = time.perf_counter(), self.meter
        if self._open is not None:
            rows, start, exposed, cpu, by_name = self._open
            self.cell.steps.append(Step(rows, now - start, meter.exposed - exposed, meter.cpu - cpu))
            if rows == self.batch:
                for name, spent in meter.by_name.items():
                    if spent > by_name.get(name, 0.0):
                        self.cell.breakdown[name] = self.cell.breakdown.get(name, 0.0) + spent - by_name.get(name, 0.0)
            self._open = None
        if model_inputs.is_decoding and not model_inputs.is_dummy:
            self._open = (int(model_inputs.seq_length.size(0)), now, meter.exposed, meter.cpu, dict(meter.by_name))


def load_requests(count: int) -> list[dict]:
    """``count`` requests: the prompts and schemas of ``benchmarks/data/forced_schemas/``, in turn."""
    items = [json.loads(p.read_text()) for p in sorted(SCHEMAS.glob('*.json'))]
    out = []
    for i in range(count):
        item = items[i % len(items)]
        fmt = {'type': 'json_schema', 'json_schema': {'name': item['name'], 'schema': item['schema']}}
        out.append(dict(prompt=f'Extract a JSON record from this text. {item["prompt"]}', format=fmt))
    return out


def side_of_installed_lmdeploy() -> str:
    """``ours`` where the 0.18.0 series is applied to the installed lmdeploy, else ``upstream``."""
    from lmdeploy.pytorch.spec_decode import spec_agent
    return 'ours' if hasattr(spec_agent.SpecModelAgent, 'pop_guided_errors') else 'upstream'


def worker(spec: dict) -> None:
    """Serve the parent: one line of JSON ``{"method", "batch"}`` on stdin runs that cell and prints one RESULT line."""
    if spec['device'] == 'cpu':
        from lmdeploy_guided_spec.support.harness import enable_cpu_triton
        enable_cpu_triton()
        from lmdeploy_guided_spec import cpu
        cpu.activate()
    import torch
    if spec['threads']:
        torch.set_num_threads(spec['threads'])
    import lmdeploy
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec.cpu import models

    side = side_of_installed_lmdeploy()
    if side != spec['side']:
        raise SystemExit(f'{sys.executable}: lmdeploy {lmdeploy.__version__} here is {side!r}, asked for '
                         f'{spec["side"]!r} (upstream: the series reverted; ours: applied)')
    if not lmdeploy.__version__.startswith('0.18.'):
        raise SystemExit(f'{sys.executable}: lmdeploy {lmdeploy.__version__}; this benchmark compares lmdeploy 0.18')
    meter = Meter()
    instrument(meter, side)
    clock = StepClock(meter, spec['k'])
    clock.install()
    requests = load_requests(max(spec['batches']))
    engine = None  # (method, pipeline)

    def configs(batch: int, max_new_tokens: int):
        return [GenerationConfig(response_format=r['format'], max_new_tokens=max_new_tokens, do_sample=False)
                for r in requests[:batch]]

    def start(method: str):
        target, draft = METHODS[method]
        target, draft = spec.get('model') or target, spec.get('draft') or draft
        speculative = SpeculativeConfig(method=method, model=models.resolve(draft) if draft else '',
                                        num_speculative_tokens=spec['k'])
        began = time.perf_counter()
        pipe = pipeline(models.resolve(target),
                        backend_config=PytorchEngineConfig(max_batch_size=max(spec['batches']),
                                                           cache_max_entry_count=spec['cache'], session_len=4096),
                        speculative_config=speculative, log_level='ERROR')
        # warm-up: every schema compiled once, every batch size run once
        for batch in spec['batches']:
            pipe([r['prompt'] for r in requests[:batch]], gen_config=configs(batch, spec['k'] + 2))
        print(f'  {side} {method}: engine started and warmed up in {time.perf_counter() - began:.1f} s',
              file=sys.stderr, flush=True)
        return pipe

    print('READY', flush=True)
    try:
        for line in sys.stdin:
            command = json.loads(line)
            method, batch = command['method'], command['batch']
            if engine is None or engine[0] != method:
                if engine is not None:
                    engine[1].close()
                engine = None
                engine = (method, start(method))
            cell = clock.begin(batch)
            began = time.perf_counter()
            outs = engine[1]([r['prompt'] for r in requests[:batch]], gen_config=configs(batch, spec['max_new_tokens']))
            seconds = time.perf_counter() - began
            clock.end()
            cell.outputs = [list(o.token_ids) for o in outs]
            s = cell.summary(batch)
            print(f'  {side} {method} B={batch}: {seconds:.1f} s, {s["steps"]} steps of the whole batch, exposed '
                  f'{s["exposed"] * 1e3:.2f} ms/step, wall {s["wall"] * 1e3:.1f} ms/step', file=sys.stderr, flush=True)
            # the largest entry points at once, so a run cut off before its table still shows where the time went
            steps = len(cell.full(batch))
            if steps:
                top = sorted(cell.breakdown.items(), key=lambda item: -item[1])[:4]
                parts = ', '.join(f'{name} {spent / steps * 1e3:.2f}' for name, spent in top)
                print(f'  {side} {method} B={batch}: exposed ms/step by entry point: {parts}', file=sys.stderr,
                      flush=True)
            print('RESULT ' + json.dumps(cell.to_json()), flush=True)
    finally:
        if engine is not None:
            engine[1].close()


# -- the parent process -----------------------------------------------------------------------------------------------
class Side:
    """A worker process of one side, kept for the whole run (its engine is started once per method)."""

    def __init__(self, side: str, python: str, args):
        self.side, self.python = side, python
        spec = dict(side=side, device=args.device, methods=args.methods.split(','),
                    batches=[int(b) for b in args.batches.split(',')], k=args.k, max_new_tokens=args.max_new_tokens,
                    threads=args.threads, cache=args.cache_max_entry_count, model=args.model, draft=args.draft)
        env = dict(os.environ)
        if args.device == 'cpu':
            env.setdefault('LMDEPLOY_GUIDED_SPEC_CPU_MEMORY_GB', '4')
        else:
            env.pop('LMDEPLOY_GUIDED_SPEC_DEVICE', None)  # the .pth hook would put the engine on the CPU path
        self.tail: collections.deque[str] = collections.deque(maxlen=40)
        self.proc = subprocess.Popen([python, str(Path(__file__).resolve()), '--worker', json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=env, cwd=ROOT)
        # the worker's progress lines are shown; the rest of its stderr (lmdeploy's and transformers' messages) only
        # when it fails
        self._stderr = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr.start()
        self._read('READY')

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            self.tail.append(line)
            if line.startswith(f'  {self.side} '):
                print(line, end='', file=sys.stderr, flush=True)

    def _read(self, prefix: str) -> str:
        stdout: collections.deque[str] = collections.deque(maxlen=20)
        for line in self.proc.stdout:
            if line.startswith(prefix):
                return line[len(prefix):]
            stdout.append(line)  # lmdeploy logs some errors to stdout
        self.proc.wait()
        self._stderr.join(timeout=5)
        sys.stderr.writelines(list(self.tail) + list(stdout))
        raise SystemExit(f'{self.side} ({self.python}) failed with exit code {self.proc.returncode}')

    def run(self, method: str, batch: int) -> Cell:
        self.proc.stdin.write(json.dumps(dict(method=method, batch=batch)) + '\n')
        self.proc.stdin.flush()
        return Cell.from_json(json.loads(self._read('RESULT ')))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--upstream-python', default=str(ROOT / '.venv-0.18.0-upstream' / 'bin' / 'python'),
                        help='Python of an environment with lmdeploy 0.18.0 as released (the series reverted); '
                             'default: .venv-0.18.0-upstream/bin/python')
    parser.add_argument('--ours-python', default=str(ROOT / '.venv' / 'bin' / 'python'),
                        help='Python of an environment with lmdeploy 0.18.0 and its series applied; '
                             'default: .venv/bin/python')
    parser.add_argument('--methods', default='eagle3,deepseek_mtp', help='comma list of eagle3, deepseek_mtp')
    parser.add_argument('--batches', default='1,8,32')
    parser.add_argument('--k', type=int, default=3, help='draft tokens per step')
    parser.add_argument('--max-new-tokens', type=int, default=48)
    parser.add_argument('--threads', type=int, default=None,
                        help='torch threads of each engine process (default: 1 on the CPU path; on CUDA torch\'s own)')
    parser.add_argument('--breakdown', action='store_true', help='also print exposed ms per step of each entry point')
    parser.add_argument('--cache-max-entry-count', type=float, default=0.2)
    parser.add_argument('--device', choices=('cpu', 'cuda'), default='cpu',
                        help='cpu: the CPU path; cuda: a GPU, lmdeploy as installed (FlashAttention-3 for upstream)')
    parser.add_argument('--model', help='target checkpoint or CPU-path model name (default: the method\'s tiny model)')
    parser.add_argument('--draft', help='draft checkpoint or CPU-path model name (default: the method\'s tiny draft)')
    parser.add_argument('--reps', type=int, default=1,
                        help='runs of every cell per side, interleaved with the other side\'s; steps are pooled')
    parser.add_argument('--sides', default=','.join(SIDES),
                        help='comma list of upstream, ours (default both); one side prints its own figures only, '
                             'e.g. where upstream cannot start (lmdeploy 0.18.0 without FlashAttention-3 on CUDA)')
    parser.add_argument('--worker', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.threads is None and args.device == 'cpu':
        args.threads = 1
    if args.worker:
        worker(json.loads(args.worker))
        return 0
    methods = args.methods.split(',')
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f'unknown method(s) {unknown}; choose from {list(METHODS)}')
    batches = [int(b) for b in args.batches.split(',')]
    run_sides = tuple(side for side in SIDES if side in args.sides.split(','))
    if not run_sides or set(args.sides.split(',')) - set(SIDES):
        parser.error(f'--sides {args.sides}: choose from {",".join(SIDES)}')
    pythons = {side: python for side, python in
               (('upstream', args.upstream_python), ('ours', args.ours_python)) if side in run_sides}
    for side, python in pythons.items():
        if not Path(python).exists():
            parser.error(f'--{side}-python {python} does not exist (see docs/en/versions.md for how to build it)')
    sides = {}
    try:
        for side in run_sides:
            sides[side] = Side(side, pythons[side], args)
        results = {side: {} for side in SIDES}
        for method in methods:
            for batch in batches:
                for rep in range(args.reps):
                    # one side right after the other, the first side alternating: drifts of a shared machine fall on
                    # both
                    order = run_sides if rep % 2 == 0 else run_sides[::-1]
                    for side in order:
                        cell = sides[side].run(method, batch)
                        merged = results[side].setdefault((method, batch), cell)
                        if merged is not cell:
                            merged.merge(cell)
    finally:
        for worker_side in sides.values():
            worker_side.close()
    for side in run_sides:
        print(f'{side}: {pythons[side]}')
    print()
    lines = table(results, methods, batches, args.k) if len(run_sides) == 2 else \
        one_side_table(results[run_sides[0]], run_sides[0], methods, batches, args.k)
    for line in lines:
        print(line)
    if args.breakdown:
        print('\nexposed ms per step, by entry point:')
        for line in breakdown(results, methods, batches):
            print(f'  {line}')
    print(f'\n{args.device}, torch threads {args.threads or "default"}, greedy, json_schema requests '
          f'(benchmarks/data/forced_schemas), max_new_tokens {args.max_new_tokens}; per step: exposed and grammar CPU '
          'are means, wall the median, over the steps where the whole batch ran.')
    missed = goals(results, methods, batches) if len(run_sides) == 2 else []
    for line in missed:
        print(f'goal missed: {line}')
    print(f'vs_upstream_exposed_ratio {headline(results):.3f}')
    outputs_differ = any('outputs differ' in line for line in missed)
    return 1 if outputs_differ else 0


if __name__ == '__main__':
    sys.exit(main())
