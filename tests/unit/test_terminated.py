"""Matchers that end: lmdeploy 0.15+ builds plain ``xgrammar.GrammarMatcher(compiled)`` objects, which accept a stop
token and then refuse masks and jump-forward strings. A request goes on after a stop token only when it ignores its
stop tokens (``ignore_eos``, ``min_new_tokens``): every position after a stop token the grammar allows allows stop
tokens only, and no later token is accepted or reported as a failure."""
import functools
import json

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import (
    GrammarWorker,
    SpecGrammarManager,
    commit,
    fill_bitmask,
    testing,
    unpack_bitmask,
    verification_bitmask,
)
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.forced import ForcedTokenizer, forced_drafts
from lmdeploy_guided_spec.step import has_ended

from grammars import INSTANCES, SCHEMAS, compile_schema, dumps

pytestmark = pytest.mark.unit

NAME = 'llama3'
V = testing.TOKENIZERS[NAME].model_vocab_size


@pytest.fixture(params=[True, False], ids=['terminating', 'plain'])
def new_matcher(request):
    # lmdeploy 0.14 builds its matchers with terminate_without_stop_token=True, lmdeploy 0.15+ without
    return functools.partial(xgr.GrammarMatcher, terminate_without_stop_token=request.param)


def _eos():
    return testing.load_tokenizer(NAME).eos_token_id


def _path():
    return testing.load_tokenizer(NAME).encode(dumps(INSTANCES['person'][0]), add_special_tokens=False)


def _ended():
    """A plain matcher that accepted the whole instance and EOS."""
    m = xgr.GrammarMatcher(compile_schema(NAME, SCHEMAS['person']))
    for t in _path() + [_eos()]:
        assert m.accept_token(t)
    assert m.is_terminated()
    return m


def test_has_ended_only_after_a_stop_token(new_matcher):
    m = new_matcher(compile_schema(NAME, SCHEMAS['person']))
    for t in _path():
        assert not has_ended(m)
        assert m.accept_token(t)
    # a terminating matcher reports termination here, yet still gives masks (EOS); it never ends
    assert not has_ended(m)
    m.accept_token(_eos())
    assert has_ended(m) == (not new_matcher.keywords['terminate_without_stop_token'])
    assert has_ended(_ended())


def _stops():
    return sorted(testing.tokenizer_info(NAME).stop_token_ids)


def test_fill_bitmask_of_an_ended_matcher_allows_its_stop_tokens():
    fresh = xgr.GrammarMatcher(compile_schema(NAME, SCHEMAS['person']))
    allowed = unpack_bitmask(fill_bitmask({0: _ended(), 1: fresh}, 2, V), V)
    assert allowed[0].nonzero().flatten().tolist() == _stops()
    assert torch.equal(allowed[1], testing.allowed_tokens(fresh, V))


def test_verification_of_an_ended_matcher_allows_its_stop_tokens():
    allowed = unpack_bitmask(verification_bitmask({0: _ended()}, [[1, 2, 3]], V), V)
    assert all(row.nonzero().flatten().tolist() == _stops() for row in allowed)


def test_verification_past_a_drafted_stop_token(new_matcher):
    """Drafts that end the grammar and go on: after the stop token, stop tokens only (reached only by a request that
    ignores its stop tokens)."""
    compiled = compile_schema(NAME, SCHEMAS['person'])
    path = _path()
    m = new_matcher(compiled)
    for t in path[:-1]:
        assert m.accept_token(t)
    drafts = [path[-1], _eos(), path[0]]
    allowed = unpack_bitmask(verification_bitmask({0: m}, [drafts], V), V)
    assert torch.equal(allowed[0], testing.allowed_tokens(m, V))
    ref = m.fork()
    assert ref.accept_token(path[-1])
    assert torch.equal(allowed[1], testing.allowed_tokens(ref, V)) and allowed[1, _eos()]
    assert all(row.nonzero().flatten().tolist() == _stops() for row in allowed[2:])
    # after a stop token the grammar does not allow there, the positions are unreachable: every token
    allowed = unpack_bitmask(verification_bitmask({0: m}, [[_eos(), path[-1], path[0]]], V), V)
    assert not allowed[0, _eos()] and allowed[1:].all()


@pytest.mark.parametrize('threaded', [False, True])
def test_a_drafting_window_through_a_stop_token(new_matcher, threaded):
    """Draft positions after a drafted EOS: no mask is asked of an ended fork, and the window's masks are the
    reference verification masks."""
    compiled = compile_schema(NAME, SCHEMAS['person'])
    path = _path()
    worker = GrammarWorker(inline=not threaded)
    manager = SpecGrammarManager(V, worker=worker, sparse_masks=threaded)
    m = new_matcher(compiled)
    for t in path[:-1]:
        assert m.accept_token(t)
    drafts = [path[-1], _eos(), path[0], path[1]]
    window = manager.begin_draft({0: m}, 1, 4, session_ids=[5])
    for token in drafts:
        window.mask_logits_(torch.zeros(1, V))
        window.advance([token])
    window.wait()
    assert window.dead == {0}
    reused = manager.verification_bitmask({0: m}, [drafts], [5])
    logits = torch.zeros(5, V)
    manager.apply_(logits, reused, {0: m}, 5)
    expected = torch.zeros(5, V)
    manager.apply_(expected, verification_bitmask({0: m}, [drafts], V), {0: m}, 5)
    assert torch.equal(logits, expected)
    worker.shutdown()


def test_forced_drafts_and_propose_of_an_ended_matcher():
    forced = ForcedTokenizer.from_huggingface(testing.load_tokenizer(NAME), testing.tokenizer_info(NAME))
    assert forced_drafts(_ended(), 4, V, forced) == []
    manager = SpecGrammarManager(V, tokenizer=testing.load_tokenizer(NAME), tokenizer_info=testing.tokenizer_info(NAME),
                                 worker=GrammarWorker(inline=True))
    assert manager.propose({0: _ended()}, 1, 3, filler=9).tolist() == [[9, 9, 9]]
    window = DraftGrammar({0: _ended()}, 1, V, 2, forced=True)
    assert window.forced_tokens(0) == {} and window.dead == {0}


def test_forced_drafts_end_at_the_stop_token(new_matcher):
    compiled = testing.grammar_compiler(NAME).compile_json_schema(json.dumps(SCHEMAS['person']),
                                                                  any_whitespace=False)
    m = new_matcher(compiled)
    for t in _path():
        assert m.accept_token(t)
    assert forced_drafts(m, 4, V) == [_eos()]


def test_commit_after_a_stop_token_ends_the_row(capfd):
    m = xgr.GrammarMatcher(compile_schema(NAME, SCHEMAS['person']))
    path = _path()
    manager = SpecGrammarManager(V, worker=GrammarWorker(inline=True))
    assert manager.commit({0: m}, [path], session_ids=[3]) == {0: len(path)}
    assert manager.commit({0: m}, [[_eos(), path[0], path[1]]], session_ids=[3]) == {0: 1}
    assert manager.commit({0: m}, [[path[0]]], session_ids=[3]) == {0: 0}
    assert manager.pop_failures() == {}, 'tokens after the stop token are no failure'
    assert commit({0: _ended()}, [[path[0]]]) == {0: 0}
    # the ended matcher is not asked to accept them: xgrammar would print a warning per token (a batch of requests
    # that stop mid-window filled a rank's stderr with them)
    assert 'trying to accept new token' not in capfd.readouterr().err
