"""lmdeploy 0.18 as released, on the CPU path: its own ``pipeline``, guided decoding and guided speculative decoding.

lmdeploy 0.18 brings its own guided speculative decoding (``GuidedSpecHelper``) and refuses speculative decoding
on CUDA without FlashAttention-3; the CPU path's 0.18 backend (:mod:`lmdeploy_guided_spec.cpu.lmdeploy_0_18`)
runs it with torch attention over causal speculative windows. These tests drive lmdeploy through ``pipeline`` on
the tiny models (random weights, steered toward finishing JSON) and check that:

- the target generates without speculation, unguided and with ``response_format`` (json_schema, regex);
- eagle3 (tiny Llama with its Eagle3 draft) and deepseek_mtp (tiny DeepSeek-V3-style target with its MTP layer)
  draft and verify, and their greedy output equals the same target's non-speculative greedy output, unguided and
  guided (upstream's guided speculative path: ``GuidedSpecHelper`` masks the drafts and the verification).

They run only where lmdeploy 0.18 is installed (``scripts/setup.sh --lmdeploy 0.18.0 --venv DIR``).
"""
from __future__ import annotations

from importlib.metadata import version

import pytest

LMDEPLOY_VERSION = version('lmdeploy')
if not LMDEPLOY_VERSION.startswith('0.18.'):
    pytest.skip(f'lmdeploy {LMDEPLOY_VERSION} is installed; this module tests lmdeploy 0.18 on the CPU path (a 0.18 '
                'environment: bash scripts/setup.sh --lmdeploy 0.18.0 --venv DIR)', allow_module_level=True)

from e2e_helpers import METHODS, PROMPTS, gen_config, generate, is_valid, model_agent, response_format  # noqa: E402

UNGUIDED_TOKENS = 24
GUIDED_KINDS = ('json_schema', 'regex_schema')


def _unguided():
    # the steered tiny models end unguided text at once: ignore_eos gives every request the same length
    return gen_config(None, ignore_eos=True, max_new_tokens=UNGUIDED_TOKENS)


@pytest.fixture(scope='module')
def plain_outputs(engines):
    """Greedy non-speculative outputs of each method's target: ``{(target, kind): [Output]}``."""
    cache = {}

    def outputs(target: str, kind: str):
        if (target, kind) not in cache:
            pipe = engines(target, spec=False)
            config = _unguided() if kind == 'text' else gen_config(response_format(kind))
            cache[target, kind] = generate(pipe, PROMPTS, [config] * len(PROMPTS))
        return cache[target, kind]

    return outputs


def _speculative(engines, method: str):
    from lmdeploy.pytorch.spec_decode.guided_spec_helper import GuidedSpecHelper
    pipe = engines(METHODS[method], spec=True)
    # upstream's own guided speculative decoding, not a series
    assert isinstance(model_agent(pipe).spec_agent.proposer.guided_helper, GuidedSpecHelper)
    return pipe


def _recorded(pipe, configs):
    from lmdeploy_guided_spec.cpu.steps import StepRecorder
    with StepRecorder() as recorder:
        outputs = generate(pipe, PROMPTS, configs)
    rows = recorder.rows()
    return outputs, sum(len(r.drafts) for r in rows), sum(r.accepted for r in rows)


def test_fa3_is_absent_and_the_cpu_backend_is_the_0_18_one(cpu_path):
    """Upstream refuses speculative decoding without FA3 (the series lets the causal Triton window verify instead);
    the CPU path never reaches that check."""
    from lmdeploy.pytorch.backends import selector
    from lmdeploy.pytorch.backends.cuda import attention

    from lmdeploy_guided_spec.cpu import lmdeploy_0_18
    from lmdeploy_guided_spec.series.patching import installed_is_applied
    assert not attention.use_fa3
    if installed_is_applied():
        attention.require_fa3_for_speculative_decoding()
    else:
        with pytest.raises(RuntimeError, match='FlashAttention-3'):
            attention.require_fa3_for_speculative_decoding()
    assert cpu_path.backend_module() is lmdeploy_0_18
    assert selector._get_backend() is lmdeploy_0_18.CpuOpsBackend


def test_non_speculative_generates_unguided_and_guided(engines, plain_outputs):
    engines('tiny-llama', spec=False)
    for out in plain_outputs('tiny-llama', 'text'):
        assert len(out.token_ids) == UNGUIDED_TOKENS and out.finish_reason == 'length', out
    for kind in GUIDED_KINDS:
        fmt = response_format(kind)
        for out in plain_outputs('tiny-llama', kind):
            assert out.finish_reason == 'stop' and is_valid(out.text, fmt), (kind, out)


@pytest.mark.parametrize('method', list(METHODS))
def test_speculative_unguided_equals_non_speculative(engines, plain_outputs, method):
    pipe = _speculative(engines, method)
    outputs, drafted, _ = _recorded(pipe, [_unguided()] * len(PROMPTS))
    assert drafted > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs(METHODS[method], 'text')]


@pytest.mark.parametrize('method', list(METHODS))
def test_speculative_guided_is_valid_and_equals_non_speculative(engines, plain_outputs, method):
    pipe = _speculative(engines, method)
    for kind in GUIDED_KINDS:
        fmt = response_format(kind)
        outputs, drafted, accepted = _recorded(pipe, [gen_config(fmt)] * len(PROMPTS))
        assert drafted > 0 and accepted > 0, (kind, drafted, accepted)
        for out in outputs:
            assert out.finish_reason == 'stop' and is_valid(out.text, fmt), (kind, out)
        # upstream's GuidedSpecHelper (matchers without terminate_without_stop_token) on these models
        plain = plain_outputs(METHODS[method], kind)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain], kind
