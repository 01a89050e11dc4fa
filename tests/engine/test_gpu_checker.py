"""The GPU tests' grammar checker (tests/gpu/gpu_cases.py) against the installed lmdeploy, on CPU.

The checker builds its matchers with lmdeploy's own ``GuidedDecodingManager``, whose ``get_processor`` changed
between releases (0.14: ``(session_id, seq_id, schema, kind)``; 0.15 and later: ``(session_id, seq_id,
response_format)``). The first GPU run failed every grammar check of the pipeline and api_server tests on 0.18.0 with
a TypeError there, after the engines had run; this keeps the checker working with every release CI installs.
"""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / 'gpu'))

import gpu_cases  # noqa: E402

pytestmark = pytest.mark.engine

INSTANCES = {
    'json_schema': '{"name": "bob", "age": 42, "ok": true, "tags": ["a"]}',
    'regex_schema': 'AB-123',
    'json_object': '{"x": [1, 2, {"y": null}]}',
}
# each breaks its grammar at its last character
INVALID = {'json_schema': '{"name": "eve"', 'regex_schema': 'AB-12x', 'json_object': '["'}


@pytest.fixture(scope='module')
def checker():
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    from transformers import AutoConfig, AutoTokenizer

    from lmdeploy_guided_spec.support import tiny_models
    model = tiny_models.build_llama_target()
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    config = AutoConfig.from_pretrained(str(model))
    manager = GuidedDecodingManager(tokenizer, config.vocab_size, config.eos_token_id)
    manager.processors = {}
    eos = config.eos_token_id
    return dict(manager=manager, tokenizer=tokenizer, eos={eos} if isinstance(eos, int) else set(eos), session=[0])


def _session(checker) -> int:
    checker['session'][0] += 1
    return checker['session'][0]


@pytest.mark.parametrize('kind', gpu_cases.FORMAT_KINDS)
def test_matcher_compiles_the_kind_as_the_engine_does(checker, kind):
    session = _session(checker)
    matcher = gpu_cases.guided_matcher(checker['manager'], session, kind)
    try:
        assert matcher.accept_string(INSTANCES[kind])
        assert matcher.is_completed() or matcher.is_terminated()
    finally:
        checker['manager'].remove_processor(session)
    session = _session(checker)
    matcher = gpu_cases.guided_matcher(checker['manager'], session, kind)
    try:
        assert not matcher.accept_string(INVALID[kind])
    finally:
        checker['manager'].remove_processor(session)


@pytest.mark.parametrize('kind', gpu_cases.FORMAT_KINDS)
def test_check_guided_output_passes_an_instance_and_fails_a_violation(checker, kind):
    tokenizer = checker['tokenizer']
    good = tokenizer.encode(INSTANCES[kind], add_special_tokens=False)
    gpu_cases.check_guided_output(checker['manager'], _session(checker), kind, good, INSTANCES[kind], 'stop',
                                  checker['eos'])
    # cut short by max_new_tokens: a prefix is fine as long as the grammar accepts it
    gpu_cases.check_guided_output(checker['manager'], _session(checker), kind, good[:-1],
                                  tokenizer.decode(good[:-1]), 'length', checker['eos'])
    with pytest.raises(AssertionError, match='rejected by the grammar'):
        bad = tokenizer.encode(INVALID[kind], add_special_tokens=False)
        gpu_cases.check_guided_output(checker['manager'], _session(checker), kind, bad, INVALID[kind], 'length',
                                      checker['eos'])
    with pytest.raises(AssertionError, match='stopped before the grammar completed'):
        gpu_cases.check_guided_output(checker['manager'], _session(checker), kind, good[:-1],
                                      tokenizer.decode(good[:-1]), 'stop', checker['eos'])
