"""Drafting without the grammar's masks (``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0``): the engine thread never waits for
the grammar worker while a draft model drafts, and verification is masked exactly as with masked drafts."""
import json
import threading
import time

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, testing, unpack_bitmask

from grammars import INSTANCES, SCHEMAS

pytestmark = pytest.mark.unit

NAME = 'llama3'
K = 3


def _manager(draft_masks: bool, sparse: bool, worker=None) -> SpecGrammarManager:
    return SpecGrammarManager(testing.TOKENIZERS[NAME].model_vocab_size, worker=worker or GrammarWorker(inline=True),
                              tokenizer=testing.load_tokenizer(NAME), tokenizer_info=testing.tokenizer_info(NAME),
                              sparse_masks=sparse, draft_masks=draft_masks)


def _committed() -> dict[int, xgr.GrammarMatcher]:
    compiled = testing.grammar_compiler(NAME).compile_json_schema(json.dumps(SCHEMAS['nested_order']))
    return {0: xgr.GrammarMatcher(compiled), 2: xgr.GrammarMatcher(compiled)}


def _instance_tokens() -> list[int]:
    text = json.dumps(INSTANCES['nested_order'][0])
    return testing.load_tokenizer(NAME).encode(text, add_special_tokens=False)


def _dense(manager, bitmask, matchers, rows: int):
    """The verification masks as booleans, whatever form the manager gives them in."""
    vocab = manager.vocab_size
    logits = manager.apply_(torch.zeros(rows * (K + 1), vocab), bitmask, matchers, K + 1)
    return torch.isfinite(logits)


@pytest.mark.parametrize('draft_vocab', [False, True], ids=['own-vocab', 'eagle3-map'])
@pytest.mark.parametrize('sparse', [True, False], ids=['sparse', 'dense'])
def test_free_drafting_never_waits_and_verification_is_masked_alike(sparse, draft_vocab):
    """The worker is held busy while the draft model drafts a whole window: every ``mask_logits_`` and ``advance``
    returns at once and leaves the draft logits as they were. Once the worker is free, the verification masks are
    those of a window whose drafts were masked, bit for bit."""
    vocab = testing.TOKENIZERS[NAME].model_vocab_size
    tokens = _instance_tokens()
    drafts = torch.tensor([tokens[:K], [7] * K, tokens[:K]])
    draft_map = torch.arange(0, vocab, 4) if draft_vocab else None
    width = vocab // 4 if draft_vocab else vocab

    worker = GrammarWorker()
    free = _manager(False, sparse, worker)
    hold = threading.Event()
    busy = worker.submit(hold.wait, 5.0)  # a drafting that waits is held 5 s, not forever
    try:
        committed = _committed()
        began = time.perf_counter()
        window = free.begin_draft(committed, 3, K, session_ids=[10, 11, 12], draft_id_to_target_id=draft_map)
        assert not window.forced, 'forced drafts wait for the position\'s mask: off with free drafts'
        for position in range(K):
            logits = torch.randn(3, width)
            before = logits.clone()
            assert window.mask_logits_(logits) is logits
            assert torch.equal(logits, before), 'the draft logits are not masked'
            window.advance(drafts[:, position:position + 1].clone())
        assert time.perf_counter() - began < 2.0, 'drafting waited for the busy worker'
        assert not busy.done()
    finally:
        hold.set()
    free_masks = _dense(free, free.verification_bitmask(committed, drafts, [10, 11, 12]), committed, 3)

    masked = _manager(True, sparse)
    committed = _committed()
    window = masked.begin_draft(committed, 3, K, session_ids=[10, 11, 12], draft_id_to_target_id=draft_map)
    for position in range(K):
        window.mask_logits_(torch.zeros(3, width))
        window.advance(drafts[:, position:position + 1].clone())
    masked_masks = _dense(masked, masked.verification_bitmask(committed, drafts, [10, 11, 12]), committed, 3)
    assert torch.equal(free_masks, masked_masks)
    assert not free_masks[:K + 1].all(), 'the guided rows are masked'
    assert free_masks[K + 1:2 * (K + 1)].all(), 'the unguided row is not'
    worker.shutdown()


def test_a_free_draft_the_grammar_rejects_is_rejected_at_verification():
    """Free drafts may break the grammar. The row's window ends at the first such draft: its position's mask is the
    grammar state after the drafts before it (so verification rejects it, and the token sampled there is valid), and
    the positions after it allow every token (they are never reached; a row without any allowed token would fail
    sampling for the whole batch)."""
    tokens = _instance_tokens()
    vocab = testing.TOKENIZERS[NAME].model_vocab_size
    bad = testing.load_tokenizer(NAME).encode('}', add_special_tokens=False)[0]
    manager = _manager(False, sparse=False)
    committed = {0: _committed()[0]}
    drafts = torch.tensor([[tokens[0], bad, tokens[2]]])
    window = manager.begin_draft(committed, 1, K, session_ids=[5])
    for position in range(K):
        window.mask_logits_(torch.zeros(1, vocab))
        window.advance(drafts[:, position:position + 1].clone())
    allowed = _dense(manager, manager.verification_bitmask(committed, drafts, [5]), committed, 1)
    assert allowed[0, tokens[0]] and not allowed[0].all()
    assert not allowed[1, bad], 'verification rejects the draft the grammar rejects'
    reference = _committed()[0]
    assert reference.accept_token(tokens[0])
    expected = torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    reference.fill_next_token_bitmask(expected, 0)
    assert torch.equal(allowed[1], unpack_bitmask(expected, vocab)[0]), 'the state after the accepted draft'
    assert allowed[2:].all(), 'positions after the rejected draft allow every token'


@pytest.mark.parametrize('draft_masks', [True, False], ids=['masked', 'free'])
def test_which_ranks_keep_grammar_state(draft_masks):
    """The rank that samples always keeps the grammar; a tensor-parallel rank that does not sample keeps it where
    its drafts depend on it (masked draft logits, drafts the grammar makes), and not where a draft model drafts
    freely."""
    manager = _manager(draft_masks, sparse=True)
    assert manager.keeps_grammar(samples=True, draft_model=True)
    assert manager.keeps_grammar(samples=True, draft_model=False)
    assert manager.keeps_grammar(samples=False, draft_model=False)
    assert manager.keeps_grammar(samples=False, draft_model=True) is draft_masks
