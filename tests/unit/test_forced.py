"""Grammar-forced tokens: canonical tokenization of jump-forward text, held-back tails, drafting windows."""
import functools
import json

import numpy as np
import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import SpecGrammarManager, testing, unpack_bitmask, verification_bitmask
from lmdeploy_guided_spec.bitmask import allocate_bitmask, pack_bool_mask
from lmdeploy_guided_spec.draft import DraftGrammar
from lmdeploy_guided_spec.forced import ForcedTokenizer, forced_drafts, single_allowed_token, single_allowed_tokens

from grammars import INSTANCES, SCHEMAS, compile_schema

pytestmark = pytest.mark.unit


@pytest.fixture(params=[True, False], ids=['terminating', 'plain'])
def new_matcher(request):
    # lmdeploy 0.14 builds its matchers with terminate_without_stop_token=True, lmdeploy 0.15+ without
    return functools.partial(xgr.GrammarMatcher, terminate_without_stop_token=request.param)


# json.dumps' default separators and the compact ones, with the xgrammar options that write them
WHITESPACE = {
    'single': (dict(any_whitespace=False), dict(ensure_ascii=False)),
    'compact': (dict(any_whitespace=False, separators=(',', ':')), dict(ensure_ascii=False, separators=(',', ':'))),
}


def _forced(name):
    return ForcedTokenizer.from_huggingface(testing.load_tokenizer(name), testing.tokenizer_info(name))


def _vocab(name):
    return testing.TOKENIZERS[name].model_vocab_size


def _compile(name, schema, whitespace):
    return testing.grammar_compiler(name).compile_json_schema(json.dumps(schema), **WHITESPACE[whitespace][0])


@pytest.mark.parametrize('text', ['{"', '{"customer_billing_address_postal_code": "', '", "status": "activ', '"}',
                                  ', "日本語": ', ' '])
def test_tokenize_writes_the_text_exactly(tokenizer_name, text):
    forced = _forced(tokenizer_name)
    ids, stable = forced.tokenize(text)
    assert b''.join(forced.decoded_vocab[t] for t in ids) == text.encode()
    assert 0 <= stable <= len(ids)
    assert forced.tokenize(text) == (ids, stable), 'cached'


@pytest.mark.parametrize('whitespace', sorted(WHITESPACE))
@pytest.mark.parametrize('schema', sorted(SCHEMAS))
def test_forced_drafts_are_the_canonical_tokens(tokenizer_name, schema, whitespace, new_matcher):
    """At every state along an instance's canonical tokens, the forced drafts are the next canonical tokens."""
    tok = testing.load_tokenizer(tokenizer_name)
    vocab = _vocab(tokenizer_name)
    forced = _forced(tokenizer_name)
    compiled = _compile(tokenizer_name, SCHEMAS[schema], whitespace)
    forced_positions = total = 0
    for instance in INSTANCES[schema]:
        text = json.dumps(instance, **WHITESPACE[whitespace][1])
        path = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        matcher = new_matcher(compiled)
        for i in range(len(path)):
            before = testing.allowed_tokens(matcher, vocab)
            drafts = forced_drafts(matcher, 8, vocab, forced)
            assert drafts == path[i:i + len(drafts)], (i, [tok.decode([t]) for t in drafts])
            assert torch.equal(testing.allowed_tokens(matcher, vocab), before), 'the matcher is not changed'
            forced_positions += bool(drafts)
            total += 1
            if i < len(path) - 1:
                assert matcher.accept_token(path[i])
    # property names, separators and the end are forced: from a sixth of the positions (escapes_unicode, mostly
    # free text, compact) to nearly three quarters (enum_prefixes, single spaces)
    assert forced_positions * 6 >= total


def test_any_whitespace_forces_nothing_at_the_start(llama3, new_matcher):
    """lmdeploy's default: optional whitespace may follow '{', so even a fixed first property is not forced."""
    schema = {'type': 'object', 'properties': {'customer_billing_address_postal_code': {'type': 'string'}},
              'required': ['customer_billing_address_postal_code'], 'additionalProperties': False}
    vocab = _vocab(llama3)
    forced = _forced(llama3)
    any_ws = new_matcher(compile_schema(llama3, schema))
    assert any_ws.find_jump_forward_string() == '{'
    assert forced_drafts(any_ws, 8, vocab, forced) == []
    single = new_matcher(_compile(llama3, schema, 'single'))
    drafts = forced_drafts(single, 8, vocab, forced)
    assert testing.load_tokenizer(llama3).decode(drafts) == '{"customer_billing_address_postal_code":'


def test_held_back_text_is_forced_when_nothing_extends_it(llama3, new_matcher):
    """The end of a grammar: the last forced text and EOS are drafts although longer tokens exist."""
    tok = testing.load_tokenizer(llama3)
    vocab = _vocab(llama3)
    forced = _forced(llama3)
    matcher = new_matcher(testing.grammar_compiler(llama3).compile_regex('hello world'))
    drafts = forced_drafts(matcher, 8, vocab, forced)
    assert drafts == tok.encode('hello world', add_special_tokens=False) + [tok.eos_token_id]
    # a prefix of the remaining text could be written with a longer token: held back while the grammar allows it
    matcher = new_matcher(testing.grammar_compiler(llama3).compile_regex('hello world[a-z]*'))
    drafts = forced_drafts(matcher, 8, vocab, forced)
    assert tok.decode(drafts) == 'hello'


def test_without_a_tokenizer_only_single_tokens_are_forced(llama3, new_matcher):
    tok = testing.load_tokenizer(llama3)
    matcher = new_matcher(_compile(llama3, SCHEMAS['person'], 'single'))
    for t in tok.encode('{"name": "Ada", "age": 3', add_special_tokens=False):
        assert matcher.accept_token(t)
    assert forced_drafts(matcher, 8, _vocab(llama3)) == []
    assert matcher.accept_token(tok.encode('6}', add_special_tokens=False)[0])
    matcher.accept_token(tok.encode('}', add_special_tokens=False)[0])
    assert forced_drafts(matcher, 8, _vocab(llama3)) == [tok.eos_token_id]


@pytest.mark.parametrize('vocab_size', [817, 1000, 1024])
def test_single_allowed_token_ignores_padding_bits(vocab_size):
    allowed = torch.zeros(1, vocab_size, dtype=torch.bool)
    assert single_allowed_token(pack_bool_mask(allowed)[0], vocab_size) is None
    for token in (0, 31, 32, vocab_size - 1):
        allowed = torch.zeros(1, vocab_size, dtype=torch.bool)
        allowed[0, token] = True
        row = pack_bool_mask(allowed)[0]  # sets the padding bits of the last word, as xgrammar's allocate does
        assert single_allowed_token(row, vocab_size) == token
        allowed[0, (token + 1) % vocab_size] = True
        assert single_allowed_token(pack_bool_mask(allowed)[0], vocab_size) is None
    assert single_allowed_token(allocate_bitmask(1, vocab_size)[0], vocab_size) is None


def test_a_prefix_space_tokenizer_is_written_without_its_space():
    """SentencePiece tokenizers with add_prefix_space write '{' at the start of a text as '▁{'."""
    vocab = [b'\n', b' {', b'{', b'"', b'a', b' ', b'{"']

    def encode(text):
        ids, text = ([5] if text[0] != '\n' else []), text
        table = {'\n': 0, '{': 2, '"': 3, 'a': 4}
        return ids + [table[c] for c in text]

    forced = ForcedTokenizer(encode, vocab)
    assert forced.tokenize('{"a') == ((2, 3, 4), 3), 'no token extends "a", \'"a\' or \'{"a\''
    assert forced.tokenize('{') == ((2,), 0), "'{' is a prefix of '{\"'"


def _path(name, schema, whitespace):
    tok = testing.load_tokenizer(name)
    return tok.encode(json.dumps(INSTANCES[schema][0], **WHITESPACE[whitespace][1]), add_special_tokens=False)


@pytest.mark.parametrize('k', [1, 4, 8])
def test_propose_drafts_forced_tokens_and_keeps_reference_masks(llama3, k, new_matcher):
    """Method grammar: drafts are the forced tokens, then a token the grammar rejects; the window's masks are the
    verification masks of the reference algorithm, bit for bit."""
    tok = testing.load_tokenizer(llama3)
    vocab = _vocab(llama3)
    forced = _forced(llama3)
    compiled = _compile(llama3, SCHEMAS['nested_order'], 'single')
    path = _path(llama3, 'nested_order', 'single')
    # forced drafts alone (guessed drafts: test_guess.py)
    manager = SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=testing.tokenizer_info(llama3),
                                 sparse_masks=False, guess_drafts=False)
    for start in range(0, len(path), 3):
        committed = {0: new_matcher(compiled), 2: new_matcher(compiled)}
        for t in path[:start]:
            assert committed[0].accept_token(t)
        drafts = manager.propose(committed, 3, k, session_ids=[10, 11, 12], filler=7)
        assert drafts.shape == (3, k) and drafts.dtype == torch.long
        assert drafts[1].tolist() == [7] * k, 'unguided rows draft the filler'
        counts = manager.forced_counts([10, 11, 12])
        assert counts[1] == 0
        for row in (0, 2):
            expect = forced_drafts(committed[row], k, vocab, forced)
            assert counts[row] == len(expect), 'forced_counts: the forced drafts of each row'
            assert drafts[row, :len(expect)].tolist() == expect
            if len(expect) < k:
                # the first unforced position drafts a token the grammar rejects there
                fork = committed[row].fork()
                for t in expect:
                    fork.accept_token(t)
                assert not testing.allowed_tokens(fork, vocab)[drafts[row, len(expect)]]
        kept = manager.verification_bitmask(committed, drafts, [10, 11, 12])
        reference = verification_bitmask(committed, drafts, vocab)
        rows = [r * (k + 1) + i for r in (0, 2) for i in range(k + 1)]
        assert torch.equal(unpack_bitmask(kept[rows], vocab), unpack_bitmask(reference[rows], vocab))
        assert manager.num_kept_windows == 0


@pytest.mark.parametrize('sparse', [True, False], ids=['sparse', 'dense'])
def test_a_window_masks_no_row_that_is_no_longer_guided(llama3, sparse):
    """Defect: verification reused a drafting window's masks whole when every guided row of the batch sat where the
    window had it, also when a row the window had guided now held another, unguided request (a guided request ended
    or was preempted and an unguided one was prefilled into its place): the unguided request took the other one's
    grammar (an ended grammar allows only stop tokens: it wrote ``<|end_of_text|>`` with ``ignore_eos``)."""
    vocab = _vocab(llama3)
    compiled = _compile(llama3, SCHEMAS['nested_order'], 'single')
    manager = SpecGrammarManager(vocab, tokenizer=testing.load_tokenizer(llama3),
                                 tokenizer_info=testing.tokenizer_info(llama3), sparse_masks=sparse,
                                 guess_drafts=False)
    k = 3
    committed = {0: xgr.GrammarMatcher(compiled), 2: xgr.GrammarMatcher(compiled)}
    drafts = manager.propose(committed, 3, k, session_ids=[10, 11, 12], filler=7)
    # session 12 is gone; session 13, unguided, is row 2 now; rows 0 and 1 are as they were
    guided = {0: committed[0]}
    bitmask = manager.verification_bitmask(guided, drafts, [10, 11, 13])
    logits = manager.apply_(torch.zeros(3 * (k + 1), vocab), bitmask, guided, k + 1)
    assert torch.isfinite(logits[2 * (k + 1):]).all(), 'the unguided row took the grammar of the row before it'
    assert not torch.isfinite(logits[:k + 1]).all(), 'the guided row is masked'
    assert torch.isfinite(logits[k + 1:2 * (k + 1)]).all()


def test_propose_without_guided_rows_does_no_grammar_work():
    manager = SpecGrammarManager(1000, forced_drafts=False)
    drafts = manager.propose({}, 4, 3, filler=5)
    assert drafts.tolist() == [[5] * 3] * 4
    assert manager.num_kept_windows == 0


@pytest.mark.parametrize('with_map', [False, True])
def test_advance_drafts_the_forced_token_whatever_the_draft_chose(llama3, with_map, new_matcher):
    """Draft-model windows: a forced position takes the grammar's token in place, even one an Eagle3 draft
    vocabulary lacks."""
    tok = testing.load_tokenizer(llama3)
    vocab = _vocab(llama3)
    compiled = _compile(llama3, SCHEMAS['person'], 'single')
    expect = forced_drafts(new_matcher(compiled), 3, vocab, _forced(llama3))
    assert len(expect) == 3
    ids = None
    if with_map:
        # a draft vocabulary without any of the forced tokens
        keep = torch.ones(vocab, dtype=torch.bool)
        keep[expect] = False
        ids = torch.nonzero(keep).flatten()[:4000]
    manager = SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=testing.tokenizer_info(llama3))
    committed = {1: new_matcher(compiled)}
    window = manager.begin_draft(committed, 2, 3, draft_id_to_target_id=ids)
    width = vocab if ids is None else ids.numel()
    chosen = []
    for position in range(3):
        logits = torch.randn(2, width)
        window.mask_logits_(logits)
        draft = logits.argmax(-1, keepdim=True)
        if ids is not None:
            draft = ids[draft]
        unguided = int(draft[0])
        assert window.forced_tokens(position) == {1: expect[position]}
        window.advance(draft)
        assert int(draft[1]) == expect[position], 'overwritten in place'
        assert int(draft[0]) == unguided
        chosen.append(int(draft[1]))
    window.wait()
    assert window.drafts[1] == expect and not window.dead
    assert window.forced_count(1) == 3 and window.forced_count(0) == 0

    off = SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=testing.tokenizer_info(llama3),
                             forced_drafts=False)
    window = off.begin_draft({1: new_matcher(compiled)}, 2, 1, draft_id_to_target_id=ids)
    logits = torch.zeros(2, width)
    window.mask_logits_(logits)
    draft = logits.argmax(-1, keepdim=True)
    draft = draft if ids is None else ids[draft]
    before = draft.clone()
    window.advance(draft)
    assert torch.equal(draft, before), 'forced_drafts=False leaves the draft model its choice'
    assert window.forced_count(1) == 0


def test_forced_tokens_of_a_window_at_every_position(llama3, new_matcher):
    """The worker finds forced tokens while it fills; positions whose fork died have none."""
    tok = testing.load_tokenizer(llama3)
    vocab = _vocab(llama3)
    compiled = testing.grammar_compiler(llama3).compile_regex('[0-9]-abc')
    window = DraftGrammar({0: new_matcher(compiled)}, 1, vocab, 3, forced=True, tokenizer=_forced(llama3))
    assert window.forced_tokens(0) == {}, 'any digit'
    window.advance(tok.encode('7', add_special_tokens=False))
    assert window.forced_tokens(1) == {0: tok.encode('-', add_special_tokens=False)[0]}
    window.advance([tok.encode('x', add_special_tokens=False)[0]])  # overwritten with the forced '-'
    assert window.forced_tokens(2) == {0: tok.encode('abc', add_special_tokens=False)[0]}
    assert tok.decode(window.drafts[0]) == '7-' and not window.dead

    dying = DraftGrammar({0: new_matcher(compiled)}, 1, vocab, 2, forced=True, tokenizer=_forced(llama3))
    dying.advance(tok.encode('x', add_special_tokens=False))  # not a digit: the fork dies
    assert dying.forced_tokens(1) == {} and dying.dead == {0}


def test_single_token_rows_from_numpy_and_torch_agree():
    allowed = np.zeros((1, 100), dtype=bool)
    allowed[0, 42] = True
    row = pack_bool_mask(torch.from_numpy(allowed))[0]
    assert single_allowed_token(row, 100) == single_allowed_token(row.numpy(), 100) == 42
    assert xgr.get_bitmask_shape(1, 100)[1] == row.shape[0]


@pytest.mark.parametrize('vocab_size', [817, 1000, 1024])
def test_single_allowed_tokens_of_a_block_equal_the_row_by_row_answer(vocab_size):
    gen = torch.Generator().manual_seed(vocab_size)
    rows = []
    for token in (0, 31, 32, vocab_size - 1):
        one = torch.zeros(vocab_size, dtype=torch.bool)
        one[token] = True
        two = one.clone()
        two[(token + 1) % vocab_size] = True
        two_words = one.clone()
        two_words[(token + 40) % vocab_size] = True
        rows += [one, two, two_words]
    rows.append(torch.zeros(vocab_size, dtype=torch.bool))
    rows.append(torch.rand(vocab_size, generator=gen) < 0.5)
    block = pack_bool_mask(torch.stack(rows))  # padding bits of the last word set, as xgrammar's allocate does
    expected = [single_allowed_token(row, vocab_size) for row in block]
    assert expected.count(None) < len(expected)
    assert single_allowed_tokens(block, vocab_size) == expected
    assert single_allowed_tokens(block.numpy(), vocab_size) == expected
    assert single_allowed_tokens(allocate_bitmask(3, vocab_size), vocab_size) == [None] * 3


def test_extended_by_allowed_equals_checking_every_extension(llama3):
    forced = _forced(llama3)
    vocab = forced.decoded_vocab
    size = _vocab(llama3)
    gen = torch.Generator().manual_seed(7)
    quote, brace = forced.encode('"')[0], forced.encode('}')[0]
    tokens = [quote, brace, forced.encode(' ')[0], forced.encode('{"')[0]]
    for token in tokens:
        extensions = forced.extensions(token).tolist()
        assert all(vocab[t].startswith(vocab[token]) and len(vocab[t]) > len(vocab[token]) for t in extensions)
        for density in (0.0, 1e-4, 0.5):
            allowed = torch.rand(size, generator=gen) < density
            if density == 0.0 and extensions:
                allowed[extensions[-1]] = True  # one extension, the last of the sorted ones
            mask = pack_bool_mask(allowed.reshape(1, -1))[0]
            expected = any(bool(allowed[t]) for t in extensions)
            # twice: the first call builds the token's bits, the second reads them
            assert forced.extended_by_allowed(token, mask) == expected
            assert forced.extended_by_allowed(token, mask.numpy()) == expected
    assert forced.extensions(quote).size > 100  # the case the bits are for: thousands of tokens start with '"'


class _JumpCounter:
    """Counts GrammarMatcher.find_jump_forward_string calls and the characters they return."""

    def __init__(self, monkeypatch):
        self.calls = self.chars = 0
        original = xgr.GrammarMatcher.find_jump_forward_string

        def counted(matcher):
            text = original(matcher)
            self.calls += 1
            self.chars += len(text)
            return text

        monkeypatch.setattr(xgr.GrammarMatcher, 'find_jump_forward_string', counted)


@pytest.mark.parametrize('method', ['propose', 'window'])
def test_a_long_forced_literal_is_read_once_not_at_every_position(llama3, method, monkeypatch):
    """regex a{100000} forces 100,000 characters; xgrammar builds the whole string on every call, so reading it at
    every position of every step held the worker (and every other request) for seconds per token at a{1000000}."""
    from lmdeploy_guided_spec import GrammarWorker
    compiled = testing.grammar_compiler(llama3).compile_regex('a{100000}')
    tokenizer = testing.load_tokenizer(llama3)
    runs = {}
    for memo in (True, False):
        manager = SpecGrammarManager(_vocab(llama3), worker=GrammarWorker(inline=True), pin_memory=False,
                                     sparse_masks=False, tokenizer=tokenizer, guess_drafts=False)
        if not memo:
            manager.jumps = None
        counter = _JumpCounter(monkeypatch)
        committed = xgr.GrammarMatcher(compiled)
        drafts = []
        for _ in range(8):
            if method == 'propose':
                tokens = manager.propose({0: committed}, 1, 3, session_ids=[5])[0].tolist()
            else:
                window = manager.begin_draft({0: committed}, 1, 3, session_ids=[5])
                tokens = []
                for _ in range(3):
                    chosen = torch.zeros(1, 1, dtype=torch.long)  # the draft model's choice, replaced
                    window.advance(chosen)
                    tokens.append(int(chosen[0, 0]))
            manager.verification_bitmask({0: committed}, [tokens], [5])
            # every draft is accepted (the target's bonus token left out)
            assert manager.commit({0: committed}, [tokens], session_ids=[5]) == {0: 3}
            drafts.append(tokens)
        runs[memo] = drafts, counter.calls, counter.chars
        monkeypatch.undo()
    (with_memo, calls, chars), (without, calls_before, _) = runs[True], runs[False]
    assert with_memo == without, 'the memo changes no draft'
    text = tokenizer.decode([t for d in with_memo for t in d])
    assert text == 'a' * len(text) and len(text) > 24
    assert calls == 1 and chars == 100_000, (calls, chars)
    assert calls_before >= 8 * 3, calls_before  # before: at every draft position of every step


@pytest.mark.parametrize('method', ['propose', 'begin_draft', 'guess'])
def test_a_state_inside_a_character_whose_rest_is_forced(llama3, method, new_matcher):
    """``\\s`` takes U+00A0 (bytes C2 A0): after the byte token C2 the grammar forces the byte A0. Where more than
    one token starts with it (A0 alone, A0 ED ... before Hangul), the forced text is read from xgrammar, whose
    jump-forward string of that state is half a character: Python cannot decode it (UnicodeDecodeError in the grammar
    worker, for a regex_schema of Korean words and a sampled byte token). Nothing whole is forced there: the drafts
    are free, the windows and the commit go on."""
    from lmdeploy_guided_spec import GrammarWorker
    from lmdeploy_guided_spec.step import has_ended
    info = testing.tokenizer_info(llama3)
    c2, a0 = info.decoded_vocab.index(b'\xc2'), info.decoded_vocab.index(b'\xa0')
    compiled = testing.grammar_compiler(llama3).compile_regex(r'\s*[\uac00-\ud7a3]+')
    manager = SpecGrammarManager(_vocab(llama3), worker=GrammarWorker(inline=True), pin_memory=False,
                                 sparse_masks=False, tokenizer=testing.load_tokenizer(llama3),
                                 guess_drafts=method == 'guess')
    committed = new_matcher(compiled)
    assert committed.accept_token(c2)
    assert not has_ended(committed)
    forced = _forced(llama3)
    mask = allocate_bitmask(1, _vocab(llama3))
    committed.fill_next_token_bitmask(mask)
    forced_drafts(committed, 3, _vocab(llama3), forced)
    if method == 'begin_draft':
        window = manager.begin_draft({0: committed}, 1, 3, session_ids=[5])
        tokens = []
        for _ in range(3):
            chosen = torch.full((1, 1), a0, dtype=torch.long)
            window.advance(chosen)
            tokens.append(int(chosen[0, 0]))
    else:
        tokens = manager.propose({0: committed}, 1, 3, session_ids=[5], prompt_ids=[[1, 2, 3]])[0].tolist()
    manager.verification_bitmask({0: committed}, [tokens], [5])
    # the target writes the rest of the character
    assert manager.commit({0: committed}, [[a0]], session_ids=[5]) == {0: 1}
    assert manager.pop_failures() == {}
    assert committed.accept_string('가')
