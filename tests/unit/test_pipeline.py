"""Verification masks reused from drafting windows are bit-identical to the per-position reference."""
import functools
import random

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, apply_bitmask_, testing, verification_bitmask

from grammars import INSTANCES, REGEX_INSTANCES, REGEXES, SCHEMAS, compile_regex, compile_schema, dumps

pytestmark = pytest.mark.unit


@pytest.fixture(params=[True, False], ids=['terminating', 'plain'])
def new_matcher(request):
    # lmdeploy 0.14 builds its matchers with terminate_without_stop_token=True, lmdeploy 0.15+ without
    return functools.partial(xgr.GrammarMatcher, terminate_without_stop_token=request.param)


NAME, V = 'qwen3', 151936


def _path(text):
    return testing.load_tokenizer(NAME).encode(text, add_special_tokens=False)


def _grammars():
    out = [(compile_schema(NAME, SCHEMAS[s]), _path(dumps(INSTANCES[s][0]))) for s in sorted(SCHEMAS)]
    out += [(compile_regex(NAME, REGEXES[r]), _path(REGEX_INSTANCES[r][-1])) for r in sorted(REGEXES)]
    return out


def _drafts(rng, path, start, k, eos):
    """A draft window: mostly the valid continuation, sometimes corrupted, sometimes ending in EOS."""
    drafts = list(path[start:start + k]) + [eos] * k
    drafts = drafts[:k]
    if rng.random() < 0.4:
        drafts[rng.randrange(k)] = rng.randrange(V)
    return drafts


def _same_masks(manager, reused, reference, matchers, k):
    """Reused masks (bitmask or SparseRows) mask guided rows exactly as the reference bitmask does."""
    batch = reference.shape[0] // (k + 1)
    rows = [b * (k + 1) + i for b in sorted(matchers) for i in range(k + 1)]
    if isinstance(reused, torch.Tensor):
        assert torch.equal(reused[rows], reference[rows])
    logits = torch.randn(batch * (k + 1), V)
    expected = apply_bitmask_(logits.clone(), reference, rows=rows)
    assert torch.equal(manager.apply_(logits, reused, matchers, k + 1), expected)


@pytest.mark.parametrize('k', [1, 3, 5])
@pytest.mark.parametrize('threaded__sparse', [(False, False), (True, False), (True, True)])
def test_window_masks_equal_reference(k, threaded__sparse, new_matcher):
    threaded, sparse = threaded__sparse
    rng = random.Random(k)
    eos = testing.load_tokenizer(NAME).eos_token_id
    grammars = _grammars()
    worker = GrammarWorker(inline=not threaded)
    manager = SpecGrammarManager(V, worker=worker, batch_fill=threaded, sparse_masks=sparse)
    for trial in range(8):
        batch = 6
        sessions = [100 * trial + b for b in range(batch)]
        guided_rows = sorted(rng.sample(range(batch), 4))
        matchers, drafts = {}, []
        for b in range(batch):
            compiled, path = grammars[rng.randrange(len(grammars))]
            start = rng.randrange(len(path) + 1)
            if b in guided_rows:
                m = new_matcher(compiled)
                for t in path[:start]:
                    assert m.accept_token(t)
                matchers[b] = m
            drafts.append(_drafts(rng, path, start, k, eos))
        reference = verification_bitmask(matchers, drafts, V)
        window = manager.begin_draft(matchers, batch, k, session_ids=sessions)
        for i in range(k):
            window.mask_logits_(torch.zeros(batch, V))
            window.advance(torch.tensor([[d[i]] for d in drafts]))
        reused = manager.verification_bitmask(matchers, torch.tensor(drafts), sessions)
        _same_masks(manager, reused, reference, matchers, k)
        assert manager.num_kept_windows == 0, 'a verification consumes its windows'
    worker.shutdown()


def test_reordered_batch_and_unknown_sessions_fall_back(new_matcher):
    """A later step with another batch order, a new request and changed drafts still gets exact masks."""
    k = 3
    grammars = _grammars()
    manager = SpecGrammarManager(V, worker=GrammarWorker())
    committed = {b: new_matcher(grammars[b][0]) for b in range(3)}
    drafts = [list(grammars[b][1][:k]) for b in range(3)]
    window = manager.begin_draft(committed, 3, k, session_ids=[7, 8, 9])
    for i in range(k):
        window.mask_logits_(torch.zeros(3, V))
        window.advance([d[i] for d in drafts])
    # next step: sessions 9, 7 swapped, 8 finished, 11 is new; session 7's drafts differ from its window's
    later = {0: committed[2], 1: committed[0], 2: new_matcher(grammars[3][0])}
    later_drafts = [drafts[2], [drafts[0][0], 5, 6], list(grammars[3][1][:k])]
    manager.forget([8])
    got = manager.verification_bitmask(later, later_drafts, [9, 7, 11])
    _same_masks(manager, got, verification_bitmask(later, later_drafts, V), later, k)
    assert manager.num_kept_windows == 0


def test_unguided_batch_allocates_nothing(monkeypatch):
    import lmdeploy_guided_spec.draft as draft

    def _no_alloc(*args, **kwargs):
        raise AssertionError('no allocation expected for an unguided batch')

    monkeypatch.setattr(draft, 'allocate_bitmask', _no_alloc)
    manager = SpecGrammarManager(V)
    assert manager.begin_draft({}, 8, 3, session_ids=list(range(8))) is None
    assert manager.commit_async({}, torch.zeros(8, 4, dtype=torch.long)) is None
    assert manager.verification_bitmask({}, torch.zeros(8, 3, dtype=torch.long), list(range(8))) is None
