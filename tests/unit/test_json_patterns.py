"""A JSON schema's ``pattern`` compiles exactly: the engine's compile of a schema (the compile service's ``_compile``,
which lmdeploy's own compiles share) accepts a string exactly when it is a JSON string whose value matches the
pattern. xgrammar 0.2.8 does not: its regex automaton accepts ``"00"`` for ``^(0|1\\d*)(x\\d+)?$``, and a pattern
with a character beyond ASCII becomes rules that take a raw quote or newline inside the string (``^.+é$`` accepts
``"a"é"``: not JSON) and, with nested quantifiers, cost more per token the longer the string."""
import json
import random
import re

import pytest
import xgrammar as xgr

from lmdeploy_guided_spec import regular, testing
from lmdeploy_guided_spec.compile import _compile

from grammars import mask_costs

pytestmark = pytest.mark.unit

# pattern: characters its strings are drawn from (quotes, backslashes and control characters among them)
PATTERNS = {
    r'^(0|1\d*)(x\d+)?$': '01x2"',  # xgrammar's automaton accepts "00"
    r'^(0|1\d*)(x[\d"\\\n]+)?$': '01x"\\\n\t',  # the same, with characters JSON escapes
    r'^[A-Za-zÀ-ÿ\s]+$': 'aZé \n\t"\x01',  # beyond ASCII: xgrammar's rules take a raw newline
    r'^.+é$': 'aé"\n\\\x7f',
    r'^([A-Za-zÀ-ÿ]+\s?)*$': 'aé \n"',  # beyond ASCII, nested quantifiers
    r'((\d+)\.)?(\d\d):(60|([0-5][0-9])):(60|([0-5][0-9]))': '0159.:',  # a benchmark schema's time pattern
}


def _matcher(schema: dict) -> xgr.GrammarMatcher:
    compiled = _compile(testing.grammar_compiler('llama3'), 'json_schema', json.dumps(schema), {'any_whitespace': True})
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)


def _accepts(matcher: xgr.GrammarMatcher, text: str) -> bool:
    matcher.reset()
    return matcher.accept_string(text) and matcher.is_terminated()


@pytest.mark.parametrize('pattern', list(PATTERNS))
def test_a_string_is_accepted_exactly_when_its_value_matches(pattern):
    """Random strings over the pattern's characters and their prefixes, written as ``json.dumps`` writes them
    (characters beyond ASCII as themselves; control characters, quotes and backslashes escaped): accepted exactly
    when the pattern matches the whole value; the same characters raw inside the string are never accepted."""
    matcher = _matcher({'type': 'string', 'pattern': pattern})
    rng = random.Random(0)
    alphabet = PATTERNS[pattern]
    strings = {''} | {''.join(rng.choice(alphabet) for _ in range(rng.randint(1, 8))) for _ in range(300)}
    # instances of the pattern (walks through its automaton, each step a character of the alphabet where one fits)
    # and each with one character more or less
    accepting, transitions = regular._automaton(pattern, loops_only=False)
    for _ in range(100):
        state, text = 0, ''
        while transitions[state] and not (accepting[state] and rng.random() < 0.2) and len(text) < 12:
            low, high, state = rng.choice(transitions[state])
            fits = [c for c in alphabet if low <= ord(c) <= high]
            text += rng.choice(fits) if fits else chr(rng.randint(low, min(high, low + 50)))
        at = rng.randint(0, len(text))
        strings |= {text, text[:at] + rng.choice(alphabet) + text[at:], text[:at] + text[at + 1:]}
    matched = 0
    for text in sorted(strings):
        # xgrammar's dot matches a newline too
        expected = re.fullmatch(pattern, text, re.DOTALL) is not None
        matched += expected
        assert _accepts(matcher, json.dumps(text, ensure_ascii=False)) == expected, (pattern, text)
        if any(ord(c) < 0x20 for c in text) or ('"' in text and '\\' not in text):
            raw = '"' + text + '"'
            assert not _accepts(matcher, raw), (pattern, raw)
    assert 50 < matched < len(strings) - 50, (matched, len(strings))


def test_the_inexact_automaton_and_raw_characters_inside_an_object():
    """Inside an object, as the engine compiles a response_format: the pattern's value is exact, the object's other
    keywords keep their meaning."""
    schema = {'type': 'object', 'properties': {
        'code': {'type': 'string', 'pattern': r'^(0|1\d*)(x\d+)?$'},
        'name': {'type': 'string', 'pattern': r'^[A-Za-zÀ-ÿ\s]+$'},
        'n': {'type': 'integer', 'minimum': 3}}, 'required': ['code', 'name', 'n'], 'additionalProperties': False}
    matcher = _matcher(schema)
    assert _accepts(matcher, '{"code": "10x3", "name": "Zoé\\nDupont", "n": 3}')
    assert not _accepts(matcher, '{"code": "00", "name": "Zoé", "n": 3}')
    assert not _accepts(matcher, '{"code": "0", "name": "Zoé\nDupont", "n": 3}')
    assert not _accepts(matcher, '{"code": "0", "name": "Zo"é", "n": 3}')
    assert not _accepts(matcher, '{"code": "0", "name": "Zoé", "n": 2}')
    assert not _accepts(matcher, '{"code": "0", "name": "Zoé", "n": 3, "x": 1}')


def test_the_cost_of_a_mask_stays_flat_along_a_patterned_string():
    """``^([A-Za-zÀ-ÿ]+\\s?)*$`` over words: xgrammar's compile cost 0.3 s per mask after 100 characters (20 s for
    the walk); the exact rules a millisecond at most."""
    info = testing.tokenizer_info('llama3')
    matcher = _matcher({'type': 'string', 'pattern': r'^([A-Za-zÀ-ÿ]+\s?)*$'})
    ids = testing.load_tokenizer('llama3').encode('"' + 'Zoé écrit une lettre ' * 12 + '"', add_special_tokens=False)
    costs = mask_costs(matcher, ids, info.vocab_size)
    assert matcher.is_terminated()
    late, early = max(costs[-10:]), max(costs[:10])
    assert late < max(0.02, 5 * early), (early, late)


@pytest.mark.parametrize('pattern', [
    r'^[a-z]+(-[a-z]+)*$', r'^[0-9]{4}-[0-9]{2}$', r'^\d+$',  # exact in xgrammar's automaton
    r'^(?!tag|category)$',  # a lookahead: left to xgrammar
    r'^[a-z]{1,500}é$',  # more states than the automaton may have
])
def test_patterns_xgrammar_compiles_exactly_are_left_to_it(pattern):
    assert regular.exact_pattern_automaton(pattern) is None
    assert regular.exact_patterns_grammar({'type': 'string', 'pattern': pattern}) is None


def test_a_pattern_key_inside_an_instance_is_data():
    """A ``const`` whose value holds a ``pattern`` key: the value stays as written beside a pattern that gets exact
    rules (the same string in both places)."""
    inexact = r'^(0|1\d*)(x\d+)?$'
    schema = {'type': 'object', 'properties': {
        'code': {'type': 'string', 'pattern': inexact},
        'rule': {'const': {'pattern': inexact}}}, 'required': ['code', 'rule'], 'additionalProperties': False}
    matcher = _matcher(schema)
    # xgrammar writes a const compact
    rule = json.dumps({'pattern': inexact}, separators=(',', ':'))
    assert _accepts(matcher, f'{{"code": "10", "rule": {rule}}}')
    assert not _accepts(matcher, f'{{"code": "00", "rule": {rule}}}')


def test_properties_named_like_keywords_and_a_placeholder_the_schema_spells():
    """A property named ``default`` is a schema like any other (its pattern gets exact rules); a patternProperties key
    that spells the placeholder pattern keeps its own meaning."""
    inexact = r'^(0|1\d*)(x\d+)?$'
    schema = {'type': 'object', 'properties': {'default': {'type': 'string', 'pattern': inexact}},
              'patternProperties': {'^exactpattern0$': {'type': 'integer'}}, 'required': ['default'],
              'additionalProperties': False}
    matcher = _matcher(schema)
    assert _accepts(matcher, '{"default": "10", "exactpattern0": 1}')
    assert not _accepts(matcher, '{"default": "00"}')
    assert not _accepts(matcher, '{"default": "10", "10": 1}')


def test_a_pattern_property_name():
    """A ``patternProperties`` key is a pattern of property names: exact there too."""
    schema = {'type': 'object', 'patternProperties': {r'^(0|1\d*)(x\d+)?$': {'type': 'integer'},
                                                      r'^.+é$': {'type': 'boolean'}}, 'additionalProperties': False}
    matcher = _matcher(schema)
    assert _accepts(matcher, '{"10x2": 1, "a\\nbé": true}')
    assert not _accepts(matcher, '{"00": 1}')
    assert not _accepts(matcher, '{"a"é": true}')


def test_a_schema_without_such_patterns_is_xgrammars_own():
    schema = json.dumps({'type': 'object', 'properties': {'a': {'type': 'string', 'pattern': '^[a-z]+$'}}})
    compiler = testing.grammar_compiler('llama3')
    assert regular.exact_patterns_grammar(schema) is None
    assert str(_compile(compiler, 'json_schema', schema, {}).grammar) == \
        str(compiler.compile_json_schema(schema).grammar)


# (minLength, maxLength) of a string property, and values of every kind: control characters, quotes, backslashes,
# characters beyond ASCII and beyond the BMP
LENGTHS = [(None, 3), (2, None), (1, 4), (0, 0)]
VALUES = ['', 'a', 'ab', 'abc', 'abcd', 'a\tb', 'a\nb', 'a"b', 'a\\b', '\x14', 'é', 'éé\x7f', '😀', 'a/b']


@pytest.mark.parametrize('low, high', LENGTHS)
def test_a_string_with_a_length_is_a_json_string(low, high):
    """xgrammar 0.2.8 writes the characters of a string with ``minLength`` or ``maxLength`` as ``[^"\\\r\n]``: a
    raw tab or control character (sampled output came back with a raw 0x14 and finish_reason ``stop``: not JSON).
    The engine's compile accepts exactly the JSON texts of values of the right length that need no escape (escapes
    stay out, as in xgrammar's rule: allowing them made a maxLength of 1000 compile for minutes)."""
    bounds = {k: v for k, v in (('minLength', low), ('maxLength', high)) if v is not None}
    schema = {'type': 'object', 'properties': {'s': {'type': 'string', **bounds}}, 'required': ['s'],
              'additionalProperties': False}
    matcher = _matcher(schema)

    def expected(text: str) -> bool:
        try:
            value = json.loads(text)['s']
        except ValueError:
            return False  # a raw control character, a quote that ends the string early
        fits = (low is None or len(value) >= low) and (high is None or len(value) <= high)
        return fits and '\\' not in text

    accepted = 0
    for value in VALUES:
        # escaped as json.dumps writes it (ASCII only, or as it is), and unescaped
        for text in (json.dumps({'s': value}), json.dumps({'s': value}, ensure_ascii=False), '{"s": "' + value + '"}'):
            assert _accepts(matcher, text) is expected(text), text
            accepted += expected(text)
    assert accepted >= 3
