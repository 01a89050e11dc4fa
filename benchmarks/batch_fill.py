"""Filling one draft position for a batch: a Python loop of fill_next_token_bitmask vs xgrammar's BatchGrammarMatcher.

Real tokenizer (Qwen3, 151,936-padded vocabulary), the grammars of benchmarks/data/mask_overhead.json, states
spread along valid instances. Prints per-batch medians and the core count; the last line is
``batch_fill_speedup <loop time / batch time at B=32>`` (above 1: BatchGrammarMatcher is faster here).
SpecGrammarManager uses BatchGrammarMatcher from 16 live rows on machines with at least 8 cores.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import xgrammar as xgr

from lmdeploy_guided_spec import testing

sys.path.insert(0, os.path.dirname(__file__))
from mask_overhead import Workload, load_grammars  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizer', default='qwen3')
    parser.add_argument('--batches', default='8,32,128')
    parser.add_argument('--reps', type=int, default=30)
    args = parser.parse_args(argv)
    vocab = testing.TOKENIZERS[args.tokenizer].model_vocab_size
    grammars = load_grammars(args.tokenizer)
    batch_matcher = xgr.BatchGrammarMatcher()
    print(f'cores: {os.cpu_count()}, tokenizer {args.tokenizer} (vocab {vocab})')
    print(f'{"B":>5} {"loop us":>10} {"batch us":>10} {"speedup":>8}')
    speedup32 = None
    for batch in map(int, args.batches.split(',')):
        matchers = list(Workload(args.tokenizer, batch, seed=batch, grammars=grammars).matchers().values())
        bitmask = xgr.allocate_token_bitmask(batch, vocab)
        loop_t, batch_t = [], []
        for _ in range(args.reps):
            start = time.perf_counter()
            for i, m in enumerate(matchers):
                m.fill_next_token_bitmask(bitmask, i)
            loop_t.append(time.perf_counter() - start)
            start = time.perf_counter()
            batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
            batch_t.append(time.perf_counter() - start)
        lo, ba = statistics.median(loop_t), statistics.median(batch_t)
        print(f'{batch:>5} {lo * 1e6:>10.0f} {ba * 1e6:>10.0f} {lo / ba:>8.2f}')
        if batch == 32:
            speedup32 = lo / ba
    if speedup32 is None:
        print('batch_fill_speedup n/a')
        return 1
    print(f'batch_fill_speedup {speedup32:.2f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
