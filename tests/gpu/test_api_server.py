"""Guided speculative decoding through ``lmdeploy serve api_server`` and the openai client, on the GPU.

The server runs as a subprocess on 127.0.0.1 with a free port, with the tiny target and its draft; requests carry
``response_format`` (``json_schema``, ``regex_schema``, ``json_object``), plain and streamed, one at a time and
concurrently next to unguided ones.
"""
import http.client
import json
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gpu_cases
import pytest
import torch

from lmdeploy_guided_spec.testing import free_port

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA is not available')]

STARTUP_TIMEOUT = 600


def _lmdeploy_command() -> list[str]:
    script = Path(sys.executable).parent / 'lmdeploy'
    if script.exists():
        return [str(script)]
    found = shutil.which('lmdeploy')
    return [found] if found else [sys.executable, '-m', 'lmdeploy']


@pytest.fixture(scope='module', params=['eagle3', 'deepseek_mtp'])
def server(request, tiny_models, tmp_path_factory):
    method = request.param
    target, draft = gpu_cases.targets(tiny_models, method)
    port = free_port()
    log_path = tmp_path_factory.mktemp('api-server') / f'{method}.log'
    cmd = _lmdeploy_command() + [
        'serve', 'api_server', str(target), '--backend', 'pytorch', '--server-name', '127.0.0.1', '--server-port',
        str(port), '--speculative-algorithm', method, '--speculative-draft-model', str(draft),
        '--speculative-num-draft-tokens', str(gpu_cases.NUM_SPEC_TOKENS), '--max-batch-size', '16',
        '--cache-max-entry-count', '0.2', '--session-len', '4096', '--log-level', 'WARNING'
    ]
    log = log_path.open('w')
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f'http://127.0.0.1:{port}'
    deadline = time.monotonic() + STARTUP_TIMEOUT
    model_name = None
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f'api_server exited with {proc.returncode}:\n{log_path.read_text()[-6000:]}')
            try:
                with urllib.request.urlopen(f'{base}/v1/models', timeout=5) as resp:
                    model_name = json.load(resp)['data'][0]['id']
                break
            except (OSError, http.client.HTTPException):
                time.sleep(2)
        if model_name is None:
            pytest.fail(f'api_server did not answer within {STARTUP_TIMEOUT} s:\n{log_path.read_text()[-6000:]}')
        yield dict(method=method, base_url=f'{base}/v1', model=model_name, target=target,
                   responses=log_path.with_name(f'{method}-responses.jsonl'))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope='module')
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server['base_url'], api_key='none')


def _openai_format(kind: str) -> dict:
    # lmdeploy's response_format is the OpenAI wire format, plus its own regex_schema type
    return gpu_cases.response_format(kind)


def _check_text(server, grammar_checkers, kind: str, text: str, finish_reason: str) -> None:
    """The text is a prefix the grammar accepts; a finished one is a complete instance.

    Every response checked is also kept beside the server's log (``<method>-responses.jsonl``), so a GPU run's
    responses can be read again after the machine is gone."""
    with server['responses'].open('a') as out:
        out.write(json.dumps(dict(kind=kind, text=text, finish_reason=finish_reason)) + '\n')
    checker = grammar_checkers(server['method'])
    # text decoded from a cut-off token sequence may end in an incomplete UTF-8 character; the grammar checks bytes
    checkable = text.rstrip('\ufffd') if finish_reason == 'length' else text
    checker._session += 1
    matcher = gpu_cases.guided_matcher(checker.manager, checker._session, kind)
    try:
        assert matcher.accept_string(checkable), f'the grammar rejects {text!r}'
    finally:
        checker.manager.remove_processor(checker._session)
    if finish_reason == 'stop':
        if kind == 'regex_schema':
            assert re.fullmatch(gpu_cases.REGEX, text), text
        else:
            value = json.loads(text)
            assert isinstance(value, dict)
            if kind == 'json_schema':
                import jsonschema
                jsonschema.validate(value, gpu_cases.SCHEMA)


@pytest.mark.parametrize('temperature', [0.0, 1.0], ids=['greedy', 'sampling'])
@pytest.mark.parametrize('kind', gpu_cases.FORMAT_KINDS)
def test_chat_completion(server, client, grammar_checkers, kind, temperature):
    resp = client.chat.completions.create(model=server['model'], temperature=temperature, seed=7,
                                          max_tokens=gpu_cases.MAX_NEW_TOKENS,
                                          messages=[{'role': 'user', 'content': f'One person as {kind}, please.'}],
                                          response_format=_openai_format(kind))
    choice = resp.choices[0]
    _check_text(server, grammar_checkers, kind, choice.message.content, choice.finish_reason)


@pytest.mark.parametrize('kind', gpu_cases.FORMAT_KINDS)
def test_streamed_chat_completion(server, client, grammar_checkers, kind):
    stream = client.chat.completions.create(model=server['model'], temperature=0.0,
                                            max_tokens=gpu_cases.MAX_NEW_TOKENS, stream=True,
                                            messages=[{'role': 'user', 'content': 'Stream one person.'}],
                                            response_format=_openai_format(kind))
    text, finish = '', None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ''
            finish = chunk.choices[0].finish_reason or finish
    _check_text(server, grammar_checkers, kind, text, finish)


def test_concurrent_guided_and_unguided_requests(server, client, grammar_checkers):
    kinds = [gpu_cases.FORMAT_KINDS[i % 3] if i % 4 != 3 else 'text' for i in range(16)]

    def one(i_kind):
        i, kind = i_kind
        fmt = _openai_format(kind) if kind != 'text' else None
        extra = {'response_format': fmt} if fmt else {}
        resp = client.chat.completions.create(model=server['model'], temperature=0.0 if i % 2 else 1.0, seed=i,
                                              max_tokens=gpu_cases.MAX_NEW_TOKENS,
                                              messages=[{'role': 'user', 'content': f'Request {i}.'}], **extra)
        return kind, resp.choices[0]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(one, enumerate(kinds)))
    for kind, choice in results:
        if kind == 'text':
            assert choice.message.content is not None
        else:
            _check_text(server, grammar_checkers, kind, choice.message.content, choice.finish_reason)

