"""Run one lmdeploy engine configuration on a tiny model and write what it generated as JSON.

The GPU tests start one worker process per engine configuration: LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC is read
once per process, and a fresh process leaves the GPU clean for the next configuration.

Usage: ``python tests/gpu/engine_worker.py CONFIG.json OUT.json`` with CONFIG holding ``model``, ``method`` (null
for no speculation), ``draft``, ``num_spec_tokens``, ``eager``, ``force_triton`` and ``workload``
(:data:`gpu_cases.WORKLOADS`).
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import gpu_cases  # noqa: E402


def _response(out) -> dict:
    logprobs = None
    if out.logprobs:
        logprobs = [sorted([int(k), float(v)] for k, v in step.items()) for step in out.logprobs]
    return dict(text=out.text, token_ids=[int(t) for t in out.token_ids], finish_reason=out.finish_reason,
                logprobs=logprobs)


def run(cfg: dict) -> dict:
    """Build the pipeline of ``cfg``, run every job of :func:`gpu_cases.jobs` and return the outputs."""
    if cfg.get('force_triton'):
        os.environ['LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC'] = '1'
    else:
        os.environ.pop('LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC', None)
    import torch
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    jobs, engine_fields, engine_env = gpu_cases.WORKLOADS[cfg.get('workload', 'jobs')]
    os.environ.update(engine_env)
    backend = PytorchEngineConfig(eager_mode=bool(cfg['eager']), max_batch_size=max(gpu_cases.BATCH_SIZES),
                                  cache_max_entry_count=0.2, session_len=4096, logprobs_mode='raw_logits',
                                  **engine_fields)
    from lmdeploy_guided_spec.support.harness import count_preemptions
    preemptions = count_preemptions()
    spec = None
    if cfg.get('method'):
        spec = SpeculativeConfig(method=cfg['method'], model=cfg['draft'],
                                 num_speculative_tokens=cfg.get('num_spec_tokens', gpu_cases.NUM_SPEC_TOKENS))
    start = time.perf_counter()
    pipe = pipeline(cfg['model'], backend_config=backend, speculative_config=spec, log_level='WARNING')
    from lmdeploy.pytorch.backends.cuda import attention
    info = dict(use_fa3=bool(attention.use_fa3), fa3_spec=bool(attention.use_fa3_spec_decoding()),
                device=torch.cuda.get_device_name(), startup_s=round(time.perf_counter() - start, 2))
    results = {}
    try:
        for job in getattr(gpu_cases, jobs)():
            gens = []
            for g in job['gen']:
                g = dict(g)
                kind = g.pop('kind')
                gens.append(GenerationConfig(response_format=gpu_cases.response_format(kind), **g))
            t = time.perf_counter()
            outs = pipe(job['prompts'], gen_config=gens)
            results[job['name']] = dict(seconds=round(time.perf_counter() - t, 3),
                                        outputs=[_response(o) for o in outs])
    finally:
        pipe.close()
    info['preemptions'] = sum(preemptions)
    return dict(config=cfg, info=info, jobs=results)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    cfg = json.loads(Path(argv[0]).read_text())
    Path(argv[1]).write_text(json.dumps(run(cfg)))
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
