"""Output throughput of guided and unguided decoding, with and without speculation, on a CUDA GPU.

Four modes per batch size (1, 8 and 32 by default), on the tiny random-weight models of
``lmdeploy_guided_spec.support.tiny_models`` through lmdeploy's pipeline (greedy decoding):

* ``unguided``/``guided`` non-speculative: the target alone, without and with a JSON-schema ``response_format``;
* ``unguided``/``guided`` speculative: the same with the proposer (``eagle3`` on the tiny Llama,
  ``deepseek_mtp`` on the tiny DeepSeek-V3-style model, or ``grammar`` on the tiny Llama: no draft model, the
  drafts are the tokens the grammar forces) and ``--num-spec-tokens`` drafts per step.

Columns: generated tokens, wall seconds, output tokens/s, and tokens per step: for speculative modes the mean
number of tokens a request emits per target forward (accepted drafts + 1, counted at lmdeploy's rejection
sampler), 1 for the others. The weights are random, so acceptance (and with it the speculative speed-up) means
nothing; what the numbers show is the cost of the guided machinery next to the unguided one. The ``grammar``
method's forced drafts are accepted whatever the weights, so its tokens per step and its speed against guided
non-speculative decoding are real (an unguided request drafts nothing under it).

``--shape llama-3.1-8b`` replaces the tiny models with a Llama-3.1-8B-shaped target (bf16, 32 layers, hidden 4096,
GQA 32/8, vocabulary 128,256) and, for ``eagle3``, an Eagle3 head of matching shape (32,000-token draft
vocabulary): weightless checkpoints whose parameters the engine fills with random values on the GPU
(:mod:`lmdeploy_guided_spec.support.random_init`), so nothing of 16 GB is written or read. Not for
``deepseek_mtp``.

``--free-drafts`` (eagle3, deepseek_mtp) adds a third engine, speculative with ``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0``:
the draft model drafts without the grammar's masks and only verification is masked, so the engine thread does not
wait for the grammar worker while drafting. Its guided rows print as ``guided spec, free drafts``, with
``guided_free_vs_guided_spec`` per batch size (free against masked drafts, both guided speculative).

``--switch-interval-ms MS`` adds, for each guided speculative engine (masked drafts, and free drafts with
``--free-drafts``), a twin measured with the interpreter's switch interval at ``MS`` milliseconds
(``sys.setswitchinterval`` while it is built and measured; Python's 5 ms before and after): the grammar worker shares
the GIL with the engine's threads, and each of its calls into xgrammar waits up to the interval for the GIL while
another thread runs Python (``benchmarks/gil_share.py``). Its rows print with ``switch MS ms``, with
``switch_vs_python <mode> batch B`` per batch size. Leave ``LMDEPLOY_GUIDED_SPEC_SWITCH_INTERVAL_MS`` unset for it.

``--force-triton`` sets ``LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC=1`` (verify with the Triton kernel even where
FlashAttention-3 is installed). Without CUDA the script exits with status 2.

Before it, ``guided_spec_vs_guided_nonspec`` per batch size. Last line: ``guided_spec_vs_unguided_spec <tokens/s of
guided speculative / unguided speculative at batch 8>``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string'},
        'age': {'type': 'integer', 'minimum': 0, 'maximum': 120},
        'tags': {'type': 'array', 'items': {'type': 'string'}},
        'ok': {'type': 'boolean'},
    },
    'required': ['name', 'age', 'tags', 'ok'],
}


class _AcceptCounter:
    """Counts, at lmdeploy's RejectionSampler, the tokens every request emits per verification step."""

    def __init__(self):
        self.emitted = None
        self.rows = 0
        self.steps = 0

    def install(self) -> None:
        from lmdeploy.pytorch.spec_decode.reject_sampler import RejectionSampler
        counter = self
        original = RejectionSampler.forward

        def forward(self, target_logits, draft_token_ids, *args, **kwargs):
            out = original(self, target_logits, draft_token_ids, *args, **kwargs)
            num_rejected = out[1]
            # summed on the device, read once at the end: no synchronisation per step
            emitted = (draft_token_ids.size(-1) + 1 - num_rejected).sum()
            counter.emitted = emitted if counter.emitted is None else counter.emitted + emitted
            counter.rows += num_rejected.numel()
            counter.steps += 1
            return out

        RejectionSampler.forward = forward

    def reset(self) -> None:
        self.emitted, self.rows, self.steps = None, 0, 0

    def tokens_per_step(self) -> float | None:
        if not self.rows:
            return None
        return float(self.emitted.item()) / self.rows


def _prompts(batch: int) -> list[str]:
    return [f'Request {i}: describe a person as JSON.' for i in range(batch)]


def _gen_configs(batch: int, guided: bool, max_new_tokens: int):
    from lmdeploy import GenerationConfig
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA}} if guided else None
    return [GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, response_format=fmt)
            for _ in range(batch)]


def _measure(pipe, batch: int, guided: bool, max_new_tokens: int, counter: _AcceptCounter, spec: bool) -> dict:
    import torch
    pipe(_prompts(batch), gen_config=_gen_configs(batch, guided, 8))  # warm-up: grammars, shapes
    torch.cuda.synchronize()
    counter.reset()
    start = time.perf_counter()
    outs = pipe(_prompts(batch), gen_config=_gen_configs(batch, guided, max_new_tokens))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    per_step = counter.tokens_per_step() if spec else 1.0
    return dict(tokens=tokens, seconds=seconds, tps=tokens / seconds, per_step=per_step)


def _mode(row: dict) -> str:
    if row['free']:
        mode = 'guided spec, free drafts'
    else:
        mode = f'{"guided" if row["guided"] else "unguided"} {"speculative" if row["spec"] else "non-speculative"}'
    return mode if row['switch'] is None else f'{mode}, switch {row["switch"]:g} ms'


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--method', choices=['eagle3', 'deepseek_mtp', 'grammar'], default='eagle3')
    parser.add_argument('--batch-sizes', default='1,8,32', help='comma-separated (default: 1,8,32)')
    parser.add_argument('--max-new-tokens', type=int, default=128)
    parser.add_argument('--num-spec-tokens', type=int, default=3)
    parser.add_argument('--eager', action='store_true', help='eager mode instead of CUDA graphs')
    parser.add_argument('--shape', choices=['tiny', 'llama-3.1-8b'], default='tiny',
                        help='the tiny models, or a Llama-3.1-8B-shaped target (and Eagle3 head) filled with random '
                             'weights on the GPU (eagle3 and grammar)')
    parser.add_argument('--free-drafts', action='store_true',
                        help='also run guided speculative decoding with LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0 (draft '
                             'models draft freely, verification alone is masked)')
    parser.add_argument('--switch-interval-ms', type=float, default=None, metavar='MS',
                        help='also run each guided speculative engine with the interpreter\'s switch interval at MS '
                             'milliseconds (Python\'s: 5)')
    parser.add_argument('--force-triton', action='store_true',
                        help='verify with the Triton paged kernel even where FlashAttention-3 is installed')
    args = parser.parse_args(argv)
    batch_sizes = [int(b) for b in args.batch_sizes.split(',')]
    if args.free_drafts and args.method == 'grammar':
        parser.error('--free-drafts needs a draft model (eagle3, deepseek_mtp); the grammar method has none')

    import torch
    if not torch.cuda.is_available():
        print('gpu_throughput: CUDA is not available; this benchmark needs an NVIDIA GPU (see docs/en/gpu.md)',
              file=sys.stderr)
        return 2
    if args.force_triton:
        os.environ['LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC'] = '1'

    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec.support import tiny_models
    from lmdeploy_guided_spec.testing import environ

    if args.shape == 'llama-3.1-8b':
        if args.method == 'deepseek_mtp':
            parser.error('--shape llama-3.1-8b has no deepseek_mtp model; use eagle3 or grammar')
        from lmdeploy_guided_spec.support import random_init
        target = random_init.build_weightless_llama()
        draft = random_init.build_weightless_eagle3() if args.method == 'eagle3' else ''
        random_init.install()
    elif args.method == 'eagle3':
        target, draft = tiny_models.build_llama_target(), tiny_models.build_eagle3_draft()
    elif args.method == 'grammar':
        target, draft = tiny_models.build_llama_target(), ''  # no draft model
    else:
        target = draft = tiny_models.build_deepseek_mtp_target()
    counter = _AcceptCounter()
    counter.install()

    rows = []
    path = None
    engines = [(False, False, None), (True, False, None)] + ([(True, True, None)] if args.free_drafts else [])
    if args.switch_interval_ms is not None:
        engines += [(True, free, args.switch_interval_ms) for spec, free, _ in engines if spec]
    python_interval = sys.getswitchinterval()
    for spec, free, switch in engines:
        sys.setswitchinterval(python_interval if switch is None else switch / 1000.0)
        backend = PytorchEngineConfig(eager_mode=args.eager, max_batch_size=max(batch_sizes),
                                      cache_max_entry_count=0.3, session_len=4096)
        spec_config = SpeculativeConfig(method=args.method, model=str(draft),
                                        num_speculative_tokens=args.num_spec_tokens) if spec else None
        # the engine reads it once, when it builds its grammar manager; the caller's value comes back after
        with environ({'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS': '0' if free else '1'}):
            pipe = pipeline(str(target), backend_config=backend, speculative_config=spec_config, log_level='ERROR')
        if spec:
            from lmdeploy.pytorch.backends.cuda import attention
            path = 'FA3' if attention.use_fa3_spec_decoding() else 'Triton paged kernel'
        try:
            for batch in batch_sizes:
                # free drafts and the switch interval change nothing for unguided rows
                for guided in ((True, ) if free or switch is not None else (False, True)):
                    result = _measure(pipe, batch, guided, args.max_new_tokens, counter, spec)
                    rows.append(dict(spec=spec, guided=guided, free=free, switch=switch, batch=batch, **result))
                    # as it is measured: a run stopped at a deadline keeps what it had
                    print(f'measured: {_mode(rows[-1])}, batch {batch}: {result["tps"]:.1f} tokens/s', flush=True)
        finally:
            pipe.close()
            sys.setswitchinterval(python_interval)
        torch.cuda.empty_cache()

    print(f'device: {torch.cuda.get_device_name()}; {args.shape} model; method {args.method}, '
          f'{args.num_spec_tokens} draft tokens, '
          f'{"eager" if args.eager else "CUDA graphs"}, speculative windows verified by {path}; '
          f'max {args.max_new_tokens} new tokens, greedy; random weights')
    print(f'{"mode":<40} {"batch":>5} {"tokens":>7} {"seconds":>8} {"tokens/s":>9} {"tokens/step":>11}')
    for r in rows:
        mode = _mode(r)
        per_step = 'n/a' if r['per_step'] is None else f'{r["per_step"]:.2f}'
        print(f'{mode:<40} {r["batch"]:>5} {r["tokens"]:>7} {r["seconds"]:>8.2f} {r["tps"]:>9.1f} {per_step:>11}')
    rows, twins = [r for r in rows if r['switch'] is None], [r for r in rows if r['switch'] is not None]
    for twin in twins:
        base = [r['tps'] for r in rows if r['spec'] and r['guided'] and r['free'] == twin['free']
                and r['batch'] == twin['batch']]
        if base and base[0] > 0:
            mode = 'guided_free' if twin['free'] else 'guided_spec'
            print(f'switch_vs_python {mode} batch {twin["batch"]}: {twin["tps"] / base[0]:.3f}')
    for batch in batch_sizes:
        guided = {r['spec']: r['tps'] for r in rows if r['guided'] and not r['free'] and r['batch'] == batch}
        if len(guided) == 2 and guided[False] > 0:
            print(f'guided_spec_vs_guided_nonspec batch {batch}: {guided[True] / guided[False]:.3f}')
    for batch in batch_sizes:
        free = {r['free']: r['tps'] for r in rows if r['guided'] and r['spec'] and r['batch'] == batch}
        if len(free) == 2 and free[False] > 0:
            print(f'guided_free_vs_guided_spec batch {batch}: {free[True] / free[False]:.3f}')
    free8 = [r['tps'] for r in rows if r['free'] and r['batch'] == 8]
    unguided8 = [r['tps'] for r in rows if r['spec'] and not r['guided'] and r['batch'] == 8]
    if free8 and unguided8 and unguided8[0] > 0:
        print(f'guided_spec_free_drafts_vs_unguided_spec {free8[0] / unguided8[0]:.3f}')
    at8 = {r['guided']: r['tps'] for r in rows if r['spec'] and not r['free'] and r['batch'] == 8}
    if len(at8) == 2 and at8[False] > 0:
        print(f'guided_spec_vs_unguided_spec {at8[True] / at8[False]:.3f}')
    else:
        print('guided_spec_vs_unguided_spec n/a (batch 8 was not run)')
    return 0


if __name__ == '__main__':
    sys.exit(main())
