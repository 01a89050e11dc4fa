"""Grammar work of one commit on the grammar worker: what the engine waits for once per speculative step.

After verification the engine queues the commit of each guided row's accepted tokens (up to ``k + 1``); the next
drafting window forks the committed matchers after it, and ``pop_guided_errors`` waits for it. Beside advancing the
matchers, a commit records what each request wrote, for guessed drafts (its whitespace layout and punctuation
tokens) and forced text (the jump-forward memo). With free drafts of a draft model
(``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0``, ``SpecGrammarManager(draft_model=True)``) nothing reads those, and the
manager keeps none.

Real grammars and a real tokenizer (``benchmarks/data/mask_overhead.json``), rows started at random points of valid
instances and committed along them, ``k + 1`` tokens per row per step. Two managers, interleaved within each
repetition: ``default`` (the bookkeeping on, as with masked drafts or draft-free methods) and ``free drafts``.
Columns (medians, ms per commit): the first step of new requests and the later steps of running ones.

Last line: ``commit_free_vs_default_b128 <steady free-drafts / default, batch 128, first tokenizer>``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mask_overhead import Workload, inline_managers, load_grammars  # noqa: E402

from lmdeploy_guided_spec.manager import SpecGrammarManager  # noqa: E402

SETTINGS = {'default': dict(draft_masks=True, draft_model=True),
            'free drafts': dict(draft_masks=False, draft_model=True)}


def run(manager: SpecGrammarManager, workload: Workload, k: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` commits of ``k + 1`` tokens per row, along the rows' instances."""
    matchers = workload.matchers()
    paths = workload.rest((k + 1) * steps, -1)
    seconds = []
    for step in range(steps):
        rows = [path[step * (k + 1):(step + 1) * (k + 1)] for path in paths]
        began = time.perf_counter()
        manager.commit(matchers, rows)
        seconds.append(time.perf_counter() - began)
    manager.forget(list(range(len(paths))))
    return seconds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizers', default='llama3,qwen3')
    parser.add_argument('--batches', default='32,128')
    parser.add_argument('--k', type=int, default=3)
    parser.add_argument('--steps', type=int, default=6)
    parser.add_argument('--reps', type=int, default=5)
    args = parser.parse_args(argv)
    headline = None
    print(f'cores: {os.cpu_count()}, k={args.k}, {args.steps} steps per request, worker inline, {args.reps} reps')
    print(f'{"tokenizer":<9} {"B":>4} | ' + ' | '.join(f'{s + " first":>18} {"later":>7}' for s in SETTINGS)
          + ' | free / default')
    for name in args.tokenizers.split(','):
        grammars = load_grammars(name)
        managers = inline_managers(name, SETTINGS)
        for batch in [int(b) for b in args.batches.split(',')]:
            first = {s: [] for s in SETTINGS}
            later = {s: [] for s in SETTINGS}
            for rep in range(args.reps + 1):
                workload = Workload(name, batch, rep, grammars)
                for setting, manager in managers.items():
                    seconds = run(manager, workload, args.k, args.steps)
                    if rep:  # the first repetition warms caches up
                        first[setting].append(seconds[0])
                        later[setting].extend(seconds[1:])
            ms = {s: (statistics.median(first[s]) * 1e3, statistics.median(later[s]) * 1e3) for s in SETTINGS}
            ratio = ms['free drafts'][1] / ms['default'][1]
            cells = ' | '.join(f'{ms[s][0]:>18.2f} {ms[s][1]:>7.2f}' for s in SETTINGS)
            # three significant figures: a ratio below 0.005 is not 0 (a loaded machine's outliers)
            print(f'{name:<9} {batch:>4} | {cells} | {ratio:.3g}')
            if headline is None and batch == 128:
                headline = ratio
    print(f'commit_free_vs_default_b128 {headline:.3g}' if headline is not None
          else 'commit_free_vs_default_b128 n/a (batch 128 not run)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
