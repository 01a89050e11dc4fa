"""Traffic for a running api_server, through the openai client: concurrent greedy and sampling requests of every
format, streaming and not, and clients that disconnect mid-stream (``test_server_traffic.py`` on one rank,
``test_ranks.py`` on two)."""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from importlib.metadata import version

import openai
import pytest
from e2e_helpers import STOP_TEXTS, check_valid, data_events, response_format

KINDS = ('json_schema', 'json_object', 'regex_schema', 'text')
#: What the engine says of a request whose grammar met a state that allows no token.
DEAD_END = 'allows no token at all'

#: /v1/chat/completions serves ``n`` above 1: lmdeploy 0.18.0 fans it out into one request per choice; 0.14.0
#: refuses it (its patch 0089: it answered one choice)
CHAT_SERVES_N = not version('lmdeploy').startswith('0.14.')


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)


async def request(api: openai.AsyncOpenAI, model: str, i: int, kind: str, sampling: bool, streaming: bool):
    """One chat request of a kind: ``(response_format, text, finish_reason)``."""
    fmt = response_format(kind)
    kwargs = dict(model=model, messages=[{'role': 'user', 'content': f'Request {i}: a record, please.'}],
                  max_tokens=96 if kind != 'text' else 16, temperature=0.8 if sampling else 0.0, seed=i)
    if fmt is not None:
        kwargs['response_format'] = fmt
    if not streaming:
        choice = (await api.chat.completions.create(**kwargs)).choices[0]
        return fmt, choice.message.content, choice.finish_reason
    text, reason = '', None
    async for chunk in await api.chat.completions.create(stream=True, **kwargs):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ''
            reason = chunk.choices[0].finish_reason or reason
    return fmt, text, reason


async def mixed_round(base: str, round_: int, concurrent: int):
    """``concurrent`` requests at once, cycling through the kinds, greedy and sampling, streaming and not."""
    api = client(base)
    model = (await api.models.list()).data[0].id
    jobs = [request(api, model, 100 * round_ + i, KINDS[i % 4], sampling=(i // 4) % 2 == 1,
                    streaming=(i // 8) % 2 == 1) for i in range(concurrent)]
    return await asyncio.gather(*jobs)


def check_round(results) -> None:
    """Guided requests stop with valid output; unguided ones stop or reach their length."""
    for fmt, text, reason in results:
        if fmt is None:
            assert reason in ('stop', 'length'), (text, reason)
        else:
            assert reason == 'stop', (fmt, text, reason)
            check_valid(text, fmt)


async def disconnects(base: str, n: int):
    """``n`` streams dropped after their second chunk, each beside a request that runs to its end; returns the
    results of those."""
    api = client(base)
    model = (await api.models.list()).data[0].id

    async def dropped(i: int):
        stream = await api.chat.completions.create(
            model=model, messages=[{'role': 'user', 'content': f'Drop {i}.'}], max_tokens=96, stream=True,
            response_format=response_format(KINDS[i % 3]), temperature=0.8 if i % 2 else 0.0)
        seen = 0
        async for _ in stream:
            seen += 1
            if seen == 2:
                break
        await stream.close()

    jobs = []
    for i in range(n):
        jobs.append(dropped(i))
        jobs.append(request(api, model, 1000 + i, KINDS[i % 3], sampling=False, streaming=i % 2 == 0))
    results = await asyncio.gather(*jobs)
    return [r for r in results if r is not None]


async def one(base: str, kind: str):
    """One greedy request of a kind."""
    api = client(base)
    model = (await api.models.list()).data[0].id
    return await request(api, model, 7, kind, sampling=False, streaming=False)


def dead_ends_and_banned_tokens(base: str, alive: Callable[[], None]) -> int:
    """Requests that stopped the engine (a sampled row without a finite logit) or failed with HTTP 500, one after
    another: a grammar that allows no token at all is refused at entry; one that runs into a dead end fails its own
    request (greedy, and sampled under six seeds); ignore_eos, min_new_tokens and the n-gram stop leave the grammar its
    tokens, and the text is what the grammar accepts; the n-gram stop waits for ``min_new_tokens`` (an unguided
    request with both stopped the engine: the stop token it forced was banned). ``alive()`` asserts the server is up,
    after every request.
    Returns the number of requests that met a dead end."""
    api = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = api.models.list().data[0].id
    messages = [{'role': 'user', 'content': 'A record, please.'}]
    nothing = {'type': 'regex_schema', 'regex_schema': '[^\\s\\S]'}
    with pytest.raises(openai.BadRequestError, match='admits no instance'):
        api.chat.completions.create(model=model, messages=messages, response_format=nothing, max_tokens=8)
    # 'a' and 'b' are allowed first; after one of them nothing is: whichever the model picks, one of the two
    # regexes runs into the dead end, greedy or sampled
    dead_ends = 0
    for regex in ('a[^\\s\\S]|b', 'b[^\\s\\S]|a'):
        # sampled: a dead end about half the time each (the engine died at the first one)
        for temperature, seed in ((0.0, None), *((1.0, seed) for seed in range(1, 7))):
            fmt = {'type': 'regex_schema', 'regex_schema': regex}
            try:
                choice = api.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                     max_tokens=8, temperature=temperature, seed=seed).choices[0]
            except openai.APIStatusError as err:
                # an HTTP error with the engine's reason (0.14.0 answered HTTP 200 with the reason as the text)
                assert DEAD_END in str(err), err
                dead_ends += 1
            else:
                assert choice.message.content == regex[-1] and choice.finish_reason == 'stop', choice
            alive()
    assert dead_ends >= 2  # greedy meets one; at least one sampled request met one too
    # streamed with n=2 (0.18.0 fans it out to one request per choice; 0.14.0 refuses it: n=1 there): a choice that
    # meets the dead end ends the stream with its error event, as one choice's stream does; the stream was cut
    # instead (an exception in the server, no error and no [DONE])
    streamed_dead_ends = 0
    for regex in ('a[^\\s\\S]|b', 'b[^\\s\\S]|a'):
        fmt = {'type': 'regex_schema', 'regex_schema': regex}
        texts: dict[int, str] = {}
        try:
            for chunk in api.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                     max_tokens=8, temperature=0.0, n=2 if CHAT_SERVES_N else 1,
                                                     stream=True):
                for choice in chunk.choices:
                    texts[choice.index] = texts.get(choice.index, '') + (choice.delta.content or '')
        except openai.APIError as err:
            # the stream's error event (0.14.0 streamed the reason as the text)
            assert DEAD_END in str(err), err
            streamed_dead_ends += 1
        else:
            assert set(texts.values()) == {regex[-1]}, texts
        alive()
    assert streamed_dead_ends == 1  # greedy: both choices take the same path, into the dead end of one regex
    schema = {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': {
        'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']}}}
    ab = {'type': 'regex_schema', 'regex_schema': 'ab'}
    cases = [(ab, dict(ignore_eos=True)), (ab, dict(min_new_tokens=10)),
             ({'type': 'json_object'}, dict(ignore_eos=True)),
             (schema, dict(repetition_ngram_size=2, repetition_ngram_threshold=1)),
             (None, dict(min_new_tokens=5, repetition_ngram_size=1, repetition_ngram_threshold=1))]
    for fmt, extra in cases:
        for temperature in (0.0, 0.8):
            completion = api.chat.completions.create(model=model, messages=messages,
                                                     response_format=openai.NOT_GIVEN if fmt is None else fmt,
                                                     max_tokens=24 if fmt is not None else 40, temperature=temperature,
                                                     seed=3, extra_body=extra)
            choice = completion.choices[0]
            assert choice.finish_reason in ('stop', 'length'), (extra, choice)
            if fmt is None:
                # every token repeats a 1-gram: the n-gram stop ends the request as soon as it may
                assert choice.finish_reason == 'stop' and completion.usage.completion_tokens >= 5, (extra, completion)
            if fmt is ab:
                # after the grammar's end only stop tokens (ignore_eos runs to max_tokens); the test tokenizer does not
                # mark <|eot_id|> and <|eom_id|> special, so the text shows them
                text = choice.message.content
                for stop in STOP_TEXTS:
                    text = text.replace(stop, '')
                check_valid(text, fmt)
            elif choice.finish_reason == 'stop':
                check_valid(choice.message.content, fmt)
            alive()
    return dead_ends


#: Patterns xgrammar 0.2.8 compiles inexactly: its automaton accepts "00" for ``code``'s, and its rules of ``name``'s
#: (characters beyond ASCII) take a raw newline or quote inside the string, which is not JSON.
PATTERNED = {'type': 'json_schema', 'json_schema': {'name': 'patterned', 'schema': {
    'type': 'object', 'properties': {'code': {'type': 'string', 'pattern': '^(0|1\\d{0,3})(x\\d{1,3})?$'},
                                     'name': {'type': 'string', 'pattern': '^[A-Za-z\u00c0-\u00ff\\s]{1,12}$'}},
    'required': ['code', 'name'], 'additionalProperties': False}}}


def patterned(base: str, alive: Callable[[], None], seeds: int = 12) -> int:
    """Sampled requests for :data:`PATTERNED`, one per seed: every text that ends is JSON and satisfies the
    patterns, and none holds a raw control character (a truncated one neither). Returns the number that ended."""
    api = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = api.models.list().data[0].id
    ended = 0
    for seed in range(seeds):
        choice = api.chat.completions.create(model=model, messages=[{'role': 'user', 'content': 'A code and a name.'}],
                                             response_format=PATTERNED, max_tokens=64, temperature=1.0,
                                             seed=seed).choices[0]
        text = choice.message.content
        assert choice.finish_reason in ('stop', 'length'), choice
        assert not any(ord(c) < 0x20 and c not in ' \t\n\r' for c in text), text
        if choice.finish_reason == 'stop':
            check_valid(text, PATTERNED)
            ended += 1
        alive()
    return ended


#: a regex whose masks grow slow only after the compile service's probe of its first 16 tokens: a fixed prefix of 41
#: tokens (Llama 3's and DeepSeek's vocabularies: a token a digit or a space), then words whose masks cost xgrammar
#: 0.8 s and more from the second word on (tests/e2e/test_late_slow_masks.py)
LATE_SLOW = {'type': 'regex_schema', 'regex_schema': '(0 1 2 3 4 5 6 7 8 9 ){2}: ([a-z]+ ?){1,300}'}
#: what the refusal of a request whose masks grew slow while it ran says
LATE_SLOW_REASON = 'ms per token to match (a mask of the running request)'


def late_slow(base: str) -> tuple[float, int, dict, str]:
    """A chat request of :data:`LATE_SLOW` (all of its 48 tokens asked for: one word is a whole output), then the
    same streamed: the seconds both took, the first's status and answer, and the stream's text."""
    model = openai.OpenAI(base_url=f'{base}/v1', api_key='none', max_retries=0).models.list().data[0].id
    body = {'model': model, 'messages': [{'role': 'user', 'content': 'Some words.'}], 'response_format': LATE_SLOW,
            'max_tokens': 48, 'min_new_tokens': 48, 'temperature': 0}
    start = time.monotonic()
    status, answer = post(base, '/v1/chat/completions', body)
    _, streamed = post(base, '/v1/chat/completions', {**body, 'stream': True})
    return time.monotonic() - start, status, answer, streamed.get('text', '')


def check_late_slow_refused(status: int, answer: dict, streamed: str) -> None:
    """HTTP 400 with the reason without a stream; the stream's last event is the error (code 400), then ``[DONE]``."""
    assert status == 400 and LATE_SLOW_REASON in answer['error']['message'], (status, answer)
    assert answer['error']['type'] == 'invalid_request_error', answer
    events = data_events(streamed)
    assert events and LATE_SLOW_REASON in events[-1].get('error', {}).get('message', ''), streamed[-1500:]
    assert events[-1]['error']['code'] == 400 and streamed.rstrip().endswith('data: [DONE]'), streamed[-600:]


def health(base: str) -> int:
    return urllib.request.urlopen(f'{base}/health', timeout=10).status


#: The header Anthropic's Messages API requires (the other endpoints ignore it).
ANTHROPIC_HEADERS = {'anthropic-version': '2023-06-01'}


def guided_bodies(model: str, schema: dict, name: str, prompt: str, max_tokens: int) -> dict:
    """One request per endpoint whose output the JSON ``schema`` constrains, each in its endpoint's own field: chat
    and completions (``response_format``), ``/generate``, the Responses API (``text.format``) and Anthropic's
    Messages API (``output_format``); ``{path: body}``, to post with :data:`ANTHROPIC_HEADERS`."""
    fmt = {'type': 'json_schema', 'json_schema': {'name': name, 'schema': schema}}
    messages = [{'role': 'user', 'content': prompt}]
    return {
        '/v1/chat/completions': {'model': model, 'messages': messages, 'response_format': fmt,
                                 'max_tokens': max_tokens},
        '/v1/completions': {'model': model, 'prompt': prompt, 'response_format': fmt, 'max_tokens': max_tokens},
        '/generate': {'prompt': prompt, 'response_format': fmt, 'max_tokens': max_tokens},
        '/v1/responses': {'model': model, 'input': prompt, 'max_output_tokens': max_tokens,
                          'text': {'format': {'type': 'json_schema', 'name': name, 'schema': schema}}},
        '/v1/messages': {'model': model, 'messages': messages, 'max_tokens': max_tokens,
                         'output_format': {'type': 'json_schema', 'schema': schema}},
    }


def post(base: str, path: str, body: dict, timeout: float = 300, headers: dict | None = None) -> tuple[int, dict]:
    """POST ``body`` as JSON to ``path``: the HTTP status and the answer (its JSON, else ``{'text': ...}``)."""
    request = urllib.request.Request(f'{base}{path}', json.dumps(body).encode(),
                                     {'Content-Type': 'application/json', **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            status, text = answer.status, answer.read()
    except urllib.error.HTTPError as err:
        status, text = err.code, err.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, {'text': text.decode(errors='replace')}


def posted(base: str, path: str, body: dict, headers: dict | None = None) -> socket.socket:
    """A connection that has sent a POST of ``body`` to ``path`` and reads nothing: its client goes away when the
    caller closes it."""
    url = urllib.parse.urlsplit(base)
    data = json.dumps(body).encode()
    more = ''.join(f'{name}: {value}\r\n' for name, value in (headers or {}).items())
    conn = socket.create_connection((url.hostname, url.port), timeout=10)
    conn.sendall(f'POST {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json\r\n{more}'
                 f'Content-Length: {len(data)}\r\n\r\n'.encode() + data)
    return conn


def group_processes(group: int) -> list[int]:
    """The live processes of process group ``group`` (a server spawned in its own session, and all it started)."""
    pids = []
    for entry in os.listdir('/proc'):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == group and alive(int(entry)):
                pids.append(int(entry))
        except OSError:
            continue  # gone meanwhile
    return pids


def proc_text(pid: int, name: str) -> str:
    """``/proc/<pid>/<name>`` as text (``comm``: the process name, ``cmdline``: its arguments joined by spaces), or
    '?' for a process gone meanwhile."""
    try:
        with open(f'/proc/{pid}/{name}', 'rb') as f:
            return f.read().replace(b'\0', b' ').decode(errors='replace').strip()
    except OSError:
        return '?'


#: What the command line of a grammar compiler process, or of a fork server and its children, holds.
COMPILER_MARKS = ('_child_main', 'lmdeploy_guided_spec.forkserver')


def is_compiler(pid: int) -> bool:
    """Whether ``pid`` is a grammar compiler process or a fork server of them."""
    cmd = proc_text(pid, 'cmdline')
    return any(mark in cmd for mark in COMPILER_MARKS)


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/<pid>/stat`` after the process name (state, parent pid, ...), empty for a process gone."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return f.read().rsplit(')', 1)[1].split()
    except (OSError, IndexError):
        return []


def alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (not gone, not a zombie)."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != 'Z'


def busy_compilers(group: int, seconds: float = 1.0) -> list[int]:
    """The grammar compiler processes of process group ``group`` that ran on a CPU for more than half of the next
    ``seconds`` (parsing or compiling a grammar)."""
    tick = os.sysconf('SC_CLK_TCK')

    def cpu() -> dict[int, float]:
        times = {}
        for pid in group_processes(group):
            fields = _stat(pid)
            if len(fields) > 12 and is_compiler(pid):
                times[pid] = (int(fields[11]) + int(fields[12])) / tick
        return times

    before = cpu()
    time.sleep(seconds)
    after = cpu()
    return [pid for pid, spent in after.items() if spent - before.get(pid, spent) > seconds / 2]


def parent_pid(pid: int) -> int | None:
    fields = _stat(pid)
    return int(fields[1]) if len(fields) > 1 else None


def compiler_processes(pid: int) -> list[int]:
    """The grammar compiler processes that serve process ``pid`` (of its group): children of its fork server, or
    processes it started itself; not the fork server."""
    group = group_processes(os.getpgid(pid))
    servers = {entry for entry in group if parent_pid(entry) == pid and
               'lmdeploy_guided_spec.forkserver' in proc_text(entry, 'cmdline')}
    return [entry for entry in group if is_compiler(entry) and entry not in servers and parent_pid(entry) in
            servers | {pid}]


def resident_mb(pid: int) -> int:
    """Resident memory of the server ``pid`` and the processes of its group (the engine's), in MB, without the
    grammar compiler processes and their fork servers, which are killed and started again at will."""
    total = 0
    for entry in group_processes(os.getpgid(pid)):
        try:
            if is_compiler(entry):
                continue
            with open(f'/proc/{entry}/status') as f:
                total += next(int(line.split()[1]) for line in f if line.startswith('VmRSS:'))
        except (OSError, StopIteration, ValueError):
            continue  # gone meanwhile, or a kernel thread
    return total >> 10
