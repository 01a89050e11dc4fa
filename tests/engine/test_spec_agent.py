"""The patched SpecModelAgent with guided requests: greedy and random rejection sampling, drafting, cleanup."""
import json

import jsonschema
import pytest

from lmdeploy_guided_spec import SpecGrammarManager, testing
from lmdeploy_guided_spec.support.harness import GenRequest, SpecHarness, run_non_speculative

from grammars import INSTANCES, REGEXES, SCHEMAS, compile_regex, compile_schema, new_matcher
from models import DraftOverMap, PrefixLM, draft_map, instance_path

pytestmark = pytest.mark.engine

NAME = 'llama3'
V = 128256


def _json_schema(schema):
    return {'type': 'json_schema', 'json_schema': {'name': 'test', 'schema': schema}}


def _tok():
    return testing.load_tokenizer(NAME)


def _requests(formats, max_new_tokens=96, greedy=True):
    # top_k keeps lmdeploy's multinomial kernel short under the Triton interpreter
    return [GenRequest(i + 1, f, max_new_tokens, greedy=greedy, top_k=0 if greedy else 40, seed=100 + i)
            for i, f in enumerate(formats)]


def _valid_prefix(compiled, tokens, eos):
    m = new_matcher(compiled)
    return all(m.accept_token(t) for t in tokens if t != eos)


def _harness(method, target, draft, k=3, ids=None, **kwargs):
    if method == 'eagle3':
        draft = DraftOverMap(draft, ids)
    return SpecHarness(_tok(), V, target, draft, method=method, num_spec_tokens=k, draft_id_to_target_id=ids,
                       **kwargs)


@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle3'])
@pytest.mark.parametrize('schema', ['person', 'nested_order', 'enum_prefixes'])
def test_greedy_equals_non_speculative_and_validates(method, schema):
    path = instance_path(NAME, INSTANCES[schema][0])
    target = PrefixLM(V, path, bias=9.0, seed=1)
    draft = PrefixLM(V, path, bias=4.0, seed=2)
    ids = draft_map(V, 8000, seed=3, must_have=path[::2]) if method == 'eagle3' else None
    formats = [_json_schema(SCHEMAS[schema]), None, {'type': 'json_object'}]
    spec = _requests(formats)
    h = _harness(method, target, draft, ids=ids)
    h.generate(spec)
    ref = _requests(formats)
    run_non_speculative(_tok(), V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    text = _tok().decode(spec[0].tokens, skip_special_tokens=True)
    jsonschema.validate(json.loads(text), SCHEMAS[schema])
    assert h.target_forwards < len(spec[0].tokens), 'accepted drafts must save target forwards'


@pytest.mark.parametrize('name', ['qwen3', 'deepseek'])
def test_greedy_other_tokenizers_and_padded_vocab(name):
    """Qwen3 pads 151,669 tokens to 151,936 logits; DeepSeek has 129,280: masks cover the model's vocabulary."""
    tok = testing.load_tokenizer(name)
    vocab = testing.TOKENIZERS[name].model_vocab_size
    path = instance_path(name, INSTANCES['escapes_unicode'][0])
    target, draft = PrefixLM(vocab, path, bias=9.0, seed=1), PrefixLM(vocab, path, bias=4.0, seed=2)
    formats = [_json_schema(SCHEMAS['escapes_unicode']), None]
    spec, ref = _requests(formats), _requests(formats)
    SpecHarness(tok, vocab, target, draft, num_spec_tokens=3).generate(spec)
    run_non_speculative(tok, vocab, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    jsonschema.validate(json.loads(tok.decode(spec[0].tokens, skip_special_tokens=True)), SCHEMAS['escapes_unicode'])
    assert all(t < len(tok) for t in spec[0].tokens), 'padding ids past the tokenizer are never emitted'


@pytest.mark.parametrize('regex', sorted(REGEXES))
def test_greedy_regex_and_unbiased_models(regex):
    """Random target and draft: the grammar alone keeps the output valid, and spec equals non-spec."""
    fmt = {'type': 'regex_schema', 'regex_schema': REGEXES[regex]}
    target, draft = PrefixLM(V, seed=5), PrefixLM(V, seed=6)
    spec, ref = _requests([fmt, fmt], 16), _requests([fmt, fmt], 16)
    spec[1].seed = ref[1].seed = 7
    _harness('deepseek_mtp', target, draft, k=2).generate(spec)
    run_non_speculative(_tok(), V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    compiled = compile_regex(NAME, REGEXES[regex])
    assert _valid_prefix(compiled, spec[0].tokens, _tok().eos_token_id)


def test_self_draft_accepts_everything_and_terminates_mid_window(monkeypatch):
    """Draft == target: every draft is accepted; the grammar completes inside a window and EOS ends the request.

    Guesses in windows are off here: they take the place of the draft model's choices, which this test is about."""
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', '0')
    path = instance_path(NAME, INSTANCES['person'][0])
    model = PrefixLM(V, path, bias=9.0, seed=1)
    h = _harness('deepseek_mtp', model, model, k=4)
    req = _requests([_json_schema(SCHEMAS['person'])], max_new_tokens=200)
    h.generate(req)
    assert req[0].tokens == path and req[0].finish_reason == 'stop'
    decoding = [r for r in h.records if r.drafts]
    assert all(r.accepted_drafts == len(r.drafts) for r in decoding[:-1])
    assert h.target_forwards == 1 + -(-(len(path) - 1) // 5)


def test_rejected_draft_tokens_leave_state_intact():
    """An Eagle3 draft vocabulary without the tokens the grammar needs: drafts are invalid and get rejected."""
    path = instance_path(NAME, INSTANCES['person'][0])
    target = PrefixLM(V, path, bias=9.0, seed=1)
    ids = draft_map(V, 64, seed=11)
    assert not set(path) & set(ids.tolist())
    spec = _requests([_json_schema(SCHEMAS['person'])])
    h = _harness('eagle3', target, PrefixLM(V, path, bias=9.0, seed=1), ids=ids)
    # grammar-forced drafts would stand in for the missing tokens (tests/engine/test_spec_agent_forced.py)
    h.agent.guided_spec.forced_drafts = False
    h.generate(spec)
    assert spec[0].tokens == path
    assert all(r.accepted_drafts == 0 for r in h.records)


def test_max_new_tokens_inside_a_window_then_next_request():
    path = instance_path(NAME, INSTANCES['nested_order'][0])
    model = PrefixLM(V, path, bias=9.0, seed=1)
    h = _harness('deepseek_mtp', model, model, k=4)
    first = _requests([_json_schema(SCHEMAS['nested_order'])], max_new_tokens=7)
    h.generate(first)
    assert first[0].tokens == path[:7] and first[0].finish_reason == 'length'
    second = [GenRequest(9, _json_schema(SCHEMAS['nested_order']), 200)]
    h.generate(second)
    assert second[0].tokens == path
    # the first session's matcher was dropped when the next step came; the second's goes with the step after
    assert set(h.guided_decoding_manager.processors) == {9}
    h.generate([GenRequest(10, None, 1)])
    assert h.guided_decoding_manager.processors == {}


def test_unguided_requests_are_untouched():
    path = instance_path(NAME, INSTANCES['person'][0])
    target, draft = PrefixLM(V, path, bias=3.0, seed=1), PrefixLM(V, path, bias=2.0, seed=2)
    mixed = _requests([None, _json_schema(SCHEMAS['person']), None], 20)
    _harness('deepseek_mtp', target, draft).generate(mixed)
    alone = _requests([None, None, None], 20)
    _harness('deepseek_mtp', target, draft).generate(alone)
    assert mixed[0].tokens == alone[0].tokens and mixed[2].tokens == alone[2].tokens


def test_unguided_batch_does_no_grammar_work(monkeypatch):
    def _boom(*args, **kwargs):
        raise AssertionError('grammar work in an unguided batch')

    for name in ('next_token_bitmask', 'verification_bitmask', 'commit', 'begin_draft', 'apply_'):
        monkeypatch.setattr(SpecGrammarManager, name, _boom)
    reqs = _requests([None, None], 10)
    _harness('deepseek_mtp', PrefixLM(V, seed=1), PrefixLM(V, seed=2)).generate(reqs)
    assert all(len(r.tokens) == 10 for r in reqs)


@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle3'])
def test_random_sampling_stays_valid(method):
    """Random mode (rejection sampling kernels under the interpreter): every committed token is grammar-valid."""
    path = instance_path(NAME, INSTANCES['enum_prefixes'][0])
    target, draft = PrefixLM(V, path, bias=6.0, seed=1, scale=2.0), PrefixLM(V, path, bias=6.0, seed=2, scale=2.0)
    ids = draft_map(V, 8000, seed=3, must_have=path) if method == 'eagle3' else None
    formats = [_json_schema(SCHEMAS['enum_prefixes'])] * 2 + [None]
    reqs = _requests(formats, 24, greedy=False)
    h = _harness(method, target, draft, ids=ids)
    h.generate(reqs)
    compiled = compile_schema(NAME, SCHEMAS['enum_prefixes'])
    for r in reqs[:2]:
        assert _valid_prefix(compiled, r.tokens, _tok().eos_token_id), _tok().decode(r.tokens)
    assert any(r.accepted_drafts for r in h.records if r.guided)


def test_cleanup_after_many_requests():
    model = PrefixLM(V, instance_path(NAME, INSTANCES['person'][0]), bias=9.0, seed=1)
    h = _harness('deepseek_mtp', model, model, k=3)
    for start in range(0, 24, 6):
        batch = [GenRequest(start + i + 1, _json_schema(SCHEMAS['person']), 4) for i in range(6)]
        h.generate(batch)
        assert len(h.guided_decoding_manager.processors) <= 6
    h.generate([GenRequest(1000, None, 2)])
    assert h.guided_decoding_manager.processors == {}
