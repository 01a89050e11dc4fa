"""The patched SpecModelAgent orders every host read of device token ids after the kernel that writes them.

lmdeploy launches its kernels under ``torch.cuda.stream(...)``, and the current stream is per thread. The grammar
worker reads draft and accepted ids on its own thread, so the ready event it waits for must be recorded on the
thread that launched the producing kernel (the engine's), never on a worker thread whose current stream is
another (defect 3 of the issue "The engine never dies, never stalls, never drops the grammar").

The CPU path has no streams. This double gives each thread a stream of its own: ``record_ready`` returns an event
of the calling thread's stream, and a host read of token ids fails unless it waits for an event of the engine
thread. Removing the ordering from the series (or recording on another thread) makes these tests fail.
"""
import threading

import pytest
import torch

from lmdeploy_guided_spec import draft, manager, step, testing
from lmdeploy_guided_spec.ordering import host_lists
from lmdeploy_guided_spec.support.harness import GenRequest, SpecHarness, run_non_speculative

from grammars import INSTANCES, SCHEMAS
from models import DraftOverMap, PrefixLM, draft_map, instance_path

pytestmark = pytest.mark.engine

NAME = 'llama3'
V = 128256


class UnorderedRead(AssertionError):
    """Token ids read without waiting for an event of the stream (thread) that wrote them."""


class ThreadStreamEvent:
    """An event recorded on the current stream of the thread that created it."""

    def __init__(self):
        self.thread = threading.current_thread()

    def synchronize(self):
        pass


@pytest.fixture
def per_thread_streams(monkeypatch):
    """Install the double; yields the list of (thread that recorded the event or None) of every checked read."""
    import lmdeploy.pytorch.spec_decode.spec_agent as spec_agent
    engine_thread = threading.current_thread()  # the harness runs the engine's event loop on this thread
    reads = []

    def record_ready(tensor):
        return ThreadStreamEvent() if isinstance(tensor, torch.Tensor) else None

    def checked_host_lists(token_ids, ready=None):
        if isinstance(token_ids, torch.Tensor):
            reads.append(getattr(ready, 'thread', None))
            if ready is None or ready.thread is not engine_thread:
                where = 'no event' if ready is None else f'an event of thread {ready.thread.name}'
                raise UnorderedRead(f'token ids {tuple(token_ids.shape)} read after {where}, not after the engine '
                                    f'thread\'s')
        return host_lists(token_ids, ready)

    for module in (manager, draft, spec_agent):
        if hasattr(module, 'record_ready'):
            monkeypatch.setattr(module, 'record_ready', record_ready)
    for module in (manager, draft, step):
        monkeypatch.setattr(module, 'host_lists', checked_host_lists)
    return reads


def _json_schema(schema):
    return {'type': 'json_schema', 'json_schema': {'name': 'test', 'schema': schema}}


@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle3'])
def test_worker_reads_of_device_ids_wait_for_the_engine_threads_event(per_thread_streams, method):
    tok = testing.load_tokenizer(NAME)
    path = instance_path(NAME, INSTANCES['person'][0])
    target = PrefixLM(V, path, bias=9.0, seed=1)
    draft_model = PrefixLM(V, path, bias=4.0, seed=2)
    ids = None
    if method == 'eagle3':
        ids = draft_map(V, 8000, seed=3, must_have=path[::2])
        draft_model = DraftOverMap(draft_model, ids)
    formats = [_json_schema(SCHEMAS['person']), None]
    spec = [GenRequest(i + 1, f, 48, greedy=True, top_k=0, seed=100 + i) for i, f in enumerate(formats)]
    SpecHarness(tok, V, target, draft_model, method=method, num_spec_tokens=3,
                draft_id_to_target_id=ids).generate(spec)
    assert per_thread_streams, 'no host read of device token ids was checked'
    ref = [GenRequest(i + 1, f, 48, greedy=True, top_k=0, seed=100 + i) for i, f in enumerate(formats)]
    run_non_speculative(tok, V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
