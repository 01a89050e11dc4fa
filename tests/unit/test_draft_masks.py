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
    returns at once and leaves the draft logits as they were, and the window's mask buffer is not allocated on the
    engine thread. Once the worker is free, the verification masks are those of a window whose drafts were masked,
    bit for bit."""
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
        assert window.masks is None, 'the mask buffer is allocated (and written) on the worker, not here'
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
    assert window.masks.shape[:2] == (3, K + 1)

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
@pytest.mark.parametrize('draft_model', [True, False, None], ids=['draft-model', 'draft-free', 'not-known'])
def test_free_drafts_of_a_draft_model_keep_no_grammar_bookkeeping(draft_masks, draft_model):
    """The rank that samples always keeps the grammar; a tensor-parallel rank that does not sample keeps it where
    its drafts depend on it (masked draft logits, drafts the grammar makes, or the engine did not say), and not
    where a draft model drafts freely. There the commits also keep no guess histories and no jump-forward memo
    (nothing drafts from them), and the masks they commit under stay what they were."""
    manager = SpecGrammarManager(testing.TOKENIZERS[NAME].model_vocab_size, worker=GrammarWorker(inline=True),
                                 tokenizer=testing.load_tokenizer(NAME), tokenizer_info=testing.tokenizer_info(NAME),
                                 draft_masks=draft_masks, draft_model=draft_model)
    free = draft_model is True and not draft_masks
    assert manager.keeps_grammar(samples=True)
    assert manager.keeps_grammar(samples=False) is not free
    assert (manager.guesses is None) is free and (manager.jumps is None) is free
    assert (manager.forced_tokenizer is None) is free

    matchers, reference = _committed(), _committed()
    tokens = _instance_tokens()
    for start in range(0, 12, K + 1):
        manager.commit(matchers, [tokens[start:start + K + 1]] * 3)
        for matcher in reference.values():
            assert all(matcher.accept_token(t) for t in tokens[start:start + K + 1])
        expected = SpecGrammarManager(manager.vocab_size, worker=GrammarWorker(inline=True))
        assert torch.equal(manager.next_token_bitmask(matchers, 3), expected.next_token_bitmask(reference, 3))
    assert (manager.guesses is None or manager.guesses.num_histories == len(matchers))
