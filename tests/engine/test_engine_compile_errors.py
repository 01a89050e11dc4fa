"""What the engine answers a request whose grammar its own compile service fails, and the HTTP status the server
makes of it: the installed lmdeploy's ``Engine._grammar_ready`` with a real ``GuidedDecodingManager`` and its
compile service, without a model.

The server's entry check only parses a grammar, in a checker of its own; the engine compiles it, in another
service, and probes its masks. That service can be busy when the checker was not: as many grammars that look slow
to parse wait there already (``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``). The request is then the server's to serve later
(HTTP 429, as the entry check answers the same state), not one the server will never serve (HTTP 400, which a
client does not send again): lmdeploy 0.18.0 and 0.14.0 answered 400."""
import asyncio
import concurrent.futures
import time
import types

import pytest

from lmdeploy_guided_spec.compile import COMPILE_TIMEOUT_ENV, SLOW_QUEUED_ENV
from lmdeploy_guided_spec.errors import GrammarCompileBusy
from lmdeploy_guided_spec.testing import load_tokenizer, tokenizer_info

pytestmark = pytest.mark.engine


def _slow(count: int) -> dict:
    """A response_format that looks slow to parse (a counted repetition), and parses in about a second."""
    return {'type': 'json_schema', 'json_schema': {'name': f'slow{count}', 'schema': {
        'type': 'string', 'pattern': f'^[a-z]{{1,{count}}}$'}}}


def _http_status(status, message: str) -> int:
    """The HTTP status the installed lmdeploy's server answers a request the engine failed with ``status``."""
    from lmdeploy.serve.core import async_engine
    if hasattr(async_engine, 'error_status_code'):  # 0.14.0 (patch 0080)
        return async_engine.error_status_code(status)
    return async_engine.AsyncEngine._request_error_from_status(status, message).status_code


def _engine(manager):
    """An Engine without a model: its compile path, and what it answered."""
    from lmdeploy.pytorch.engine.engine import Engine
    engine = object.__new__(Engine)
    answered = []
    engine.guided_decoding_manager = manager
    engine.executor = types.SimpleNamespace(model_agent=None)  # ranks in this process: nothing to send them
    engine._grammar_executor = concurrent.futures.ThreadPoolExecutor(2)
    engine._compiling_requests = {}
    engine._response = lambda resp, status, data=None, err_msg='': answered.append((resp, status, err_msg))
    return engine, answered


async def _answer(engine, req) -> bool:
    """``_grammar_ready`` of ``req`` until its compile has ended: whether the request goes on."""
    requeued = asyncio.Event()
    engine._requeue_compiled = lambda _: requeued.set()
    if engine._grammar_ready(req):
        return True
    await asyncio.wait_for(requeued.wait(), 120)
    return engine._grammar_ready(req)


def test_a_busy_compile_service_of_the_engine_is_http_429(monkeypatch):
    from lmdeploy.messages import ResponseType
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    monkeypatch.setenv(SLOW_QUEUED_ENV, '1')
    monkeypatch.setenv(COMPILE_TIMEOUT_ENV, '60')
    manager = GuidedDecodingManager(load_tokenizer('llama3'), tokenizer_info('llama3').vocab_size)
    manager.start_compile_service()
    engine, answered = _engine(manager)
    try:
        # grammars that take minutes to parse (each held a minute by the limit), until the service has taken two
        # and refuses the next: as many requests wait for such grammars as it lets wait, whether in its queue or
        # in its processes
        taken = 0
        for count in range(40_000, 40_020):
            future = manager.compile_async(_slow(count))
            if not future.done():
                taken += 1
            elif isinstance(future.exception(), GrammarCompileBusy) and taken >= 2:
                break
            time.sleep(1)
        else:
            raise AssertionError('the compile service took 20 grammars slow to parse')
        req = types.SimpleNamespace(resp='resp 1', data={'session_id': 1, 'sampling_param': types.SimpleNamespace(
            response_format=_slow(3_000))})
        assert not asyncio.run(_answer(engine, req))
        (resp, status, message), = answered
        assert resp == 'resp 1' and 'wait already' in message, answered
        assert _http_status(status, message) == 429, (status, message)
        # a grammar the engine will not serve is still the request's problem
        answered.clear()
        bad = {'type': 'regex_schema', 'regex_schema': '[a-'}
        req = types.SimpleNamespace(resp='resp 2', data={'session_id': 2, 'sampling_param': types.SimpleNamespace(
            response_format=bad)})
        assert not asyncio.run(_answer(engine, req))
        (resp, status, message), = answered
        assert status == ResponseType.NOT_SUPPORTED and _http_status(status, message) == 400, answered
    finally:
        engine._grammar_executor.shutdown(wait=False, cancel_futures=True)
        manager.close_compile_service()
