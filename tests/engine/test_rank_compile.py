"""Ranks in processes of their own (``tp > 1``, the ``mp`` and ``ray`` executors) compile a new grammar when the
engine does, off their step (patch 0079 of 0.18.0, 0077 of 0.14.0), and the bound of the compile caches is
``LMDEPLOY_GUIDED_SPEC_COMPILE_CACHE_MB``. The installed lmdeploy's own ``GuidedDecodingManager``,
``WorkerWrapperBase`` and ``Engine`` methods, without a model; ``tests/e2e/test_ranks.py`` runs them across rank
processes."""
import asyncio
import logging
import types

import pytest

from lmdeploy_guided_spec.compile import COMPILE_CACHE_ENV, COMPILE_TIMEOUT_ENV, SLOW_QUEUED_ENV
from lmdeploy_guided_spec.testing import load_tokenizer, tokenizer_info

pytestmark = pytest.mark.engine

SCHEMA = {'type': 'object', 'properties': {'note': {'type': 'string', 'maxLength': 40}}, 'required': ['note'],
          'additionalProperties': False, 'title': 'compiled ahead of the step'}
FMT = {'type': 'json_schema', 'json_schema': {'name': 'r', 'schema': SCHEMA}}


def _manager():
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    return GuidedDecodingManager(load_tokenizer('llama3'), tokenizer_info('llama3').vocab_size)


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def test_a_rank_compiles_ahead_and_its_step_builds_the_matcher_from_that_compile(monkeypatch):
    monkeypatch.setenv(COMPILE_TIMEOUT_ENV, '20')
    manager = _manager()
    try:
        manager.precompile(None)
        manager.precompile({'type': 'text'})
        assert manager.compile_service is None, 'a rank starts its compile service with its first grammar'
        manager.precompile(FMT, 1)
        service = manager.compile_service
        # the engine probes the grammar's cost and refuses it; the rank compiles it, under the same limit
        assert service.timeout_s == 20
        assert service.mask_limit_ms == float('inf') and service.matcher_limit_mb == float('inf')
        # held for the request's session until its step builds the matcher (a request that waits for room in the KV
        # cache meanwhile keeps it, whatever the grammars of others evict)
        assert service.holders == 1
        # the step waits for that compile (in flight or done) instead of compiling the grammar itself
        manager.compiler = None  # a compile inside the step would fail here
        processors = manager.get_processors([{'session_id': 1, 'seq_id': 1}], (FMT, ))
        assert processors[0].accept_string('{"note": "hi"}')
        assert not processors[0].accept_string(', "more": 1')
        assert service.holders == 0
        # a session that ends before its step lets its grammar go too
        manager.precompile(FMT, 2)
        assert service.holders == 1
        manager.remove_processor(2)
        assert service.holders == 0
    finally:
        manager.close_compile_service()


def test_a_rank_compiles_ahead_every_grammar_the_engine_took_however_many_look_slow(monkeypatch):
    """The engine bounds the grammars that look slow to parse waiting in its compile service
    (``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``) and refuses one more with HTTP 429. A rank is sent only what the engine
    took, and it may be slower than the engine (its step holds its cores): a rank's service that refused one as
    busy left that grammar to be compiled inside the rank's step, while every request of the group waited."""
    monkeypatch.setenv(SLOW_QUEUED_ENV, '1')
    monkeypatch.setenv(COMPILE_TIMEOUT_ENV, '60')
    fmts = [{'type': 'json_schema', 'json_schema': {'name': f'slow{count}', 'schema': {
        'type': 'string', 'pattern': f'^[a-z]{{1,{count}}}$'}}} for count in range(2_000, 2_005)]
    manager = _manager()
    try:
        for fmt in fmts:  # one compiles (the other process is kept for grammars that look fast), four wait
            manager.precompile(fmt)
        manager.compiler = None  # a compile inside the step would fail here
        for session_id, fmt in enumerate(fmts):
            processors = manager.get_processors([{'session_id': session_id, 'seq_id': 1}], (fmt, ))
            assert processors[0].accept_string('"ab"'), fmt
    finally:
        manager.close_compile_service()


def test_the_compile_caches_take_their_bound_from_the_variable(monkeypatch):
    monkeypatch.setenv(COMPILE_CACHE_ENV, '300')
    manager = _manager()
    try:
        assert manager.cache_limit_bytes == 300 << 20
        manager.start_compile_service()
        assert manager.compile_service.cache_limit_bytes == 300 << 20
    finally:
        manager.close_compile_service()
    monkeypatch.delenv(COMPILE_CACHE_ENV)
    assert _manager().cache_limit_bytes == 256 << 20


def _worker(manager, spec_agent=None, need_output=True):
    from lmdeploy.pytorch.engine.executor.base_worker import WorkerWrapperBase
    worker = object.__new__(WorkerWrapperBase)  # no model: only the call under test
    worker.model_agent = types.SimpleNamespace(guided_decoding_manager=manager, spec_agent=spec_agent,
                                               need_output=need_output)
    return worker


def test_the_rank_call_never_raises_and_a_rank_without_grammar_state_compiles_nothing():
    # an exception in a call without an answer would end the rank process (and the engine with it)
    class Failing:

        def precompile(self, response_format, session_id=None):
            raise RuntimeError('the compile service is gone')

    records = _Records()
    logger = logging.getLogger('lmdeploy')
    logger.addHandler(records)
    try:
        _worker(Failing()).precompile_grammar(FMT, 7)
    finally:
        logger.removeHandler(records)
    assert any('the compile service is gone' in m for m in records.messages), records.messages
    # a rank that builds no matcher compiles nothing: without speculative decoding one that does not sample, with it
    # one that does not sample beside a draft model that drafts without the grammar
    sent = []
    manager = types.SimpleNamespace(precompile=lambda *args: sent.append(args))
    _worker(manager, types.SimpleNamespace(guided_spec=None), need_output=False).precompile_grammar(FMT, 7)
    _worker(manager, need_output=False).precompile_grammar(FMT, 7)
    _worker(manager, types.SimpleNamespace(guided_spec=object(), _keeps_grammar=False)).precompile_grammar(FMT, 7)
    assert sent == []
    # (drafts that depend on the grammar: every rank keeps it, also one that does not sample); with the session
    # that holds it
    _worker(manager, types.SimpleNamespace(guided_spec=object(), _keeps_grammar=True),
            need_output=False).precompile_grammar(FMT, 7)
    _worker(manager, types.SimpleNamespace(guided_spec=None)).precompile_grammar(FMT, 8)
    _worker(manager).precompile_grammar(FMT)
    assert sent == [(FMT, 7), (FMT, 8), (FMT, None)]


def test_a_rank_that_builds_matchers_starts_its_compile_service_with_the_rank():
    """A rank's compile service started with the first grammar: its processes took seconds to start, and the step
    waited for them (the first guided request paused the group's streams for longer than a compile). Now ``warmup``
    starts it on a rank that builds matchers, on no other, and a failure there is a warning, not a dead rank."""
    started = []
    manager = types.SimpleNamespace(start_precompile_service=lambda: started.append(True))
    agent = types.SimpleNamespace(warmup=lambda: None, guided_decoding_manager=manager, spec_agent=None,
                                  need_output=False)
    worker = _worker(manager, need_output=False)
    worker.model_agent = agent
    worker.warmup()
    assert started == []
    agent.need_output = True
    worker.warmup()
    assert started == [True]

    def fails():
        raise RuntimeError('no process could start')

    manager.start_precompile_service = fails
    records = _Records()
    logger = logging.getLogger('lmdeploy')
    logger.addHandler(records)
    try:
        worker.warmup()
    finally:
        logger.removeHandler(records)
    assert any('no process could start' in m for m in records.messages), records.messages
    # the real manager: the service of a rank's precompiles, started once
    real = _manager()
    try:
        real.start_precompile_service()
        service = real.compile_service
        assert service is not None and service.slow_queued == float('inf') and real.compiles_ahead
        real.precompile(FMT)
        assert real.compile_service is service
    finally:
        real.close_compile_service()


@pytest.mark.parametrize('executor', ['mp', 'ray'])
def test_the_engine_sends_the_grammar_to_its_ranks_without_waiting_for_an_answer(executor):
    """The mp executor's first rank answers the model's outputs on the same channel: the call asks no answer there
    (``return_mask=0``); ray's ``collective_rpc_async`` has no such parameter. Only an executor without a model agent
    of its own (ranks in other processes) is sent anything."""
    from lmdeploy.pytorch.engine.engine import Engine
    calls = []

    class MP:

        async def collective_rpc_async(self, method, args=None, kwargs=None, receiver_mask=0xff, return_mask=0xff):
            calls.append((method, args, return_mask))

    class Ray:

        async def collective_rpc_async(self, method, args=None, kwargs=None):
            calls.append((method, args, None))

    engine = object.__new__(Engine)  # no model: only the methods under test
    engine.executor = MP() if executor == 'mp' else Ray()
    engine._rank_compile_tasks = set()
    engine._rank_compile_options = None

    engine._compiling_requests = {6: object()}

    async def main():
        engine._precompile_on_ranks(FMT, 5)
        # from the thread that compiled the grammar: held for a request that still waits for it, for none where the
        # request was stopped meanwhile (its end may have reached the ranks already: a hold then would never go)
        engine._precompile_compiling(FMT, 6)
        engine._precompile_compiling(FMT, 7)
        await asyncio.sleep(0.01)
        assert not engine._rank_compile_tasks

    asyncio.run(main())
    mask = 0 if executor == 'mp' else None
    assert calls == [('precompile_grammar', (FMT, 5), mask), ('precompile_grammar', (FMT, 6), mask),
                     ('precompile_grammar', (FMT, None), mask)]


def test_a_grammar_the_engine_refuses_at_once_is_not_sent_to_the_ranks():
    """A grammar refused within the last minutes is answered at once by the engine's compile service: the ranks are
    not asked to compile it again. One compiled before is sent with the request's session, which holds it on each
    rank; one compiled now too."""
    import concurrent.futures
    import threading

    from lmdeploy.pytorch.engine.engine import Engine
    engine = object.__new__(Engine)  # no model: only the method under test
    engine.executor = types.SimpleNamespace()  # no model agent of its own: ranks in other processes
    posted = []
    loop = types.SimpleNamespace(call_soon_threadsafe=lambda callback, *args: posted.append(args))
    done = concurrent.futures.Future()
    done.set_result('a grammar')
    engine.guided_decoding_manager = types.SimpleNamespace(compile_async=lambda response_format: done)
    assert engine._check_and_compile(FMT, loop, 3) == 'a grammar'
    assert posted == [(FMT, 3)]
    refused = concurrent.futures.Future()
    refused.set_exception(ValueError('refused a minute ago'))
    engine.guided_decoding_manager = types.SimpleNamespace(compile_async=lambda response_format: refused)
    with pytest.raises(ValueError, match='a minute ago'):
        engine._check_and_compile(FMT, loop, 4)
    assert posted == [(FMT, 3)]
    pending = concurrent.futures.Future()
    threading.Timer(0.2, pending.set_result, args=('compiled now', )).start()
    engine.guided_decoding_manager = types.SimpleNamespace(compile_async=lambda response_format: pending)
    assert engine._check_and_compile(FMT, loop, 5) == 'compiled now'
    assert posted == [(FMT, 3), (FMT, 5)]
