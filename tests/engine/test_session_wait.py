"""A request's wait for a free inference instance (lmdeploy's ``Session.request_handle``, patch 0047 of 0.18.0 and
0060 of 0.14.0), driven directly: every instance is held, the bound request waits, an abort ends the wait; a
request whose client goes away is cancelled, not failed."""
import asyncio
import logging

import pytest

pytestmark = pytest.mark.engine


class _Handle:
    def __init__(self):
        self.cancelled = []

    async def async_cancel(self, session_id):
        self.cancelled.append(session_id)


class _Engine:
    def create_instance(self):
        return _Handle()


def test_a_client_that_leaves_as_its_abort_is_answered_returns_every_instance():
    """The abort ends the wait with no instance; ``generate`` answers 'abort' inside ``request_handle``, and a
    client that goes away at that moment closes the generator there. That cancelled through the instance the
    request never got (AttributeError on ``None``); now the request ends cleanly and the pool keeps its instance."""
    from lmdeploy.serve.managers.session_manager import SessionManager

    async def main():
        mgr = SessionManager()
        mgr.build_request_handle_pool(_Engine(), 1)
        held = await mgr.request_handle_pool.get()
        session = mgr.get()
        session.bind_request()

        async def generate():
            async with session.request_handle(abortable=True) as handle:
                yield handle

        gen = generate()
        first = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0.05)
        assert not first.done(), 'the request did not wait for the held instance'
        await session.async_abort()
        assert await asyncio.wait_for(first, 5) is None and session.abort_requested
        await gen.aclose()  # the client goes away as the abort is answered
        assert session._handle is None and held.cancelled == []
        mgr.request_handle_pool.put(held)
        assert mgr.request_handle_pool.pool.qsize() == 1
        # the next request of the session gets the instance
        async with session.request_handle(abortable=True) as handle:
            assert handle is held

    asyncio.run(main())


def test_a_client_that_leaves_while_its_request_waits_leaves_no_session_behind():
    """Every instance busy, a request waits for one and its client goes away (the generator is closed, the task
    cancelled): the session is released as after any request (unbound, removed from the manager where the request
    asked for it), and the pool is whole. The cancellation came out of the wait before ``request_handle``'s cleanup:
    the session stayed in the manager, bound, one per client that gave up in a queue."""
    from lmdeploy.serve.managers.session_manager import SessionManager

    async def main():
        mgr = SessionManager()
        mgr.build_request_handle_pool(_Engine(), 1)
        held = await mgr.request_handle_pool.get()
        for how in ('cancel', 'aclose'):
            session = mgr.get()
            session.bind_request()
            session._remove_on_request_exit = True  # as AsyncEngine.generate asks

            async def generate(session):
                async with session.request_handle(abortable=True) as handle:
                    yield handle

            gen = generate(session)
            first = asyncio.ensure_future(gen.__anext__())
            await asyncio.sleep(0.05)
            assert not first.done(), 'the request did not wait for the held instance'
            first.cancel()
            with pytest.raises(asyncio.CancelledError):
                await first
            if how == 'aclose':
                await gen.aclose()
            assert session.session_id not in mgr.sessions, how
            assert not session._request_bound and session._handle is None, how
        mgr.request_handle_pool.put(held)
        assert mgr.request_handle_pool.pool.qsize() == 1

    asyncio.run(main())


class _Records(logging.Handler):

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


@pytest.mark.parametrize('how', ['cancelled', 'closed'])
def test_a_request_whose_client_went_away_is_no_error_in_the_log(how):
    """A client that disconnects while its request holds an inference instance cancels the request's task (or
    closes its stream's generator): ``request_handle`` cancels the request in the engine and gives the instance back,
    but it logged the cancel as an ERROR with a traceback (patch 0083 of 0.18.0, 0082 of 0.14.0). Random traffic
    against a ``--tp 2`` server of 0.14.0 left one per 200 requests (a client gone while its request's
    ``async_end`` was answered), each reading like an engine failure to whoever watches the log."""
    from lmdeploy.serve.managers.session_manager import SessionManager
    manager = SessionManager()
    manager.build_request_handle_pool(_Engine(), 1)
    session = manager.get(7)
    records = _Records()
    logger = logging.getLogger('lmdeploy')
    logger.addHandler(records)

    async def request():
        async with session.request_handle() as handle:
            await asyncio.sleep(3600)  # the client goes away meanwhile
        return handle

    async def main():
        if how == 'cancelled':  # the server cancels the request's task (a non-streamed request)
            task = asyncio.ensure_future(request())
            await asyncio.sleep(0.05)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        else:  # the stream's generator is closed (a streamed request)

            async def stream():
                async with session.request_handle():
                    yield 'chunk'
                    await asyncio.sleep(3600)

            gen = stream()
            await gen.__anext__()
            await gen.aclose()
        instance = manager.request_handle_pool.handles[0]
        # the engine cancelled the request, and the instance is back in the pool
        assert instance.cancelled == [7], instance.cancelled
        assert manager.request_handle_pool.num_dispatched == 0

    try:
        asyncio.run(main())
    finally:
        logger.removeHandler(records)
    errors = [f'{r.levelname} {r.getMessage()}' for r in records.records
              if r.levelno >= logging.WARNING or r.exc_info]
    assert not errors, errors
