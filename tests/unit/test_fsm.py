"""Token FSMs (method fsm): vLLM's file format, loading and its errors, matcher semantics, masks, drafts, the
manager and the builder."""
import json

import pytest
import torch

from lmdeploy_guided_spec import (
    FsmBuilder,
    FsmError,
    FsmSessions,
    SpecGrammarManager,
    testing,
    unpack_bitmask,
    verification_bitmask,
)
from lmdeploy_guided_spec.bitmask import allocate_bitmask
from lmdeploy_guided_spec.forced import forced_drafts
from lmdeploy_guided_spec.fsm import Fsm

pytestmark = pytest.mark.unit

V = 1000  # not a multiple of 32
EOS = 2
ALL = set(range(V))
# 0 -10-> 1 -11-> 2 (branch: 20 -> 3 or 21 -> 4); 3: free text (wildcard) until EOS; 4: no transitions
GRAPH = {'0': {'10': 1}, '1': {'11': 2}, '2': {'20': 3, '21': 4}, '3': {'-1': 3, '2': 4}, '4': {}}


def _fsm(graph=GRAPH, vocab_size=V, stop=(EOS, )):
    return Fsm.from_dict(graph, vocab_size=vocab_size, stop_token_ids=stop)


def _allowed(matcher, vocab_size=V):
    bitmask = allocate_bitmask(1, vocab_size)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return set(unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist())


# -- vLLM's example, as vLLM's CustomFSM.save writes it -----------------------------------------------------------
LLAMA3_V = 128256
LLAMA3_STOP = (128001, 128008, 128009)


def _vllm_example(path):
    """vLLM's FSM example: "hello world" then " test" or " example", then EOS; the states after EOS (5, 6) are
    not in the graph. Written the way ``CustomFSM.save`` writes it: ``json.dump`` of ``{int: {int: int}}``."""
    tok = testing.load_tokenizer('llama3')
    hello, world, test, example = (tok.encode(p, add_special_tokens=False)[0]
                                   for p in ('hello', ' world', ' test', ' example'))
    eos = tok.eos_token_id
    graph = {0: {hello: 1}, 1: {world: 2}, 2: {test: 3, example: 4}, 3: {eos: 5}, 4: {eos: 6}}
    with open(path, 'w') as f:
        json.dump(graph, f)
    return graph


def test_vllm_example_loads_and_walks(tmp_path):
    path = tmp_path / 'fsm.json'
    graph = _vllm_example(path)
    assert path.read_text().startswith('{"0": {"15339": 1}, "1": {"1917": 2}'), 'string keys, as json writes them'
    fsm = Fsm.load(path, vocab_size=LLAMA3_V, stop_token_ids=LLAMA3_STOP)
    m = fsm.matcher()
    hello, world = graph[0], graph[1]
    assert forced_drafts(m, 8, LLAMA3_V) == [*hello, *world], 'deterministic edges up to the branch'
    assert m.accept_token(15339) and m.accept_token(1917)
    assert _allowed(m, LLAMA3_V) == {1296, 3187} and not m.is_completed()
    assert m.accept_token(1296)
    assert forced_drafts(m, 8, LLAMA3_V) == [128001], 'the EOS edge is a draft'
    assert _allowed(m, LLAMA3_V) == {128001} and m.is_completed()
    assert not m.accept_token(128009), 'only the stop token with an edge'
    assert m.accept_token(128001) and m.is_terminated() and m.state == 5, 'state 5 is not in the graph'


def test_a_state_absent_from_the_graph_constrains_nothing():
    """vLLM: ``get_tokens_from_state`` of a state not in the graph is "all allowed", and every token leads on."""
    fsm = _fsm({'0': {'10': 7, '11': 1}, '1': {'12': 1}})
    m = fsm.matcher()
    assert m.accept_token(10) and m.state == 7
    assert _allowed(m) == ALL and m.is_completed() and forced_drafts(m, 4, V) == []
    assert m.accept_token(999) and m.accept_token(10) and not m.is_terminated(), 'free text'
    assert m.accept_token(EOS) and m.is_terminated()


def test_a_state_without_transitions_constrains_nothing():
    """vLLM reads ``{}`` as an absent state: its token list is empty, which means every token is allowed."""
    m = _fsm({'0': {'10': 1}, '1': {}}).matcher()
    assert m.accept_token(10)
    assert _allowed(m) == ALL and forced_drafts(m, 4, V) == [] and m.accept_token(5) and m.accept_token(EOS)
    assert _allowed(_fsm({'0': {}}).matcher()) == ALL


def test_the_wildcard_allows_eos():
    """vLLM's "free text until the model stops": ``-1`` allows every token, EOS included."""
    m = _fsm({'0': {'10': 1}, '1': {'-1': 1}}).matcher()
    assert m.accept_token(10)
    assert _allowed(m) == ALL and m.is_completed() and forced_drafts(m, 4, V) == []
    assert m.accept_token(7) and m.state == 1 and m.accept_token(EOS) and m.is_terminated()


def test_an_explicit_edge_takes_precedence_over_the_wildcard():
    fsm = _fsm({'0': {'-1': 1, '5': 2, str(EOS): 3}, '1': {'7': 1}, '2': {'8': 2}})
    m = fsm.matcher()
    assert _allowed(m) == ALL
    assert m.fork().accept_token(5) and fsm.next_state(0, 5) == 2 and fsm.next_state(0, 6) == 1
    assert fsm.next_state(0, EOS) == 3


def test_walk_branches_wildcard_and_eos():
    m = _fsm().matcher()
    assert _allowed(m) == {10}
    assert not m.accept_token(11) and m.state == 0, 'a token without an edge is rejected, state unchanged'
    assert m.accept_token(10) and m.accept_token(11)
    assert _allowed(m) == {20, 21}
    fork = m.fork()
    assert fork.accept_token(21) and _allowed(fork) == ALL, 'a state without transitions constrains nothing'
    assert m.state == 2, 'forks are independent'
    assert m.accept_token(20)
    assert _allowed(m) == ALL, 'the wildcard allows every token'
    assert m.accept_token(999) and m.accept_token(10) and m.state == 3
    assert m.accept_token(EOS) and m.is_terminated() and not m.accept_token(10)
    assert _allowed(m) == {EOS}


def test_deterministic_edges_are_drafts():
    m = _fsm().matcher()
    assert forced_drafts(m, 8, V) == [10, 11], 'state 2 branches'
    m.accept_token(10), m.accept_token(11), m.accept_token(21)
    assert forced_drafts(m, 8, V) == [], 'a state without transitions constrains nothing: no draft'
    m = _fsm({'0': {'10': 1}, '1': {str(EOS): 2}}).matcher()
    assert forced_drafts(m, 8, V) == [10, EOS], 'an EOS edge is drafted, and nothing after it'
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
    assert [set(allowed[2, i].nonzero().flatten().tolist()) for i in range(2)] == [{11}, {20, 21}]
    assert allowed[2, 2].all(), 'state 4 has no transitions'


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
    ('{"0": {"10": -5}}', 'state 0: next state -5 of token 10 is negative'),
    ('{"0": {"10": true}}', "next state of token 10 True is not an integer"),
    ('{"0": {"10": 1.5}}', "next state of token 10 1.5 is not an integer"),
    ('{"0": {"10": 1}, "1": 2}', 'state 1: transitions must be a JSON object'),
    ('{"1": {"10": 1}}', 'there is no start state 0'),
    ('{"0": {"10": 0, "010": 0}}', 'state 0: token id 10 has two edges'),
])
def test_bad_files_give_clear_errors(tmp_path, content, message):
    path = tmp_path / 'bad.json'
    path.write_text(content)
    with pytest.raises(FsmError, match='FSM file .*bad.json') as info:
        Fsm.load(path, vocab_size=V, stop_token_ids=[EOS])
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_missing_file(tmp_path):
    with pytest.raises(FsmError, match='does not exist; speculative method fsm takes the path of a JSON file'):
        Fsm.load(tmp_path / 'nope.json', vocab_size=V, stop_token_ids=[EOS])


@pytest.mark.parametrize('graph', [
    {'0': {'10': 5}},  # an edge to a state the graph leaves out
    {'0': {'-1': 9}},
    {'0': {'10': 1}, '1': {}, '2': {'10': 3}, '3': {}},  # states that cannot be reached
    {'0': {'5': 1}, '1': {}},
])
def test_files_vllm_reads_load(graph):
    """vLLM reads these without complaint; so does Fsm, with or without stop tokens."""
    for stop in ((EOS, ), ()):
        assert _fsm(graph, stop=stop).num_states == len(graph)


def test_an_fsm_without_a_vocabulary_size_cannot_fill_masks():
    fsm = Fsm.from_dict(GRAPH, vocab_size=None, stop_token_ids=None)
    with pytest.raises(FsmError, match='without a vocabulary size'):
        fsm.matcher().fill_next_token_bitmask(torch.zeros(1, 32, dtype=torch.int32))


# -- the builder ---------------------------------------------------------------------------------------------------
def _example_builder():
    b = FsmBuilder()
    b.graph[0] = {10: 1}
    b.graph[1] = {11: 2}
    b.graph[2] = {20: 3, 21: 4}
    b.graph[3][EOS] = 5  # a state is created on first use
    b.add(4, EOS, 6)
    return b


def test_builder_saves_vllms_format(tmp_path):
    b = _example_builder()
    path = tmp_path / 'fsm.json'
    b.save(path)
    vllm = {0: {10: 1}, 1: {11: 2}, 2: {20: 3, 21: 4}, 3: {EOS: 5}, 4: {EOS: 6}}
    assert path.read_text() == json.dumps(vllm), "byte for byte what vLLM's json.dump(graph) writes"
    again = FsmBuilder.load(path)
    assert again.graph == vllm and all(isinstance(s, int) for s in again.graph), 'integer keys, as vLLM reads them'
    fsm = Fsm.load(path, vocab_size=V, stop_token_ids=[EOS])
    assert forced_drafts(fsm.matcher(), 8, V) == [10, 11]
    built = b.build(vocab_size=V, stop_token_ids=[EOS])
    assert built.edges == fsm.edges and built.num_states == 5


def test_builder_chains_new_states_and_validates(tmp_path):
    b = Fsm.builder()
    assert isinstance(b, FsmBuilder)
    end = b.chain(0, [10, 11, 12])
    assert end == 3 and b.graph == {0: {10: 1}, 1: {11: 2}, 2: {12: 3}}
    b.add(end, -1, end)
    assert b.chain(end, [13, EOS], end=9) == 9 and b.graph[3][13] == 10 and b.graph[10] == {EOS: 9}
    assert b.new_state() == 11
    assert b.chain(0, [14, 15], end=12) == 12 and b.graph[0][14] == 13 and b.graph[13] == {15: 12}, \
        'the new state in between is not the end state'
    m = b.build(vocab_size=V, stop_token_ids=[EOS]).matcher()
    assert all(m.accept_token(t) for t in (10, 11, 12, 500, 13, EOS)) and m.is_terminated()
    b.graph[0]['x'] = 1
    with pytest.raises(FsmError, match="state 0: token id 'x' is not an integer"):
        b.save(tmp_path / 'bad.json')
    assert not (tmp_path / 'bad.json').exists()
    with pytest.raises(FsmError, match='no token ids'):
        b.chain(0, [])


def test_a_grammar_vocabulary_wider_than_the_fsms_allows_nothing_past_it():
    """lmdeploy 0.18 widens the grammar vocabulary to ``len(tokenizer)`` (past the model's vocabulary, which the FSM
    has): the FSM's masks in those wider bitmasks allow no token past its vocabulary, so its single edges stay
    forced drafts."""
    vocab = 1024  # a whole number of 32-token words: the wider bitmask has a word the FSM does not write
    fsm = _fsm(vocab_size=vocab)
    wide = vocab + 1
    m = fsm.matcher()
    bitmask = allocate_bitmask(1, wide)
    m.fill_next_token_bitmask(bitmask, 0)
    assert set(unpack_bitmask(bitmask, wide)[0].nonzero().flatten().tolist()) == {10}
    sessions = FsmSessions(fsm)
    manager = SpecGrammarManager(wide, sparse_masks=False)
    drafts = manager.propose(sessions.matchers([7]), 1, 3, session_ids=[7])
    assert drafts[0, :2].tolist() == [10, 11]


def test_drafts_to_be_rejected_stay_inside_the_models_vocabulary():
    """Past a wildcard the FSM forces nothing and every token of the model is allowed: the draft verification must
    reject is a token the grammar disallows, and with a grammar vocabulary wider than the model's the only such
    tokens lie past the model's embedding. Those must not be drafted (an index error in the target forward)."""
    vocab = 1024
    fsm = _fsm({'0': {'10': 1}, '1': {'-1': 1}}, vocab_size=vocab)
    manager = SpecGrammarManager(vocab + 1, sparse_masks=False)
    drafts = manager.propose(FsmSessions(fsm).matchers([7]), 1, 3, session_ids=[7], num_model_tokens=vocab)
    assert drafts[0, 0] == 10 and (drafts < vocab).all(), drafts
    wide = SpecGrammarManager(vocab + 1, sparse_masks=False).propose(FsmSessions(fsm).matchers([8]), 1, 3,
                                                                     session_ids=[8])
    assert wide[0, 1] == vocab, 'without the bound, the token past the model is the one the grammar disallows'
