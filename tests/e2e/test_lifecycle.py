"""Bad input and the life of guided requests: an invalid response format fails its own request while the batch
and the engine go on, and finished sessions leave no grammar state behind."""
import re

import pytest
from e2e_helpers import METHODS, PROMPTS, check_valid, gen_config, generate, manager, model_agent, response_format

# (format, what the reason says): the series' wording on lmdeploy 0.14.0, lmdeploy's own entry check's on 0.18.0
INVALID = [
    ({'type': 'json_schema', 'json_schema': {'name': 'bad', 'schema': {'type': 'object', 'properties': {
        'a': {'type': 'nonsense'}}}}}, 'Unsupported type'),
    ({'type': 'regex_schema', 'regex_schema': '[a-'}, 'regex_schema does not compile|Unsupported response format: '),
    ({'type': 'xml'}, "unsupported type 'xml'|unsupported format type: xml"),
]
FAILED = 'Invalid response_format|Unsupported response format|unsupported format type'
# a regex whose token masks cost over a second each in xgrammar: the compile service refuses it
SLOW = {'type': 'regex_schema', 'regex_schema': '([a-z]+ ?){1,300}'}


@pytest.mark.parametrize('method', list(METHODS))
def test_invalid_format_fails_alone(engines, method):
    pipe = engines(METHODS[method])
    good = response_format('json_schema')
    formats = [good] + [fmt for fmt, _ in INVALID] + [SLOW, None]
    configs = [gen_config(fmt, max_new_tokens=64 if fmt is not None else 8) for fmt in formats]
    outputs = generate(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(len(formats))], configs)
    assert outputs[0].finish_reason == 'stop'
    check_valid(outputs[0].text, good)
    for out, (_, message) in zip(outputs[1:], INVALID):
        assert out.finish_reason == 'error' and re.search(FAILED, out.text) and re.search(message, out.text), out
    # a grammar whose masks cost over a second each fails with the cost and the limit
    assert outputs[-2].finish_reason == 'error' and 'ms per token to match' in outputs[-2].text, outputs[-2]
    assert outputs[-1].finish_reason in ('stop', 'length')
    # the engine keeps serving
    again = generate(pipe, PROMPTS[:1], [gen_config(good)])[0]
    assert again.finish_reason == 'stop'
    check_valid(again.text, good)


@pytest.mark.parametrize('method', ['eagle3'])
def test_finished_sessions_leave_no_grammar_state(engines, method):
    pipe = engines(METHODS[method])
    kinds = ['json_schema', 'regex_schema', 'json_object', 'text']
    configs = [gen_config(response_format(kinds[i % 4]), max_new_tokens=48) for i in range(200)]
    outputs = generate(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(200)], configs)
    assert len(outputs) == 200 and all(o.finish_reason in ('stop', 'length') for o in outputs)
    # sessions are cleaned up on the step after they finish: one more request is that step
    generate(pipe, PROMPTS[:1], [gen_config(None, max_new_tokens=4, ignore_eos=True)])
    assert manager(pipe).processors == {}
    assert model_agent(pipe).spec_agent.guided_spec.num_kept_windows == 0
