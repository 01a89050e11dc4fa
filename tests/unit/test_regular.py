"""A ``regex_schema`` is compiled as a deterministic grammar: its masks and forced text equal those of xgrammar's own
compile of the regex token by token, and the cost of a mask stays flat where xgrammar's grows with the output (one
request's regex stalled every request: a URL regex cost 5 s per token after 12 tokens)."""
import random

import pytest
import torch
import xgrammar as xgr

from lmdeploy_guided_spec import regular, testing
from lmdeploy_guided_spec.compile import _compile

from grammars import mask_costs

pytestmark = pytest.mark.unit

# regexes whose xgrammar compile stays fast, so both can be walked side by side
EQUAL = [
    r'(a|b)*c', r'a+?b', r'(?:ab)+', r'\w+@\w+\.com', r'[^a-z]+', r'\s*x\s*', r'[\u4e00-\u9fff]+', r'[a-c-]+',
    r'[\d\s]+', r'"[^"]*"', r'-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?', r'(0|1\d*)(x\d+)?', r'\u00e9+',
    r'[^"\\]{2,3}\u00e9.x*?(a|b)+?', r'\{"name": "[a-z]+", "age": [0-9]{1,3}\}', r'(a|b)*a(a|b){6}', r'a{3,}',
    r'(ab){0,}c+', r'\U0001F600+', r'\t+(yes|no|maybe)', r'(\w+ ){0,30}\w+',
]
# regexes with nested or adjacent quantifiers, and text they match: xgrammar's masks grow costly along it
COSTLY = {
    r'(https?:\/\/)?([\da-z\.-]+)\.([a-z\.]{2,6})([\/\w \.-]*)*\/?':
        'https://www.example.com/' + 'docs/getting started/page-1.html/' * 6,
    r'([a-zA-Z0-9]+\s?)*': ' '.join(['hello', 'world', 'this', 'is', 'fine'] * 20),
    r'(a*b*)*c': 'ab' * 150,
    r'((a*)*)*b': 'a' * 300,
    # "up to 40 words": 0.5 s per mask from the first token on
    r'([a-z]+ ?){1,40}': 'hello world this is fine ' * 7,
}


def _jump_forward(matcher):
    try:
        return matcher.find_jump_forward_string()
    except UnicodeDecodeError as err:
        # xgrammar returns the bytes of a partial character; compare them
        return ('partial', err.object)


def _walk_side_by_side(a, b, info, rng, steps=24):
    """A random walk through both grammars' matchers (each token one the first allows): the masks and the
    jump-forward text are equal at every step."""
    vocab = info.vocab_size
    ma, mb = xgr.GrammarMatcher(a), xgr.GrammarMatcher(b)
    ba, bb = xgr.allocate_token_bitmask(1, vocab), xgr.allocate_token_bitmask(1, vocab)
    tokens, stops = [], set(info.stop_token_ids)
    for _ in range(steps):
        ma.fill_next_token_bitmask(ba)
        mb.fill_next_token_bitmask(bb)
        assert torch.equal(ba, bb), f'masks differ after tokens {tokens}'
        assert _jump_forward(ma) == _jump_forward(mb), f'forced text differs after tokens {tokens}'
        allowed = [t for t in torch.nonzero(testing.allowed_tokens(ma, vocab)).flatten().tolist()
                   if t not in stops]
        if not allowed:
            break
        token = rng.choice(allowed)
        tokens.append(token)
        assert ma.accept_token(token) and mb.accept_token(token)
    return len(tokens)


@pytest.mark.parametrize('regex', EQUAL)
def test_masks_and_forced_text_equal_xgrammars_compile_of_the_regex(regex):
    info = testing.tokenizer_info('llama3')
    compiler = testing.grammar_compiler('llama3')
    ebnf = regular.deterministic_grammar(regex)
    assert ebnf is not None, 'left to xgrammar'
    ours, theirs = compiler.compile_grammar(ebnf), compiler.compile_regex(regex)
    rng = random.Random(regex)
    assert sum(_walk_side_by_side(ours, theirs, info, rng) for _ in range(3)) > 0


def test_the_minimal_automaton_has_one_rule_per_state():
    # [0-9]+ written three ways is one loop; a code of two letters, a dash and digits is five states
    for regex in (r'[0-9]+', r'\d\d*', r'(\d|\d\d)+'):
        assert regular.deterministic_grammar(regex) == 'root ::= ([0-9] s1)\ns1 ::= "" | ([0-9] s1)\n'
    assert regular.deterministic_grammar(r'[A-Z]{2}-\d+').count('::=') == 5


@pytest.mark.parametrize('regex', list(COSTLY))
def test_the_cost_of_a_mask_stays_flat_along_the_output(regex):
    """The engine's compile of a regex (the compile service's): masks along 100 to 300 tokens of matching text.
    xgrammar's compile of these regexes took from 1 s to minutes for the same walk (the URL regex 5 s for the 12th
    token's mask alone); the deterministic grammar takes milliseconds, the last mask no more than the first few."""
    info = testing.tokenizer_info('llama3')
    compiled = _compile(testing.grammar_compiler('llama3'), 'regex', regex, {})
    tokenizer = testing.load_tokenizer('llama3')
    ids = tokenizer.encode(COSTLY[regex], add_special_tokens=False)
    matcher = xgr.GrammarMatcher(compiled)
    costs = mask_costs(matcher, ids, info.vocab_size)
    assert testing.allowed_tokens(matcher, info.vocab_size).any()
    # flat: the slowest of the last ten masks within 50 ms (a busy machine) and 5x the slowest of the first ten
    late, early = max(costs[-10:]), max(costs[:10])
    assert late < max(0.05, 5 * early), (early, late)


@pytest.mark.parametrize('regex', [
    r'abc', r'\d{3}-\d{4}', r'(foo|bar)?baz', r'.{2,5}',  # no loop: xgrammar's parse state stays bounded
    r'(?=a)a',  # a lookahead: xgrammar refuses it
    r'x{1000000}',  # a million states
    r'[a-z]{1,500}', r'(ab)+[a-z]{1,500}',  # more than 256 states
    r'(a|b)*a(a|b){14}',  # a deterministic automaton of 2^15 states
    r'[^\s\S]',  # no instance: the entry check refuses it with the reason
    r'a[^\s\S]|b',  # a dead end after a: the request that runs into it fails with the reason
])
def test_regexes_left_to_xgrammar(regex):
    try:
        xgr.Grammar.from_regex(regex)
    except RuntimeError:
        with pytest.raises(RuntimeError):
            regular.deterministic_grammar(regex)
        return
    assert regular.deterministic_grammar(regex) is None
    compiler = testing.grammar_compiler('llama3')
    assert str(regular.compile_regex(compiler, regex).grammar) == str(compiler.compile_regex(regex).grammar)
