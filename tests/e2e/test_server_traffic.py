"""Traffic a deployed api_server sees, on the CPU path with eagle3 (a real server process on 127.0.0.1, the openai
client): concurrent greedy and sampling requests of every format, streaming and not; clients that disconnect
mid-stream; hostile requests. Afterwards the server answers correctly and ``/health`` is 200.

The defects of the issue "The engine never dies, never stalls, never drops the grammar" this guards against: mixed
greedy and sampling batches stopped the engine (1); a schema without instances was decoded unconstrained (5); a
string schema is refused before the engine (7); raw logprobs of guided requests were -inf, HTTP 500 (8).
"""
import asyncio
import concurrent.futures
import io
import json
import math
import os
import re
import signal
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest
import random_traffic
import server_traffic as traffic
from e2e_helpers import PERSON, YEAR, check_valid, data_events, metric, response_format, start_server, stop_server

from grammars import wide_object

# the session's pipelines are closed first: with this module's servers beside them they outgrew the machine
pytestmark = pytest.mark.usefixtures('no_session_pipelines')

ROUNDS = 3
CONCURRENT = 32
DISCONNECTS = 20
#: the random traffic the default suite sends (tests/e2e/random_traffic.py runs longer hunts)
RANDOM_SEED = 7
RANDOM_REQUESTS = 60
NO_INSTANCE = {'type': 'json_schema', 'json_schema': {'name': 'loop', 'schema': {
    '$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}}}


@pytest.fixture(scope='module')
def server(cpu_path, tmp_path_factory):
    from lmdeploy_guided_spec.cpu import models
    method, draft = models.SPECULATIVE['tiny-llama']
    log = tmp_path_factory.mktemp('traffic') / 'server.log'
    args = ['--speculative-algorithm', method, '--speculative-draft-model', models.resolve(draft),
            '--speculative-num-draft-tokens', '3', '--logprobs-mode', 'raw_logprobs', '--enable-abort-handling']
    proc, base = start_server(args, log, max_batch_size=16)
    yield proc, base, log
    stop_server(proc)


def test_mixed_concurrent_traffic(server):
    proc, base, log = server
    for round_ in range(ROUNDS):
        traffic.check_round(asyncio.run(traffic.mixed_round(base, round_, CONCURRENT)))
        assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200


def test_clients_that_disconnect_mid_stream(server):
    proc, base, log = server
    finished = asyncio.run(traffic.disconnects(base, DISCONNECTS))
    assert len(finished) == DISCONNECTS
    traffic.check_round(finished)
    assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200
    # the server answers correctly after the dropped streams
    fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))
    assert reason == 'stop'
    check_valid(text, fmt)


@pytest.mark.skipif(not traffic.CHAT_SERVES_N, reason='lmdeploy 0.14.0 refuses n above 1 on /v1/chat/completions (its '
                                                      'patch 0089): no stream of several choices')
def test_streams_of_several_choices_whose_client_leaves_end_quietly(server):
    """Streamed chat requests with ``n=2`` (lmdeploy 0.18.0 fans each out into one request per choice) whose client
    leaves after a few chunks: their requests end (none runs on), the server serves on, and the log holds no
    traceback of closing the stream. 0.18.0 closed a choice's stream that its cancelled reader was still running:
    "Close response body iterator failed ... RuntimeError: aclose(): asynchronous generator is already running" at
    ERROR, for most such disconnects (patch 0065)."""
    proc, base, log = server
    start = len(log.read_bytes())
    api = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0, timeout=120)
    model = api.models.list().data[0].id
    for i in range(8):
        stream = api.chat.completions.create(
            model=model, messages=[{'role': 'user', 'content': f'Leave {i}.'}], n=2, max_tokens=64, stream=True,
            temperature=0.8, response_format=response_format('json_schema'))
        for seen, _ in enumerate(stream):
            if seen == 1 + i % 3:
                break
        stream.close()
    # every choice's request ended (none runs on after its client left)
    deadline = time.monotonic() + 60
    while metric(base, 'num_requests_running') > 0 and time.monotonic() < deadline:
        time.sleep(1)
    assert metric(base, 'num_requests_running') == 0
    fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))
    assert reason == 'stop', text
    check_valid(text, fmt)
    assert proc.poll() is None and traffic.health(base) == 200
    tail = log.read_bytes()[start:].decode(errors='replace')
    assert 'Close response body iterator failed' not in tail and 'already running' not in tail, tail[-3000:]


def test_hostile_requests(server):
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{'role': 'user', 'content': 'A person, please.'}]
    # a schema whose patterns xgrammar converts for minutes (about 75 s each here; the conversion grows as the
    # square of the count): its entry check held a thread of the server for as long, beyond stopping. It is stopped
    # at the compile limit (30 s) and refused with it, while the rest of this test is served meanwhile
    patterns = {f'code{i}': {'type': 'string', 'pattern': f'^[a-z]{{1,{40_000 + i}}}$'} for i in range(3)}
    slow_to_parse = {'type': 'json_schema', 'json_schema': {'name': 'codes', 'schema': {
        'type': 'object', 'properties': patterns, 'required': list(patterns)}}}
    checks = concurrent.futures.ThreadPoolExecutor(1)
    slow_start = time.perf_counter()
    slow_check = checks.submit(client.chat.completions.create, model=model, messages=messages,
                               response_format=slow_to_parse, max_tokens=8)
    # a schema without instances: refused with the reason, the grammar is never dropped; checked beside the slow
    # one, not after it (its check waited the whole limit when both arrived while the checker started)
    with pytest.raises(openai.BadRequestError, match='admits no instance'):
        client.chat.completions.create(model=model, messages=messages, response_format=NO_INSTANCE, max_tokens=32)
    assert time.perf_counter() - slow_start < 20 and not slow_check.done()
    # a schema given as a JSON string: the server's request model takes an object (as OpenAI's does) and refuses it
    # before it reaches the engine (pipeline accepts the string: test_deployment.py)
    as_string = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': json.dumps(PERSON)}}
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=model, messages=messages, response_format=as_string, max_tokens=96)
    assert 400 <= refused.value.status_code < 500
    # ... also when the string holds a grammar that takes long to parse (xgrammar's conversion of this pattern takes
    # about 18 s): the refusal parses no grammar, and the server answers the others meanwhile (the handler of
    # refused requests once ran the whole entry check on the event loop: every client waited 22 s)
    slow = {'type': 'json_schema', 'json_schema': {'name': 'slow', 'schema': json.dumps(
        {'type': 'string', 'pattern': '^[a-z]{1,20000}$'})}}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        start = time.perf_counter()
        sent = pool.submit(client.chat.completions.create, model=model, messages=messages, response_format=slow,
                           max_tokens=8)
        time.sleep(0.2)
        with urllib.request.urlopen(f'{base}/v1/models', timeout=300) as answer:
            answer.read()
        beside = time.perf_counter() - start
        with pytest.raises(openai.BadRequestError, match='valid dictionary'):
            sent.result()
    assert time.perf_counter() - start < 3 and beside < 3, (time.perf_counter() - start, beside)
    # refused bodies whose shape the check names: HTTP 400, never a server error
    for odd in ({'type': 'json_schema', 'whitespace': 'tabs'}, {'type': 'json_schema', 'regex_schema': 5},
                {'type': 'json_object', 'whitespace': ['compact']}, {'type': 'nonsense'}):
        body = json.dumps({'model': model, 'messages': messages, 'max_tokens': 8, 'response_format': odd}).encode()
        with pytest.raises(urllib.error.HTTPError) as answer:
            urllib.request.urlopen(urllib.request.Request(f'{base}/v1/chat/completions', body,
                                                          {'Content-Type': 'application/json'}), timeout=60)
        assert answer.value.code == 400, (odd, answer.value.code, answer.value.read()[:300])
    # a schema of 400 nested objects: refused at once with the limit (its entry check took 46 s, then lmdeploy's copy
    # of the request failed)
    deep = {'type': 'string'}
    for _ in range(400):
        deep = {'type': 'object', 'properties': {'a': deep}, 'required': ['a']}
    start = time.perf_counter()
    with pytest.raises(openai.BadRequestError, match='LMDEPLOY_GUIDED_SPEC_MAX_SCHEMA_DEPTH'):
        client.chat.completions.create(model=model, messages=messages, max_tokens=32, response_format={
            'type': 'json_schema', 'json_schema': {'name': 'deep', 'schema': deep}})
    assert time.perf_counter() - start < 10
    # a regex whose masks cost over a second per token (it held up every request at every step): refused with the
    # cost and the limit (HTTP 400)
    slow = {'type': 'regex_schema', 'regex_schema': '([a-z]+ ?){1,300}'}
    _refused(client, model, messages, slow, 'ms per token to match')
    # an object of 3,000 optional properties: xgrammar's matcher holds about 0.1 GB once it has read a key, and as
    # much again for each fork (8,000 properties: 1.9 GB each; one request took the engine past 8 GB). Refused
    # with the memory and the limit, and the server's memory stays where it was
    wide = {'type': 'json_schema', 'json_schema': {'name': 'wide', 'schema': wide_object(3000)}}
    before = traffic.resident_mb(proc.pid)
    _refused(client, model, messages, wide, 'MB of memory after')
    assert traffic.resident_mb(proc.pid) < before + 100, (before, traffic.resident_mb(proc.pid))
    # the same object behind a const of twenty words, more tokens than the probe walks: it passed the probe, and one
    # request that wrote a key took the server's processes 0.3 GB up (6,000 properties: 0.6 GB). Each wide object is
    # now also probed alone
    intro = {'type': 'object', 'properties': {'intro': {'const': 'word ' * 20}, 'data': wide_object(3000)},
             'required': ['intro', 'data']}
    hidden = {'type': 'json_schema', 'json_schema': {'name': 'hidden', 'schema': intro}}
    _refused(client, model, messages, hidden, 'of the object at /properties/data alone')
    assert traffic.resident_mb(proc.pid) < before + 100, (before, traffic.resident_mb(proc.pid))
    # a regex that forces ten million characters after 400 free ones (no probe reaches them; every mask costs
    # microseconds): xgrammar built all of them, 1 to 4 s and 0.7 GB, at each read of the forced text
    forced = {'type': 'regex_schema', 'regex_schema': '[a-z]{400}((a{100}){100}){1000}'}
    _refused(client, model, messages, forced, 'requires at least 10,000,000 characters of fixed text')
    # raw logprobs of a guided request, non-streamed and streamed: finite numbers, valid JSON over HTTP
    fmt = response_format('json_schema')
    choice = client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=96,
                                            temperature=0, logprobs=True, top_logprobs=3).choices[0]
    check_valid(choice.message.content, fmt)
    values = [t.logprob for t in choice.logprobs.content] + [
        top.logprob for t in choice.logprobs.content for top in t.top_logprobs]
    assert values and all(math.isfinite(v) for v in values)
    streamed = client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=96,
                                              temperature=0, logprobs=True, top_logprobs=3, stream=True)
    for chunk in streamed:
        if chunk.choices and chunk.choices[0].logprobs is not None:
            for t in chunk.choices[0].logprobs.content or []:
                assert math.isfinite(t.logprob)
    with pytest.raises(openai.BadRequestError, match='longer than 30 s'):
        slow_check.result()
    assert time.perf_counter() - slow_start < 30 + 30
    checks.shutdown()
    assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200


def _abort(base: str, **body) -> int:
    """``/abort_request`` with ``body``: its HTTP status."""
    return traffic.post(base, '/abort_request', body, timeout=30)[0]


def test_an_abort_reaches_a_request_in_its_entry_check(server):
    """``/abort_request`` (``--enable-abort-handling``) while the request's grammar is still checked, before the
    request has a session: with its ``session_id`` and with ``abort_all``, the request ends at once with
    finish_reason 'abort' (streamed or not). Before, the first answered HTTP 400 "Session N not found" and the
    second missed the request (its epoch was stamped after the check): both ran once their checks ended, seconds
    later. An abort of a session nobody uses is still HTTP 400, and a session id aborted before serves its next
    request in full."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=120, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{'role': 'user', 'content': 'A code, please.'}]

    def slow_to_check(n: int) -> dict:
        # xgrammar converts this pattern for seconds (9,000 repetitions: about 8 s on a 2-core machine)
        return {'type': 'json_schema', 'json_schema': {'name': f'slow{n}', 'schema': {
            'type': 'string', 'pattern': f'^[a-z]{{1,{n}}}$'}}}

    def abort(**body) -> int:
        return _abort(base, **body)

    def chat(fmt, **kwargs):
        return client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=64,
                                              temperature=0, **kwargs).choices[0]

    def streamed(fmt):
        chunks = client.completions.create(model=model, prompt='A code:', max_tokens=64, temperature=0, stream=True,
                                           extra_body={'response_format': fmt})
        return [choice.finish_reason for chunk in chunks for choice in chunk.choices if choice.finish_reason]

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for n, send, body in ((9_002, lambda fmt: chat(fmt, extra_body={'session_id': 4_001}).finish_reason,
                               {'session_id': 4_001}),
                              (9_003, streamed, {'abort_all': True})):
            sent = pool.submit(send, slow_to_check(n))
            time.sleep(1)
            assert not sent.done(), 'the entry check ended within a second: make the pattern longer'
            assert abort(**body) == 200, body
            start = time.perf_counter()
            finished = sent.result()
            took = time.perf_counter() - start
            assert finished in ('abort', ['abort']) and took < 4, (body, finished, took)
    assert abort(session_id=4_002) == 400
    choice = chat(YEAR, extra_body={'session_id': 4_001})
    assert choice.finish_reason == 'stop' and re.fullmatch('[0-9]{4}', choice.message.content), choice
    assert proc.poll() is None, log.read_text()[-4000:]


def test_an_abort_reaches_a_request_that_waits_for_a_free_instance(cpu_path, tmp_path):
    """With every inference instance busy (as many long requests as ``--max-batch-size``), a request waits for one
    to free: ``/abort_request`` with its ``session_id`` ends it at once with finish_reason 'abort'. Before, the abort
    was kept and the request ended only once an instance freed (40 s and more behind long requests). The long
    requests run on meanwhile, and the server serves the next request. (The waiting request is unguided: a guided
    one's entry check could still run when the abort comes, which another test covers.) A streamed request whose
    client gives up while it waits counts as failed: before 0054/0067 it was never counted as ended, and the
    ``lmdeploy:num_api_requests_waiting`` gauge stayed at 1 for ever. A request the engine fails counts once, streamed
    or not."""
    log = tmp_path / 'server.log'
    proc, base = start_server(['--enable-abort-handling'], log, max_batch_size=2)
    try:
        client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
        model = client.models.list().data[0].id
        started = [threading.Event() for _ in range(2)]

        def long_request(i: int):
            reason = None
            for chunk in client.completions.create(model=model, prompt='Once upon a time', max_tokens=1000,
                                                   temperature=0, stream=True,
                                                   extra_body={'ignore_eos': True, 'session_id': 5_001 + i}):
                started[i].set()
                for choice in chunk.choices:
                    reason = choice.finish_reason or reason
            return reason

        def ask(session_id: int, **fmt):
            return client.chat.completions.create(model=model, messages=[{'role': 'user', 'content': 'Which year?'}],
                                                  max_tokens=16, temperature=0, extra_body={'session_id': session_id},
                                                  **fmt).choices[0]

        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            running = [pool.submit(long_request, i) for i in range(2)]
            for i, event in enumerate(started):
                assert event.wait(120), f'long request {i} did not start: {running[i]}'
            waiting = pool.submit(ask, 5_100)
            time.sleep(1)
            assert not waiting.done(), 'the request did not wait for an instance: the long requests ended too soon'
            assert _abort(base, session_id=5_100) == 200
            start = time.perf_counter()
            try:
                finished = waiting.result(timeout=20).finish_reason
            except concurrent.futures.TimeoutError:
                finished = 'still waiting after 20 s'
            took = time.perf_counter() - start
            # a client that gives up while its streamed request waits (its read timeout, 1.5 s): the server sees it
            # go (a request without a stream waits on and runs)
            impatient = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=1.5, max_retries=0)
            with pytest.raises(openai.APITimeoutError):
                for _ in impatient.chat.completions.create(
                        model=model, messages=[{'role': 'user', 'content': 'Which year?'}], max_tokens=16,
                        stream=True):
                    pass
            long_ones_ran_on = not any(r.done() for r in running)
            assert _abort(base, abort_all=True) == 200
            assert long_ones_ran_on, 'the long requests ended too soon: make them longer'
            assert finished == 'abort' and took < 4, (finished, took)
            assert [r.result() for r in running] == ['abort'] * 2
        choice = ask(5_100, response_format=YEAR)
        assert choice.finish_reason == 'stop' and re.fullmatch('[0-9]{4}', choice.message.content), choice
        assert proc.poll() is None, log.read_text()[-4000:]
        # nothing waits now: the request whose client gave up counts as failed, not as waiting for ever (the server
        # writes its gauges every 10 s: a write between the failures showed some of them until the next one)
        deadline = time.monotonic() + 30
        while True:
            waiting, failed = metric(base, 'num_api_requests_waiting'), metric(base, 'num_requests_failed')
            if (waiting == 0 and failed >= 4) or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert waiting == 0, (waiting, failed)
        # the waiting request aborted, the two long ones aborted, the one whose client gave up
        assert failed == 4, (waiting, failed)
        # a request the engine fails (a grammar whose masks cost past the limit) counts once, streamed or not: a
        # stream closed at its error event counted it as cancelled too
        refused = {'type': 'regex_schema', 'regex_schema': '([a-z]+ ?){1,300}'}
        for stream in (False, True):
            with pytest.raises(openai.APIError, match='ms per token to match'):
                answer = client.chat.completions.create(model=model, messages=[{'role': 'user', 'content': 'Words.'}],
                                                        max_tokens=8, response_format=refused, stream=stream)
                if stream:
                    list(answer)
        deadline = time.monotonic() + 30
        while metric(base, 'num_requests_failed') < 6 and time.monotonic() < deadline:
            time.sleep(1)
        time.sleep(11)  # and a gauge written after that
        assert metric(base, 'num_requests_failed') == 6, metric(base, 'num_requests_failed')
    finally:
        stop_server(proc)


def _refused(client, model, messages, fmt, reason):
    """A request the engine refuses for its grammar: HTTP 400 with ``reason``, on every release (lmdeploy 0.14.0's
    api_server answered HTTP 200 with the reason as the text, ``finish_reason`` 'error')."""
    with pytest.raises(openai.APIStatusError) as raised:
        client.chat.completions.create(model=model, messages=messages, response_format=fmt, max_tokens=16)
    assert raised.value.status_code == 400 and reason in str(raised.value), raised.value


def test_a_session_id_in_use_is_refused_with_a_conflict(server):
    """A request with the ``session_id`` of a request still running: HTTP 409 that names the id (chat, completions,
    generate), never HTTP 500 "Internal Server Error" (lmdeploy's session manager raised ValueError "User session id
    N already exists" out of the handler); the running request goes on, and the id serves again once it ended.
    Prompt lists of /v1/completions side by side are served too (0.14.0 gave each list item the session ids 1, 2,
    ...: the second list failed the same way)."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    session_id = 4242
    messages = [{'role': 'user', 'content': 'A person, please.'}]
    running = client.chat.completions.create(model=model, messages=messages, max_tokens=120, stream=True,
                                             extra_body={'session_id': session_id, 'ignore_eos': True})
    chunks = iter(running)
    next(chunks)
    requests = {'/v1/chat/completions': {'model': model, 'messages': messages, 'max_tokens': 8,
                                         'session_id': session_id, 'response_format': response_format('json_schema')},
                '/v1/completions': {'model': model, 'prompt': 'A person:', 'max_tokens': 8, 'session_id': session_id},
                '/generate': {'prompt': 'A person:', 'max_tokens': 8, 'session_id': session_id}}
    for path, body in requests.items():
        status, answer = traffic.post(base, path, body)
        assert status == 409, (path, status, answer)
        assert f'session_id {session_id} is in use' in json.dumps(answer), (path, answer)
    finish = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices]
    assert finish[-1] == 'length'
    status, answer = traffic.post(base, '/v1/chat/completions', requests['/v1/chat/completions'] | {'max_tokens': 96})
    assert status == 200 and answer['choices'][0]['finish_reason'] == 'stop', answer
    check_valid(answer['choices'][0]['message']['content'], response_format('json_schema'))
    # two prompt lists side by side (the first still running when the second arrives), and a request of session 1
    lists = concurrent.futures.ThreadPoolExecutor(2)
    first = lists.submit(traffic.post, base, '/v1/completions', {'model': model, 'prompt': ['One:', 'Two:'],
                                                          'max_tokens': 100, 'ignore_eos': True})
    time.sleep(1)
    second = lists.submit(traffic.post, base, '/v1/completions', {'model': model, 'prompt': ['Three:', 'Four:'],
                                                           'max_tokens': 8})
    own = traffic.post(base, '/v1/completions', {'model': model, 'prompt': 'Five:', 'max_tokens': 8, 'session_id': 1})
    for status, answer in (first.result(), second.result(), own):
        assert status == 200, (status, answer)
    assert [len(first.result()[1]['choices']), len(second.result()[1]['choices'])] == [2, 2]
    assert proc.poll() is None and traffic.health(base) == 200


#: A conversation whose earlier tool call has ``arguments`` that are not JSON (the request's fault: HTTP 400)
UNPARSABLE_CALL = [
    {'role': 'user', 'content': 'Weather?'},
    {'role': 'assistant', 'content': None, 'tool_calls': [
        {'id': 'call_1', 'type': 'function', 'function': {'name': 'lookup', 'arguments': '{"city": '}}]},
    {'role': 'tool', 'tool_call_id': 'call_1', 'content': 'sunny'}]


def test_a_refused_request_leaves_its_session_id_free(server):
    """A request refused with an error, each way a request can be refused (its body, its prompt, its grammar, the
    engine), leaves its ``session_id``: the next request of that id is served. On 0.14.0 the chat endpoint kept the
    session of a request its response parser or ``logit_bias`` refused, and every later request of the id was HTTP
    409 "in use" (and without an id, each such request left a session behind)."""
    proc, base, log = server
    model = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0).models.list().data[0].id
    chat = {'model': model, 'max_tokens': 4}
    refusals = [
        ('/v1/chat/completions', chat | {'messages': UNPARSABLE_CALL}),
        ('/v1/chat/completions', chat | {'messages': [{'role': 'user', 'content': 'Hi'}],
                                         'logit_bias': {'not a token id': 5}}),
        ('/v1/chat/completions', chat | {'messages': [{'role': 'narrator', 'content': 'Once'}]}),
        ('/v1/chat/completions', chat | {'messages': [{'role': 'user', 'content': 'Hi'}],
                                         'response_format': {'type': 'regex_schema', 'regex_schema': '[a-'}}),
        ('/v1/completions', {'model': model, 'prompt': 'word ' * 5000, 'max_tokens': 4}),
        ('/generate', {'prompt': '', 'max_tokens': 4}),
    ]
    for i, (path, body) in enumerate(refusals):
        session_id = 5100 + i
        status, answer = traffic.post(base, path, body | {'session_id': session_id})
        assert 400 <= status < 500, (path, body, status, answer)
        status, answer = traffic.post(base, '/v1/chat/completions', {
            'model': model, 'messages': [{'role': 'user', 'content': 'Hi'}], 'max_tokens': 4,
            'session_id': session_id})
        assert status == 200, (path, body, status, answer)
    assert proc.poll() is None and traffic.health(base) == 200


def _bad_request(create, match: str, **kwargs) -> openai.BadRequestError:
    """The HTTP 400 that ``create(**kwargs)`` answers with a reason that says ``match``, streamed or not."""
    with pytest.raises(openai.BadRequestError, match=match) as refused:
        answer = create(**kwargs)
        if kwargs.get('stream'):
            list(answer)
    return refused.value


def test_several_choices_are_served_or_refused(server):
    """``n`` above 1: /v1/completions served one choice and logged "n(2) > 1 hasn't been supported yet. Fallback to
    1", and 0.14.0's /v1/chat/completions served one choice without a word, so a client that asked for two choices
    got one. Each is HTTP 400 with the reason now, streamed or not; 0.18.0's chat endpoint serves ``n`` (one request
    per choice), each choice under its grammar; ``n=1`` is served as before."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    fmt = response_format('json_schema')
    messages = [{'role': 'user', 'content': 'A person, please.'}]
    for stream in (False, True):
        refused = _bad_request(client.completions.create, 'one choice per prompt', model=model,
                               prompt=['A person:', 'A year:'], n=2, max_tokens=8, temperature=0.8, stream=stream,
                               extra_body={'response_format': fmt})
        assert 'n 2' in str(refused), refused
        if traffic.CHAT_SERVES_N:
            texts: dict[int, str] = {}
            reasons: dict[int, str] = {}
            answer = client.chat.completions.create(model=model, messages=messages, n=2, max_tokens=96,
                                                    temperature=0.8, seed=11, stream=stream, response_format=fmt)
            for chunk in (answer if stream else [answer]):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, '') + (
                        choice.delta.content or '' if stream else choice.message.content)
                    reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            assert sorted(texts) == [0, 1] and set(reasons.values()) <= {'stop', 'length'}, (texts, reasons)
            for index, text in texts.items():
                if reasons[index] == 'stop':
                    check_valid(text, fmt)
        else:
            _bad_request(client.chat.completions.create, 'answers one choice', model=model, messages=messages, n=2,
                         max_tokens=8, temperature=0.8, stream=stream, response_format=fmt)
    choices = client.completions.create(model=model, prompt=['A person:', 'A year:'], n=1, max_tokens=4).choices
    assert sorted(c.index for c in choices) == [0, 1]
    assert len(client.chat.completions.create(model=model, messages=messages, n=1, max_tokens=4).choices) == 1
    assert 'Fallback to 1' not in log.read_text(errors='replace')
    assert proc.poll() is None and traffic.health(base) == 200


def test_completions_serve_logprobs(server):
    """/v1/completions with ``logprobs``: OpenAI's ``tokens``, ``token_logprobs``, ``top_logprobs`` and
    ``text_offset`` for every token, streamed or not, guided or not. lmdeploy raised ValueError('logprobs is
    removed') inside the stream (the client got a broken chunked response) and answered ``logprobs: null``
    without a stream."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    kwargs = dict(model=model, prompt='A person:', max_tokens=6, temperature=0, logprobs=2,
                  extra_body={'ignore_eos': True})
    choice = client.completions.create(**kwargs).choices[0]
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == 6, choice
    assert ''.join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(6)]
    for token, logprob, tops in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert math.isfinite(logprob) and logprob <= 0
        assert tops[token] == logprob and 2 <= len(tops) <= 3, (token, tops)
    streamed = [chunk.choices[0] for chunk in client.completions.create(stream=True, **kwargs) if chunk.choices]
    tokens = [t for c in streamed if c.logprobs for t in c.logprobs.tokens]
    offsets = [o for c in streamed if c.logprobs for o in c.logprobs.text_offset]
    assert streamed[-1].finish_reason == 'length'
    assert tokens == lp.tokens and offsets == lp.text_offset, streamed
    assert ''.join(c.text for c in streamed) == choice.text
    # a guided request: its document and the logprobs of each of its tokens
    fmt = response_format('json_schema')
    guided = client.completions.create(model=model, prompt='A person:', max_tokens=96, temperature=0, logprobs=3,
                                       extra_body={'response_format': fmt}).choices[0]
    assert guided.finish_reason == 'stop', guided
    check_valid(guided.text, fmt)
    assert guided.logprobs.tokens and all(math.isfinite(x) for x in guided.logprobs.token_logprobs), guided
    assert proc.poll() is None and traffic.health(base) == 200


def test_a_streamed_list_of_prompts_names_each_choice(server):
    """/v1/completions with a list of prompts, streamed: each chunk's choice carries the index of its prompt, as
    without a stream, so that an OpenAI client can tell the completions apart; the texts and finish reasons per
    index are those of the answer without a stream (greedy), guided or not. lmdeploy gave every chunk ``index: 0``:
    the completions ran together into one."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    prompts = ['A person:', 'Another person:', 'A third one:']
    for extra in ({'ignore_eos': True}, {'response_format': response_format('json_schema')}):
        kwargs = dict(model=model, prompt=prompts, max_tokens=24 if 'ignore_eos' in extra else 96, temperature=0,
                      extra_body=extra)
        whole = client.completions.create(**kwargs).choices
        assert [c.index for c in whole] == [0, 1, 2], whole
        texts, reasons = {}, {}
        for chunk in client.completions.create(stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] = texts.get(choice.index, '') + choice.text
                if choice.finish_reason is not None:
                    reasons[choice.index] = choice.finish_reason
        assert sorted(texts) == [0, 1, 2], texts
        assert [texts[i] for i in range(3)] == [c.text for c in whole], (texts, whole)
        assert [reasons.get(i) for i in range(3)] == [c.finish_reason for c in whole], (reasons, whole)
        if 'response_format' in extra:
            for choice in whole:
                assert choice.finish_reason == 'stop', choice
                check_valid(choice.text, extra['response_format'])
    assert proc.poll() is None and traffic.health(base) == 200


def test_prompts_at_the_edges(server):
    """An empty prompt is served on /v1/completions, /generate refuses it by name, an empty messages list is not a
    server error, null sampling fields are their defaults, a token-id prompt on /v1/completions is HTTP 400 saying
    what to send, a message of a role the chat template does not know is HTTP 400 naming it, so are tool call
    arguments that are not JSON, and a prompt longer than the context is refused as such: HTTP 400 saying it exceeds
    the context length. On 0.14.0 the
    empty prompt was HTTP 500 (``len(None)``) and the long one HTTP 200 with ``finish_reason`` 'error' and the text
    "internal error happened, status code ResponseType.INPUT_LENGTH_ERROR"."""
    proc, base, log = server
    model = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0).models.list().data[0].id
    status, answer = traffic.post(base, '/v1/completions', {'model': model, 'prompt': '', 'max_tokens': 4,
                                                     'ignore_eos': True})
    assert status == 200 and answer['choices'][0]['finish_reason'] == 'length', (status, answer)
    status, answer = traffic.post(base, '/generate', {'prompt': '', 'max_tokens': 4})
    assert status == 400 and 'empty' in json.dumps(answer), (status, answer)
    status, answer = traffic.post(base, '/v1/chat/completions', {'model': model, 'messages': [], 'max_tokens': 4})
    assert status < 500, (status, answer)
    # sampling fields sent as null take their defaults (0.14.0 compared them: HTTP 500), and a prompt of token ids
    # is refused on /v1/completions (0.14.0: HTTP 500 "unsupported prompt type")
    nulls = {'temperature': None, 'top_p': None, 'top_k': None, 'n': None, 'max_tokens': 4}
    for path, body in (('/v1/chat/completions', {'model': model, 'messages': [{'role': 'user', 'content': 'Hi'}]}),
                       ('/v1/completions', {'model': model, 'prompt': 'Hi'})):
        status, answer = traffic.post(base, path, {**body, **nulls})
        assert status == 200, (path, status, answer)
    # (0.14.0's /generate declares them not nullable: HTTP 422)
    status, answer = traffic.post(base, '/generate', {'prompt': 'Hi', **nulls})
    assert status in (200, 422), (status, answer)
    # (0.18.0 answered "Request preprocessing failed." and logged a traceback)
    status, answer = traffic.post(base, '/v1/completions', {'model': model, 'prompt': [1, 2, 3], 'max_tokens': 4})
    assert status == 400 and 'token ids' in json.dumps(answer), (status, answer)
    # a message of a role the chat template does not know is the request's problem, and the answer names the role
    # (0.18.0: "Request preprocessing failed."; 0.14.0: "in prompt processing error"; both logged a KeyError)
    odd = {'model': model, 'messages': [{'role': 'narrator', 'content': 'Once'}], 'max_tokens': 4}
    status, answer = traffic.post(base, '/v1/chat/completions', odd)
    assert status == 400 and "'narrator'" in answer['error']['message'], (status, answer)
    status, answer = traffic.post(base, '/v1/chat/completions', {**odd, 'stream': True})
    assert "'narrator'" in json.dumps(answer) and 'processing' not in json.dumps(answer), (status, answer)
    # arguments of an earlier tool call that are not JSON: HTTP 400 in OpenAI's error body (0.14.0: {"detail": ...})
    broken = {'model': model, 'max_tokens': 4, 'messages': UNPARSABLE_CALL + [{'role': 'user', 'content': 'And now?'}]}
    status, answer = traffic.post(base, '/v1/chat/completions', broken)
    assert status == 400 and 'invalid JSON' in answer['error']['message'], (status, answer)
    long = 'word ' * 5000
    for path, body in (('/v1/completions', {'model': model, 'prompt': long}),
                       ('/v1/chat/completions', {'model': model, 'messages': [{'role': 'user', 'content': long}]})):
        status, answer = traffic.post(base, path, {**body, 'max_tokens': 4})
        text = json.dumps(answer)
        assert 'context length' in text and 'internal error' not in text, (path, status, answer)
        assert status == 400, (path, status, answer)
    assert proc.poll() is None and traffic.health(base) == 200


def test_a_request_the_engine_fails_is_an_error_on_every_endpoint(server):
    """A request the engine fails, here for a grammar whose masks cost past the limit (the engine's compile refuses
    it, not the server's entry check), is an error with the engine's reason on every endpoint, never an answer whose
    text is the reason: HTTP 400 without a stream; a stream ends with its error event (chat, completions and
    /generate: ``data: {"error": ...}``, then ``[DONE]``; the Responses API: ``response.failed`` whose error is the
    reason, with no output text and no message, where both releases opened an empty one; Anthropic's: ``event:
    error``). lmdeploy 0.14.0 answered each with HTTP 200, ``finish_reason`` 'error' (the Responses API: status
    failed, "Response generation failed.") and the reason as the text, streamed or not."""
    proc, base, log = server
    model = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0).models.list().data[0].id
    reason = 'ms per token to match'
    slow = '([a-z]+ ?){1,300}'
    schema = {'type': 'object', 'properties': {'words': {'type': 'string', 'pattern': slow}}, 'required': ['words']}
    bodies = traffic.guided_bodies(model, schema, 'words', 'Some words.', max_tokens=8)
    for path, body in bodies.items():
        status, answer = traffic.post(base, path, body, headers=traffic.ANTHROPIC_HEADERS)
        assert status == 400 and reason in json.dumps(answer), (path, status, answer)
        status, answer = traffic.post(base, path, {**body, 'stream': True}, headers=traffic.ANTHROPIC_HEADERS)
        text = answer.get('text', '')
        assert status == 200, (path, status, text[:600])
        events = data_events(text)
        assert events, (path, text[:600])
        if path == '/v1/responses':
            failed = [e for e in events if e.get('type') == 'response.failed']
            assert failed and reason in failed[-1]['response']['error']['message'], (path, text[:1500])
            assert not failed[-1]['response'].get('output_text'), failed[-1]
            # no output before the failure: no message either (0.14.0 opened an empty one)
            assert failed[-1]['response']['output'] == [], failed[-1]
            assert not any(e.get('type', '').startswith('response.output_item') for e in events), text[:1500]
            assert not any(e.get('type') == 'response.output_text.delta' and reason in e.get('delta', '')
                           for e in events), text[:1500]
        elif path == '/v1/messages':
            assert 'event: error' in text and reason in events[-1]['error']['message'], (path, text[:1500])
            assert not any(reason in json.dumps(e.get('delta', {})) for e in events), text[:1500]
        else:
            assert reason in events[-1]['error']['message'], (path, text[:1500])
            assert text.rstrip().endswith('data: [DONE]'), (path, text[-300:])
            assert not any(reason in json.dumps(e.get('choices', [])) or reason in str(e.get('text', ''))
                           for e in events[:-1]), (path, text[:1500])
    assert proc.poll() is None and traffic.health(base) == 200


def test_a_grammar_whose_masks_grow_slow_later_is_refused_with_400(server):
    """A grammar that passes the compile service's probe of its first 16 tokens and whose masks grow slow later (see
    ``tests/e2e/test_late_slow_masks.py``) held the batch for seconds at every step of the request (0.18.0 patch 0093,
    0.14.0 patch 0092). Now its request is refused once a mask goes over the limit: HTTP 400 with the cost and the
    limit without a stream, a stream's error event (code 400, then ``[DONE]``), and the server serves on."""
    proc, base, log = server
    took, status, answer, streamed = traffic.late_slow(base)
    traffic.check_late_slow_refused(status, answer, streamed)
    # each request ran its prefix and two or three slow masks (the second refuses it, one more step may be scheduled;
    # about a second each on a 2-core machine), not its 48 tokens
    assert took < 60, took
    assert proc.poll() is None and traffic.health(base) == 200


def test_random_traffic(server):
    """Seeded random traffic (``random_traffic.py``: every endpoint and format, hostile schemas and settings, cut
    streams, session ids in use): no HTTP 5xx, no dropped connection or broken stream, every guided document that
    stopped valid, and the check request after each wave answers a valid document."""
    proc, base, log = server
    out = io.StringIO()
    outcomes, failures = asyncio.run(random_traffic.run(base, seed=RANDOM_SEED, requests=RANDOM_REQUESTS, out=out))
    random_traffic.report(outcomes, failures, out)
    assert not failures, out.getvalue()[-8000:]
    assert len(outcomes) == RANDOM_REQUESTS
    assert proc.poll() is None and traffic.health(base) == 200


def test_random_traffic_tells_one_call_from_several():
    """The hunt's judge of calls (no server): ``parallel_tool_calls`` false on chat and Anthropic's
    ``disable_parallel_tool_use`` (constrained or not) fail an answer with two calls, and pass one with one."""
    tools = [{'type': 'function', 'function': {'name': 'f', 'description': 'f', 'parameters': None}}]
    chat = {'tools': tools, 'tool_choice': 'required', 'parallel_tool_calls': False}
    call = {'function': {'name': 'f', 'arguments': '{}'}}

    def answer(*calls):
        return {'choices': [{'finish_reason': 'tool_calls', 'message': {'tool_calls': list(calls)}}]}

    assert random_traffic.check_tool_calls('/v1/chat/completions', chat, answer(call)) is None
    assert 'parallel_tool_calls false' in random_traffic.check_tool_calls('/v1/chat/completions', chat,
                                                                         answer(call, call))
    use = {'type': 'tool_use', 'name': 'f', 'input': {}}
    for choice in ({'type': 'auto'}, {'type': 'any'}):
        messages = {'tools': [{'name': 'f', 'description': 'f', 'input_schema': {'type': 'object'}}],
                    'tool_choice': {**choice, 'disable_parallel_tool_use': True}}
        one = {'stop_reason': 'tool_use', 'content': [use]}
        assert random_traffic.check_tool_calls('/v1/messages', messages, one) is None
        two = random_traffic.check_tool_calls('/v1/messages', messages, {**one, 'content': [use, use]})
        assert two is not None and 'disable_parallel_tool_use' in two, (choice, two)
        messages['tool_choice']['disable_parallel_tool_use'] = False
        assert random_traffic.check_tool_calls('/v1/messages', messages, {**one, 'content': [use, use]}) is None


def test_sampling_that_leaves_one_token_is_greedy_decoding(server):
    """Through the server (eagle3), concurrent and streamed: sampling that leaves a single token at each step
    (``top_k=1``, a ``top_p`` or ``min_p`` that only the likeliest token passes, a temperature of 1e-38) must give
    greedy decoding's tokens, guided or not. Speculative decoding verified the drafts against the logits before
    ``top_k``/``top_p``/``min_p`` (patch 0040 of 0.18.0, 0053 of 0.14.0), so it sampled tokens they exclude; a
    ``top_k`` beyond the vocabulary or a temperature of 1e-38 stopped the engine for every request (patch 0039,
    0052)."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    person = response_format('json_schema')
    # (the unguided row: the tiny model's first greedy token ends it otherwise)
    cases = [(person, 'A person, please.', 96, {}), (YEAR, 'Which year?', 16, {}),
             (None, 'Hello!', 24, {'ignore_eos': True})]

    def ask(fmt, prompt, max_tokens, own, stream=False, extra_body=None, **sampling):
        args = dict(model=model, messages=[{'role': 'user', 'content': prompt}], max_tokens=max_tokens,
                    extra_body={**own, **(extra_body or {})}, **sampling)
        if fmt is not None:
            args['response_format'] = fmt
        if not stream:
            choice = client.chat.completions.create(**args).choices[0]
            return choice.message.content or '', choice.finish_reason
        parts, reason = [], None
        for chunk in client.chat.completions.create(stream=True, **args):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or '')
                reason = chunk.choices[0].finish_reason or reason
        return ''.join(parts), reason

    greedy = [ask(*case, temperature=0) for case in cases]
    assert all(text for text, _ in greedy), greedy
    # (the OpenAI arguments, lmdeploy's own): each leaves one token per step
    one_token = [({'temperature': 1.0}, {'top_k': 1}), ({'temperature': 1.5, 'top_p': 1e-6}, {}),
                 ({'temperature': 1.0}, {'min_p': 1.0}), ({'temperature': 1e-38}, {'top_k': 10**9})]
    asks = [(case, stream) for case in cases for stream in (False, True)]
    for i, (openai_args, own) in enumerate(one_token):
        with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(ask, *case, stream, seed=100 * i + j, extra_body=own, **openai_args)
                       for j, (case, stream) in enumerate(asks)]
            answers = [future.result() for future in futures]
        for (case, stream), answer, expected in zip(asks, answers, [g for g in greedy for _ in (False, True)]):
            assert answer == expected, (openai_args, own, case[1], stream, answer[0], expected[0])
            if case[0] is not None:
                check_valid(answer[0], case[0])
    assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200


def test_patterns_xgrammar_compiles_inexactly(server):
    """A schema whose patterns xgrammar 0.2.8 compiles inexactly (its automaton, its rules of a pattern beyond
    ASCII), sampled: the output is JSON that satisfies the patterns."""
    proc, base, log = server

    def alive():
        assert proc.poll() is None, log.read_text()[-4000:]

    assert traffic.patterned(base, alive) >= 6


def test_requests_whose_grammar_meets_banned_tokens_or_a_dead_end(server):
    """Requests that stopped the engine (a sampled row without a finite logit) or failed with HTTP 500: a grammar that
    allows no token at all is refused at entry; one that runs into a dead end fails its own request; ignore_eos,
    min_new_tokens and the n-gram stop leave the grammar its tokens, and the text is what the grammar accepts."""
    proc, base, log = server

    def alive():
        assert proc.poll() is None, log.read_text()[-4000:]

    traffic.dead_ends_and_banned_tokens(base, alive)
    assert traffic.health(base) == 200
    fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))
    assert reason == 'stop'
    check_valid(text, fmt)



def _client(server) -> tuple[openai.OpenAI, str]:
    api = openai.OpenAI(base_url=f'{server[1]}/v1', api_key='none', timeout=120, max_retries=0)
    return api, api.models.list().data[0].id


@pytest.mark.parametrize('stream', [False, True], ids=['batch', 'stream'])
@pytest.mark.parametrize('whitespace', [None, 'compact'])
def test_the_responses_api_follows_text_format(server, whitespace, stream):
    """The Responses API's ``text.format`` (``/v1/responses``) constrains the output as a chat ``response_format``
    does, ``whitespace`` included (0.18.0 patch 0059, 0.14.0 patch 0071: it was dropped, and the output had any
    whitespace). On 0.14.0 every answer was HTTP 500: its usage lacked a field the openai package requires."""
    c, model = _client(server)
    fmt = {'type': 'json_schema', 'name': 'person', 'schema': PERSON, 'strict': True}
    if whitespace is not None:
        fmt['whitespace'] = whitespace
    kwargs = dict(model=model, input='Describe a person as JSON.', text={'format': fmt}, max_output_tokens=96,
                  temperature=0)
    if stream:
        text, status = '', None
        for event in c.responses.create(stream=True, **kwargs):
            if event.type == 'response.output_text.delta':
                text += event.delta
            elif event.type in ('response.completed', 'response.incomplete', 'response.failed'):
                status = event.response.status
    else:
        response = c.responses.create(**kwargs)
        text, status = response.output_text, response.status
    assert status == 'completed', (status, text)
    check_valid(text, {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}})
    if whitespace == 'compact':
        assert text == json.dumps(json.loads(text), separators=(',', ':'), ensure_ascii=False), text


RESPONSES_BAD = {
    # name: (text.format, what the message says)
    'schema not an object': ({'type': 'json_schema', 'name': 'p', 'schema': 'not an object'},
                             '`text.format.schema` must be an object'),
    'schema a list': ({'type': 'json_schema', 'name': 'p', 'schema': [1]}, '`text.format.schema` must be an object'),
    'name not a string': ({'type': 'json_schema', 'name': 5, 'schema': PERSON}, '`text.format.name` must be a string'),
    'unknown whitespace': ({'type': 'json_schema', 'name': 'p', 'schema': PERSON, 'whitespace': 'wide'},
                           'whitespace'),
    'invalid schema': ({'type': 'json_schema', 'name': 'p', 'schema': {'type': 'nonsense'}}, 'nonsense'),
    # values the entry check passes and the chat request built of the format refuses (HTTP 500 on 0.14.0 before
    # its patch 0074 caught them)
    'strict not a boolean': ({'type': 'json_schema', 'name': 'p', 'schema': PERSON, 'strict': [1]}, 'strict'),
    'empty whitespace': ({'type': 'json_schema', 'name': 'p', 'schema': PERSON, 'whitespace': ''}, 'whitespace'),
}


@pytest.mark.parametrize('name', RESPONSES_BAD)
def test_the_responses_api_refuses_a_bad_text_format_with_400(server, name):
    """A ``text.format`` the server cannot serve is HTTP 400 with OpenAI's error body, streamed or not (a schema or
    name of the wrong type was HTTP 500: the chat request built from it raised), naming the field ``text`` (the check
    of the grammar named the chat endpoint's ``response_format``), and the server serves on."""
    fmt, message = RESPONSES_BAD[name]
    c, model = _client(server)
    for stream in (False, True):
        refused = _bad_request(c.responses.create, '', model=model, input='x', text={'format': fmt},
                               max_output_tokens=8, stream=stream)
        assert refused.status_code == 400 and message in refused.message, (stream, refused)
        # the field as the client sent it (0.18.0 said response_format.whitespace for text.format.whitespace)
        assert refused.param == 'text' and 'response_format.' not in refused.message, (stream, refused.param, refused)
    assert server[0].poll() is None


def _anthropic_message(server, body: dict) -> tuple[int, dict]:
    """POST ``body`` to the Anthropic Messages endpoint (``/v1/messages``): the status and the JSON answer."""
    request = urllib.request.Request(f'{server[1]}/v1/messages', data=json.dumps(body).encode(), method='POST',
                                     headers={'content-type': 'application/json', 'anthropic-version': '2023-06-01'})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_the_anthropic_messages_api_follows_output_format(server):
    """Anthropic's structured outputs (``output_format: {"type": "json_schema", "schema": ...}``) on ``/v1/messages``
    constrain the text as a chat ``response_format`` does (0.18.0 patch 0062, 0.14.0 patch 0072: the field was dropped
    and the text was free); a schema that is not an object, a format of another type or a schema the grammar cannot
    serve is HTTP 400, and the server serves on."""
    _, model = _client(server)
    body = {'model': model, 'max_tokens': 96, 'temperature': 0, 'messages': [{'role': 'user', 'content': 'A person.'}],
            'output_format': {'type': 'json_schema', 'schema': PERSON}}
    status, answer = _anthropic_message(server, body)
    assert status == 200 and answer['stop_reason'] == 'end_turn', answer
    text = ''.join(block['text'] for block in answer['content'] if block['type'] == 'text')
    check_valid(text, {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}})
    for output_format, message in (({'type': 'json_schema', 'schema': 'not an object'}, 'output_format.schema'),
                                   ({'type': 'regex', 'pattern': 'a+'}, 'output_format type'),
                                   ({'type': 'json_schema', 'schema': {'type': 'nonsense'}}, 'nonsense'),
                                   ({'type': 'json_schema', 'schema': PERSON, 'whitespace': ''}, 'whitespace'),
                                   ({'type': 'json_schema', 'schema': PERSON, 'whitespace': 0}, 'whitespace')):
        status, answer = _anthropic_message(server, {**body, 'output_format': output_format})
        assert status == 400 and message in answer['error']['message'], answer
        # the field as the client sent it (the chat request's response_format.whitespace was named before)
        assert 'response_format.' not in answer['error']['message'], answer
    assert server[0].poll() is None


@pytest.mark.parametrize('field, value, stream', [('temperature', -1.0, False), ('temperature', 3.0, True),
                                                  ('top_p', 1.5, False), ('top_p', -0.1, True), ('top_k', -1, False)])
def test_the_anthropic_messages_api_refuses_sampling_out_of_range_with_400(server, field, value, stream):
    """A ``temperature`` outside Anthropic's [0, 1], a ``top_p`` outside [0, 1] or a negative ``top_k`` on
    ``/v1/messages`` is HTTP 400 naming the field, streamed or not (0.14.0 patch 0073: HTTP 500, an assertion of
    lmdeploy's GenerationConfig; 0.18.0 checks them), and the server serves on."""
    _, model = _client(server)
    body = {'model': model, 'max_tokens': 8, 'messages': [{'role': 'user', 'content': 'Hi.'}], field: value,
            'stream': stream}
    status, answer = _anthropic_message(server, body)
    assert status == 400 and answer['type'] == 'error' and field in answer['error']['message'], answer
    status, answer = _anthropic_message(server, {**body, field: 0.5 if field != 'top_k' else 4, 'stream': False})
    assert status == 200 and answer['stop_reason'] in ('end_turn', 'max_tokens'), answer


def test_an_api_server_killed_outright_leaves_no_process_behind(cpu_path, tmp_path):
    """An api_server killed outright (the OOM killer, ``kill -9``) left lmdeploy's engine process running on its
    own: on a GPU the model and the KV cache stay taken, and a server started again does not find the memory. The
    engine process, the compiler processes and the grammar checker's end with the server.

    Before the kill, this server without speculative decoding is the one to reach /generate's refusal of a format
    beside ``logprob_start_len`` (the prompt's logprobs alone: no output to constrain; a speculative server refuses
    ``logprob_start_len`` first)."""
    from importlib.metadata import version
    log = tmp_path / 'server.log'
    proc, base = start_server(['--logprobs-mode', 'raw_logprobs'], log)
    group = proc.pid  # the server leads a session of its own: its process group holds all it started
    try:
        fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))  # grammars checked and compiled
        check_valid(text, fmt)
        if not version('lmdeploy').startswith('0.14.'):  # 0.14's /generate has no logprob_start_len
            body = {'prompt': 'x', 'max_tokens': 0, 'return_logprob': True, 'logprob_start_len': 0,
                    'response_format': YEAR}
            request = urllib.request.Request(f'{base}/generate', json.dumps(body).encode(),
                                             {'Content-Type': 'application/json'})
            with pytest.raises(urllib.error.HTTPError) as refused:
                urllib.request.urlopen(request, timeout=60)
            assert refused.value.code == 400
            error = json.loads(refused.value.read())
            assert error['error']['param'] == 'logprob_start_len', error
        started = [pid for pid in traffic.group_processes(group) if pid != proc.pid]
        assert any(traffic.proc_text(pid, 'comm') == 'ZMQMPEngine' for pid in started), {
            pid: traffic.proc_text(pid, 'cmdline')[:200] for pid in started}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        # the engine process stops as on SIGTERM at once, and is killed 60 s later if it has not ended
        deadline = time.monotonic() + 90
        while traffic.group_processes(group) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = traffic.group_processes(group)
        described = {pid: traffic.proc_text(pid, 'cmdline')[:200] for pid in left}
    finally:
        try:
            os.killpg(group, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert not left, f'still running 90 s after the server was killed: {described}'



def test_generate_serves_a_constraint_of_its_output(server):
    """lmdeploy's /generate declared no guided field, and its request model dropped what it did not declare: a request
    with response_format, regex or sampling_params.json_schema came back 200 with unconstrained output. It serves them
    (a prompt or input_ids, streamed or not, with logprobs), and refuses with HTTP 400 naming the field what it
    cannot serve; a request without one is served as before."""
    from importlib.metadata import version

    from transformers import AutoTokenizer

    from lmdeploy_guided_spec.cpu import models
    proc, base, log = server
    answer = {'type': 'string', 'enum': ['yes', 'no']}

    def post(body: dict):
        request = urllib.request.Request(f'{base}/generate', json.dumps(body).encode(),
                                         {'Content-Type': 'application/json'})
        with urllib.request.urlopen(request, timeout=120) as reply:
            if not body.get('stream'):
                return json.loads(reply.read())
            chunks = data_events(reply.read())
        assert chunks and not any('error' in c for c in chunks), chunks
        logprobs = sum((c['meta_info']['output_token_logprobs'] or [] for c in chunks), [])
        return {'text': ''.join(c['text'] for c in chunks), 'output_ids': sum((c['output_ids'] for c in chunks), []),
                'meta_info': {**chunks[-1]['meta_info'], 'output_token_logprobs': logprobs}}

    def refused(body: dict, param: str | None):
        with pytest.raises(urllib.error.HTTPError) as error:
            post(body)
        assert error.value.code == 400, body
        error = json.loads(error.value.read())
        error = error.get('error', error)
        assert param is None or error['param'] == param, error
        return error['message']

    prompt_ids = AutoTokenizer.from_pretrained(models.resolve('tiny-llama'))('A year:')['input_ids']
    for body, matches in (
            ({'prompt': 'A year:', 'response_format': YEAR}, r'[0-9]{4}'),
            ({'input_ids': prompt_ids, 'regex': '[0-9]{4}', 'stream': True}, r'[0-9]{4}'),  # SGLang's field
            ({'prompt': 'Yes or no?', 'guided_choice': ['yes', 'no'], 'temperature': 1.0}, r'yes|no'),  # vLLM's
            ({'prompt': 'Yes or no?', 'sampling_params': {'json_schema': json.dumps(answer)}, 'return_logprob': True,
              'stream': True}, r'"(yes|no)"')):  # SGLang's sampling_params
        body = {'max_tokens': 16, 'temperature': 0.0, **body}
        out = post(body)
        assert re.fullmatch(matches, out['text']), (body, out)
        assert out['meta_info']['finish_reason'] == {'type': 'stop'}, out
        if body.get('return_logprob'):
            logprobs = out['meta_info']['output_token_logprobs']
            assert [t for _, t in logprobs] == out['output_ids'] and all(math.isfinite(p) for p, _ in logprobs), out
    # what /generate cannot serve is refused by name, never dropped
    assert 'EBNF' in refused({'prompt': 'x', 'sampling_params': {'ebnf': 'root ::= "a"'}}, 'sampling_params')
    refused({'prompt': 'x', 'regex': '[0-9]', 'response_format': YEAR}, 'regex')
    refused({'prompt': 'x', 'response_format': {'type': 'xml'}}, 'response_format')
    assert 'instance' in refused({'prompt': 'x', 'response_format': NO_INSTANCE}, 'response_format')
    if not version('lmdeploy').startswith('0.14.'):  # 0.14's /generate has no logprob_start_len
        # the prompt's logprobs alone: nothing to constrain (this server refuses it beside speculative decoding too)
        assert 'logprob_start_len' in refused({'prompt': 'x', 'max_tokens': 0, 'logprob_start_len': 0,
                                               'response_format': YEAR}, None)
    out = post({'prompt': 'A year:', 'max_tokens': 4})
    assert out['meta_info']['completion_tokens'] <= 4 and isinstance(out['text'], str), out
    # an SGLang client's sampling settings: dropped, the request ran with 128 tokens at temperature 1
    greedy = post({'prompt': 'A year:', 'max_tokens': 6, 'temperature': 0.0, 'ignore_eos': True})
    assert len(greedy['output_ids']) == 6, greedy
    for body in ({'prompt': 'A year:', 'ignore_eos': True, 'sampling_params': {'max_new_tokens': 6, 'temperature': 0}},
                 {'prompt': 'A year:', 'stream': True, 'sampling_params': {'max_new_tokens': 6, 'temperature': 0,
                                                                          'top_k': -1, 'n': 1, 'ignore_eos': True}}):
        out = post(body)
        assert out['output_ids'] == greedy['output_ids'] and out['text'] == greedy['text'], (body, out, greedy)
    out = post({'prompt': 'Yes or no?', 'sampling_params': {'json_schema': json.dumps(answer), 'max_new_tokens': 16,
                                                            'temperature': 0}})
    assert re.fullmatch(r'"(yes|no)"', out['text']) and out['meta_info']['finish_reason'] == {'type': 'stop'}, out
    out = post({'prompt': 'A year:', 'sampling_params': {'regex': '[0-9]{4}', 'max_new_tokens': 8, 'temperature': 0}})
    assert re.fullmatch(r'[0-9]{4}', out['text']), out  # the request of docs/*/usage.md
    for params, message in (({'n': 2}, 'sampling_params.n is not supported'),
                            ({'max_new_tokens': 'many'}, 'sampling_params: max_tokens'),
                            ({'temperature': 3.0}, 'temperature'),
                            ({'max_new_token': 6}, 'max_new_token is not a sampling parameter')):
        assert message in refused({'prompt': 'x', 'sampling_params': params}, None), params
    assert 'disagree' in refused({'prompt': 'x', 'max_tokens': 4, 'sampling_params': {'max_new_tokens': 6}},
                                 'sampling_params')
    # a min_p outside [0, 1] was HTTP 500 (GenerationConfig's assertion), a stop string "Request preprocessing failed."
    for body in ({'min_p': 5}, {'sampling_params': {'min_p': -1}}):
        assert 'min_p' in refused({'prompt': 'x', **body}, None), body
    for body in ({'stop': '"'}, {'sampling_params': {'stop': '"'}}):
        out = post({'prompt': 'A year:', 'max_tokens': 4, **body})
        assert out['meta_info']['finish_reason']['type'] in ('stop', 'length'), (body, out)
    # token ids outside the vocabulary: the prompt's stopped the server, a top_k or stop id past int64 the engine
    with open(os.path.join(models.resolve('tiny-llama'), 'config.json')) as config:
        vocab = json.load(config)['vocab_size']
    for body, outside in (({'input_ids': [10**9]}, 10**9), ({'input_ids': [1, -5]}, -5)):
        # HTTP 400 (0.14.0 answered HTTP 200, finish_reason "error" and the reason as the text)
        with pytest.raises(urllib.error.HTTPError) as raised:
            post({**body, 'max_tokens': 4})
        assert raised.value.code == 400, raised.value
        message = json.loads(raised.value.read())['message']
        assert f'outside the vocabulary of {vocab} tokens: {outside}' in message, message
        # the server's log gives the engine's reason too ('reason "error"' alone told an operator nothing), as a
        # warning: the request's problem, not the server's (it was an ERROR)
        assert re.search(rf' - WARNING - .*reason "error": .*outside the vocabulary of {vocab} tokens: {outside}',
                         log.read_text()), log.read_text()[-3000:]
    out = post({'prompt': 'A year:', 'max_tokens': 6, 'temperature': 0.0, 'ignore_eos': True, 'top_k': 2**63,
                'stop_token_ids': [2**63]})
    assert out['output_ids'] == greedy['output_ids'], out
    assert proc.poll() is None and traffic.health(base) == 200
    assert proc.poll() is None, log.read_text()[-4000:]


def test_logit_bias_is_served_and_never_outweighs_the_grammar(server):
    """OpenAI's logit_bias on /v1/chat/completions was HTTP 500: its processor, a local function, cannot be pickled
    to the engine's process. It is served: a bias of +100 picks its token, and under a grammar it picks among the
    tokens the grammar allows only (a token the grammar forbids stays forbidden whatever its bias); an id outside
    the vocabulary is HTTP 400."""
    from transformers import AutoTokenizer

    from lmdeploy_guided_spec.cpu import models
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    tokenizer = AutoTokenizer.from_pretrained(models.resolve('tiny-llama'))
    seven, letter = tokenizer.convert_tokens_to_ids('7'), tokenizer.convert_tokens_to_ids('x')

    def ask(bias: dict, **kwargs) -> str:
        answer = client.chat.completions.create(model=model, messages=[{'role': 'user', 'content': 'A year?'}],
                                                logit_bias={str(k): v for k, v in bias.items()}, temperature=0,
                                                max_tokens=4, **kwargs)
        return answer.choices[0].message.content

    assert ask({seven: 100}) == '7777'
    assert ask({seven: 100}, response_format=YEAR) == '7777'
    assert re.fullmatch('[0-9]{4}', ask({letter: 100}, response_format=YEAR))
    with pytest.raises(openai.BadRequestError):
        ask({len(tokenizer) + 10: 5})
    assert proc.poll() is None, log.read_text()[-4000:]
