"""Grammars compile off the engine loop: a request waits for its grammar while the others keep decoding, and a
compile past the limit fails that request alone (defect 6 of the issue "The engine never dies, never stalls,
never drops the grammar").

One speculative engine (eagle3) with a compile limit of a few seconds. A long unguided stream decodes while two
big schemas arrive: one compiles within the limit, one does not. Before the fix the engine compiled inside its
loop: the stream stopped for as long as the compile ran, and no compile ever failed.
"""
import asyncio
import re
import threading
import time

import pytest
import xgrammar as xgr
from e2e_helpers import (
    ENGINE_KWARGS,
    PROMPTS,
    check_valid,
    gen_config,
    generate,
    manager,
    model_agent,
    while_streaming,
)

from lmdeploy_guided_spec.compile import COMPILE_TIMEOUT_ENV

from grammars import wide_object

LIMIT_S = 3
# the schema past the limit: 16,000 optional properties compile in 15 s on a 2-core EPYC that compiles 300 in 0.05 s
# (and 8,000 in 4 s, which once was the slow schema here and fit a 6 s limit on a faster machine). The limit stays
# far from both on machines several times slower or faster
SLOW_PROPERTIES = 16000
# the longest pause of the running stream while the big grammars compile: shorter than the slow compile (before
# the fix the stream paused for the whole compile, several times the limit). A step of the tiny model takes
# milliseconds; the margin is for the entry checks, which parse the whole grammar in Python threads, and for a
# loaded machine
MAX_GAP_S = 6
#: the grammar that compiles beside them: no bounded string, so that it compiles in milliseconds. PERSON's
#: ``maxLength`` strings took a second on a loaded 2-core machine, and past the limit beside the slow compile (CI)
SMALL = {'type': 'object', 'properties': {'age': {'type': 'integer', 'minimum': 0, 'maximum': 130},
                                          'ok': {'type': 'boolean'}},
         'required': ['age', 'ok'], 'additionalProperties': False}


def _fmt(schema: dict) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'wide', 'schema': schema}}


@pytest.fixture(scope='module')
def limited_pipe(engines, monkeypatch_module):
    """A speculative pipeline whose engine compiles grammars with a limit of LIMIT_S seconds."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec.cpu import models
    key = ('compile-limit', LIMIT_S)
    if key not in engines._pipes:
        monkeypatch_module.setenv(COMPILE_TIMEOUT_ENV, str(LIMIT_S))
        spec = SpeculativeConfig(method='eagle3', model=models.resolve('tiny-llama-eagle3'), num_speculative_tokens=3)
        engines._pipes[key] = pipeline(models.resolve('tiny-llama'), backend_config=PytorchEngineConfig(
            **ENGINE_KWARGS), speculative_config=spec, log_level='ERROR')
        monkeypatch_module.delenv(COMPILE_TIMEOUT_ENV)
    return engines._pipes[key]


@pytest.fixture(scope='module')
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_slow_compiles_do_not_stall_decoding_and_a_compile_past_the_limit_fails_alone(limited_pipe):
    fits, too_slow, small = _fmt(wide_object(300)), _fmt(wide_object(SLOW_PROPERTIES)), _fmt(SMALL)
    outputs, gap, took = while_streaming(limited_pipe, PROMPTS[:3], [gen_config(fits, max_new_tokens=24),
                                                                     gen_config(too_slow), gen_config(small)])
    # the grammar past the limit fails its own request, and says why and what to change
    assert outputs[1].finish_reason == 'error', outputs[1]
    assert f'longer than {LIMIT_S} s' in outputs[1].text and COMPILE_TIMEOUT_ENV in outputs[1].text, outputs[1].text
    # the others completed under their grammars
    assert outputs[0].finish_reason in ('stop', 'length'), outputs[0]
    assert outputs[0].text.startswith('{') and all(key.startswith('"field_') for key in
                                                   _keys(outputs[0].text)), outputs[0].text
    assert outputs[2].finish_reason == 'stop', outputs[2]
    check_valid(outputs[2].text, small)
    # while the grammars compiled, the stream kept decoding
    assert gap < MAX_GAP_S, f'the stream paused {gap:.1f} s while grammars compiled ({took:.1f} s)'


def _tag(schema) -> dict:
    """A structural tag: a JSON instance of ``schema`` between ``<call>`` and ``</call>``."""
    return {'type': 'structural_tag', 'format': {'type': 'tag', 'begin': '<call>', 'content': {
        'type': 'json_schema', 'json_schema': schema}, 'end': '</call>'}}


def test_structural_tags_compile_off_the_loop(limited_pipe):
    """Defect: lmdeploy 0.18 builds a structural tag from the client's tools for tool_choice="required" (pipeline
    users send their own), and the engine compiled structural tags inside its loop, with no limit: the stream of
    every other request stopped for the whole compile, and a tag nesting a schema hundreds of levels deep was
    converted for minutes."""
    deep = {'type': 'string'}
    for _ in range(300):
        deep = {'type': 'object', 'properties': {'a': deep}}
    small = SMALL
    formats = [_tag(wide_object(300)), _tag(wide_object(SLOW_PROPERTIES)), _tag(small), _tag(deep)]
    outputs, gap, took = while_streaming(limited_pipe, PROMPTS[:4], [gen_config(fmt, max_new_tokens=96)
                                                                     for fmt in formats])
    assert outputs[0].finish_reason in ('stop', 'length') and outputs[0].text.startswith('<call>{'), outputs[0]
    assert outputs[1].finish_reason == 'error', outputs[1]
    assert f'longer than {LIMIT_S} s' in outputs[1].text and COMPILE_TIMEOUT_ENV in outputs[1].text, outputs[1].text
    assert outputs[2].finish_reason == 'stop', outputs[2]
    assert outputs[2].text.startswith('<call>') and outputs[2].text.endswith('</call>'), outputs[2]
    check_valid(outputs[2].text[len('<call>'):-len('</call>')], _fmt(SMALL))
    assert outputs[3].finish_reason == 'error' and 'the structural_tag nests' in outputs[3].text, outputs[3]
    assert gap < MAX_GAP_S, f'the stream paused {gap:.1f} s while structural tags compiled ({took:.1f} s)'


def _keys(text: str) -> list[str]:
    """The property names of a (possibly cut) JSON object, as written."""
    return re.findall(r'"[^"]*"(?=\s*:)', text)


def test_compiled_grammars_are_kept_in_bounded_caches(limited_pipe):
    """Both compile caches of the engine are bounded by bytes (lmdeploy left xgrammar's unbounded), and a grammar
    compiled once is served from the cache to the next request."""
    mgr = manager(limited_pipe)
    assert 0 < mgr.compiler.cache_limit_bytes <= 1 << 30
    service = mgr.compile_service
    assert service is not None and 0 < service.cache_limit_bytes <= 1 << 30
    schema = _fmt(wide_object(200))
    generate(limited_pipe, PROMPTS[:1], [gen_config(schema, max_new_tokens=8)])
    kind, source, options = mgr.compile_args(schema)
    grammar = service.lookup(kind, source, **options)
    assert grammar is not None
    out = generate(limited_pipe, PROMPTS[:1], [gen_config(schema, max_new_tokens=8)])[0]
    assert out.finish_reason in ('stop', 'length')
    assert service.lookup(kind, source, **options) is grammar


def test_a_request_stopped_while_its_grammar_compiles_leaves_nothing(engines):
    """A client that gives up while its request waits for its grammar (a streamed request whose connection closes,
    a cancelled task): the engine stops waiting for the grammar, the request never runs once the compile ends, and
    no grammar state is left for its session. The grammar stays compiled: the same schema is served at once next."""
    pipe = engines('tiny-llama')
    engine = pipe.async_engine.engine
    # required properties: about 5 s of entry check and compile here, long enough to stop the request meanwhile and
    # far from the 30 s limit, and a matcher of 1 MB (an enum of 24,000 strings, as slow, took 40-56 MB of the 64 MB
    # limit, and the probe's reading of it once went past). The prefix keeps it out of the cache of earlier tests
    fmt = _fmt(wide_object(6_000, required=True, prefix='stopped'))
    session_id = 987_001
    outputs = []

    async def consume():
        async for out in pipe.generate(PROMPTS[0], session_id, gen_config=gen_config(fmt, max_new_tokens=8)):
            outputs.append(out)

    # the engine's entry check and compile of the grammar, off its loop: when they are done, the engine decides
    # whether to hand the request back
    checked, failed = threading.Event(), []
    check_and_compile = engine._check_and_compile

    def watched(*args):
        try:
            return check_and_compile(*args)
        except BaseException as exc:
            failed.append(exc)
            raise
        finally:
            checked.set()

    engine._check_and_compile = watched  # this engine's alone, taken away at the end
    try:
        future = pipe._run(coro=consume())
        deadline = time.monotonic() + 30
        while session_id not in engine._compiling_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert session_id in engine._compiling_requests, 'the request did not wait for its grammar'
        args = manager(pipe).compile_args(fmt)
        service = manager(pipe).compile_service
        assert service.lookup(args[0], args[1], **args[2]) is None, 'compiled already: make the schema bigger'
        future.cancel()  # the engine hears of it as a client that went away: lmdeploy's safe_run cancels the session
        deadline = time.monotonic() + 10
        while session_id in engine._compiling_requests and time.monotonic() < deadline:
            time.sleep(0.02)
        assert session_id not in engine._compiling_requests, 'a stopped request still waits for its grammar'
        # the check and the compile run to their end (a later request may want the grammar) ...
        assert checked.wait(timeout=120), 'the check and compile of the grammar did not end'
        assert not failed, failed
        grammar = service.lookup(args[0], args[1], **args[2])
        assert grammar is not None
        # ... and the stopped request never runs: a request handed back then would be scheduled within a step or two
        # (milliseconds here), so watch its session's sequences for a while
        scheduled, end = False, time.monotonic() + 2
        while time.monotonic() < end:
            session = engine.scheduler.sessions.get(session_id)
            scheduled |= session is not None and bool(session.sequences)
            time.sleep(0.005)
    finally:
        del engine._check_and_compile
    assert not scheduled, 'the stopped request was scheduled after its grammar compiled'
    assert outputs == [], outputs
    assert session_id not in model_agent(pipe).guided_decoding_manager.processors
    # nor a hold of its grammar in the compile cache, past the cache's bound (it was held as the request arrived)
    assert service.holders == 0
    # the same schema now costs no compile, and is served under its grammar
    start = time.perf_counter()
    again = generate(pipe, [PROMPTS[0]], [gen_config(fmt, max_new_tokens=16)])[0]
    assert again.finish_reason in ('stop', 'length'), again
    matcher = xgr.GrammarMatcher(grammar)
    assert again.token_ids and all(matcher.accept_token(t) for t in again.token_ids), again
    assert time.perf_counter() - start < 10


# xgrammar converts a pattern with a counted repetition in time that grows about as the square of the count: this
# one takes over a minute on a 2-core machine (18 s for {1,20000}; bounds past 65,535 are converted at once)
SLOW_TO_PARSE = {'type': 'object', 'properties': {'code': {'type': 'string', 'pattern': '^[a-z]{1,40000}$'}},
                 'required': ['code']}


def test_a_grammar_slow_to_parse_is_stopped_at_the_limit_and_fails_alone(limited_pipe, monkeypatch):
    """The entry check of a request parsed its grammar in a thread of the serving process and again on one of the
    engine's check threads, with no limit: this schema held both for over a minute each (and a few such requests
    every check thread, so that each new guided request waited behind them). The check now runs in a compiler
    process stopped at the compile limit, and the request fails alone with the reason."""
    monkeypatch.setenv(COMPILE_TIMEOUT_ENV, str(LIMIT_S))  # the limit of this process's checks
    small = _fmt(SMALL)
    outputs, gap, took = while_streaming(limited_pipe, PROMPTS[:2], [gen_config(_fmt(SLOW_TO_PARSE)),
                                                                     gen_config(small)])
    assert outputs[0].finish_reason == 'error', outputs[0]
    assert f'longer than {LIMIT_S} s' in outputs[0].text and COMPILE_TIMEOUT_ENV in outputs[0].text, outputs[0].text
    assert outputs[1].finish_reason == 'stop', outputs[1]
    check_valid(outputs[1].text, small)
    # the limit, the start of a checker process and the other request; the check alone took over a minute before
    assert took < 30, took
    assert gap < MAX_GAP_S, f'the stream paused {gap:.1f} s while the grammar was checked ({took:.1f} s)'


@pytest.mark.skipif(__import__('lmdeploy').__version__.startswith('0.14.'),
                    reason="0.14.0's response parsers build no format, so only the endpoints check a request's")
def test_the_engines_check_stops_when_its_client_leaves(limited_pipe, monkeypatch):
    """0.18.0 patch 0092: the engine's entry check of a format (the only check of one the response parser builds,
    from the tools of a forced call) asks the client probe that api_server hands the session: a client that leaves
    stops the parse, and the request ends with 'abort', counted as cancelled, as a client that leaves elsewhere is
    (not as an abort, which an operator sends). A probe that fails is asked no more and keeps no abort from stopping
    the check (run_entry_check stops polling a probe that raises)."""
    from lmdeploy.metrics.metrics_processor import metrics_processor
    monkeypatch.setenv(COMPILE_TIMEOUT_ENV, '120')  # far past the parse a stop cuts short (over a minute)
    engine, stats = limited_pipe.async_engine, metrics_processor.scheduler_stats

    async def check(n: int, probe, abort_after: float | None = None):
        schema = {'type': 'string', 'pattern': f'^[a-z]{{1,{40_100 + n}}}$'}  # new to the checker's cache
        session = engine.session_mgr.get()
        session.client_disconnected = probe  # as api_server's create_session sets it
        start = time.monotonic()
        task = asyncio.ensure_future(engine.preprocess([{'role': 'user', 'content': 'A word.'}], session,
                                                       gen_config=gen_config(_fmt(schema))))
        if abort_after is not None:
            await asyncio.sleep(abort_after)
            await session.async_abort()
        request = await task
        outputs = [out async for out in engine.generate(request)]
        return outputs, time.monotonic() - start

    looks = []

    async def leaves():
        looks.append(time.monotonic())
        return len(looks) >= 3  # gone at its third look

    async def fails():
        raise RuntimeError('the connection state cannot be read')

    before = (stats.num_cancelled_reqs, stats.num_aborted_reqs)
    outputs, took = limited_pipe._run(coro=check(0, leaves)).result(timeout=150)
    assert [out.finish_reason for out in outputs] == ['abort'] and took < 20, (outputs, took)
    assert (stats.num_cancelled_reqs, stats.num_aborted_reqs) == (before[0] + 1, before[1])
    outputs, took = limited_pipe._run(coro=check(1, fails, abort_after=2)).result(timeout=150)
    assert [out.finish_reason for out in outputs] == ['abort'] and took < 20, (outputs, took)
    assert (stats.num_cancelled_reqs, stats.num_aborted_reqs) == (before[0] + 1, before[1] + 1)


class _Counting:
    """An ``xgrammar.GrammarCompiler`` whose compiles are counted in ``calls``."""

    def __init__(self, compiler, calls: list):
        self._compiler, self._calls = compiler, calls

    def __getattr__(self, name):
        attr = getattr(self._compiler, name)
        if not name.startswith('compile_'):
            return attr

        def counted(*args, **kwargs):
            self._calls.append(name)
            return attr(*args, **kwargs)

        return counted


#: a prompt of more than one block of the KV cache (64 tokens)
LONG_PROMPT = ' '.join(PROMPTS * 3)


def test_a_request_that_waits_for_the_kv_cache_keeps_its_grammar(cpu_path, monkeypatch):
    """A request admitted with its grammar compiled waits for room in the KV cache, while another request's grammar
    compiles into a cache too small for both: the waiting request's grammar is held, and its first step builds its
    matcher from the cache. Before, the newer grammar evicted it, and that step compiled it again while every
    request of the batch waited (seconds, for a schema near the limit)."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.pytorch.engine.model_agent import agent
    from lmdeploy.pytorch.messages import MessageStatus

    from lmdeploy_guided_spec.compile import COMPILE_CACHE_ENV
    from lmdeploy_guided_spec.cpu import models
    # each grammar takes 0.6 MB compiled here: the cache holds one of them. Ten blocks of 64 tokens of KV cache: the
    # long stream leaves one near its end, and the waiting request's prompt takes two
    monkeypatch.setenv(COMPILE_CACHE_ENV, '1')
    pipe = pipeline(models.resolve('tiny-llama'), backend_config=PytorchEngineConfig(
        **{**ENGINE_KWARGS, 'max_batch_size': 4, 'num_gpu_blocks': 10}), log_level='ERROR')
    engine = pipe.async_engine.engine
    service = manager(pipe).compile_service
    try:
        # the step compiles a grammar it does not find with the manager's xgrammar compiler
        in_step = []
        monkeypatch.setattr(manager(pipe), 'compiler', _Counting(manager(pipe).compiler, in_step))
        # steps of a bigger model from the moment the KV cache is nearly full, so that the stream ends seconds later
        slow = threading.Event()
        forward = agent.model_forward

        def slowed(*args, **kwargs):
            if slow.is_set():
                time.sleep(0.5)
            return forward(*args, **kwargs)

        monkeypatch.setattr(agent, 'model_forward', slowed)
        first, second = _fmt(wide_object(40, prefix='waits')), _fmt(wide_object(40, prefix='evicts'))
        args = [manager(pipe).compile_args(fmt) for fmt in (first, second)]
        outputs, seen = {}, {}

        async def run(session_id, config, prompt):
            async for out in pipe.generate(prompt, session_id, gen_config=config):
                text, _, _ = outputs.get(session_id, ('', None, None))
                outputs[session_id] = (text + out.response, out.finish_reason, out.generate_token_len)

        async def main():
            stream = asyncio.ensure_future(run(970_001, gen_config(None, max_new_tokens=480, ignore_eos=True),
                                               PROMPTS[1]))
            deadline = time.monotonic() + 60
            while engine.scheduler.block_manager.get_num_free_gpu_blocks() > 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.001)
            # about 30 steps of the stream are left: 15 s for the two entry checks and compiles
            slow.set()
            waits = asyncio.ensure_future(run(970_002, gen_config(first, max_new_tokens=16), LONG_PROMPT))
            deadline = time.monotonic() + 60
            while service.lookup(*args[0][:2], **args[0][2]) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            evicts = asyncio.ensure_future(run(970_003, gen_config(second, max_new_tokens=16), PROMPTS[2]))
            deadline = time.monotonic() + 60
            while service.lookup(*args[1][:2], **args[1][2]) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            waiting = engine.scheduler.sessions[970_002].sequences.values()
            seen['waiting'] = [seq.status == MessageStatus.WAITING for seq in waiting]
            seen['stream'] = outputs.get(970_001, (None, None, 0))[1]
            seen['bytes'] = service.cache_size_bytes
            await asyncio.gather(waits, evicts, stream)

        pipe._run(coro=main()).result(timeout=300)
    finally:
        pipe.close()
    # the case: the first request waited for the KV cache while the second's grammar came into the cache
    assert seen['waiting'] == [True] and seen['stream'] is None, (seen, outputs)
    assert in_step == [], 'a step compiled a grammar: its request\'s grammar was evicted while it waited'
    assert seen['bytes'] > service.cache_limit_bytes, 'the waiting request\'s grammar was evicted'
    for session_id, fmt in ((970_002, first), (970_003, second)):
        text, reason, _ = outputs[session_id]
        assert reason in ('stop', 'length'), outputs[session_id]
        if reason == 'stop':
            check_valid(text, fmt)
    # the holds were let go as the matchers were built: the cache is back within its bound
    assert service.holders == 0 and service.cache_size_bytes <= service.cache_limit_bytes
