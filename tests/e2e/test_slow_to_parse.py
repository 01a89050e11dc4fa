"""Requests whose grammars take minutes to parse, many at once, against a real api_server on the CPU path (the openai
client): they hold up no other request, those past the queue's bound are refused at once with HTTP 429, and a
checker process that dies under a check is HTTP 503. A module of its own: its server runs while no other test's
server does (three servers and the test process outgrew the CI machine's memory)."""
import concurrent.futures
import contextlib
import os
import signal
import time

import openai
import pytest
import server_traffic as traffic
from e2e_helpers import check_valid, response_format, start_server, stop_server

# the session's pipelines are closed first: with this module's servers beside them they outgrew the machine
pytestmark = pytest.mark.usefixtures('no_session_pipelines')


def test_requests_slow_to_parse_hold_up_no_other_request(cpu_path, tmp_path):
    """Ten requests whose schemas take minutes to parse, each its own, at once: each holds a check of the server for up
    to the compile limit (14 s here). A request whose schema was checked before waited 55 s behind them (the
    checks waited on the event loop's default executor: 6 threads on two cores), one with a new small schema 28 s
    (every checker process held a slow one). Now both are answered within seconds; the slow ones past the queue's
    bound (4 here) are refused at once with HTTP 429 (sent again later, they are checked), the others with HTTP
    400 at the limit. Then a checker process dies under a check: HTTP 503 with OpenAI's error body (it was a
    plain-text 500), and the server checks the next request."""
    from lmdeploy_guided_spec.testing import environ
    log = tmp_path / 'server.log'
    with environ({'LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT': '14', 'LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED': '4'}):
        proc, base = start_server([], log, max_batch_size=16)
    try:
        client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
        model = client.models.list().data[0].id
        messages = [{'role': 'user', 'content': 'A person, please.'}]

        def ask(fmt, max_tokens=8):
            start = time.perf_counter()
            choice = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                    max_tokens=max_tokens, temperature=0).choices[0]
            return time.perf_counter() - start, choice

        def slow(count: int) -> dict:
            return {'type': 'json_schema', 'json_schema': {'name': f'slow{count}', 'schema': {
                'type': 'string', 'pattern': f'^[a-z]{{1,{count}}}$'}}}

        def timed(fmt):
            start = time.perf_counter()
            try:
                ask(fmt)
            except openai.APIStatusError as err:
                return time.perf_counter() - start, err
            raise AssertionError(f'{fmt} was served')

        person = response_format('json_schema')
        ask(person)  # checked and compiled: the checkers start
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            slow_ones = [pool.submit(timed, slow(40_000 + i)) for i in range(10)]
            time.sleep(1)
            checked_before, choice = ask(person)
            assert choice.finish_reason == 'length'
            small = response_format('json_schema', schema={'type': 'object', 'properties': {'x': {'type': 'integer'}},
                                                           'required': ['x']})
            new_small, choice = ask(small, max_tokens=32)
            check_valid(choice.message.content, small)
            print(f'\n[slow to parse] beside 10: a schema checked before {checked_before:.1f} s, a new small one '
                  f'{new_small:.1f} s')
            # (without the fix: the first waits for a thread, at least 13 s; the second for the checks of the slow
            # ones queued before it, about 40 s)
            assert checked_before < 10 and new_small < 16, (checked_before, new_small)
            answers = [future.result() for future in slow_ones]
        busy = [seconds for seconds, err in answers if err.status_code == 429]
        assert 1 <= len(busy) <= 6 and max(busy) < 5, answers
        for _, err in answers:
            if err.status_code == 429:
                assert 'wait already' in err.message and err.body['type'], err.body
            else:
                assert err.status_code == 400 and 'longer than 14 s' in err.message, err
        # clients that go away while their schemas slow to parse are checked: their checks stop with them. They
        # held the checker's queue for the whole limit, and a live client's slow schema got HTTP 429 meanwhile
        left = [traffic.posted(base, '/v1/chat/completions', {
            'model': model, 'messages': messages, 'max_tokens': 8, 'response_format': slow(40_100 + i)})
            for i in range(10)]
        time.sleep(1.5)  # the server has read them and started their checks (a client gone before is not checked)
        for conn in left:
            conn.close()
        time.sleep(1.5)
        start = time.perf_counter()
        try:
            served, choice = ask(slow(2_000))  # it looks slow to parse, and parses in a second
        except openai.APIStatusError as err:
            raise AssertionError(f'refused after {time.perf_counter() - start:.1f} s: {err}') from err
        print(f'[slow to parse] beside 10 that went away: a new slow-looking one served in {served:.1f} s')
        assert choice.finish_reason in ('length', 'stop') and served < 15, served
        # a process of the server's checker dies under a check: the server's fault, HTTP 503 (OpenAI's clients send
        # it again), and the next check starts a fresh process. The checker's processes are killed until the
        # request is answered: the check may not have reached a process yet (a process that a timeout above
        # stopped starts again in seconds on a busy machine, and a fresh one takes the check after a kill)
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            dying = pool.submit(timed, slow(50_000))
            deadline = time.monotonic() + 60
            killed = []
            while not dying.done() and time.monotonic() < deadline:
                time.sleep(2)
                # the checker's processes are the server's compiler processes (the fork server's children)
                for pid in traffic.compiler_processes(proc.pid):
                    if dying.done():  # a process killed now would die under the next request
                        break
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                        killed.append(pid)
            _, err = dying.result(timeout=60)
        assert killed, 'no checker process was found'
        # the next request must not meet a process killed above that has yet to end (a kill takes effect later)
        deadline = time.monotonic() + 30
        while any(traffic.alive(pid) for pid in killed) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert err.status_code == 503 and 'could not be checked' in err.message, err
        assert err.body['type'] and err.body['message'], err.body
        other = {'type': 'object', 'properties': {'y': {'type': 'integer'}}, 'required': ['y']}
        _, choice = ask(response_format('json_schema', schema=other), max_tokens=32)
        assert choice.finish_reason == 'stop'
        assert proc.poll() is None, log.read_text()[-4000:]
        assert traffic.health(base) == 200
    finally:
        stop_server(proc)


def test_a_full_queue_of_grammars_slow_to_parse_is_http_429_on_every_endpoint(cpu_path, tmp_path):
    """While as many grammars that look slow to parse wait as the server queues (1 here), one more is refused at
    once with HTTP 429 on every endpoint, streamed or not, in the body of its protocol (OpenAI's ``error``;
    Anthropic's ``rate_limit_error``): the server is busy, and the same request is served once the queue has room.
    lmdeploy 0.18.0's Responses and Anthropic APIs answered HTTP 400 (a client does not send a 400 again), and
    0.14.0's Anthropic API answered 429 with OpenAI's body. A client of any endpoint that leaves while its grammar
    is parsed stops the parse (the Responses and Anthropic APIs' went on to the compile limit before patch 0091),
    also that of a format the response parser builds from the tools of a forced tool call (lmdeploy 0.18: the
    engine's own check of it went on to the compile limit before patch 0092)."""
    from lmdeploy import __version__ as lmdeploy_version

    from lmdeploy_guided_spec.testing import environ
    log = tmp_path / 'server.log'
    with environ({'LMDEPLOY_GUIDED_SPEC_COMPILE_TIMEOUT': '60', 'LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED': '1'}):
        proc, base = start_server(['--tool-call-parser', 'qwen3'], log)
    try:
        model = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0).models.list().data[0].id

        def slow(count: int) -> dict:
            return {'type': 'string', 'pattern': f'^[a-z]{{1,{count}}}$'}

        def bodies(schema: dict) -> dict:
            return traffic.guided_bodies(model, schema, 'word', 'A word, please.', max_tokens=4)

        # one slow check holds the queue (its client reads nothing): minutes of parsing, past the limit of 60 s
        held = traffic.posted(base, '/v1/chat/completions', bodies(slow(40_000))['/v1/chat/completions'])
        time.sleep(2)
        refused = []
        for stream in (False, True):
            for path, body in bodies(slow(3_000 + stream)).items():
                start = time.perf_counter()
                status, answer = traffic.post(base, path, {**body, 'stream': stream}, timeout=30,
                                              headers=traffic.ANTHROPIC_HEADERS)
                seconds = time.perf_counter() - start
                refused.append((path, stream, status, seconds))
                assert status == 429 and seconds < 5, (path, stream, status, seconds, answer)
                if path == '/v1/messages':
                    assert answer['type'] == 'error' and answer['error']['type'] == 'rate_limit_error', answer
                    assert 'wait already' in answer['error']['message'], answer
                else:
                    assert 'wait already' in answer['error']['message'], (path, answer)
        print(f'\n[slow to parse] refused at once while the queue is full: {refused}')
        held.close()  # its check stops with its client: the queue has room again
        deadline = time.monotonic() + 30
        while True:
            status, answer = traffic.post(base, '/v1/responses', bodies(slow(3_000))['/v1/responses'])
            if status != 429 or time.monotonic() > deadline:
                break
            time.sleep(1)
        assert status == 200 and answer['status'] in ('completed', 'incomplete'), (status, answer)
        # a client of any endpoint that leaves while its grammar is checked stops the parse: the Responses and
        # Anthropic APIs held it until the compile limit (their check was the engine's, which only an abort stops)
        held_bodies = [(path, lambda n, path=path: bodies(slow(41_000 + n))[path])
                       for path in bodies(slow(1)) if path != '/v1/chat/completions']
        if not lmdeploy_version.startswith('0.14.'):
            # lmdeploy 0.18 builds a format from the tools of a forced call (0.14.0 builds none): the engine checks it
            for choice in ('required', {'type': 'function', 'function': {'name': 'save'}}):
                held_bodies.append((f'/v1/chat/completions tool_choice={choice}', lambda n, choice=choice: {
                    'model': model, 'messages': [{'role': 'user', 'content': 'Save a word.'}], 'max_tokens': 4,
                    'tools': [{'type': 'function', 'function': {'name': 'save', 'parameters': {
                        'type': 'object', 'properties': {'word': slow(41_000 + n)}, 'required': ['word']}}}],
                    'tool_choice': choice}))
        stopped = {}
        for n, (path, body) in enumerate(held_bodies):
            # no process parses or compiles before the request (those of the rounds before have ended)
            deadline = time.monotonic() + 30
            while traffic.busy_compilers(proc.pid) and time.monotonic() < deadline:
                pass
            held = traffic.posted(base, path.split()[0], body(n), headers=traffic.ANTHROPIC_HEADERS)
            deadline, busy = time.monotonic() + 20, []
            while not busy and time.monotonic() < deadline:
                busy = traffic.busy_compilers(proc.pid)
            assert busy, (path, 'no process parses the grammar of the held request')
            held.close()
            # stopped: the processes that parsed it are idle (or gone) for three seconds in a row
            start, idle = time.monotonic(), 0
            while idle < 3 and time.monotonic() < start + 25:
                idle = 0 if set(busy) & set(traffic.busy_compilers(proc.pid)) else idle + 1
            stopped[path] = round(time.monotonic() - start - idle, 1)
            assert idle >= 3, (path, 'the grammar of a client that left is still parsed 25 s later')
        print(f'[slow to parse] the parse stopped after its client left (s): {stopped}')
        assert proc.poll() is None and traffic.health(base) == 200
    finally:
        stop_server(proc)
