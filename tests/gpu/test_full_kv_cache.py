"""A full KV cache on the GPU, with CUDA graphs: the scheduler preempts decoding sequences and prefills them again.

The GPU twin of ``tests/e2e/test_deployment.py::test_sequences_preempted_for_a_full_kv_cache``: 8 KV blocks of 64
tokens for 12 long requests (a 30-digit array, a fixed-length regex, ``json_object``, unguided rows that ignore
their stop tokens; every third sampled), without speculation and with eagle3, against the same requests on an
unconstrained cache. Every guided output is accepted token by token (and complete where it stopped), every unguided
one runs to its length, and greedy output equals the unconstrained one (up to near ties). ``GPU_ENGINE_RUNS_FROM``
works as for ``test_pipeline_spec.py``.
"""
import os

import gpu_cases
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() and not os.environ.get('GPU_ENGINE_RUNS_FROM'),
                       reason='CUDA is not available'),
]


@pytest.mark.parametrize('spec', [False, True], ids=['non-speculative', 'eagle3'])
def test_sequences_preempted_for_a_full_kv_cache(engine_runs, grammar_checkers, spec):
    run = engine_runs.get('eagle3', spec=spec, eager=False, force_triton=spec, workload='preempt')
    reference = engine_runs.get('eagle3', spec=False, eager=False, workload='preempt-ref')
    assert run['info']['preemptions'] > 0, 'no sequence was preempted: the cache was not full'
    assert reference['info']['preemptions'] == 0
    checker = grammar_checkers('eagle3')
    near_ties = finished = 0
    for job in gpu_cases.preempt_jobs():
        outputs = run['jobs'][job['name']]['outputs']
        references = reference['jobs'][job['name']]['outputs']
        for i, (gen, out, ref) in enumerate(zip(job['gen'], outputs, references)):
            if gen['kind'] == 'text':
                assert out['finish_reason'] == 'length', (i, out['finish_reason'])
            else:
                # a random model may write whitespace until max_new_tokens; what it wrote must still follow
                assert out['finish_reason'] in ('stop', 'length'), (i, gen['kind'], out['finish_reason'])
                checker.check(gen['kind'], out)
                finished += out['finish_reason'] == 'stop'
            if not gen['do_sample']:
                verdict = gpu_cases.compare_greedy(gpu_cases.dict_logprobs(out), gpu_cases.dict_logprobs(ref))
                near_ties += verdict == 'near-tie'
                assert verdict in (None, 'near-tie'), f'row {i} ({gen["kind"]}): {verdict}'
    assert finished > 0, 'the fixed-length regex finishes whatever the model'
    assert near_ties <= 2, f'{near_ties} greedy rows part at near ties'
