"""Draft forks, position-serial verification masks and commits with real tokenizers and real grammars."""
import functools
import json
import random
import threading

import jsonschema
import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import (
    GrammarWorker,
    SpecGrammarManager,
    commit,
    testing,
    unpack_bitmask,
    verification_bitmask,
)
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.errors import GrammarRejectedError
from lmdeploy_guided_spec.step import grammar_is_empty

from grammars import INSTANCES, REGEX_INSTANCES, REGEXES, SCHEMAS, compile_regex, compile_schema, dumps

pytestmark = pytest.mark.unit

# A schema whose language is empty: it compiles to `defs_a ::= defs_a`, and its first mask allows nothing.
EMPTY_SCHEMA = {'$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}


@pytest.fixture(params=[True, False], ids=['terminating', 'plain'])
def new_matcher(request):
    # lmdeploy 0.14 builds its matchers with terminate_without_stop_token=True, lmdeploy 0.15+ without
    return functools.partial(xgr.GrammarMatcher, terminate_without_stop_token=request.param)


def _vocab(name):
    return testing.TOKENIZERS[name].model_vocab_size


def _path(name, text):
    return testing.load_tokenizer(name).encode(text, add_special_tokens=False)


def _state_after(new_matcher, compiled, tokens):
    m = new_matcher(compiled)
    for t in tokens:
        assert m.accept_token(t)
    return m


def _random_drafts(rng, path, start, k, vocab):
    """A draft window: a valid continuation, corrupted at a random position (or not at all)."""
    drafts = list(path[start:start + k])
    drafts += [rng.randrange(vocab) for _ in range(k - len(drafts))]
    bad = rng.randrange(k + 1)
    if bad < k:
        drafts[bad] = rng.randrange(vocab)
    return drafts


@pytest.mark.parametrize('schema', sorted(SCHEMAS))
def test_verification_rows_equal_serial_reference(tokenizer_name, schema, new_matcher):
    """Row i of each request equals a fresh matcher advanced by drafts 0..i-1; later rows allow everything."""
    rng = random.Random(schema)
    vocab = _vocab(tokenizer_name)
    compiled = compile_schema(tokenizer_name, SCHEMAS[schema])
    path = _path(tokenizer_name, dumps(INSTANCES[schema][0]))
    k = 4
    for _ in range(6):
        starts = [rng.randrange(len(path)) for _ in range(3)]
        matchers = {row: _state_after(new_matcher, compiled, path[:starts[row]]) for row in (0, 2)}
        drafts = [_random_drafts(rng, path, s, k, vocab) for s in starts]
        before = {r: testing.allowed_tokens(m, vocab) for r, m in matchers.items()}
        allowed = unpack_bitmask(verification_bitmask(matchers, torch.tensor(drafts), vocab), vocab).view(3, k + 1, -1)
        assert allowed[1].all(), 'unguided rows must stay unconstrained'
        for row, m in matchers.items():
            ref = m.fork()
            for i in range(k + 1):
                assert torch.equal(allowed[row, i], testing.allowed_tokens(ref, vocab)), (row, i)
                if i == k or not ref.accept_token(drafts[row][i]):
                    break
            assert allowed[row, i + 1:].all(), 'positions after a rejected draft are unreachable'
            # the committed matcher did not move
            assert torch.equal(testing.allowed_tokens(m, vocab), before[row])


def test_commit_advances_exactly_the_accepted_tokens(llama3, new_matcher):
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    matchers = {0: new_matcher(compiled), 1: new_matcher(compiled)}
    out = torch.tensor([path[:3] + [-1, -1], path[:5]])
    assert commit(matchers, out) == {0: 3, 1: 5}
    # each committed matcher is now in the state of a fresh matcher fed those tokens
    for row, n in ((0, 3), (1, 5)):
        assert torch.equal(testing.allowed_tokens(matchers[row], 128256),
                           testing.allowed_tokens(_state_after(new_matcher, compiled, path[:n]), 128256))


def test_commit_stops_at_termination(llama3, new_matcher):
    tok = testing.load_tokenizer(llama3)
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    m = _state_after(new_matcher, compiled, path[:-1])
    accepted = commit({0: m}, [[path[-1], tok.eos_token_id, path[0]]])
    # a terminating matcher rejects EOS after the end of the grammar, a plain one accepts it and then ends
    ends_with_eos = not new_matcher.keywords['terminate_without_stop_token']
    assert accepted == {0: 1 + ends_with_eos} and m.is_terminated()


def test_commit_goes_on_where_a_grammar_may_end(llama3, caplog, new_matcher):
    """lmdeploy's matchers report termination wherever the grammar may end (x(yz)? after x) but still accept what
    may follow; the commit must take it, as the non-speculative path does."""
    tok = testing.load_tokenizer(llama3)
    x, y, z = (tok.convert_tokens_to_ids(c) for c in 'xyz')
    m = new_matcher(testing.grammar_compiler(llama3).compile_regex('x(yz)?'))
    terminating = new_matcher.keywords['terminate_without_stop_token']
    assert commit({0: m}, [[x]]) == {0: 1} and m.is_terminated() == terminating
    assert commit({0: m}, [[y, z, tok.eos_token_id]]) == {0: 2 + (not terminating)}
    if terminating:
        assert not testing.allowed_tokens(m, 128256)[y], 'after xyz nothing but EOS may follow'
    assert m.is_terminated()
    assert 'Please file an issue' not in caplog.text


def test_commit_of_a_rejected_token_keeps_state(llama3, new_matcher):
    compiled = compile_schema(llama3, SCHEMAS['person'])
    m = new_matcher(compiled)
    before = testing.allowed_tokens(m, 128256)
    bad = int((~before).nonzero()[0])
    failures = {}
    assert commit({0: m}, [[bad]], failures=failures) == {0: 0}
    assert list(failures) == [0] and str(bad) in failures[0]
    assert torch.equal(testing.allowed_tokens(m, 128256), before)
    with pytest.raises(GrammarRejectedError, match=f'token {bad}'):
        commit({0: m}, [[bad]])


def test_a_rejected_committed_token_is_a_failure_of_its_session(llama3, new_matcher):
    """Never a silent fallback: the session whose matcher rejected a committed token has a failure, the others
    commit as usual."""
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    bad = int((~testing.allowed_tokens(_state_after(new_matcher, compiled, path[:2]), 128256)).nonzero()[0])
    manager = SpecGrammarManager(128256, worker=GrammarWorker())
    matchers = {0: new_matcher(compiled), 1: new_matcher(compiled)}
    future = manager.commit_async(matchers, torch.tensor([path[:2] + [bad], path[:3]]), session_ids=[41, 42])
    assert future.result() == {0: 2, 1: 3}
    failures = manager.pop_failures()
    assert list(failures) == [41]
    assert f'token {bad}' in failures[41] and 'after 2 accepted' in failures[41]
    assert manager.failures() == {}
    manager.commit(matchers, [[bad], path[3:4]])
    got = manager.pop_failures()
    assert list(got) == [0], 'without session ids the batch row is the key'
    assert f'token {bad}' in got[0] and 'after 0 accepted' in got[0]
    manager.worker.shutdown()


def test_failures_name_the_token_and_the_count(llama3, new_matcher):
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    bad = int((~testing.allowed_tokens(_state_after(new_matcher, compiled, path[:2]), 128256)).nonzero()[0])
    manager = SpecGrammarManager(128256, worker=GrammarWorker(inline=True))
    manager.commit({3: new_matcher(compiled)}, [[]] * 3 + [path[:2] + [bad]], session_ids={3: 77})
    assert manager.failures() == manager.failures(), 'failures() does not clear'
    (session, message), = manager.pop_failures().items()
    assert session == 77 and f'token {bad}' in message and 'after 2 accepted' in message
    assert manager.pop_failures() == {}
    # finished sessions leave no failure behind
    manager.commit({0: new_matcher(compiled)}, [[bad]], session_ids=[78])
    manager.forget([78])
    assert manager.failures() == {}


def test_a_commit_queued_before_its_session_ends_leaves_no_failure(llama3, new_matcher):
    """A session id comes back (``pipeline.chat`` reuses it for the next turn): a failure of a commit queued before
    the session ended must not fail the request that reuses the id."""
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    bad = int((~testing.allowed_tokens(_state_after(new_matcher, compiled, path[:2]), 128256)).nonzero()[0])
    manager = SpecGrammarManager(128256, worker=GrammarWorker())
    busy = threading.Event()
    manager.submit(busy.wait, 30)
    future = manager.commit_async({0: new_matcher(compiled)}, [path[:2] + [bad]], session_ids=[79])
    manager.forget([79])
    busy.set()
    assert future.result(timeout=30) == {0: 2}
    manager.submit(lambda: None).result(timeout=30)
    assert manager.failures() == {}
    # the session's next request commits and fails as its own
    manager.commit({0: new_matcher(compiled)}, [[bad]], session_ids=[79])
    assert list(manager.pop_failures()) == [79]
    manager.worker.shutdown()


@pytest.mark.parametrize('name', ['llama3', 'qwen3'])
def test_an_empty_language_is_found_and_fails_its_request(name, new_matcher):
    vocab = _vocab(name)
    compiled = compile_schema(name, EMPTY_SCHEMA)
    assert grammar_is_empty(compiled)
    assert grammar_is_empty(new_matcher(compiled), vocab)
    assert not grammar_is_empty(compile_schema(name, SCHEMAS['person']))
    assert not grammar_is_empty(testing.grammar_compiler(name).compile_regex('x?'))
    m = new_matcher(compiled)
    assert not testing.allowed_tokens(m, vocab).any()
    manager = SpecGrammarManager(vocab, worker=GrammarWorker(inline=True))
    # whatever the engine samples from an all -inf row
    manager.commit({0: m}, [[0]], session_ids=[9])
    message = manager.pop_failures()[9]
    assert 'allows no token' in message


@pytest.mark.parametrize('regex', sorted(REGEXES))
def test_regex_verification(llama3, regex, new_matcher):
    compiled = compile_regex(llama3, REGEXES[regex])
    for text in REGEX_INSTANCES[regex]:
        path = _path(llama3, text)
        drafts = (path + [0] * 3)[:3]
        allowed = unpack_bitmask(verification_bitmask({0: new_matcher(compiled)}, [drafts], 128256), 128256)
        for i in range(min(3, len(path))):
            assert allowed[i, path[i]], 'each valid next token is allowed at its position'


def test_draft_grammar_masks_and_forks(tokenizer_name, new_matcher):
    """Masked argmax drafts are always grammar-valid; the committed matcher never moves."""
    vocab = _vocab(tokenizer_name)
    compiled = compile_schema(tokenizer_name, SCHEMAS['nested_order'])
    committed = {0: new_matcher(compiled), 1: new_matcher(compiled)}
    draft = DraftGrammar(committed, batch_size=3, vocab_size=vocab, num_spec_tokens=12)
    chosen = [[], [], []]
    for _ in range(12):
        logits = torch.randn(3, vocab)
        unguided_before = logits[2].clone()
        draft.mask_logits_(logits)
        assert torch.equal(logits[2], unguided_before)
        tokens = logits.argmax(-1, keepdim=True)
        draft.advance(tokens)
        for r in range(3):
            chosen[r].append(int(tokens[r]))
    assert not draft.dead
    for r in (0, 1):
        assert testing.allowed_tokens(committed[r], vocab).sum() == testing.allowed_tokens(new_matcher(compiled),
                                                                                            vocab).sum()
        fresh = new_matcher(compiled)
        assert all(fresh.accept_token(t) for t in chosen[r]), 'masked drafts must be grammar-valid'


def test_draft_grammar_dead_row_stops_masking(llama3, new_matcher):
    compiled = compile_schema(llama3, SCHEMAS['person'])
    draft = DraftGrammar({0: new_matcher(compiled)}, batch_size=1, vocab_size=128256, num_spec_tokens=2)
    logits = torch.randn(1, 128256)
    draft.mask_logits_(logits)
    invalid = int(torch.isinf(logits[0]).nonzero()[0])
    draft.advance([invalid])
    assert draft.dead == {0}
    logits = torch.randn(1, 128256)
    draft.mask_logits_(logits)
    assert torch.isfinite(logits).all()


class _Target:
    """A deterministic 'model': logits are a function of the prefix, biased toward a valid instance."""

    def __init__(self, path, vocab, bias, seed):
        self.path, self.vocab, self.bias, self.seed = path, vocab, bias, seed

    def __call__(self, prefix):
        g = torch.Generator().manual_seed(hash((self.seed, tuple(prefix))) % (2**31))
        logits = torch.randn(self.vocab, generator=g)
        n = len(prefix)
        if self.bias and n < len(self.path) and list(prefix) == self.path[:n]:
            logits[self.path[n]] += self.bias
        return logits


def _greedy_guided(new_matcher, target, compiled, vocab, eos, steps):
    m, out = new_matcher(compiled), []
    for _ in range(steps):
        logits = target(out).unsqueeze(0)
        mgr = SpecGrammarManager(vocab)
        mgr.apply_(logits, mgr.next_token_bitmask({0: m}, 1), {0: m})
        t = int(logits.argmax())
        out.append(t)
        m.accept_token(t)
        if t == eos:
            break
    return out


def _greedy_guided_spec(new_matcher, target, draft_model, compiled, vocab, eos, steps, k):
    """The speculative loop as the patched engine runs it: masked drafts, masked verification, greedy accept."""
    mgr = SpecGrammarManager(vocab)
    matchers = {0: new_matcher(compiled)}
    out, forwards = [], 0
    while len(out) < steps and (not out or out[-1] != eos):
        draft = mgr.begin_draft(matchers, 1, k)
        drafts = []
        for _ in range(k):
            logits = draft_model(out + drafts).unsqueeze(0)
            draft.mask_logits_(logits)
            drafts.append(int(logits.argmax()))
            draft.advance([drafts[-1]])
        logits = torch.stack([target(out + drafts[:i]) for i in range(k + 1)])
        mgr.apply_(logits, mgr.verification_bitmask(matchers, [drafts]), matchers, k + 1)
        forwards += 1
        picks = logits.argmax(-1).tolist()
        accepted = []
        for i in range(k + 1):
            accepted.append(picks[i])
            if i == k or picks[i] != drafts[i]:
                break
        mgr.commit(matchers, [accepted])
        out += accepted
    # as the engine's stopping criteria do: cut at EOS and at the token budget
    if eos in out:
        out = out[:out.index(eos) + 1]
    return out[:steps], forwards


@pytest.mark.parametrize('schema', sorted(SCHEMAS))
@pytest.mark.parametrize('bias', [0.0, 8.0])
def test_greedy_speculative_equals_greedy(llama3, schema, bias, new_matcher):
    """Contract rules 1 and 2 on the core alone: same tokens, and a fresh matcher accepts them."""
    tok = testing.load_tokenizer(llama3)
    vocab = 128256
    compiled = compile_schema(llama3, SCHEMAS[schema])
    path = _path(llama3, dumps(INSTANCES[schema][0])) + [tok.eos_token_id]
    target = _Target(path, vocab, bias, seed=1)
    draft_model = _Target(path, vocab, bias * 0.6, seed=2)  # a worse model: some drafts get rejected
    steps = len(path) + 4 if bias else 24
    reference = _greedy_guided(new_matcher, target, compiled, vocab, tok.eos_token_id, steps)
    spec, forwards = _greedy_guided_spec(new_matcher, target, draft_model, compiled, vocab, tok.eos_token_id, steps,
                                         k=3)
    assert spec == reference
    fresh = new_matcher(compiled)
    assert all(fresh.accept_token(t) for t in spec if t != tok.eos_token_id)
    if bias:
        text = tok.decode(spec, skip_special_tokens=True)
        jsonschema.validate(json.loads(text), SCHEMAS[schema])
        assert forwards < len(spec), 'a draft that follows the target must save forwards'


def test_manager_without_guided_rows_does_nothing(monkeypatch):
    import lmdeploy_guided_spec.step as step

    def _no_alloc(*args, **kwargs):
        raise AssertionError('no allocation expected for an unguided batch')

    monkeypatch.setattr(step, 'allocate_bitmask', _no_alloc)
    mgr = SpecGrammarManager(128256)
    logits = torch.randn(4, 128256)
    before = logits.clone()
    assert mgr.next_token_bitmask({}, 4) is None
    assert mgr.verification_bitmask({}, torch.zeros(2, 3, dtype=torch.long)) is None
    assert mgr.begin_draft({}, 2) is None
    assert mgr.commit({}, torch.zeros(2, 4, dtype=torch.long)) == {}
    mgr.apply_(logits, None, {}, 2)
    assert torch.equal(logits, before)


def test_fork_independence_with_xgrammar(llama3, new_matcher):
    """The assumption the design rests on: a fork moves independently of its origin."""
    compiled = compile_schema(llama3, SCHEMAS['person'])
    path = _path(llama3, dumps(INSTANCES['person'][0]))
    m = new_matcher(compiled)
    f = m.fork()
    for t in path[:4]:
        assert f.accept_token(t)
    assert isinstance(f, xgr.GrammarMatcher)
    assert torch.equal(testing.allowed_tokens(m, 128256), testing.allowed_tokens(new_matcher(compiled), 128256))


# 'a' is allowed first, and after it nothing at all: the empty character class follows a prefix, so the language is
# not empty ('b') and no entry check can refuse it
DEAD_END_REGEX = 'a[^\\s\\S]|b'


@pytest.mark.parametrize('path', ['manager', 'window', 'window_sparse', 'window_engine', 'verification'])
def test_a_state_that_allows_no_token_gets_finite_logits_and_fails_its_request(llama3, path, new_matcher):
    vocab = _vocab(llama3)
    compiled = testing.grammar_compiler(llama3).compile_regex(DEAD_END_REGEX)
    a = _path(llama3, 'a')[0]
    assert not grammar_is_empty(compiled)
    # window_engine: as in the engine, the window is made in inference mode and the worker is a thread of its own
    manager = SpecGrammarManager(vocab, worker=GrammarWorker(inline=path != 'window_engine'), pin_memory=False,
                                 sparse_masks=path == 'window_sparse')
    dead_end = new_matcher(compiled)
    assert dead_end.accept_token(a) and not testing.allowed_tokens(dead_end, vocab).any()
    fresh = new_matcher(compiled)
    if path == 'manager':
        # the committed state allows nothing (the first token of a request, or a step without drafts)
        logits = torch.randn(2, vocab)
        manager.apply_(logits, manager.next_token_bitmask({0: dead_end}, 2), {0: dead_end})
    elif path == 'verification':
        # drafts that lead into the dead end: the position after 'a' allows everything, the rest are unreachable
        bitmask = manager.verification_bitmask({0: fresh, 1: dead_end}, [[a, 0, 0], [0, 0, 0]], [1, 2])
        logits = torch.randn(8, vocab)
        manager.apply_(logits, bitmask, {0: fresh, 1: dead_end}, num_positions=4)
        allowed = unpack_bitmask(bitmask, vocab)
        assert allowed[0].sum() < vocab and allowed[1:].all()
    else:
        with torch.inference_mode(path == 'window_engine'):
            window = manager.begin_draft({0: fresh, 1: dead_end}, 2, 3, session_ids=[1, 2])
        for position in range(3):
            logits = torch.randn(2, vocab)
            window.mask_logits_(logits)
            assert torch.isfinite(logits).any(-1).all(), f'a row without a finite logit at draft position {position}'
            window.advance([a, 0])
        assert window.dead == {0, 1}
        logits = torch.randn(8, vocab)
        manager.apply_(logits, manager.verification_bitmask({0: fresh, 1: dead_end}, [[a, 0, 0], [0, 0, 0]], [1, 2]),
                       {0: fresh, 1: dead_end}, num_positions=4)
    assert torch.isfinite(logits).any(-1).all(), 'a row without a finite logit fails sampling for the whole batch'
    # whatever is sampled there fails the request, naming the cause
    manager.commit({0: dead_end}, [[int(logits[0].argmax())]], session_ids=[2])
    assert 'allows no token at all' in manager.pop_failures()[2]
    assert fresh.accept_token(a) and not fresh.is_terminated()  # the committed matcher did not move before


@pytest.mark.parametrize('path', ['next_token', 'verification', 'window', 'window_sparse', 'window_engine'])
def test_a_request_that_goes_on_after_its_grammar_ended_writes_only_stop_tokens(llama3, path, new_matcher):
    """ignore_eos (or min_new_tokens not reached) keeps a request going after its grammar ended: its rows allow its
    stop tokens only, never every token (which let the text run on past the JSON, unconstrained)."""
    vocab = _vocab(llama3)
    tok = testing.load_tokenizer(llama3)
    compiled = compile_schema(llama3, SCHEMAS['person'])
    full = _path(llama3, dumps(INSTANCES['person'][0]))
    ended = _state_after(new_matcher, compiled, full)
    ended.accept_token(tok.eos_token_id)
    other = new_matcher(compiled)
    matchers = {0: other, 1: ended}
    manager = SpecGrammarManager(vocab, worker=GrammarWorker(inline=path != 'window_engine'), pin_memory=False,
                                 sparse_masks=path == 'window_sparse')
    if path == 'next_token':
        positions, bitmask = 1, manager.next_token_bitmask(matchers, 2)
    else:
        positions = 4
        if path != 'verification':
            with torch.inference_mode(path == 'window_engine'):
                window = manager.begin_draft(matchers, 2, 3, session_ids=[1, 2])
            for _ in range(3):
                window.advance([full[0], tok.eos_token_id])
        bitmask = manager.verification_bitmask(matchers, [full[:3], [tok.eos_token_id] * 3], [1, 2])
    logits = torch.zeros(2 * positions, vocab)
    manager.apply_(logits, bitmask, matchers, positions)
    stops = sorted(testing.tokenizer_info(llama3).stop_token_ids)
    # the 0.14-style matcher never ends: after the grammar's end it allows exactly its stop tokens too
    for i in range(positions, 2 * positions):
        allowed = torch.isfinite(logits[i]).nonzero().flatten().tolist()
        assert allowed == stops, (i, allowed[:5])
    assert torch.isfinite(logits[0]).sum() < vocab  # the other request is still masked by its grammar
    # what is sampled there is committed without a failure
    manager.commit(matchers, [[full[0]], [stops[0]]], session_ids=[1, 2])
    assert manager.pop_failures() == {}


@pytest.mark.parametrize('sparse', [False, True])
def test_where_banned_tokens_and_the_grammar_leave_nothing_the_grammar_wins(llama3, sparse, new_matcher):
    """ignore_eos bans the stop tokens the end of a grammar allows alone; lmdeploy's n-gram stop bans every token
    but a stop token in the middle of one. With ``banned`` the emptied rows take the grammar's tokens; the rest are
    masked as always, and without ``banned`` nothing changes (the caller says when processors may have banned). A
    row without a grammar that processors left nothing stays empty (the engine fails its request): it was given
    every token, and sampled at random from the whole vocabulary."""
    vocab = _vocab(llama3)
    compiled = compile_schema(llama3, SCHEMAS['person'])
    full = _path(llama3, dumps(INSTANCES['person'][0]))
    at_end = _state_after(new_matcher, compiled, full)
    middle = _state_after(new_matcher, compiled, full[:3])
    start = new_matcher(compiled)
    matchers = {0: at_end, 1: middle, 2: start}
    manager = SpecGrammarManager(vocab, worker=GrammarWorker(inline=True), pin_memory=False, sparse_masks=sparse)
    bitmask = manager.next_token_bitmask(matchers, 4)
    if sparse:
        from lmdeploy_guided_spec.sparse import sparse_rows
        bitmask = sparse_rows(bitmask[:3], [0, 1, 2], vocab)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(5, vocab, generator=gen)
    logits[4] = float('-inf')  # an unguided row a user's logits processor left nothing
    stops = sorted(testing.tokenizer_info(llama3).stop_token_ids)
    logits[0, stops] = float('-inf')  # ignore_eos
    logits[1] = float('-inf')  # the n-gram stop: only a stop token is left, which the grammar disallows here
    logits[1, stops[0]] = 0.0
    logits[2, :1000] = float('-inf')  # bad words that leave the grammar something
    before = logits.clone()
    plain = manager.apply_(logits.clone(), bitmask, matchers)
    assert not torch.isfinite(plain[:2]).any(-1).any()  # what killed the engine: rows without a finite logit
    out = manager.apply_(logits, bitmask, matchers, banned=True)
    allowed = testing.allowed_tokens
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == stops
    assert torch.equal(torch.isfinite(out[1]), allowed(middle, vocab)[:vocab])
    assert (out[0][torch.isfinite(out[0])] == 0).all() and (out[1][torch.isfinite(out[1])] == 0).all()
    assert torch.equal(out[2], plain[2]) and torch.isfinite(out[2]).any()
    assert torch.equal(out[3], before[3])  # the unguided rows
    assert torch.equal(out[4], before[4])
    # lmdeploy 0.14's order: the grammar's mask first, the processors after it, then the rows are kept
    assert torch.equal(manager.keep_grammar_tokens_(plain.clone(), bitmask, matchers), out)
