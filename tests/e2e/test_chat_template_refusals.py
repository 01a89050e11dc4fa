"""A conversation that the model's own chat template refuses, against a real api_server on the CPU path.

Hugging Face chat templates raise on conversations their model was not trained on: Gemma's refuses a system message
and roles that do not alternate ("Conversation roles must alternate user/assistant/user/assistant/..."), Mistral's
the same. The client sent something the model does not take: HTTP 400 with the template's reason, on every endpoint
that takes messages, streamed or not. lmdeploy 0.18.0 answered "Request preprocessing failed." (0.14.0: "in prompt
processing error") and logged a traceback for each, which read like a fault of the server. The model here is the
tiny Llama with Gemma's chat template in its tokenizer (lmdeploy then renders with ``HFChatTemplate``).
"""
import json
import pathlib
import urllib.request

import pytest
import server_traffic as traffic
from e2e_helpers import start_server, stop_server

# the session's pipelines are closed first: with this module's server beside them they outgrew the machine
pytestmark = pytest.mark.usefixtures('no_session_pipelines')

#: Gemma's chat template as its tokenizer ships it (google/gemma-2-2b-it), in one line
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")


def _model_with_template(tmp_path, template: str):
    """The tiny Llama's files, its tokenizer's chat template replaced by ``template``."""
    from lmdeploy_guided_spec.cpu.models import resolve
    source = resolve('tiny-llama')
    model = tmp_path / 'tiny-llama-gemma-template'
    model.mkdir()
    for path in pathlib.Path(source).iterdir():
        if path.name != 'tokenizer_config.json':
            (model / path.name).symlink_to(path)
    config = json.loads((pathlib.Path(source) / 'tokenizer_config.json').read_text())
    assert not config.get('chat_template'), 'the tiny Llama has a chat template of its own now'
    config['chat_template'] = template
    (model / 'tokenizer_config.json').write_text(json.dumps(config))
    return model


def test_a_conversation_the_chat_template_refuses_is_http_400_with_its_reason(cpu_path, tmp_path):
    log = tmp_path / 'server.log'
    proc, base = start_server([], log, model=str(_model_with_template(tmp_path, GEMMA_TEMPLATE)))
    try:
        model = json.loads(urllib.request.urlopen(f'{base}/v1/models', timeout=10).read())['data'][0]['id']
        system = 'System role not supported'
        alternate = 'Conversation roles must alternate'
        refused = [
            ('/v1/chat/completions', {'model': model, 'max_tokens': 4, 'messages': [
                {'role': 'system', 'content': 'Be brief.'}, {'role': 'user', 'content': 'Hi.'}]}, system),
            ('/v1/chat/completions', {'model': model, 'max_tokens': 4, 'messages': [
                {'role': 'user', 'content': 'Hi.'}, {'role': 'user', 'content': 'Hello?'}]}, alternate),
            ('/v1/responses', {'model': model, 'max_output_tokens': 4, 'instructions': 'Be brief.', 'input': 'Hi.'},
             system),
            ('/v1/messages', {'model': model, 'max_tokens': 4, 'messages': [
                {'role': 'assistant', 'content': 'Hi.'}]}, alternate),
        ]
        for path, body, reason in refused:
            for stream in (False, True):
                status, answer = traffic.post(base, path, {**body, 'stream': stream},
                                              headers=traffic.ANTHROPIC_HEADERS)
                text = json.dumps(answer)
                # (a stream may have begun before the refusal: then it is the stream's error event)
                assert reason in text, (path, stream, status, answer)
                assert 'preprocessing failed' not in text and 'processing error' not in text, (path, answer)
                if stream:
                    continue
                assert status == 400, (path, status, answer)
                if path == '/v1/messages':
                    assert answer['type'] == 'error' and answer['error']['type'] == 'invalid_request_error', answer
                else:
                    assert answer['error']['message'], answer
        # a conversation the template takes is served, on each endpoint
        served = [
            ('/v1/chat/completions', {'model': model, 'max_tokens': 4, 'messages': [
                {'role': 'user', 'content': 'Hi.'}, {'role': 'assistant', 'content': 'Hello.'},
                {'role': 'user', 'content': 'Name a colour.'}]}),
            ('/v1/responses', {'model': model, 'max_output_tokens': 4, 'input': 'Hi.'}),
            ('/v1/messages', {'model': model, 'max_tokens': 4, 'messages': [{'role': 'user', 'content': 'Hi.'}]}),
        ]
        for path, body in served:
            status, answer = traffic.post(base, path, body, headers=traffic.ANTHROPIC_HEADERS)
            assert status == 200, (path, status, answer)
        text = log.read_text()
        assert 'Traceback' not in text, text[-4000:]
        assert proc.poll() is None and traffic.health(base) == 200
    finally:
        stop_server(proc)
