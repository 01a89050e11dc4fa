"""Greedy guided speculative decoding equals greedy guided decoding without speculation, token for token, over
32 schema/prompt pairs per proposer; every output is a complete, valid instance of its format."""
import pytest
from e2e_helpers import METHODS, check_valid, gen_config, generate, response_format

from lmdeploy_guided_spec.draft import DraftGrammar

_S = {'type': 'string', 'maxLength': 12}
_I = {'type': 'integer', 'minimum': -50, 'maximum': 5000}
SCHEMAS = [
    {'type': 'object', 'properties': {'name': _S}, 'required': ['name']},
    {'type': 'object', 'properties': {'name': _S, 'age': _I}, 'required': ['name', 'age']},
    {'type': 'object', 'properties': {'ok': {'type': 'boolean'}, 'n': _I}, 'required': ['ok', 'n']},
    {'type': 'object', 'properties': {'status': {'enum': ['active', 'activated', 'inactive']}},
     'required': ['status']},
    {'type': 'object', 'properties': {'level': {'enum': [1, 10, 100]}, 'note': _S}, 'required': ['level', 'note']},
    {'type': 'object', 'properties': {'tags': {'type': 'array', 'items': _S, 'maxItems': 3}}, 'required': ['tags']},
    {'type': 'object', 'properties': {'xs': {'type': 'array', 'items': _I, 'minItems': 1, 'maxItems': 4}},
     'required': ['xs']},
    {'type': 'object', 'properties': {'ratio': {'type': 'number', 'minimum': 0, 'maximum': 1},
                                      'unit': {'enum': ['m', 'kg', 's']}}, 'required': ['ratio', 'unit']},
    {'type': 'object', 'properties': {'user': {'type': 'object', 'properties': {'id': _I, 'nick': _S},
                                               'required': ['id', 'nick'], 'additionalProperties': False}},
     'required': ['user'], 'additionalProperties': False},
    {'type': 'object', 'properties': {'code': {'type': 'string', 'pattern': '^[A-Z]{2}[0-9]{3}$'}},
     'required': ['code']},
    {'type': 'object', 'properties': {'a': {'type': 'null'}, 'b': {'type': 'boolean'}}, 'required': ['a', 'b']},
    {'type': 'object', 'properties': {'first': _S, 'last': _S, 'email': _S}, 'required': ['first', 'last'],
     'additionalProperties': False},
    {'type': 'array', 'items': {'enum': ['red', 'green', 'blue']}, 'minItems': 1, 'maxItems': 3},
    {'type': 'object', 'properties': {'items': {'type': 'array', 'maxItems': 2, 'items': {
        'type': 'object', 'properties': {'sku': _S, 'qty': _I}, 'required': ['sku', 'qty']}}},
     'required': ['items']},
    {'type': 'object', 'properties': {'answer': {'enum': ['yes', 'no', 'maybe']}, 'why': _S},
     'required': ['answer']},
    {'type': 'object', 'properties': {'lat': {'type': 'number', 'minimum': -90, 'maximum': 90},
                                      'lon': {'type': 'number'}}, 'required': ['lat', 'lon'],
     'additionalProperties': False},
    {'type': 'object', 'properties': {'date': {'type': 'string', 'pattern': '^[0-9]{4}-[0-9]{2}-[0-9]{2}$'}},
     'required': ['date']},
    {'type': 'object', 'properties': {'k': {'type': 'string', 'minLength': 2, 'maxLength': 4}}, 'required': ['k']},
    {'type': 'object', 'properties': {'matrix': {'type': 'array', 'maxItems': 2,
                                                 'items': {'type': 'array', 'items': _I, 'maxItems': 2}}},
     'required': ['matrix']},
    {'type': 'object', 'properties': {'id': _I, 'done': {'type': 'boolean'}, 'title': _S},
     'required': ['id', 'done', 'title'], 'additionalProperties': False},
]
REGEXES = [
    r'[A-Z]{2}-[0-9]{3}', r'(yes|no|maybe)', r'[0-9]{4}-[0-9]{2}-[0-9]{2}', r'#[0-9a-f]{6}',
    r'[a-z]{3,8}@[a-z]{3,6}\.(com|org)', r'(\+|-)?[0-9]{1,4}\.[0-9]{2}', r'(red|green|blue), (small|large)',
    r'v[0-9]\.[0-9]{1,2}\.[0-9]{1,2}', r'[A-Z][a-z]{2,6} [A-Z][a-z]{2,6}', r'order-[a-z]{2}-[0-9]{2}-done',
    r'\(([0-9]{3})\) [0-9]{3}-[0-9]{4}',
]
PROMPTS = ['Answer in JSON.', 'Fill in the record.', 'Give a short example.', 'What would a tester write?',
           'Random data, please.', 'Describe it.', 'One more.', 'The usual format.']
FORMATS = ([response_format('json_schema', schema=s) for s in SCHEMAS]
           + [response_format('regex_schema', regex=r) for r in REGEXES] + [response_format('json_object')])
PAIRS = [(fmt, PROMPTS[i % len(PROMPTS)]) for i, fmt in enumerate(FORMATS)]
BATCH = 16


# on 0.14 with deepseek_mtp alone: its eagle3 runs the greedy rows of test_pipeline_matrix and, with free drafts,
# the test below
@pytest.mark.one_method({'0.18': ['eagle3'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', list(METHODS))
def test_greedy_speculative_equals_non_speculative(engines, method):
    assert len(PAIRS) >= 30
    spec, ref = engines(METHODS[method]), engines(METHODS[method], spec=False)
    for start in range(0, len(PAIRS), BATCH):
        chunk = PAIRS[start:start + BATCH]
        prompts = [p for _, p in chunk]
        configs = [gen_config(fmt, max_new_tokens=128) for fmt, _ in chunk]
        outputs = generate(spec, prompts, configs)
        expected = generate(ref, prompts, configs)
        for (fmt, prompt), out, exp in zip(chunk, outputs, expected):
            assert out.token_ids == exp.token_ids, (fmt, prompt, out.text, exp.text)
            assert out.finish_reason == 'stop', (fmt, out)
            check_valid(out.text, fmt)


def test_free_drafts_verified_under_the_grammar_equal_non_speculative(engines, monkeypatch):
    """``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0``: the Eagle3 draft drafts without the grammar's masks, so some drafts
    break the grammar; verification alone keeps the output what guided decoding without speculation writes (greedy
    rows token for token), and sampled rows in the same batch follow their grammar."""
    spec = engines(METHODS['eagle3'], env={'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS': '0'})
    ref = engines(METHODS['eagle3'], spec=False)
    windows, broken = [], []
    advance = DraftGrammar._advance

    def counted(window, token_ids, position, ready=None):
        dead = len(window.dead)
        advance(window, token_ids, position, ready)
        windows.append(window.mask_drafts)
        broken.append(len(window.dead) - dead)

    monkeypatch.setattr(DraftGrammar, '_advance', counted)
    chunk = PAIRS[:BATCH]
    prompts = [p for _, p in chunk]
    configs = [gen_config(fmt, max_new_tokens=128) for fmt, _ in chunk]
    # sampled rows in the same batch: the rejection sampler accepts a draft with the masked target's probability
    sampled = [gen_config(fmt, sampling=True, seed=200 + i, max_new_tokens=128) for i, (fmt, _) in enumerate(chunk[:6])]
    outputs = generate(spec, prompts + prompts[:6], configs + sampled)
    monkeypatch.undo()
    assert windows and not any(windows), 'every window drafted without masks'
    assert sum(broken) > 0, 'some free drafts broke the grammar (or ended it)'
    for (fmt, prompt), out, exp in zip(chunk, outputs, generate(ref, prompts, configs)):
        assert out.token_ids == exp.token_ids, (fmt, prompt, out.text, exp.text)
        assert out.finish_reason == 'stop', (fmt, out)
        check_valid(out.text, fmt)
    for (fmt, _), out in zip(chunk, outputs[len(chunk):]):
        assert out.finish_reason == 'stop', (fmt, out)
        check_valid(out.text, fmt)


PREAMBLE = 'You are a careful assistant that writes data records for a test suite. ' * 12


@pytest.mark.one_method({'0.18': ['eagle3'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', list(METHODS))
def test_prefix_caching_keeps_guided_speculative_output(engines, method):
    """``enable_prefix_caching`` (``--enable-prefix-caching``, common in deployments): requests whose prompts share
    a preamble reuse its KV blocks, in a batch and in the requests that follow. Greedy guided speculative decoding
    still writes what guided decoding without speculation and without the cache writes, token for token, and a
    sampled request that hits the cache follows its grammar. lmdeploy 0.14.0 turns prefix caching off under
    speculative decoding ("Speculative decoding prefix caching is not supported."): nothing is cached there, and the
    output is the same."""
    import lmdeploy
    caches = lmdeploy.__version__ != '0.14.0'
    spec = engines(METHODS[method], enable_prefix_caching=True)
    ref = engines(METHODS[method], spec=False)
    chunk = PAIRS[:12]
    prompts = [PREAMBLE + prompt for _, prompt in chunk]
    configs = [gen_config(fmt, max_new_tokens=96) for fmt, _ in chunk]
    expected = generate(ref, prompts, configs)
    cached = []
    for _ in range(2):  # the second round finds every prompt's preamble cached
        responses = spec(prompts, gen_config=configs)
        cached += [r.cached_tokens for r in responses]
        for (fmt, prompt), out, exp in zip(chunk, responses, expected):
            assert list(out.token_ids) == exp.token_ids, (fmt, prompt, out.text, exp.text)
            check_valid(out.text, fmt)
    if caches:
        assert sum(cached) >= len(chunk) * 64, f'few prompts found their preamble cached: {cached}'
    else:
        assert not any(cached), cached
    for i, (fmt, _) in enumerate(chunk[:4]):
        sampled = spec([prompts[i]], gen_config=[gen_config(fmt, sampling=True, seed=300 + i, max_new_tokens=96)])[0]
        assert (sampled.cached_tokens > 0) == caches and sampled.finish_reason == 'stop', sampled
        check_valid(sampled.text, fmt)
