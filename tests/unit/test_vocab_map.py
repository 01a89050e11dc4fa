"""Eagle3-style draft vocabularies: target bitmask -> draft mask, on real grammar states."""
import pytest
import torch

from lmdeploy_guided_spec import DraftVocabMap, SpecGrammarManager, VocabMapError, testing, unpack_bitmask
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.step import fill_bitmask

from grammars import INSTANCES, SCHEMAS, compile_schema, dumps, new_matcher

pytestmark = pytest.mark.unit

TARGET_VOCAB = 128256


def _random_map(draft_vocab, seed, must_have=()):
    """A draft vocabulary: a sorted random subset of target ids (as Eagle3 builds from token frequencies)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(TARGET_VOCAB, generator=g)[:draft_vocab]
    ids = torch.unique(torch.cat([ids, torch.tensor(list(must_have), dtype=torch.long)]))[:max(draft_vocab, 1)]
    return torch.sort(ids).values


@pytest.mark.parametrize('draft_vocab', [817, 32000])
@pytest.mark.parametrize('schema', sorted(SCHEMAS))
def test_translation_is_exact_on_grammar_states(llama3, draft_vocab, schema):
    compiled = compile_schema(llama3, SCHEMAS[schema])
    path = testing.load_tokenizer(llama3).encode(dumps(INSTANCES[schema][0]), add_special_tokens=False)
    vmap = DraftVocabMap(_random_map(draft_vocab, seed=len(schema), must_have=path), TARGET_VOCAB)
    m = new_matcher(compiled)
    for token in path:
        target_bitmask = fill_bitmask({0: m}, 1, TARGET_VOCAB)
        target_allowed = unpack_bitmask(target_bitmask, TARGET_VOCAB)[0]
        draft_allowed = vmap.draft_allowed(target_bitmask)[0]
        # never admits a draft id whose target id is masked, and keeps every allowed id the draft vocab has
        assert torch.equal(draft_allowed, target_allowed[vmap.target_ids])
        packed = unpack_bitmask(vmap.draft_bitmask(target_bitmask), vmap.draft_vocab_size)[0]
        assert torch.equal(packed, draft_allowed)
        assert m.accept_token(token)


def test_masked_eagle3_drafts_are_valid_target_tokens(llama3):
    compiled = compile_schema(llama3, SCHEMAS['enum_prefixes'])
    tok = testing.load_tokenizer(llama3)
    path = tok.encode(dumps(INSTANCES['enum_prefixes'][0]), add_special_tokens=False)
    ids = _random_map(4096, seed=7, must_have=path)
    mgr = SpecGrammarManager(TARGET_VOCAB)
    draft = mgr.begin_draft({0: new_matcher(compiled)}, 2, 10, draft_id_to_target_id=ids)
    assert isinstance(draft, DraftGrammar) and draft.vocab_map is mgr.vocab_map(ids)
    chosen = []
    for _ in range(10):
        logits = torch.randn(2, ids.numel())
        row1 = logits[1].clone()
        draft.mask_logits_(logits)
        assert torch.equal(logits[1], row1)
        target_ids = ids[logits.argmax(-1, keepdim=True)]
        draft.advance(target_ids)
        chosen.append(int(target_ids[0]))
        if 0 in draft.dead:
            break
    fresh = new_matcher(compiled)
    assert all(fresh.accept_token(t) for t in chosen)


def test_map_errors_name_the_fix():
    with pytest.raises(VocabMapError, match='absolute target ids'):
        DraftVocabMap(torch.tensor([0, 5, TARGET_VOCAB]), TARGET_VOCAB)
    with pytest.raises(VocabMapError, match='1-D'):
        DraftVocabMap(torch.zeros(2, 2, dtype=torch.long), TARGET_VOCAB)
    vmap = DraftVocabMap(torch.arange(100), TARGET_VOCAB)
    with pytest.raises(VocabMapError, match='100 rows'):
        vmap.mask_draft_logits_(torch.randn(1, 99), torch.full((1, 4008), -1, dtype=torch.int32))


@pytest.mark.parametrize('draft_vocab', [817, 32000])
def test_sparse_draft_masks_translate_on_the_worker(llama3, draft_vocab, monkeypatch):
    """With masks in index form (the CPU path), a draft-vocabulary window masks draft logits exactly as the dense
    translation does, and the engine thread never translates (the worker built the draft masks)."""
    compiled = compile_schema(llama3, SCHEMAS['enum_prefixes'])
    path = testing.load_tokenizer(llama3).encode(dumps(INSTANCES['enum_prefixes'][0]), add_special_tokens=False)
    ids = _random_map(draft_vocab, seed=3, must_have=path)
    k = 6
    dense = SpecGrammarManager(TARGET_VOCAB, sparse_masks=False).begin_draft(
        {0: new_matcher(compiled), 2: new_matcher(compiled)}, 3, k, draft_id_to_target_id=ids)
    sparse_mgr = SpecGrammarManager(TARGET_VOCAB, sparse_masks=True)
    sparse = sparse_mgr.begin_draft({0: new_matcher(compiled), 2: new_matcher(compiled)}, 3, k,
                                    draft_id_to_target_id=ids)
    translated = []
    original = DraftVocabMap.mask_draft_logits_
    monkeypatch.setattr(DraftVocabMap, 'mask_draft_logits_',
                        lambda self, *a: translated.append(1) or original(self, *a))
    g = torch.Generator().manual_seed(0)
    for position in range(k):
        logits = torch.randn(4, ids.numel(), generator=g)  # one padding row past the batch
        expect = dense.mask_logits_(logits.clone())[[0, 2]]
        before = len(translated)
        got = sparse.mask_logits_(logits.clone())
        assert len(translated) == before, 'the engine thread translated a draft mask'
        assert torch.equal(got[[0, 2]], expect)
        assert torch.equal(got[[1, 3]], logits[[1, 3]])
        # row 0 follows the instance, row 2 the draft model's masked greedy choice
        step = torch.stack([torch.tensor(path[position]), ids[got[2].argmax()]]).view(2, 1)
        chosen = torch.tensor([[int(step[0])], [0], [int(step[1])]])
        dense.advance(chosen)
        sparse.advance(chosen.clone())
    assert len(translated) == k  # the dense window's, counted to show that the check sees a translation
    dense.wait()
    sparse.wait()
    assert torch.equal(unpack_bitmask(sparse.masks.view(3 * (k + 1), -1), TARGET_VOCAB),
                       unpack_bitmask(dense.masks.view(3 * (k + 1), -1), TARGET_VOCAB))
