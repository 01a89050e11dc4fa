"""Grammar work per speculative step: the project's pipeline against the straightforward reference.

Per speculative step with ``k`` draft tokens and a batch of ``B`` guided requests this runs, for real:

* ``k`` draft forwards of a small draft model and one target forward over ``B x (k + 1)`` tokens (Llama
  architecture built from config, random weights, the tokenizer's full vocabulary, fp32 on this CPU);
* grammar work with real xgrammar grammars (JSON schemas and regexes) for a real tokenizer:

  - **reference** (what a straightforward integration does): per draft position fill the forks' masks after the
    draft logits exist, apply, pick, advance; after the target logits exist fork the committed matchers again,
    then per position fill, copy and apply; commit after rejection;
  - **project** (:class:`SpecGrammarManager`): fills run on the grammar worker one position ahead while the
    draft forwards run, verification reuses the draft masks (only the bonus position is new and is filled during
    the target forward), one copy and one masking call for all positions, the commit is queued;
  - **unguided**: the same forwards and greedy picks without any grammar work (the baseline).

Torch runs on one thread, standing in for the accelerator; the other core is free for the grammar worker, the way
a host CPU works beside a GPU. Pipelines are interleaved within each repetition and the median is reported.

Columns, per speculative step (medians):

* ``grammar CPU``: CPU time spent in grammar work on any thread (forks, fills, accepts, commits, preparing and
  applying masks);
* ``exposed``: time the step's own thread spends in grammar calls, waits for the grammar worker included, i.e. what
  grammar work adds to the critical path when the device does not share the host's cores (the headline);
* ``step delta``: wall time of the guided step minus the unguided step. Here the grammar worker and the forward
  share two CPU cores, so this also counts contention a GPU would not see; it is reported as a cross-check.

Last line: ``mask_exposed_ratio <project / reference exposed time, batch 32, 3 draft tokens, Qwen3>``.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, apply_bitmask_, testing
from lmdeploy_guided_spec.step import commit, fill_bitmask, verification_bitmask

DATA = Path(__file__).parent / 'data' / 'mask_overhead.json'


class Timer:
    """Sums the time spent in wrapped calls, on whichever thread they run.

    ``clock=time.thread_time`` counts the CPU time of the calling thread (grammar work; waiting costs nothing and
    a thread that shares a core is not charged for the other's time); ``time.perf_counter`` counts wall time.
    """

    def __init__(self, clock=time.perf_counter):
        self.total = 0.0
        self.clock = clock

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total += self.clock() - start
        return timed


class TimedWorker(GrammarWorker):
    """A grammar worker whose jobs count as grammar work."""

    def __init__(self, timer: Timer):
        super().__init__()
        self.timer = timer

    def submit(self, fn, *args, **kwargs):
        return super().submit(self.timer.wrap(fn), *args, **kwargs)


def build_models(vocab_size: int, hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)

    def make(n_layers):
        cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                          num_hidden_layers=n_layers, num_attention_heads=max(2, hidden // 32),
                          num_key_value_heads=max(1, hidden // 64), tie_word_embeddings=True)
        return LlamaForCausalLM(cfg).eval()

    return make(layers), make(1)


class Workload:
    """Requests of one benchmark cell: compiled grammars, start states and prefixes."""

    def __init__(self, name: str, batch: int, seed: int, grammars: list[tuple[xgr.CompiledGrammar, list[int]]]):
        rng = random.Random(seed)
        self.items = [grammars[(seed + b) % len(grammars)] for b in range(batch)]
        self.starts = [rng.randrange(max(1, len(path) - 4)) for _, path in self.items]

    def matchers(self) -> dict[int, xgr.GrammarMatcher]:
        out = {}
        for b, ((compiled, path), start) in enumerate(zip(self.items, self.starts)):
            m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            for t in path[:start]:
                m.accept_token(t)
            out[b] = m
        return out

    def rest(self, pad: int, filler: int) -> list[list[int]]:
        """Each row's instance tokens from its start state on (what :meth:`matchers` has not taken), then ``pad``
        times ``filler``."""
        return [path[start:] + [filler] * pad for (_, path), start in zip(self.items, self.starts)]

    def prefixes(self) -> torch.Tensor:
        width = 8
        rows = [(path[max(0, s - width):s] + [0] * width)[:width] for (_, path), s in zip(self.items, self.starts)]
        return torch.tensor(rows)


def _fork_all(matchers: dict) -> dict:
    return {row: m.fork() for row, m in matchers.items()}


def _accept_all(forks: dict, tokens: list[int]) -> None:
    for row, fork in forks.items():
        fork.accept_token(tokens[row])


def _greedy_accept(target_logits: torch.Tensor, drafts: torch.Tensor, k: int) -> torch.Tensor:
    """Greedy rejection: accepted drafts plus the target token at the first mismatch (or the bonus); -1 pads."""
    batch = drafts.shape[0]
    picks = target_logits.view(batch, k + 1, -1).argmax(-1)
    match = (picks[:, :k] == drafts).long().cumprod(-1)
    n_acc = match.sum(-1)
    out = torch.full((batch, k + 1), -1, dtype=torch.long)
    for b in range(batch):
        n = int(n_acc[b])
        out[b, :n] = drafts[b, :n]
        out[b, n] = picks[b, n]
    return out


class Runner:
    """Runs ``steps`` speculative steps of one pipeline on one workload and times them."""

    def __init__(self, target, draft, vocab_size: int, k: int):
        self.target, self.draft, self.vocab_size, self.k = target, draft, vocab_size, k

    def _draft_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.draft(ids, logits_to_keep=1).logits[:, -1].float()

    def _target_logits(self, ids: torch.Tensor) -> torch.Tensor:
        return self.target(ids, logits_to_keep=self.k + 1).logits.reshape(-1, self.vocab_size).float()

    @torch.inference_mode()
    def run(self, mode: str, workload: Workload, steps: int) -> tuple[float, float, float]:
        """(wall, grammar CPU, exposed) seconds per step.

        ``exposed`` is the time the step's own thread spends in grammar calls, waits for the grammar worker
        included: the time grammar work adds to the critical path when the device does not share the host's
        cores. The wall time is also reported; on this machine the worker shares two cores with the forward.
        """
        k = self.k
        timer, exposed = Timer(time.thread_time), Timer()
        matchers = workload.matchers() if mode != 'unguided' else {}
        ids = workload.prefixes()
        batch = ids.shape[0]
        sessions = list(range(batch))
        manager = SpecGrammarManager(self.vocab_size, worker=TimedWorker(timer), pin_memory=False) \
            if mode == 'project' else None
        apply = exposed.wrap(timer.wrap(apply_bitmask_))
        ref_commit, ref_verify = exposed.wrap(timer.wrap(commit)), exposed.wrap(timer.wrap(verification_bitmask))
        ref_fill, ref_accept = exposed.wrap(timer.wrap(fill_bitmask)), exposed.wrap(timer.wrap(_accept_all))
        start = time.perf_counter()
        for _ in range(steps):
            # -- drafting -------------------------------------------------------------------------------------
            window = exposed.wrap(manager.begin_draft)(matchers, batch, k, session_ids=sessions) if manager else None
            forks = exposed.wrap(timer.wrap(_fork_all))(matchers) if mode == 'reference' else None
            draft_ids, drafts = ids, []
            for _ in range(k):
                logits = self._draft_logits(draft_ids)
                if window is not None:
                    exposed.wrap(window.wait)()  # waiting is exposure, not work: the fill is timed on the worker
                    exposed.wrap(timer.wrap(window.mask_logits_))(logits)
                elif forks:
                    bitmask = ref_fill(forks, batch, self.vocab_size)
                    apply(logits, bitmask, rows=sorted(forks))
                token = logits.argmax(-1, keepdim=True)
                if window is not None:
                    exposed.wrap(window.advance)(token)
                elif forks:
                    ref_accept(forks, token.view(-1).tolist())
                drafts.append(token)
                draft_ids = torch.cat([draft_ids[:, 1:], token], dim=1)
            draft_tokens = torch.cat(drafts, dim=1)
            # -- verification ----------------------------------------------------------------------------------
            logits = self._target_logits(torch.cat([ids, draft_tokens], dim=1))
            if manager is not None:
                bitmask = exposed.wrap(manager.verification_bitmask)(matchers, draft_tokens, sessions)
                exposed.wrap(timer.wrap(manager.apply_))(logits, bitmask, matchers, k + 1)
            elif matchers:
                bitmask = ref_verify(matchers, draft_tokens, self.vocab_size)
                masks, per_position = bitmask.view(batch, k + 1, -1), logits.view(batch, k + 1, -1)
                for i in range(k + 1):  # per position: copy and apply
                    apply(per_position[:, i], masks[:, i].contiguous(), rows=sorted(matchers))
            out = _greedy_accept(logits, draft_tokens, k)
            if manager is not None:
                exposed.wrap(manager.commit_async)(matchers, out)
            elif matchers:
                ref_commit(matchers, out)
            last = out.clamp_min(0).gather(1, (out >= 0).sum(1, keepdim=True) - 1)
            ids = torch.cat([ids[:, 1:], last], dim=1)
        if manager is not None:
            manager.worker.run(lambda: None)
            manager.worker.shutdown()
        wall = time.perf_counter() - start
        return wall / steps, timer.total / steps, exposed.total / steps


def inline_managers(name: str, settings: dict[str, dict], **options) -> dict[str, SpecGrammarManager]:
    """One ``SpecGrammarManager`` per setting for tokenizer ``name``, its worker inline (the caller's thread does the
    grammar work), host masks unpinned and dense, the forced tokenizer prepared; ``options`` for all of them."""
    tokenizer = testing.load_tokenizer(name)
    vocab = testing.TOKENIZERS[name].model_vocab_size
    managers = {setting: SpecGrammarManager(vocab, worker=GrammarWorker(inline=True), pin_memory=False,
                                            sparse_masks=False, tokenizer=tokenizer, **options, **values)
                for setting, values in settings.items()}
    for manager in managers.values():
        if manager.forced_tokenizer is not None:
            manager.forced_tokenizer.prepare()
    return managers


def load_grammars(name: str) -> list[tuple[xgr.CompiledGrammar, list[int]]]:
    data = json.loads(DATA.read_text())
    compiler = testing.grammar_compiler(name)
    tok = testing.load_tokenizer(name)
    out = []
    for item in data['schemas']:
        compiled = compiler.compile_json_schema(json.dumps(item['schema']))
        out.append((compiled, tok.encode(json.dumps(item['instance'], ensure_ascii=False), add_special_tokens=False)))
    for item in data['regexes']:
        out.append((compiler.compile_regex(item['regex']), tok.encode(item['instance'], add_special_tokens=False)))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizers', default='qwen3,llama3')
    parser.add_argument('--batches', default='1,8,32,128')
    parser.add_argument('--ks', default='1,3,5')
    parser.add_argument('--steps', type=int, default=3, help='speculative steps per timed run')
    parser.add_argument('--reps', type=int, default=5, help='interleaved repetitions; the median is reported')
    parser.add_argument('--hidden', type=int, default=128)
    parser.add_argument('--layers', type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    headline = None
    print(f'{"tokenizer":<9} {"V":>7} {"B":>4} {"k":>2} {"step ms":>8} | {"grammar CPU ms":^17} | '
          f'{"exposed ms":^17} | {"step delta ms":^17} | {"exposed":>7} {"CPU":>5} {"delta":>5}', flush=True)
    print(f'{"":<9} {"":>7} {"":>4} {"":>2} {"unguided":>8} | {"reference":>9} {"project":>7} | '
          f'{"reference":>9} {"project":>7} | {"reference":>9} {"project":>7} | {"ratio":>7} {"ratio":>5} '
          f'{"ratio":>5}', flush=True)
    for name in args.tokenizers.split(','):
        vocab = testing.TOKENIZERS[name].model_vocab_size
        grammars = load_grammars(name)
        target, draft = build_models(vocab, args.hidden, args.layers)
        for batch in map(int, args.batches.split(',')):
            for k in map(int, args.ks.split(',')):
                runner = Runner(target, draft, vocab, k)
                workload = Workload(name, batch, seed=batch * 10 + k, grammars=grammars)
                runner.run('unguided', workload, 1)  # warm-up
                samples = {m: [] for m in ('unguided', 'reference', 'project')}
                for rep in range(args.reps):
                    order = ['unguided', 'reference', 'project']
                    random.Random(rep).shuffle(order)
                    for mode in order:
                        samples[mode].append(runner.run(mode, workload, args.steps))
                med = {m: [statistics.median(x[i] for x in s) for i in range(3)] for m, s in samples.items()}
                base = med['unguided'][0]
                (w_ref, c_ref, e_ref), (w_prj, c_prj, e_prj) = med['reference'], med['project']
                d_ref, d_prj = w_ref - base, w_prj - base
                exposed_ratio = e_prj / max(e_ref, 1e-9)
                cpu_ratio = c_prj / max(c_ref, 1e-9)
                delta_ratio = d_prj / d_ref if d_ref > 0 else float('nan')
                print(f'{name:<9} {vocab:>7} {batch:>4} {k:>2} {base * 1e3:>8.1f} | {c_ref * 1e3:>9.2f} '
                      f'{c_prj * 1e3:>7.2f} | {e_ref * 1e3:>9.2f} {e_prj * 1e3:>7.2f} | {d_ref * 1e3:>9.2f} '
                      f'{d_prj * 1e3:>7.2f} | {exposed_ratio:>7.2f} {cpu_ratio:>5.2f} {delta_ratio:>5.2f}', flush=True)
                if name == 'qwen3' and batch == 32 and k == 3:
                    headline = exposed_ratio
    params = sum(p.numel() for p in target.parameters())
    print(f'\ntarget model: Llama, hidden {args.hidden}, {args.layers} layers, {params / 1e6:.1f} M parameters '
          f'(last vocabulary), fp32, 1 torch thread; draft: 1 layer. Steps per run {args.steps}, '
          f'median of {args.reps} interleaved repetitions.')
    if headline is None:
        print('mask_exposed_ratio n/a (the headline cell qwen3, B=32, k=3 was not run)')
        return 1
    print(f'mask_exposed_ratio {headline:.3f}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
