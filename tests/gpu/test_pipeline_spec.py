"""Guided speculative decoding through lmdeploy's pipeline on the GPU, with tiny random-weight models.

Every engine configuration runs in a worker process (:mod:`engine_worker`) over the same jobs: ``json_schema``,
``regex_schema`` and ``json_object`` requests, greedy and sampling, at batch 1, 8 and 64 (batches of 8 and 64 mix
in unguided requests). Configurations: proposer ``eagle3`` (tiny Llama target) and ``deepseek_mtp`` (tiny
DeepSeek-V3-style target, MLA on the Triton path); CUDA graphs and eager mode; speculative windows verified by
FlashAttention-3 (where it is installed) or by the causal Triton paged kernel
(``LMDEPLOY_GUIDED_SPEC_FORCE_TRITON_SPEC=1``, the only path where FA3 is absent).

``GPU_ENGINE_RUNS_FROM=DIR`` checks the outputs a GPU session saved in DIR (``<configuration>.out.json``) instead of
running engines, on any machine, CPU included.
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

METHODS = ['eagle3', 'deepseek_mtp']
GRAPHS = [pytest.param(False, id='cudagraph'), pytest.param(True, id='eager')]
ATTENTION = ['fa3', 'triton']


def _spec_run(engine_runs, fa3_installed, method, eager, attention):
    if attention == 'fa3' and not fa3_installed:
        pytest.skip('FlashAttention-3 is not installed; the Triton path is the default here and runs as "triton"')
    return engine_runs.get(method, spec=True, eager=eager, force_triton=attention == 'triton')


def _check_all(run, checker):
    checked = finished = 0
    for job in gpu_cases.jobs():
        outputs = run['jobs'][job['name']]['outputs']
        assert len(outputs) == job['batch']
        for gen, out in zip(job['gen'], outputs):
            if gen['kind'] == 'text':
                assert out['token_ids'], 'an unguided request in a guided batch generated nothing'
                continue
            checker.check(gen['kind'], out)
            checked += 1
            finished += out['finish_reason'] == 'stop'
    # the fixed-length regex finishes whatever the model: some outputs must have completed their grammar
    assert finished > 0
    return checked


@pytest.mark.parametrize('attention', ATTENTION)
@pytest.mark.parametrize('eager', GRAPHS)
@pytest.mark.parametrize('method', METHODS)
def test_speculative_outputs_follow_their_grammar(engine_runs, fa3_installed, grammar_checkers, method, eager,
                                                  attention):
    run = _spec_run(engine_runs, fa3_installed, method, eager, attention)
    assert run['info']['fa3_spec'] == (attention == 'fa3')
    assert _check_all(run, grammar_checkers(method)) > 0


@pytest.mark.parametrize('eager', GRAPHS)
@pytest.mark.parametrize('method', METHODS)
def test_non_speculative_outputs_follow_their_grammar(engine_runs, grammar_checkers, method, eager):
    run = engine_runs.get(method, spec=False, eager=eager)
    assert _check_all(run, grammar_checkers(method)) > 0


def _compare(spec_run, ref_run):
    mismatches, near_ties, total = [], 0, 0
    for job in gpu_cases.jobs():
        if not job['greedy']:
            continue
        spec_outs = spec_run['jobs'][job['name']]['outputs']
        ref_outs = ref_run['jobs'][job['name']]['outputs']
        for i, (gen, a, b) in enumerate(zip(job['gen'], spec_outs, ref_outs)):
            total += 1
            verdict = gpu_cases.compare_greedy(gpu_cases.dict_logprobs(a), gpu_cases.dict_logprobs(b))
            if verdict == 'near-tie':
                near_ties += 1
            elif verdict is not None:
                mismatches.append(f'{job["name"]}[{i}] ({gen["kind"]}): {verdict}')
    return mismatches, near_ties, total


@pytest.mark.parametrize('attention', ATTENTION)
@pytest.mark.parametrize('eager', GRAPHS)
@pytest.mark.parametrize('method', METHODS)
def test_greedy_speculative_equals_non_speculative(engine_runs, fa3_installed, method, eager, attention):
    """Contract rule 2, guided and unguided requests alike: token for token, up to near ties of two tokens."""
    spec_run = _spec_run(engine_runs, fa3_installed, method, eager, attention)
    ref_run = engine_runs.get(method, spec=False, eager=eager)
    mismatches, near_ties, total = _compare(spec_run, ref_run)
    assert not mismatches, '\n'.join(mismatches[:20])
    assert near_ties <= total // 10, f'{near_ties} of {total} greedy outputs part at near ties'


@pytest.mark.parametrize('method', METHODS)
def test_cuda_graphs_and_eager_mode_agree(engine_runs, method):
    mismatches, near_ties, total = _compare(engine_runs.get(method, spec=True, eager=False, force_triton=True),
                                            engine_runs.get(method, spec=True, eager=True, force_triton=True))
    assert not mismatches, '\n'.join(mismatches[:20])
    assert near_ties <= total // 10


@pytest.mark.parametrize('method', METHODS)
def test_free_drafts_follow_their_grammar_and_equal_non_speculative(engine_runs, grammar_checkers, method):
    """``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0`` with CUDA graphs: the draft model drafts without the grammar's masks and
    verification alone keeps every guided output on its grammar and greedy output equal to non-speculative."""
    run = engine_runs.get(method, spec=True, eager=False, force_triton=True, workload='free-drafts')
    assert _check_all(run, grammar_checkers(method)) > 0
    mismatches, near_ties, total = _compare(run, engine_runs.get(method, spec=False, eager=False))
    assert not mismatches, '\n'.join(mismatches[:20])
    assert near_ties <= total // 10
