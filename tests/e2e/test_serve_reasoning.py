"""``lmdeploy serve api_server`` with a reasoning parser (``--reasoning-parser default``, Qwen3's and DeepSeek-R1's)
and speculative decoding (the tiny DeepSeek-V3 model, whose tokenizer has ``<think>`` and ``</think>``; its MTP
layer drafts), queried with the ``openai`` client: a ``response_format`` is the answer after the reasoning (0.18.0 patch
0072). lmdeploy's grammar of the format covered the whole output: the model answered in the format at once, and the
parser, which starts inside the reasoning block, gave the document as ``reasoning_content`` (``content`` None).

The tiny model writes no ``</think>`` of its own: a ``logit_bias`` towards the tokens of that text makes it end its
reasoning within a few tokens, as a reasoning model would after its thoughts; inside the document the grammar masks
them.
"""
import pytest
from e2e_helpers import check_valid, openai_client, served

pytestmark = [pytest.mark.usefixtures('no_session_pipelines'),
              pytest.mark.skipif(not __import__('importlib').util.find_spec('lmdeploy.serve.parsers'),
                                 reason='lmdeploy 0.14.0 has no response parser of reasoning and tools')]

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
    for seed in range(4):
        content, reasoning, reason = _ask(client, stream=stream, temperature=1.0, seed=seed)
        assert reason == 'stop', (content, reasoning, reason)
        assert content, f'the document was read as reasoning: {reasoning!r}'
        check_valid(content.strip(), FORMAT)
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
