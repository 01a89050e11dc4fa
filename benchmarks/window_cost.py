"""Grammar work of one drafting window on the grammar worker, without a model: what must hide behind the device.

On a GPU the draft and target forwards of a speculative step take a few milliseconds, and the grammar worker's
work for the step (fork the committed matchers, fill the masks of ``k + 1`` positions, find forced tokens and
guesses, advance the forks by the drafted tokens) must fit beside them or the engine waits. The first GPU run showed
the engine thread waiting 47 ms of a 57 ms step at batch 128 (docs/en/gpu.md). This measures that work on the
host's CPU, the way ``SpecGrammarManager.begin_draft`` does it in an engine with a draft model, for real grammars
and a real tokenizer (``benchmarks/data/mask_overhead.json``: JSON schemas and regexes, rows started at random
points of valid instances), the drafts being the instances' own tokens.

Three settings, interleaved within each repetition: ``masks`` (forced drafts off), ``forced`` (forced drafts, no
guesses), ``default`` (forced drafts and guesses in windows, the engine's default). Columns per window (medians):
worker milliseconds, and the grammar's ``fill_next_token_bitmask`` calls that ran one by one (not those of one
``BatchGrammarMatcher`` call). Batch fill follows the engine's rule (at least 8 cores and 16 live rows);
``--batch-fill on|off`` forces it.

Last line: ``window_ms_b128 <default setting, batch 128, k=3, first tokenizer>``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mask_overhead import Workload, inline_managers, load_grammars  # noqa: E402

from lmdeploy_guided_spec.manager import SpecGrammarManager  # noqa: E402

SETTINGS = {'masks': dict(forced_drafts=False), 'forced': dict(forced_drafts=True, guess_drafts=False),
            'default': dict(forced_drafts=True, guess_drafts=True)}


class FillCounter:
    """Counts GrammarMatcher.fill_next_token_bitmask calls (the one-by-one fills) while installed."""

    def __init__(self):
        self.calls = 0
        self._original = xgr.GrammarMatcher.fill_next_token_bitmask

    def __enter__(self):
        original = self._original

        def fill(matcher, *args, **kwargs):
            self.calls += 1
            return original(matcher, *args, **kwargs)

        xgr.GrammarMatcher.fill_next_token_bitmask = fill
        return self

    def __exit__(self, *exc):
        xgr.GrammarMatcher.fill_next_token_bitmask = self._original


CLOCKS = {'wall': time.perf_counter, 'cpu': time.process_time}


def window(manager: SpecGrammarManager, workload: Workload, batch: int, k: int, session: int,
           clock=time.perf_counter) -> tuple[float, int]:
    """Worker seconds and one-by-one fills of one window whose drafts are the rows' instance tokens."""
    matchers = workload.matchers()
    paths = workload.rest(k + 1, 0)
    with FillCounter() as fills:
        began = clock()
        w = manager.begin_draft(matchers, batch, k, session_ids=list(range(session, session + batch)))
        for position in range(k):
            w.wait()
            w.advance(torch.tensor([[paths[row][position]] for row in range(batch)]))
        w.verification_masks()
        seconds = clock() - began
    manager.forget(list(range(session, session + batch)))
    return seconds, fills.calls


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizers', default='llama3,qwen3')
    parser.add_argument('--batches', default='8,32,128')
    parser.add_argument('--k', type=int, default=3)
    parser.add_argument('--reps', type=int, default=5)
    parser.add_argument('--batch-fill', choices=('auto', 'on', 'off'), default='auto')
    parser.add_argument('--clock', choices=tuple(CLOCKS), default='wall',
                        help='wall: elapsed time; cpu: CPU time of the process (steadier on a busy machine; counts '
                        'the threads of a batch fill together)')
    args = parser.parse_args(argv)
    batch_fill = None if args.batch_fill == 'auto' else args.batch_fill == 'on'
    headline = None
    print(f'cores: {os.cpu_count()}, k={args.k}, batch fill {args.batch_fill}, worker inline, {args.reps} reps, '
          f'{args.clock} clock')
    print(f'{"tokenizer":<9} {"B":>4} | ' + ' | '.join(f'{s + " ms":>11} {"fills":>6}' for s in SETTINGS))
    for name in args.tokenizers.split(','):
        grammars = load_grammars(name)
        managers = inline_managers(name, SETTINGS, batch_fill=batch_fill)
        for batch in [int(b) for b in args.batches.split(',')]:
            times = {s: [] for s in SETTINGS}
            fills = {s: [] for s in SETTINGS}
            for rep in range(args.reps + 1):
                workload = Workload(name, batch, rep, grammars)
                for setting, manager in managers.items():
                    seconds, calls = window(manager, workload, batch, args.k, 100_000 * rep, CLOCKS[args.clock])
                    if rep:  # the first repetition warms caches up
                        times[setting].append(seconds)
                        fills[setting].append(calls)
            cells = ' | '.join(f'{statistics.median(times[s]) * 1e3:>11.1f} {statistics.median(fills[s]):>6.0f}'
                               for s in SETTINGS)
            print(f'{name:<9} {batch:>4} | {cells}')
            if headline is None and batch == 128:
                headline = statistics.median(times['default']) * 1e3
    print(f'window_ms_b128 {headline:.1f}' if headline is not None else 'window_ms_b128 n/a (batch 128 not run)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
