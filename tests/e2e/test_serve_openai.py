"""``lmdeploy serve api_server`` with speculative decoding, started as a real process on the CPU path (its engine
runs in a spawned child process, which the ``.pth`` hook activates), queried with the ``openai`` client."""
import json
import threading
import urllib.request

import openai
import pytest
from e2e_helpers import CODE_REGEX, PERSON, check_valid, start_server, stop_server

JSON_SCHEMA = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
JSON_OBJECT = {'type': 'json_object'}
# lmdeploy's extension of the OpenAI response_format
REGEX = {'type': 'regex_schema', 'regex_schema': CODE_REGEX}
INVALID = {'type': 'json_schema', 'json_schema': {'name': 'bad', 'schema': {
    'type': 'object', 'properties': {'a': {'type': 'nonsense'}}}}}


@pytest.fixture(scope='module')
def server(cpu_path, tmp_path_factory):
    log = tmp_path_factory.mktemp('api_server') / 'server.log'
    proc, base = start_server(['--speculative-algorithm', 'eagle3', '--speculative-draft-model', 'tiny-llama-eagle3',
                               '--speculative-num-draft-tokens', '3'], log, max_batch_size=8)
    try:
        yield dict(base=base, proc=proc, log=log)
    finally:
        stop_server(proc)


@pytest.fixture(scope='module')
def client(server):
    c = openai.OpenAI(base_url=f'{server["base"]}/v1', api_key='none', timeout=120, max_retries=0)
    return c, c.models.list().data[0].id


def _chat(client, fmt, stream=False, prompt='Describe a person as JSON.', max_tokens=96):
    c, model = client
    kwargs = dict(model=model, messages=[{'role': 'user', 'content': prompt}], response_format=fmt,
                  max_tokens=max_tokens, temperature=0)
    if not stream:
        choice = c.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, reason = '', None
    for chunk in c.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ''
            reason = chunk.choices[0].finish_reason or reason
    return text, reason


@pytest.mark.parametrize('stream', [False, True], ids=['batch', 'stream'])
@pytest.mark.parametrize('fmt', [JSON_SCHEMA, JSON_OBJECT, REGEX], ids=['json_schema', 'json_object', 'regex'])
def test_response_format(client, fmt, stream):
    text, reason = _chat(client, fmt, stream=stream)
    assert reason == 'stop', text
    check_valid(text, fmt)


def test_stream_equals_non_stream(client):
    assert _chat(client, JSON_SCHEMA, stream=True) == _chat(client, JSON_SCHEMA)


def test_invalid_schema_is_a_client_error_and_the_server_stays_up(client, server):
    results = {}

    def valid():
        results['valid'] = _chat(client, JSON_SCHEMA, stream=True, prompt='A long record, please.')

    worker = threading.Thread(target=valid)
    worker.start()
    with pytest.raises(openai.BadRequestError) as err:
        _chat(client, INVALID)
    worker.join(timeout=120)
    assert err.value.status_code == 400
    assert 'Invalid response_format' in str(err.value) and 'Unsupported type "nonsense"' in str(err.value)
    # the concurrent valid request finished, and the server answers afterwards
    text, reason = results['valid']
    assert reason == 'stop'
    check_valid(text, JSON_SCHEMA)
    text, reason = _chat(client, REGEX)
    assert reason == 'stop'
    check_valid(text, REGEX)
    assert server['proc'].poll() is None
    with urllib.request.urlopen(f'{server["base"]}/health', timeout=5) as r:
        assert r.status == 200
    assert json.loads(urllib.request.urlopen(f'{server["base"]}/v1/models', timeout=5).read())['data']
