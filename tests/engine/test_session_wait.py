"""A request's wait for a free inference instance (lmdeploy's ``Session.request_handle``, patch 0047 of 0.18.0 and
0060 of 0.14.0), driven directly: every instance is held, the bound request waits, an abort ends the wait."""
import asyncio

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
