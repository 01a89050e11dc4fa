"""Host reads of device token ids on the grammar worker wait for the event the engine recorded after writing them.

The engine launches the kernel that writes draft or accepted token ids on its stream and hands the ids to the core
at once; the worker thread reads them later, on a stream of its own. A test double stands in for the device: token
ids whose host reads raise unless their event was waited on first, and an event that completes only when the test
says the kernel is done.
"""
import functools
import threading

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, testing, verification_bitmask
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.ordering import PromptIds, host_lists, record_ready

from grammars import INSTANCES, SCHEMAS, compile_schema, dumps

pytestmark = pytest.mark.unit

NAME = 'llama3'
V = testing.TOKENIZERS[NAME].model_vocab_size

_HOST_READS = {torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__int__,
               torch.Tensor.__index__, torch.Tensor.__float__, torch.Tensor.__bool__, torch.Tensor.__iter__}


class UnorderedRead(AssertionError):
    """The core read device token ids before waiting for the kernel that writes them."""


class KernelEvent:
    """A stand-in for ``torch.cuda.Event``: ``synchronize`` blocks until the test completes the 'kernel'."""

    def __init__(self):
        self.waited = False
        self._done = threading.Event()

    def complete(self):
        self._done.set()

    def synchronize(self):
        assert self._done.wait(10), 'the kernel never completed'
        self.waited = True


class DeviceIds(torch.Tensor):
    """Token ids 'on a device': a host read before their event's ``synchronize`` raises :class:`UnorderedRead`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        owner = next((a for a in args if isinstance(a, DeviceIds)), None)
        event = getattr(owner, 'event', None)
        if func in _HOST_READS and event is not None and not event.waited:
            raise UnorderedRead(f'{func.__name__} of token ids before their ready event was waited on')
        out = super().__torch_function__(func, types, args, kwargs or {})
        if isinstance(out, DeviceIds):
            out.event = event
        return out


def _device_ids(shape):
    """Placeholder ids the 'kernel' overwrites later, and the event recorded after that kernel."""
    ids = torch.full(shape, -7, dtype=torch.long).as_subclass(DeviceIds)
    ids.event = KernelEvent()
    return ids, ids.event


def _kernel_writes(ids, values):
    """The producing kernel runs after the core took the ids: write them, then complete the event."""
    torch.Tensor.copy_(ids, torch.tensor(values, dtype=torch.long))
    ids.event.complete()


def _path():
    return testing.load_tokenizer(NAME).encode(dumps(INSTANCES['person'][0]), add_special_tokens=False)


@pytest.fixture(params=[True, False], ids=['terminating', 'plain'])
def new_matcher(request):
    # lmdeploy 0.14 builds its matchers with terminate_without_stop_token=True, lmdeploy 0.15+ without
    return functools.partial(xgr.GrammarMatcher, terminate_without_stop_token=request.param)


@pytest.fixture
def compiled():
    return compile_schema(NAME, SCHEMAS['person'])


@pytest.fixture
def worker():
    worker = GrammarWorker()
    yield worker
    worker.shutdown()


def test_the_double_catches_an_unordered_read():
    ids, _ = _device_ids((1, 2))
    with pytest.raises(UnorderedRead):
        ids.tolist()
    with pytest.raises(UnorderedRead):
        host_lists(ids)


def test_commit_async_reads_accepted_ids_after_their_kernel(compiled, worker, new_matcher):
    path = _path()
    manager = SpecGrammarManager(V, worker=worker)
    matchers = {0: new_matcher(compiled)}
    ids, event = _device_ids((1, 4))
    future = manager.commit_async(matchers, ids, ready=event)
    _kernel_writes(ids, [path[:4]])
    assert future.result() == {0: 4}
    assert event.waited and manager.pop_failures() == {}


def test_commit_reads_after_the_event(compiled, new_matcher):
    ids, event = _device_ids((1, 3))
    _kernel_writes(ids, [_path()[:3]])
    manager = SpecGrammarManager(V, worker=GrammarWorker(inline=True))
    assert manager.commit({0: new_matcher(compiled)}, ids, ready=event) == {0: 3}
    assert event.waited


def test_draft_advance_reads_chosen_ids_after_their_kernel(compiled, worker, new_matcher):
    path = _path()
    window = DraftGrammar({0: new_matcher(compiled)}, 1, V, 2, worker=worker)
    for position in range(2):
        window.mask_logits_(torch.zeros(1, V))
        ids, event = _device_ids((1, 1))
        window.advance(ids, ready=event)
        _kernel_writes(ids, [[path[position]]])
        window.wait()
        assert event.waited
    assert window.drafts[0] == path[:2] and not window.dead


def test_forced_draft_advance_orders_the_worker_after_its_override(llama3, worker, new_matcher):
    """With forced drafts the engine thread overwrites the ids first; the worker still reads after the event."""
    import json
    tok = testing.load_tokenizer(llama3)
    compiled = testing.grammar_compiler(llama3).compile_json_schema(json.dumps(SCHEMAS['person']),
                                                                    any_whitespace=False)
    manager = SpecGrammarManager(V, worker=worker, tokenizer=tok, tokenizer_info=testing.tokenizer_info(llama3))
    window = manager.begin_draft({0: new_matcher(compiled)}, 1, 1)
    window.mask_logits_(torch.zeros(1, V))
    ids, event = _device_ids((1, 1))
    event.complete()
    window.advance(ids, ready=event)
    window.wait()
    assert event.waited
    assert window.drafts[0] == [window.forced_tokens(0)[0]] == [ids[0, 0].item()]


def test_verification_bitmask_reads_drafts_after_their_kernel(compiled, worker, new_matcher):
    path = _path()
    matchers = {0: new_matcher(compiled)}
    manager = SpecGrammarManager(V, worker=worker, sparse_masks=False)
    ids, event = _device_ids((1, 3))
    done = threading.Timer(0.05, _kernel_writes, (ids, [path[:3]]))
    done.start()
    got = manager.verification_bitmask(matchers, ids, ready=event)
    done.join()
    assert event.waited
    assert torch.equal(got, verification_bitmask(matchers, [path[:3]], V))


def test_step_functions_take_ready(compiled, new_matcher):
    from lmdeploy_guided_spec import commit
    path = _path()
    ids, event = _device_ids((1, 3))
    _kernel_writes(ids, [path[:3]])
    reference = verification_bitmask({0: new_matcher(compiled)}, [path[:3]], V)
    assert torch.equal(verification_bitmask({0: new_matcher(compiled)}, ids, V, ready=event), reference)
    ids, event = _device_ids((1, 3))
    _kernel_writes(ids, [path[:3]])
    assert commit({0: new_matcher(compiled)}, ids, ready=event) == {0: 3}


def test_record_ready_is_none_for_host_tensors():
    assert record_ready(torch.zeros(2, dtype=torch.long)) is None
    assert record_ready([1, 2]) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason='needs CUDA')
def test_record_ready_records_on_the_current_stream():
    ids = torch.arange(4, device='cuda')
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        ids.add_(1)
        event = record_ready(ids)
    assert isinstance(event, torch.cuda.Event)
    event.synchronize()
    assert ids.tolist() == [1, 2, 3, 4]


def test_prompt_ids_are_read_after_their_copy(worker):
    """The prompt of a prefill (lmdeploy's flat layout) is split per row on the worker, after the ready event."""
    ids, event = _device_ids((1, 5))
    prompt = PromptIds(ids, torch.tensor([2, 3]), ready=event)
    rows = worker.submit(lambda: (len(prompt), prompt[0], prompt[1]))
    _kernel_writes(ids, [[11, 12, 13, 14, 15]])
    assert rows.result(10) == (2, [11, 12], [13, 14, 15]) and event.waited
    # without the event the read is unordered, and the double says so
    unordered, _ = _device_ids((1, 5))
    with pytest.raises(UnorderedRead):
        len(PromptIds(unordered, torch.tensor([5])))
