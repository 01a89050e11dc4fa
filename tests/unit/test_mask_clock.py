"""The clock of token masks (:class:`lmdeploy_guided_spec.mask_clock.MaskClock`): a grammar whose masks grow slow after
the compile service's probe of its first 16 tokens is found at its first mask over the limit, in every place the
speculative path fills masks, and nothing else changes."""
import json
import math

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, testing, unpack_bitmask
from lmdeploy_guided_spec import compile as compile_module
from lmdeploy_guided_spec.mask_clock import MaskClock
from lmdeploy_guided_spec.step import commit, fill_bitmask, verification_bitmask

pytestmark = pytest.mark.unit

NAME = 'llama3'
#: a fixed prefix of more than 16 tokens, then words whose masks grow slow (xgrammar 0.2.8 on a 2-core EPYC: 0.8 s
#: for the second word, 1.2 s for the third)
LATE_SLOW = '(0 1 2 3 4 5 6 7 8 9 ){2}: ([a-z]+ ?){1,300}'
PERSON = {'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']}
#: a limit every mask goes over: the clock's records without waiting for a slow mask
EVERY_MASK_MS = 1e-6


def _vocab() -> int:
    return testing.TOKENIZERS[NAME].model_vocab_size


def _person() -> xgr.GrammarMatcher:
    return xgr.GrammarMatcher(testing.grammar_compiler(NAME).compile_json_schema(json.dumps(PERSON)))


def test_a_grammar_the_probe_passes_is_over_the_limit_later():
    """The compile service's probe finds the grammar cheap (microseconds a mask); four words past its prefix a mask
    costs more than the default limit (1.5 s on a 2-core EPYC), and at the second such mask the clock names the
    request, the cost and the limit."""
    info = testing.tokenizer_info(NAME)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = compile_module._compile(compiler, 'regex', LATE_SLOW, {})
    cost = compile_module.grammar_cost(grammar, limit_s=compile_module.DEFAULT_MASK_LIMIT_MS / 1e3,
                                       kinds=compile_module.probe_tokens(info))
    assert cost.seconds < compile_module.DEFAULT_MASK_LIMIT_MS / 1e3 / 10, cost
    matcher = xgr.GrammarMatcher(grammar)
    tokens = testing.load_tokenizer(NAME).encode('0 1 2 3 4 5 6 7 8 9 0 1 2 3 4 5 6 7 8 9 : complains about the toner',
                                                 add_special_tokens=False)
    assert len(tokens) > 16
    for token in tokens:
        assert matcher.accept_token(token), token
    clock = MaskClock()
    assert clock.limit_ms == compile_module.DEFAULT_MASK_LIMIT_MS
    fill_bitmask({1: matcher}, 2, _vocab(), clock=clock, session_ids=[40, 41])
    # one mask over the limit is a strike; a second refuses
    assert clock.pop() == {}
    bitmask = fill_bitmask({1: matcher}, 2, _vocab(), clock=clock, session_ids=[40, 41])
    over = clock.pop()
    assert list(over) == [41], over
    assert 'ms per token to match' in over[41] and compile_module.MASK_LIMIT_ENV in over[41], over
    # the mask is filled all the same
    assert torch.equal(unpack_bitmask(bitmask, _vocab())[1], testing.allowed_tokens(matcher, _vocab()))
    assert clock.pop() == {}


def test_the_clock_records_only_what_it_is_asked_to_time():
    """No session, no record (the mask is filled); ``inf`` turns the clock off; a request that ended is forgotten; a
    limit that is not positive is refused."""
    clock = MaskClock(EVERY_MASK_MS)
    bitmask = xgr.allocate_token_bitmask(1, _vocab())
    matcher = _person()
    assert not clock.fill(matcher, bitmask, 0, None)
    assert clock.pop() == {}
    assert clock.fill(matcher, bitmask, 0, 7, matcher) and clock.fill(matcher, bitmask, 0, 7, matcher)
    clock.forget([7])
    assert clock.pop() == {}
    # the strikes went with it
    assert clock.fill(matcher, bitmask, 0, 7, matcher) and clock.pop() == {}
    off = MaskClock(math.inf)
    assert not off.fill(matcher, bitmask, 0, 7) and not off.fill(matcher, bitmask, 0, 7) and off.pop() == {}
    with pytest.raises(ValueError, match='positive'):
        MaskClock(0)


def test_a_record_goes_only_to_the_request_that_made_it():
    """Records are handed out to the requests of the step that asks, by their committed matcher: a session id that
    came back with another request (the next turn of a chat) is not refused for the masks of the one before it (a
    drafting window fills its last masks after its step, so they may come after that request ended); a request not
    in the step keeps its record for a step of its own; strikes of another matcher do not add up."""
    clock = MaskClock(EVERY_MASK_MS)
    bitmask = xgr.allocate_token_bitmask(1, _vocab())
    first, second, other = _person(), _person(), _person()
    for _ in range(2):
        clock.fill(first, bitmask, 0, 7, first)
        clock.fill(other, bitmask, 0, 9, other)
    # session 9 is not in this step: its record waits for one of its own
    assert clock.pending and list(clock.pop({7: first})) == [7]
    assert clock.pending and list(clock.pop({9: other})) == [9]
    assert not clock.pending
    # the next request of session 7: the late record of the first one is dropped, not handed out
    clock.fill(first, bitmask, 0, 7, first)
    clock.fill(first, bitmask, 0, 7, first)
    assert clock.pop({7: second}) == {}
    assert clock.pop() == {}
    # one strike of the first and one of the second are not two of either
    clock.forget([7])
    clock.fill(first, bitmask, 0, 7, first)
    clock.fill(second, bitmask, 0, 7, second)
    assert clock.pop() == {}


@pytest.mark.parametrize('batch_fill', [False, True], ids=['loop', 'batch-fill'])
def test_every_place_the_speculative_path_fills_a_mask_is_timed(batch_fill):
    """The drafting window (a row at a time, or xgrammar's batch fill, whose rows are timed again one by one, once a
    window, when the batch went over the limit), the verification of rows without a window, and the first token's
    mask: each records the sessions of its rows, and a window or fill without session ids records nothing."""
    rows = 17 if batch_fill else 2
    sessions = [100 + row for row in range(rows)]
    manager = SpecGrammarManager(_vocab(), worker=GrammarWorker(inline=True), batch_fill=batch_fill,
                                 sparse_masks=False, forced_drafts=False, mask_limit_ms=EVERY_MASK_MS)
    matchers = {row: _person() for row in range(rows)}
    tokens = testing.load_tokenizer(NAME).encode(json.dumps({'name': 'Ann'}), add_special_tokens=False)
    # two windows: a batch fill over the limit is timed again row by row once a window
    for _ in range(2):
        window = manager.begin_draft(matchers, rows, 2, session_ids=sessions)
        for token in tokens[:2]:
            window.advance(torch.full((rows, ), token))
        window.wait()
    # refused (twice over the limit), each row by its committed matcher
    assert set(manager.pop_slow_grammars({s: matchers[row] for row, s in enumerate(sessions)})) == set(sessions)
    window = manager.begin_draft(matchers, rows, 2)
    for token in tokens[:2]:
        window.advance(torch.full((rows, ), token))
    window.wait()
    assert manager.pop_slow_grammars() == {}
    drafts = torch.zeros(rows, 2, dtype=torch.long)
    for _ in range(2):
        manager.verification_bitmask(matchers, drafts, [200 + row for row in range(rows)])
    assert set(manager.pop_slow_grammars()) == {200 + row for row in range(rows)}
    for _ in range(2):
        manager.next_token_bitmask(matchers, rows, [300 + row for row in range(rows)])
    assert set(manager.pop_slow_grammars()) == {300 + row for row in range(rows)}
    manager.next_token_bitmask(matchers, rows)
    # a rejected token is not a slow grammar: pop_failures and pop_slow_grammars keep apart
    assert manager.pop_slow_grammars() == {} and manager.pop_failures() == {}
    manager.forget(sessions)


def test_the_clock_changes_no_mask():
    """Masks filled with the clock (every mask over its limit) are those filled without it, bit for bit."""
    tokens = testing.load_tokenizer(NAME).encode(json.dumps({'name': 'Ann'}), add_special_tokens=False)
    drafts = [tokens[:3], tokens[1:4]]
    timed = verification_bitmask({0: _person(), 1: _person()}, drafts, _vocab(), clock=MaskClock(EVERY_MASK_MS),
                                 session_ids=[5, 6])
    plain = verification_bitmask({0: _person(), 1: _person()}, drafts, _vocab())
    assert torch.equal(timed, plain)


def test_ordinary_grammars_are_never_over_the_limit():
    """At the default limit a batch of ordinary grammars, filled by xgrammar's batch fill or a row at a time, the
    first token's mask and a verification record nothing."""
    tokens = testing.load_tokenizer(NAME).encode(json.dumps({'name': 'Ann'}), add_special_tokens=False)
    for batch_fill in (False, True):
        manager = SpecGrammarManager(_vocab(), worker=GrammarWorker(inline=True), batch_fill=batch_fill,
                                     sparse_masks=False, forced_drafts=False)
        matchers = {row: _person() for row in range(17)}
        sessions = list(range(17))
        manager.next_token_bitmask(matchers, 17, sessions)
        window = manager.begin_draft(matchers, 17, 2, session_ids=sessions)
        for token in tokens[:2]:
            window.advance(torch.full((17, ), token))
        window.wait()
        manager.verification_bitmask(matchers, torch.tensor([tokens[:2]] * 17), [100 + s for s in sessions])
        assert manager.pop_slow_grammars() == {}


def test_the_speculative_commit_times_each_accept():
    """xgrammar's accepts of an ambiguous grammar can grow slow faster than its masks: for ``((x|xx)+ ?){1,300}``
    over runs of x an accept took 264 ms beside a mask of 65 ms (2-core EPYC), and the clock counted only the
    masks. The speculative path's commit times each accept against the same limit, for the same request (its
    committed matcher), and the accepts themselves are unchanged."""
    info = testing.tokenizer_info(NAME)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    grammar = compile_module._compile(compiler, 'regex', '((x|xx)+ ?){1,300}', {})
    token = testing.load_tokenizer(NAME).encode('xxxxxxxx', add_special_tokens=False)
    assert len(token) == 1
    timed, plain = xgr.GrammarMatcher(grammar), xgr.GrammarMatcher(grammar)
    clock = MaskClock(limit_ms=5)
    over, count = {}, 0
    while not over and count < 60:
        count += 1
        assert commit({0: timed}, [token], session_ids=[7], clock=clock) == {0: 1}
        assert commit({0: plain}, [token]) == {0: 1}
        over = clock.pop()
    assert list(over) == [7] and 'an accept of the running request' in over[7], (count, over)
    assert timed.is_terminated() == plain.is_terminated() and not timed.is_terminated()
    # without session ids nothing is timed
    quiet = MaskClock(limit_ms=EVERY_MASK_MS)
    commit({0: xgr.GrammarMatcher(grammar)}, [token] * 3, clock=quiet)
    assert not quiet.pending
