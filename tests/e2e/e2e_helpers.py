"""Pipelines, requests, grammars and checks shared by the end-to-end tests."""
from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass

import jsonschema
import pytest

from lmdeploy_guided_spec.testing import environ, forget_at_exit, free_port, kill_at_exit, kill_session

NUM_SPEC_TOKENS = 3
STARTUP_S = 300
MAX_NEW_TOKENS = 96
METHODS = {'eagle3': 'tiny-llama', 'deepseek_mtp': 'tiny-deepseek-mtp'}
ENGINE_KWARGS = dict(max_batch_size=16, cache_max_entry_count=0.1, session_len=2048)

PERSON = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string', 'maxLength': 16},
        'age': {'type': 'integer', 'minimum': 0, 'maximum': 130},
        'tags': {'type': 'array', 'items': {'type': 'string', 'maxLength': 8}, 'maxItems': 3},
    },
    'required': ['name', 'age', 'tags'],
    'additionalProperties': False,
}
# fixed length: a random model finishes it, and the grammar forces the dash
CODE_REGEX = r'[A-Z]{2}-[0-9]{3}'
#: tiny-llama's stop tokens as text (its Llama-3.2 tokenizer marks only <|end_of_text|> special)
STOP_TEXTS = ('<|end_of_text|>', '<|eom_id|>', '<|eot_id|>')


def response_format(kind: str, schema: dict | None = None, regex: str | None = None) -> dict | None:
    """lmdeploy ``response_format`` of a kind (``text``: None)."""
    if kind == 'json_schema':
        return {'type': 'json_schema', 'json_schema': {'name': 'e2e', 'schema': schema or PERSON}}
    if kind == 'regex_schema':
        return {'type': 'regex_schema', 'regex_schema': regex or CODE_REGEX}
    if kind == 'json_object':
        return {'type': 'json_object'}
    if kind == 'text':
        return None
    raise ValueError(kind)


#: four digits, as a regex_schema response_format
YEAR = response_format('regex_schema', regex='[0-9]{4}')
#: the reason the engine gives for a request whose logits it could not sample (no finite value)
UNSAMPLEABLE = 'no finite value to sample from'


def check_valid(text: str, fmt: dict | None) -> None:
    """Assert that ``text`` is a complete instance of ``fmt``."""
    kind = None if fmt is None else fmt['type']
    if kind == 'json_schema':
        jsonschema.validate(json.loads(text), fmt['json_schema']['schema'])
    elif kind == 'json_object':
        assert isinstance(json.loads(text), dict), text
    elif kind == 'regex_schema':
        assert re.fullmatch(fmt['regex_schema'], text), f'{text!r} does not match {fmt["regex_schema"]!r}'


def is_valid(text: str, fmt: dict | None) -> bool:
    try:
        check_valid(text, fmt)
    except (AssertionError, ValueError, jsonschema.ValidationError):
        return False
    return True


def gen_config(fmt: dict | None = None, *, sampling: bool = False, seed: int = 0, **kwargs):
    from lmdeploy import GenerationConfig
    kwargs.setdefault('max_new_tokens', MAX_NEW_TOKENS)
    if sampling:
        kwargs.update(do_sample=True, random_seed=seed)
        kwargs.setdefault('temperature', 0.8)
        kwargs.setdefault('top_k', 20)
    return GenerationConfig(response_format=fmt, **kwargs)


@dataclass
class Output:
    text: str
    token_ids: list[int]
    finish_reason: str | None
    #: why a request failed, where the release says it beside the text (lmdeploy 0.18's ``Response.error_message``;
    #: 0.14 has none)
    error_message: str | None = None


_FORWARD_LOCK = threading.Lock()


def serialize_forwards() -> None:
    """Let the engines of this process run their forwards one at a time.

    lmdeploy keeps the current step context in a process-wide singleton (``StepCtxMgrApi``) that every forward sets
    and restores, and that layers read (linear, MoE). An engine is alone in its process in normal use; the tests keep
    several pipelines in one process, and an engine's trailing step can overlap the next test's requests to another
    engine, which then reads a foreign or cleared context. So the model and draft forwards of all engines take one
    lock.
    """
    from lmdeploy.pytorch.engine.model_agent import agent
    from lmdeploy.pytorch.spec_decode.proposers import base

    for module, name in ((agent, 'model_forward'), (base, 'draft_model_forward')):
        forward = getattr(module, name)
        if getattr(forward, 'serialized', False):
            continue

        def serialized(*args, _forward=forward, **kwargs):
            with _FORWARD_LOCK:
                return _forward(*args, **kwargs)

        serialized.serialized = True
        setattr(module, name, serialized)


class Engines:
    """Pipelines of the named CPU models, built on first use and shared by the tests of a session."""

    def __init__(self):
        self._pipes = {}
        serialize_forwards()

    def __call__(self, target: str, spec: bool = True, num_spec_tokens: int = NUM_SPEC_TOKENS, *,
                 env: dict[str, str] | None = None, **engine_options):
        """The pipeline; ``engine_options`` are ``PytorchEngineConfig`` fields beyond ``ENGINE_KWARGS``, ``env``
        environment variables set while the engine builds (settings it reads once, then)."""
        key = (target, spec, num_spec_tokens if spec else 0, *sorted(engine_options.items()))
        if env:
            key += (('env', tuple(sorted(env.items()))), )
        if key not in self._pipes:
            with environ(env):
                self._pipes[key] = self._build(target, spec, num_spec_tokens, engine_options)
        return self._pipes[key]

    @staticmethod
    def _build(target: str, spec: bool, num_spec_tokens: int, engine_options: dict):
        from lmdeploy import PytorchEngineConfig, pipeline
        from lmdeploy.messages import SpeculativeConfig

        from lmdeploy_guided_spec.cpu import models
        speculative_config = None
        if spec:
            method, draft = models.SPECULATIVE[target]
            speculative_config = SpeculativeConfig(method=method, model=models.resolve(draft) if draft else '',
                                                   num_speculative_tokens=num_spec_tokens)
        pipe = pipeline(models.resolve(target), backend_config=PytorchEngineConfig(**ENGINE_KWARGS, **engine_options),
                        speculative_config=speculative_config, log_level='ERROR')
        return pipe

    def close(self):
        for pipe in self._pipes.values():
            pipe.close()
        self._pipes.clear()


def draft_free_pipeline(engines: Engines, target: str, method: str, k: int, fsm_path: str | None = None):
    """A pipeline with a draft-free method (``grammar``, ``fsm``), built once and closed with the session's other
    engines (closing an engine while others of the process live on is not what the pool does)."""
    key = ('draft-free', target, method, k, fsm_path)
    pipes = engines._pipes
    if key not in pipes:
        from lmdeploy import PytorchEngineConfig, pipeline
        from lmdeploy.messages import SpeculativeConfig

        from lmdeploy_guided_spec.cpu import models
        spec = SpeculativeConfig(method=method, fsm_path=fsm_path, num_speculative_tokens=k)
        pipes[key] = pipeline(models.resolve(target), backend_config=PytorchEngineConfig(**ENGINE_KWARGS),
                              speculative_config=spec, log_level='ERROR')
    return pipes[key]


def method_pipeline(engines: Engines, method: str):
    """A pipeline of ``method``: a draft model's (on its target in :data:`METHODS`), or on tiny-llama the draft-free
    ``grammar`` (k=3) or ``non-spec`` (no speculative decoding)."""
    if method == 'non-spec':
        return engines('tiny-llama', spec=False)
    if method == 'grammar':
        return draft_free_pipeline(engines, 'tiny-llama', 'grammar', 3)
    return engines(METHODS[method])


def model_agent(pipe):
    """The in-process model agent of a pipeline's engine."""
    return pipe.async_engine.engine.executor.model_agent


def manager(pipe):
    """The pipeline engine's ``GuidedDecodingManager``."""
    return model_agent(pipe).guided_decoding_manager


def _text(response) -> str:
    """The text of a pipeline response; for a failed request, the reason (lmdeploy 0.18 gives it as
    ``error_message``, 0.14 as the text)."""
    if response.finish_reason == 'error' and not response.text:
        return getattr(response, 'error_message', None) or ''
    return response.text


def generate(pipe, prompts: list[str], configs) -> list[Output]:
    """Non-streaming batch generation."""
    responses = pipe(prompts, gen_config=configs)
    return [Output(_text(r), list(r.token_ids), r.finish_reason, getattr(r, 'error_message', None))
            for r in responses]


def stream(pipe, prompts: list[str], configs) -> list[Output]:
    """Streaming batch generation: the chunks of every request put together."""
    texts = [''] * len(prompts)
    tokens: list[list[int]] = [[] for _ in prompts]
    reasons: list[str | None] = [None] * len(prompts)
    for chunk in pipe.stream_infer(prompts, gen_config=configs):
        texts[chunk.index] += _text(chunk)
        tokens[chunk.index] += list(chunk.token_ids or [])
        if chunk.finish_reason is not None:
            reasons[chunk.index] = chunk.finish_reason
    return [Output(t, ids, r) for t, ids, r in zip(texts, tokens, reasons)]


PROMPTS = [
    'Describe a person as JSON.', 'Who wrote the first program?', 'Give me a record.', 'List three colours.',
    'A customer, please.', 'Write an order code.', 'What is the weather like?', 'Name a river and its length.',
]


# -- api_server ----------------------------------------------------------------------------------------------------
def while_streaming(pipe, prompts, configs, tokens: int = 1000):
    """``generate(pipe, prompts, configs)`` while a long unguided stream (of up to ``tokens`` tokens) decodes; returns
    the outputs, the longest pause of the stream meanwhile and how long the requests took."""
    times: list[float] = []
    finished = []
    # the stream's session is aborted once the requests are answered (it ran its 1000 tokens, most of the test's
    # time)
    session = pipe.session()

    def long_stream():
        config = gen_config(None, max_new_tokens=tokens, ignore_eos=True)
        for chunk in pipe.stream_infer([PROMPTS[1]], sessions=[session], gen_config=[config]):
            times.append(time.perf_counter())
            if chunk.finish_reason is not None:
                finished.append(chunk.finish_reason)

    streamer = threading.Thread(target=long_stream, daemon=True)
    streamer.start()
    deadline = time.perf_counter() + 120
    while len(times) < 5 and time.perf_counter() < deadline and streamer.is_alive():
        time.sleep(0.05)
    assert len(times) >= 5, 'the long stream did not start'
    start = time.perf_counter()
    outputs = generate(pipe, prompts, configs)
    end = time.perf_counter()
    stream_was_running = streamer.is_alive()
    session.abort()
    streamer.join(timeout=300)
    assert finished in (['length'], ['abort']), finished
    assert stream_was_running, 'the stream ended before the compiles did; make it longer'
    window = [t for t in times if start <= t <= end]
    assert window, 'the stream sent nothing while the grammars compiled'
    return outputs, max((b - a for a, b in zip(window, window[1:])), default=0.0), end - start


def spawn_server(args: list[str], log, max_batch_size: int = 4, model: str = 'tiny-llama',
                 port: int | None = None) -> tuple[subprocess.Popen, int]:
    """``lmdeploy serve api_server`` for ``model`` (a name of the CPU path's models) on the CPU path, in a new
    session, its output in ``log``, on 127.0.0.1 at ``port`` (a free one where None)."""
    port = port or free_port()
    cmd = [sys.executable, '-m', 'lmdeploy_guided_spec.cpu', 'serve', model, '--backend', 'pytorch', *args,
           '--server-name', '127.0.0.1', '--server-port', str(port), '--max-batch-size', str(max_batch_size),
           '--cache-max-entry-count', '0.1', '--log-level', 'WARNING']
    with open(log, 'wb') as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    # a test run stopped by SIGTERM skips the tests' finally blocks: the server would go on decoding
    kill_at_exit(proc)
    return proc, port


def start_server(args: list[str], log, max_batch_size: int = 4, model: str = 'tiny-llama',
                 port: int | None = None) -> tuple[subprocess.Popen, str]:
    """Spawn the api_server and wait until it answers ``/v1/models``."""
    proc, port = spawn_server(args, log, max_batch_size, model, port)
    base = f'http://127.0.0.1:{port}'
    return proc, wait_for_server(proc, base, log)


def wait_for_server(proc: subprocess.Popen, base: str, log) -> str:
    """Wait until the api_server ``proc`` started answers ``/v1/models`` at ``base``; fail (stopping it) if it exits
    or is not up within ``STARTUP_S``."""
    deadline = time.monotonic() + STARTUP_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f'api_server exited with {proc.returncode}:\n{log.read_text()[-4000:]}')
        try:
            urllib.request.urlopen(f'{base}/v1/models', timeout=2)
            return base
        except (OSError, http.client.HTTPException):
            if time.monotonic() > deadline:
                stop_server(proc)
                pytest.fail(f'api_server not up after {STARTUP_S} s:\n{log.read_text()[-4000:]}')
            time.sleep(1)


def metric(base: str, name: str) -> float:
    """The value of lmdeploy's Prometheus metric ``lmdeploy:<name>`` on the api_server at ``base`` (``/metrics``)."""
    text = urllib.request.urlopen(f'{base}/metrics', timeout=10).read().decode()
    found = re.search(rf'^lmdeploy:{name}\{{[^}}]*\}} (\S+)$', text, re.M)
    assert found, f'{name} not in the metrics'
    return float(found.group(1))


def data_events(text: str | bytes) -> list[dict]:
    """The JSON objects of a server-sent event stream's ``data:`` lines, in order (``data: [DONE]`` is not one)."""
    if isinstance(text, bytes):
        text = text.decode()
    return [json.loads(line[len('data: '):]) for line in text.splitlines() if line.startswith('data: {')]


def served(tmp_path_factory, args: list[str], **kwargs):
    """The body of a module's server fixture: the api_server of :func:`start_server` (``args``, ``kwargs``) as
    ``{"base", "proc", "log"}``, stopped after."""
    log = tmp_path_factory.mktemp('api_server') / 'server.log'
    proc, base = start_server(args, log, **kwargs)
    try:
        yield dict(base=base, proc=proc, log=log)
    finally:
        stop_server(proc)


def openai_client(server: dict) -> tuple:
    """``(client, model name)`` of the ``openai`` client of a :func:`served` server."""
    import openai
    # requests of hundreds of tokens at once took 120 s on a CI machine whose other suite ran its rank checks beside
    # them (13 s on the machine alone): the timeout catches a stall, not a slow machine
    c = openai.OpenAI(base_url=f'{server["base"]}/v1', api_key='none', timeout=300, max_retries=0)
    return c, c.models.list().data[0].id


def stop_server(proc: subprocess.Popen) -> None:
    # the server and the engine process it spawned share the new session's process group (lmdeploy's dp launcher
    # stops its api_servers, in groups of their own, when it gets SIGTERM)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=40)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    # whatever is left of its session
    kill_session(proc.pid)
    forget_at_exit(proc)


def banned_tokens_and_dead_ends(pipe) -> None:
    """One batch with sampling rows through ``pipe``: ignore_eos, min_new_tokens or the n-gram stop together with the
    grammar (the grammar wins where they meet) and grammars that run into a dead end (each fails its own request with
    the reason), and an unguided request whose n-gram stop waits for its min_new_tokens (the stop token it forced was
    banned: a row without a finite logit); then the engine still serves."""
    ab = {'type': 'regex_schema', 'regex_schema': 'ab'}
    dead_ends = [{'type': 'regex_schema', 'regex_schema': regex} for regex in ('a[^\\s\\S]|b', 'b[^\\s\\S]|a')]
    person = response_format('json_schema')
    configs = [gen_config(ab, sampling=True, seed=1, ignore_eos=True, max_new_tokens=12),
               gen_config(ab, ignore_eos=True, max_new_tokens=12),
               gen_config(ab, sampling=True, seed=2, min_new_tokens=8, max_new_tokens=12),
               gen_config(person, sampling=True, seed=3, repetition_ngram_size=2, repetition_ngram_threshold=1),
               *(gen_config(fmt, sampling=sampling, seed=4) for fmt in dead_ends for sampling in (False, True)),
               gen_config(person, sampling=True, seed=5),
               # room for min_new_tokens counted in speculative steps (up to k + 1 tokens each) and a step more
               gen_config(None, sampling=True, seed=7, min_new_tokens=5, repetition_ngram_size=1,
                          repetition_ngram_threshold=1, max_new_tokens=40)]
    responses = pipe([PROMPTS[i % len(PROMPTS)] for i in range(len(configs))], gen_config=configs)
    outputs = [Output(r.text, list(r.token_ids), r.finish_reason) for r in responses]
    # the reason of a failed request: lmdeploy 0.18 gives it as error_message, 0.14 as the text
    reasons = [(getattr(r, 'error_message', None) or '') + r.text for r in responses]
    for out in outputs[:3]:
        # ignore_eos runs to max_new_tokens writing stop tokens after the grammar's end; min_new_tokens does not
        # outlast the grammar
        text = out.text
        for stop in STOP_TEXTS:
            text = text.replace(stop, '')
        assert out.finish_reason in ('stop', 'length'), out
        check_valid(text, ab)
    assert outputs[3].finish_reason in ('stop', 'length'), outputs[3]
    failed = [reason for out, reason in zip(outputs[4:8], reasons[4:8]) if out.finish_reason == 'error']
    assert failed and all('allows no token at all' in reason for reason in failed), (outputs[4:8], reasons[4:8])
    for out, config in zip(outputs[4:8], configs[4:8]):
        if out.finish_reason != 'error':
            assert out.finish_reason == 'stop', out
            check_valid(out.text, config.response_format)
    assert outputs[8].finish_reason == 'stop', outputs[8]
    check_valid(outputs[8].text, person)
    # every token repeats a 1-gram: the n-gram stop ends the request as soon as it may
    assert outputs[9].finish_reason == 'stop' and len(outputs[9].token_ids) >= 5, (outputs[9], reasons[9])
    # the engine still serves
    again = generate(pipe, PROMPTS[:1], [gen_config(person, sampling=True, seed=6)])[0]
    assert again.finish_reason == 'stop'
    check_valid(again.text, person)
