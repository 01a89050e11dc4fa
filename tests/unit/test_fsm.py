"""Token FSMs (method fsm): loading and its errors, matcher semantics, masks, drafts and the manager."""
import json

import pytest
import torch

from lmdeploy_guided_spec import FsmError, FsmSessions, SpecGrammarManager, unpack_bitmask, verification_bitmask
from lmdeploy_guided_spec.bitmask import allocate_bitmask
from lmdeploy_guided_spec.forced import forced_drafts
from lmdeploy_guided_spec.fsm import Fsm

pytestmark = pytest.mark.unit

V = 1000  # not a multiple of 32
EOS = 2
# 0 -10-> 1 -11-> 2 (branch: 20 -> 3 or 21 -> 4); 3: free text (wildcard) until EOS; 4: terminal
GRAPH = {'0': {'10': 1}, '1': {'11': 2}, '2': {'20': 3, '21': 4}, '3': {'-1': 3, '2': 4}, '4': {}}


def _fsm(graph=GRAPH, vocab_size=V, stop=(EOS, )):
    return Fsm.from_dict(graph, vocab_size=vocab_size, stop_token_ids=stop)


def _allowed(matcher):
    bitmask = allocate_bitmask(1, V)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, V)[0].nonzero().flatten().tolist())


def test_walk_branches_wildcard_and_eos():
    m = _fsm().matcher()
    assert _allowed(m) == {10}
    assert not m.accept_token(11) and m.state == 0, 'a token without an edge is rejected, state unchanged'
    assert m.accept_token(10) and m.accept_token(11)
    assert _allowed(m) == {20, 21}
    fork = m.fork()
    assert fork.accept_token(21) and _allowed(fork) == {EOS}, 'a state without transitions allows only EOS'
    assert m.state == 2, 'forks are independent'
    assert m.accept_token(20)
    assert _allowed(m) == set(range(V)), 'the wildcard allows every token, and EOS has its own edge here'
    assert m.accept_token(999) and m.accept_token(10) and m.state == 3
    assert m.accept_token(EOS) and m.is_terminated() and not m.accept_token(10)
    assert _allowed(m) == {EOS}


def test_wildcard_excludes_eos_without_an_edge():
    m = _fsm({'0': {'-1': 0}}).matcher()
    assert _allowed(m) == set(range(V)) - {EOS}
    assert not m.accept_token(EOS) and not m.accept_token(V) and m.accept_token(5)


def test_deterministic_edges_are_drafts():
    m = _fsm().matcher()
    assert forced_drafts(m, 8, V) == [10, 11], 'state 2 branches'
    m.accept_token(10), m.accept_token(11), m.accept_token(21)
    assert forced_drafts(m, 8, V) == [EOS]
    assert forced_drafts(_fsm().matcher(), 1, V) == [10]


def test_masks_cover_padding_and_match_the_reference():
    fsm = _fsm()
    committed = {0: fsm.matcher(), 2: fsm.matcher()}
    committed[2].accept_token(10)
    drafts = [[10, 11, 20], [0, 0, 0], [11, 21, EOS]]
    allowed = unpack_bitmask(verification_bitmask(committed, drafts, V), V).view(3, 4, V)
    assert [set(allowed[0, i].nonzero().flatten().tolist()) for i in range(3)] == [{10}, {11}, {20, 21}]
    assert allowed[0, 3].sum() == V, 'the wildcard'
    assert allowed[1].all(), 'unguided rows allow everything'
    assert [set(allowed[2, i].nonzero().flatten().tolist()) for i in range(3)] == [{11}, {20, 21}, {EOS}]


def test_manager_drafts_commits_and_sessions():
    fsm = _fsm()
    sessions = FsmSessions(fsm)
    manager = SpecGrammarManager(V, sparse_masks=False)
    matchers = sessions.matchers([7, 8])
    assert set(matchers) == {0, 1} and len(sessions) == 2
    drafts = manager.propose(matchers, 2, 4, session_ids=[7, 8])
    assert drafts[0, :2].tolist() == [10, 11] and drafts[1, :2].tolist() == [10, 11]
    assert drafts[0, 2] not in (20, 21), 'the branch is not drafted: a token the FSM rejects'
    manager.verification_bitmask(matchers, drafts, [7, 8])
    assert manager.commit(matchers, [[10, 11, 21, -1], [10, -1, -1, -1]]) == {0: 3, 1: 1}
    again = sessions.matchers([7, 8])
    assert again[0].state == 4 and again[1].state == 1, 'committed state is kept per session'
    sessions.forget([7])
    assert sessions.matchers([7])[0].state == 0 and len(sessions) == 2


def test_a_response_format_takes_precedence():
    sessions = FsmSessions(_fsm())
    grammar = object()
    matchers = sessions.matchers([1, 2, 3], {1: grammar})
    assert matchers[1] is grammar and matchers[0].state == 0 and matchers[2].state == 0
    assert len(sessions) == 2


def test_load_reads_a_file(tmp_path):
    path = tmp_path / 'fsm.json'
    path.write_text(json.dumps(GRAPH))
    fsm = Fsm.load(path, vocab_size=V, stop_token_ids=[EOS])
    assert fsm.num_states == 5 and fsm.wildcard == {3: 3}
    assert Fsm.load(path, vocab_size=None, stop_token_ids=None).num_states == 5, 'structure only'


@pytest.mark.parametrize('content,message', [
    ('{"0": {"10": 1', 'cannot read FSM file'),
    ('[1, 2]', 'the top level must be a JSON object'),
    ('{}', 'the FSM has no states'),
    ('{"zero": {}}', "state 'zero' is not an integer"),
    ('{"-3": {}}', 'state -3 is negative'),
    ('{"0": [10, 1]}', 'state 0: transitions must be a JSON object'),
    ('{"0": {"ten": 1}, "1": {}}', "state 0: token id 'ten' is not an integer"),
    ('{"0": {"-2": 0}}', 'state 0: token id -2 is negative; -1 is the wildcard'),
    ('{"0": {"1000": 0}}', 'state 0: token id 1000 is outside the vocabulary [0, 1000)'),
    ('{"0": {"10": "one"}, "1": {}}', "next state of token 10 'one' is not an integer"),
    ('{"0": {"10": 5}}', 'state 0: token 10 leads to unknown state 5'),
    ('{"0": {"-1": 9}}', 'state 0: token -1 leads to unknown state 9'),
    ('{"1": {"10": 1}}', 'there is no start state 0'),
    ('{"0": {"10": 1}, "1": {}, "2": {"10": 3}, "3": {}}', '2 state(s) cannot be reached from the start state 0: 2, 3'),
    ('{"0": {"10": 0, "010": 0}}', 'state 0: token id 10 has two edges'),
])
def test_bad_files_give_clear_errors(tmp_path, content, message):
    path = tmp_path / 'bad.json'
    path.write_text(content)
    with pytest.raises(FsmError, match='FSM file .*bad.json') as info:
        Fsm.load(path, vocab_size=V, stop_token_ids=[EOS])
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file_and_missing_stop_tokens(tmp_path):
    with pytest.raises(FsmError, match='does not exist; speculative method fsm takes the path of a JSON file'):
        Fsm.load(tmp_path / 'nope.json', vocab_size=V, stop_token_ids=[EOS])
    with pytest.raises(FsmError, match='state 1 has no transitions, so only EOS may follow it, but no stop token'):
        _fsm({'0': {'5': 1}, '1': {}}, stop=())


def test_an_fsm_without_a_vocabulary_size_cannot_fill_masks():
    fsm = Fsm.from_dict(GRAPH, vocab_size=None, stop_token_ids=None)
    with pytest.raises(FsmError, match='without a vocabulary size'):
        fsm.matcher().fill_next_token_bitmask(torch.zeros(1, 32, dtype=torch.int32))
