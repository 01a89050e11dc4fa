"""The grammar worker and the engine thread share one GIL: who waits for whom.

The grammar worker is a thread of the engine's process. Its work is thousands of short calls into xgrammar per
speculative step (forks, accepts, fills, jump-forward strings), and every call releases the GIL and takes it back.

1. The worker beside an engine thread that waits (its share of the Python of a thread running at the same time):
   xgrammar's calls release the GIL, so a thread that runs Python beside the worker keeps nearly all its speed.
2. The worker beside an engine thread that runs pure Python all the time (the engine loop, the scheduler, making
   inputs): after each of its calls the worker waits for the GIL until the interpreter's switch interval has passed
   (``sys.setswitchinterval``, 5 ms by default), so one speculative step of grammar work takes many times longer.
   Measured at Python's default interval and at 0.2 ms.

One step is a drafting window of ``k`` positions (the rows' instance tokens as drafts) and the commit of ``k + 1``
tokens per row, for the grammars of ``benchmarks/data/mask_overhead.json``; settings ``default`` (masked drafts,
forced drafts and guesses) and ``free`` (``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0`` with a draft model).

Last line: ``worker_slowdown_beside_python_b128 <step beside busy Python / alone, default setting, Python's default
interval, batch 128>``.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mask_overhead import Workload, inline_managers, load_grammars  # noqa: E402

from lmdeploy_guided_spec.manager import SpecGrammarManager  # noqa: E402

SETTINGS = {'default': dict(draft_masks=True), 'free': dict(draft_masks=False, draft_model=True)}
SHORT_INTERVAL_S = 0.0002


def step(manager: SpecGrammarManager, workload: Workload, batch: int, k: int, session: int) -> None:
    """One speculative step's grammar work: a window drafting the rows' instance tokens, then their commit."""
    matchers = workload.matchers()
    paths = workload.rest(k + 1, -1)
    sessions = list(range(session, session + batch))
    window = manager.begin_draft(matchers, batch, k, session_ids=sessions)
    for position in range(k):
        window.mask_logits_(torch.zeros(batch, 8))  # waits for the position (masked drafts) or returns at once
        window.advance(torch.tensor([[max(paths[row][position], 0)] for row in range(batch)]))
    window.verification_masks()
    manager.commit(matchers, [paths[row][:k + 1] for row in range(batch)], session_ids=sessions)
    manager.forget(sessions)


def spin(done: list, seconds: float = float('inf')) -> float:
    """Iterations per second of a pure-Python loop that runs until ``done`` holds something or ``seconds`` pass."""
    count, start = 0, time.perf_counter()
    end = start + seconds
    while not done and time.perf_counter() < end:
        count += 1
    return count / (time.perf_counter() - start)


def beside(work, busy: bool) -> tuple[float, float]:
    """Run ``work()`` on a thread while this thread spins in Python (``busy``) or waits. Returns the thread's seconds
    and, when busy, the spinning speed over the speed of the same loop alone just before."""
    alone = spin([], 0.5) if busy else 0.0
    done = []

    def run():
        began = time.perf_counter()
        work()
        done.append(time.perf_counter() - began)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    speed = spin(done) if busy else 0.0
    thread.join()
    return done[0], speed / alone if busy else 0.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizer', default='llama3')
    parser.add_argument('--batches', default='32,128')
    parser.add_argument('--k', type=int, default=3)
    parser.add_argument('--reps', type=int, default=3)
    args = parser.parse_args(argv)
    default_interval = sys.getswitchinterval()
    grammars = load_grammars(args.tokenizer)
    # the worker runs inline on the thread that calls it: one thread of grammar work beside this one
    managers = inline_managers(args.tokenizer, SETTINGS)
    print(f'cores: {os.cpu_count()}, {args.tokenizer}, k={args.k}, medians of {args.reps}; one step of grammar work '
          f'(window and commit) on a thread, ms')
    print(f'interval {default_interval * 1e3:g} ms (Python\'s), then {SHORT_INTERVAL_S * 1e3:g} ms: the step beside a '
          'thread that spins in Python, its slowdown, and the share of its speed the spinning thread keeps')
    print(f'{"setting":<8} {"B":>4} | {"alone":>7} | {"busy":>7} {"x":>6} {"kept":>5} | {"busy":>7} {"x":>6} '
          f'{"kept":>5}')
    headline = None
    for batch in [int(b) for b in args.batches.split(',')]:
        workloads = [Workload(args.tokenizer, batch, seed, grammars) for seed in range(args.reps)]
        for setting, manager in managers.items():
            def work(seed: int, manager=manager, workloads=workloads, batch=batch):
                return lambda: step(manager, workloads[seed], batch, args.k, 1000 * seed)

            work(0)()  # warm up
            alone = statistics.median(beside(work(seed), busy=False)[0] for seed in range(args.reps))
            # beside a thread that runs Python all the time: the worker's time, and how much of its speed the
            # spinning thread keeps
            busy = [beside(work(seed), busy=True) for seed in range(args.reps)]
            slow = statistics.median(seconds for seconds, _ in busy)
            share = statistics.median(kept for _, kept in busy)
            sys.setswitchinterval(SHORT_INTERVAL_S)
            try:
                busy = [beside(work(seed), busy=True) for seed in range(args.reps)]
            finally:
                sys.setswitchinterval(default_interval)
            short = statistics.median(seconds for seconds, _ in busy)
            short_share = statistics.median(kept for _, kept in busy)
            print(f'{setting:<8} {batch:>4} | {alone * 1e3:>7.1f} | {slow * 1e3:>7.0f} {slow / alone:>6.1f} '
                  f'{share:>5.2f} | {short * 1e3:>7.0f} {short / alone:>6.1f} {short_share:>5.2f}')
            if headline is None and batch == 128 and setting == 'default':
                headline = slow / alone
    print(f'worker_slowdown_beside_python_b128 {headline:.1f}' if headline is not None
          else 'worker_slowdown_beside_python_b128 n/a (batch 128 not run)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
