"""Traffic a deployed api_server sees, on the CPU path with eagle3 (a real server process on 127.0.0.1, the openai
client): concurrent greedy and sampling requests of every format, streaming and not; clients that disconnect
mid-stream; hostile requests. Afterwards the server answers correctly and ``/health`` is 200.

The defects of the issue "The engine never dies, never stalls, never drops the grammar" this guards against: mixed
greedy and sampling batches stopped the engine (1); a schema without instances was decoded unconstrained (5); a
string schema is refused before the engine (7); raw logprobs of guided requests were -inf, HTTP 500 (8).
"""
import asyncio
import json
import math

import openai
import pytest
import server_traffic as traffic
from e2e_helpers import PERSON, check_valid, response_format, start_server, stop_server

ROUNDS = 3
CONCURRENT = 32
DISCONNECTS = 20
#: The texts of tiny-llama's stop tokens (its Llama-3.2 tokenizer marks only <|end_of_text|> special).
STOP_TEXTS = ('<|end_of_text|>', '<|eom_id|>', '<|eot_id|>')
NO_INSTANCE = {'type': 'json_schema', 'json_schema': {'name': 'loop', 'schema': {
    '$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}}}


@pytest.fixture(scope='module')
def server(cpu_path, tmp_path_factory):
    from lmdeploy_guided_spec.cpu import models
    method, draft = models.SPECULATIVE['tiny-llama']
    log = tmp_path_factory.mktemp('traffic') / 'server.log'
    args = ['--speculative-algorithm', method, '--speculative-draft-model', models.resolve(draft),
            '--speculative-num-draft-tokens', '3', '--logprobs-mode', 'raw_logprobs']
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


def test_hostile_requests(server):
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{'role': 'user', 'content': 'A person, please.'}]
    # a schema without instances: refused with the reason, the grammar is never dropped
    with pytest.raises(openai.BadRequestError, match='admits no instance'):
        client.chat.completions.create(model=model, messages=messages, response_format=NO_INSTANCE, max_tokens=32)
    # a schema given as a JSON string: the server's request model takes an object (as OpenAI's does) and refuses it
    # before it reaches the engine (pipeline accepts the string: test_deployment.py)
    as_string = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': json.dumps(PERSON)}}
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model=model, messages=messages, response_format=as_string, max_tokens=96)
    assert 400 <= refused.value.status_code < 500
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
    assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200


def test_requests_whose_grammar_meets_banned_tokens_or_a_dead_end(server):
    """Requests that stopped the engine (a sampled row without a finite logit) or failed with HTTP 500: a grammar that
    allows no token at all is refused at entry; one that runs into a dead end fails its own request; ignore_eos,
    min_new_tokens and the n-gram stop leave the grammar its tokens, and the text is what the grammar accepts."""
    proc, base, log = server
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=300, max_retries=0)
    model = client.models.list().data[0].id
    messages = [{'role': 'user', 'content': 'A record, please.'}]
    nothing = {'type': 'regex_schema', 'regex_schema': '[^\\s\\S]'}
    with pytest.raises(openai.BadRequestError, match='admits no instance'):
        client.chat.completions.create(model=model, messages=messages, response_format=nothing, max_tokens=8)
    # 'a' and 'b' are allowed first; after one of them nothing is: whichever the model picks, one of the two
    # regexes runs into the dead end, greedy or sampled
    dead_ends = 0
    for regex in ('a[^\\s\\S]|b', 'b[^\\s\\S]|a'):
        # sampled: a dead end about half the time each (the engine died at the first one)
        for temperature, seed in ((0.0, None), *((1.0, seed) for seed in range(1, 7))):
            fmt = {'type': 'regex_schema', 'regex_schema': regex}
            try:
                choice = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                        max_tokens=8, temperature=temperature, seed=seed).choices[0]
            except openai.APIStatusError as err:
                assert 'allows no token at all' in str(err), err
                dead_ends += 1
            else:
                if choice.finish_reason == 'error':
                    # lmdeploy 0.14.0's api_server answers a request the engine failed with its reason as the text
                    assert 'allows no token at all' in choice.message.content, choice
                    dead_ends += 1
                else:
                    assert choice.message.content == regex[-1] and choice.finish_reason == 'stop', choice
            assert proc.poll() is None, log.read_text()[-4000:]
    assert dead_ends >= 2  # greedy meets one; at least one sampled request met one too
    schema = {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': {
        'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']}}}
    ab = {'type': 'regex_schema', 'regex_schema': 'ab'}
    cases = [(ab, dict(ignore_eos=True)), (ab, dict(min_new_tokens=10)),
             ({'type': 'json_object'}, dict(ignore_eos=True)),
             (schema, dict(repetition_ngram_size=2, repetition_ngram_threshold=1))]
    for fmt, extra in cases:
        for temperature in (0.0, 0.8):
            choice = client.chat.completions.create(model=model, messages=messages, response_format=fmt,
                                                    max_tokens=24, temperature=temperature, seed=3,
                                                    extra_body=extra).choices[0]
            assert choice.finish_reason in ('stop', 'length'), (extra, choice)
            if fmt is ab:
                # after the grammar's end only stop tokens (ignore_eos runs to max_tokens); the test tokenizer does not
                # mark <|eot_id|> and <|eom_id|> special, so the text shows them
                text = choice.message.content
                for stop in STOP_TEXTS:
                    text = text.replace(stop, '')
                check_valid(text, fmt)
            elif choice.finish_reason == 'stop':
                check_valid(choice.message.content, fmt)
            assert proc.poll() is None, log.read_text()[-4000:]
    assert traffic.health(base) == 200
    fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))
    assert reason == 'stop'
    check_valid(text, fmt)

