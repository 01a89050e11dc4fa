"""``lmdeploy serve api_server`` with a reasoning parser (``--reasoning-parser default``, Qwen3's and DeepSeek-R1's)
and speculative decoding (the tiny DeepSeek-V3 model, whose tokenizer has ``<think>`` and ``</think>``; its MTP
layer drafts), queried with the ``openai`` client: a ``response_format`` is the answer after the reasoning (0.18.0 patch
0072, 0.14.0 patches 0074 and 0075). lmdeploy's grammar of the format covered the whole output: the model answered in
the format at once, and the parser, which starts inside the reasoning block, gave the document as
``reasoning_content`` (``content`` None).

The tiny model writes no ``</think>`` of its own: a ``logit_bias`` towards the tokens of that text makes it end its
reasoning within a few tokens, as a reasoning model would after its thoughts; inside the document the grammar masks
them.
"""
import concurrent.futures

import pytest
from e2e_helpers import check_valid, openai_client, served

pytestmark = pytest.mark.usefixtures('no_session_pipelines')


def _with_tool_constraints() -> bool:
    """lmdeploy 0.18.0: the response parser builds constraints of tool calls (0.14.0's builds none)."""
    from lmdeploy.serve.parsers import response_parser
    return hasattr(response_parser, '_check_strict_tools')

VERDICT = {'type': 'object', 'properties': {'ok': {'type': 'boolean'}, 'score': {'type': 'integer', 'minimum': 0,
                                                                                 'maximum': 9}},
           'required': ['ok', 'score'], 'additionalProperties': False}
FORMAT = {'type': 'json_schema', 'json_schema': {'name': 'verdict', 'schema': VERDICT}}
# '</', 'think', '>', '>\n\n' of the DeepSeek-V3 tokenizer (the tiny model's; lmdeploy's logit_bias takes no added
# token, such as '</think>' itself)
END_THINKING = {'1718': 40, '37947': 40, '32': 40, '4697': 40}


@pytest.fixture(scope='module')
def server(cpu_path, tmp_path_factory):
    yield from served(tmp_path_factory, ['--speculative-algorithm', 'deepseek_mtp', '--speculative-num-draft-tokens',
                                         '3', '--reasoning-parser', 'default', '--tool-call-parser', 'qwen3'],
                      max_batch_size=8, model='tiny-deepseek-mtp')


@pytest.fixture(scope='module')
def client(server):
    return openai_client(server)


def _ask(client, stream=False, **extra):
    c, model = client
    kwargs = dict(model=model, messages=[{'role': 'user', 'content': 'Is it ok? Score it.'}], response_format=FORMAT,
                  max_tokens=400, logit_bias=END_THINKING, **extra)
    if not stream:
        choice = c.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, getattr(choice.message, 'reasoning_content', None), choice.finish_reason
    content, reasoning, reason = '', '', None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ''
            reasoning += getattr(choice.delta, 'reasoning_content', None) or ''
            reason = choice.finish_reason or reason
    return content, reasoning, reason


@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'stream'])
def test_the_answer_after_the_reasoning_is_the_document(client, stream):
    """4 sampled answers, at once: the content is the document exactly (not the whitespace before it: patch 0076)."""
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda seed: _ask(client, stream=stream, temperature=1.0, seed=seed), range(4)))
    for content, reasoning, reason in answers:
        assert reason == 'stop', (content, reasoning, reason)
        assert content, f'the document was read as reasoning: {reasoning!r}'
        assert content.startswith('{'), content
        check_valid(content, FORMAT)
        assert '</think>' not in content and '</think>' not in (reasoning or ''), (content, reasoning)


def test_with_thinking_off_the_document_comes_at_once(client):
    c, model = client
    choice = c.chat.completions.create(
        model=model, messages=[{'role': 'user', 'content': 'Is it ok?'}], response_format=FORMAT, max_tokens=64,
        temperature=0, extra_body={'chat_template_kwargs': {'enable_thinking': False}}).choices[0]
    assert choice.finish_reason == 'stop' and not getattr(choice.message, 'reasoning_content', None), choice
    check_valid(choice.message.content, FORMAT)


def test_reasoning_that_runs_out_of_tokens_ends_with_length(client, server):
    """Without the bias the tiny model never ends its reasoning: cut by max_tokens, no content, the server fine."""
    c, model = client
    choice = c.chat.completions.create(model=model, messages=[{'role': 'user', 'content': 'Is it ok?'}],
                                       response_format=FORMAT, max_tokens=24, temperature=0).choices[0]
    assert choice.finish_reason == 'length' and not choice.message.content, choice
    assert server['proc'].poll() is None


def test_the_responses_api_reasons_before_its_text_format(client):
    """The Responses API's ``text.format`` goes the same way. It ignores ``logit_bias`` (lmdeploy warns): the tiny
    model's reasoning runs to the limit, the answer incomplete; the document was read as reasoning, the response
    completed without output text."""
    c, model = client
    response = c.responses.create(model=model, input='Is it ok? Score it.', max_output_tokens=24, temperature=0,
                                  text={'format': {'type': 'json_schema', 'name': 'verdict', 'schema': VERDICT}})
    assert response.status == 'incomplete' and not response.output_text, response


YEAR = {'type': 'object', 'properties': {'year': {'type': 'integer', 'minimum': 1900, 'maximum': 2100}},
        'required': ['year'], 'additionalProperties': False}
SAVE_YEAR = {'type': 'function', 'function': {'name': 'save_year', 'parameters': YEAR, 'strict': True}}
# '<', 'tool', '_call' of the DeepSeek-V3 tokenizer: the model is pushed to write '<tool_call>' in its reasoning too,
# where lmdeploy's parser reads it as a call whose arguments nothing constrained
TOOL_CALL = {'30': 30, '72461': 30, '112042': 30}


@pytest.mark.skipif('not _with_tool_constraints()', reason='0.14.0 builds no constraint of calls')
# (tool_choice auto without a format: tests/engine/test_tool_constraints.py; here the text after the reasoning is free,
# and the pushed tiny model writes it to max_tokens: minutes on a loaded machine)
@pytest.mark.parametrize('fields', [{'tool_choice': 'required'}, {'response_format': FORMAT}],
                         ids=['required', 'beside a format'])
@pytest.mark.parametrize('stream', [False, True], ids=['plain', 'stream'])
def test_with_reasoning_on_calls_follow_their_parameters_and_none_hides_in_the_reasoning(client, fields, stream):
    """Reasoning on, a strict tool (patch 0073): the calls after the reasoning follow its parameters, the model
    pushed towards ``<tool_call>`` everywhere writes none inside the reasoning, and beside a format the answer is the
    document or calls (no call could start there, reasoning on). ``parallel_tool_calls: false`` ends the output with
    the call: after calls the text is free, and the pushed model would write on to the limit."""
    import json

    import jsonschema
    c, model = client
    calls_seen = 0
    for seed in range(2):
        kwargs = dict(model=model, messages=[{'role': 'user', 'content': 'Save a year.'}], tools=[SAVE_YEAR],
                      max_tokens=300, temperature=1.0, seed=seed, logit_bias={**END_THINKING, **TOOL_CALL},
                      parallel_tool_calls=False, **fields)
        content, reasoning, calls, reason = '', '', {}, None
        if stream:
            for chunk in c.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    content += choice.delta.content or ''
                    reasoning += getattr(choice.delta, 'reasoning_content', None) or ''
                    for call in choice.delta.tool_calls or ():
                        entry = calls.setdefault(call.index, {'name': '', 'arguments': ''})
                        entry['name'] += call.function.name or ''
                        entry['arguments'] += call.function.arguments or ''
                    reason = choice.finish_reason or reason
            calls = list(calls.values())
        else:
            choice = c.chat.completions.create(**kwargs).choices[0]
            content, reason = choice.message.content or '', choice.finish_reason
            reasoning = getattr(choice.message, 'reasoning_content', None) or ''
            calls = [{'name': call.function.name, 'arguments': call.function.arguments}
                     for call in choice.message.tool_calls or ()]
        assert reason in ('stop', 'tool_calls'), (reason, content, reasoning, calls)
        assert '<tool_call>' not in reasoning and '</think>' not in content, (reasoning, content)
        assert len(calls) <= 1, calls
        for call in calls:
            assert call['name'] == 'save_year', calls
            jsonschema.validate(json.loads(call['arguments']), YEAR)
        calls_seen += len(calls)
        if fields.get('tool_choice') == 'required':
            assert calls, (content, reasoning)
        elif 'response_format' in fields and not calls:
            check_valid(content.strip(), FORMAT)
    assert calls_seen, 'no call in two answers pushed towards one'
