"""Stream ordering on a real GPU: the grammar worker reads device token ids only after the kernel that writes them.

The engine thread runs on a side stream (lmdeploy runs its loop under ``torch.cuda.stream(...)``), where a kernel
that sleeps delays the write of the ids; the core gets the ids right after the launch and its worker thread, on a
stream of its own, reads them later. The CPU tests check this with a test double (tests/unit/test_ordering.py);
here the device, the streams and the events are real. A control read on another thread without the event sees the
placeholder (or whatever the memory held), not the ids: the delay is long enough for a missing wait to matter.
"""
import threading

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, testing
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.ordering import record_ready

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason='CUDA is not available')]

NAME = 'llama3'
PLACEHOLDER = -7
#: GPU clock cycles the producing stream sleeps before it writes the ids (tens of milliseconds on an H100)
SLEEP_CYCLES = 100_000_000
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
INSTANCE = '{"name": "ann"}'


@pytest.fixture(scope='module')
def grammar():
    compiler = testing.grammar_compiler(NAME)
    tokens = testing.load_tokenizer(NAME).encode(INSTANCE, add_special_tokens=False)
    return compiler.compile_json_schema(SCHEMA), tokens


@pytest.fixture
def worker():
    worker = GrammarWorker()
    yield worker
    worker.shutdown()


def _delayed_write(values: list[list[int]]) -> torch.Tensor:
    """On the current (side) stream: sleep, then write ``values`` into fresh device ids; returns at once."""
    # page-locked before the sleep is queued: allocating page-locked memory may wait for the device, which would
    # end the delay early
    source = torch.tensor(values, dtype=torch.long).pin_memory()
    ids = torch.full((len(values), len(values[0])), PLACEHOLDER, dtype=torch.long, device='cuda')
    torch.cuda._sleep(SLEEP_CYCLES)
    ids.copy_(source, non_blocking=True)
    return ids


def _unordered_read(ids: torch.Tensor) -> list:
    """What a thread that does not wait for the producing stream reads (its own default stream)."""
    out = []
    thread = threading.Thread(target=lambda: out.append(ids.tolist()))
    thread.start()
    thread.join()
    return out[0]


def test_the_delay_is_visible_to_an_unordered_read(grammar):
    _, tokens = grammar
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ids = _delayed_write([tokens[:2]])
        seen = _unordered_read(ids)
    side.synchronize()
    assert seen != [tokens[:2]], 'the write was not delayed: this test proves nothing here'
    assert ids.tolist() == [tokens[:2]]


def test_draft_advance_reads_the_ids_after_their_kernel(grammar, worker):
    compiled, tokens = grammar
    vocab = testing.TOKENIZERS[NAME].model_vocab_size
    window = DraftGrammar({0: xgr.GrammarMatcher(compiled)}, 1, vocab, 3, worker=worker, pin_memory=True)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for position in range(3):
            window.mask_logits_(torch.zeros(1, vocab, device='cuda'))
            # the ready event is recorded here, on the side stream, after the delayed write
            window.advance(_delayed_write([[tokens[position]]]))
        window.wait()
    assert window.drafts[0] == tokens[:3] and not window.dead


def test_commit_async_reads_the_accepted_ids_after_their_kernel(grammar, worker):
    compiled, tokens = grammar
    manager = SpecGrammarManager(testing.TOKENIZERS[NAME].model_vocab_size, worker=worker, pin_memory=True)
    matcher = xgr.GrammarMatcher(compiled)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        ids = _delayed_write([tokens[:4]])
        future = manager.commit_async({0: matcher}, ids, ready=record_ready(ids))
    assert future.result() == {0: 4}
    assert manager.pop_failures() == {}
