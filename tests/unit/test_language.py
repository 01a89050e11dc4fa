"""Grammars whose language is empty (defect 5 of the deployment issue): found on the rules xgrammar prints, with no
refusal of a grammar that has instances."""
import glob
import json
from pathlib import Path

import pytest
import xgrammar as xgr

from lmdeploy_guided_spec.language import language_is_empty

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
# the project's benchmark schemas, and JSONSchemaBench's sample where the workspace has it
SCHEMA_DIRS = [ROOT / 'benchmarks' / 'data' / 'forced_schemas', ROOT.parent / 'shared' / 'data' / 'jsonschemabench']

EMPTY = {
    'self reference': {'$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'},
    'required self': {'type': 'object', 'properties': {'a': {'$ref': '#/$defs/x'}}, 'required': ['a'],
                      '$defs': {'x': {'type': 'object', 'properties': {'b': {'$ref': '#/$defs/x'}},
                                      'required': ['b']}}},
}
NOT_EMPTY = {
    'object': {'type': 'object'},
    'optional self': {'$defs': {'n': {'type': 'object', 'properties': {'c': {'$ref': '#/$defs/n'}}}},
                      '$ref': '#/$defs/n'},
    'array of self': {'$defs': {'n': {'type': 'array', 'items': {'$ref': '#/$defs/n'}}}, '$ref': '#/$defs/n'},
    'pattern key': {'type': 'object', 'patternProperties': {'^[a-z_-]{1,9}$': {'type': 'integer'}}},
    'optional property of no instance': {'type': 'object', 'properties': {
        'a': {'type': 'string', 'pattern': '^[^\\s\\S]$'}}},
}
EMPTY['string that matches no character'] = {'type': 'string', 'pattern': '^[^\\s\\S]$'}
EMPTY['required property of no instance'] = {'type': 'object', 'properties': {
    'a': {'type': 'string', 'pattern': '^[^\\s\\S]$'}}, 'required': ['a']}
# regexes whose character classes match nothing (xgrammar prints them as negated classes of every code point), and
# some that match something
EMPTY_REGEXES = ['[^\\s\\S]', 'a[^\\s\\S]', '[^\\d\\D]+', '[^\\x00-\\U0010FFFF]', '(x|y)[^\\w\\W]z']
NOT_EMPTY_REGEXES = ['a[^\\s\\S]|b', '[^a]', '[\\s\\S]', 'x*[^\\s\\S]?', '[^"\\\\]', '[\\]\\-]', '[^\\x00-\\U0010FFFE]',
                     '[^\\n]*']


@pytest.mark.parametrize('regex', EMPTY_REGEXES)
def test_classes_that_match_nothing_make_a_language_empty(regex):
    assert language_is_empty(xgr.Grammar.from_regex(regex))


@pytest.mark.parametrize('regex', NOT_EMPTY_REGEXES)
def test_classes_that_match_something_do_not(regex):
    assert not language_is_empty(xgr.Grammar.from_regex(regex))


@pytest.mark.parametrize('name', sorted(EMPTY))
def test_empty_languages_are_found(name):
    assert language_is_empty(xgr.Grammar.from_json_schema(json.dumps(EMPTY[name])))


@pytest.mark.parametrize('name', sorted(NOT_EMPTY))
def test_schemas_with_instances_are_not_empty(name):
    assert not language_is_empty(xgr.Grammar.from_json_schema(json.dumps(NOT_EMPTY[name])))


def test_regex_ebnf_and_builtin_json():
    assert not language_is_empty(xgr.Grammar.from_regex(r'[a-z]+(x|y)*'))
    assert not language_is_empty(xgr.Grammar.builtin_json_grammar())
    assert language_is_empty('root ::= "a" root')
    assert not language_is_empty('root ::= "a" root | "b"')
    assert not language_is_empty('root ::= something we do not read ((')


def test_no_real_world_schema_is_refused():
    """Every benchmark schema xgrammar converts has instances: none may be called empty."""
    files = sorted(path for folder in SCHEMA_DIRS for path in glob.glob(str(folder / '**' / '*.json'), recursive=True))
    converted = 0
    for path in files:
        schema = json.loads(Path(path).read_text())
        if 'forced_schemas' in path:
            schema = schema['schema']
        try:
            grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
        except Exception:  # noqa: BLE001 - schemas xgrammar cannot convert are the entry check's business
            continue
        converted += 1
        assert not language_is_empty(grammar), path
    assert converted >= 20


def test_answers_are_cached_by_grammar_text(monkeypatch):
    """A request is checked more than once on its way to the engine: the second check of the same grammar does
    not parse it again; another grammar, or another start rule, does."""
    from lmdeploy_guided_spec import language
    calls = []
    real = language._rules
    monkeypatch.setattr(language, '_rules', lambda text: calls.append(len(text)) or real(text))
    schema = {'type': 'object', 'properties': {'cached_answer_probe': {'type': 'integer'}}, 'required': []}
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema))
    assert language_is_empty(grammar) is False
    assert language_is_empty(xgr.Grammar.from_json_schema(json.dumps(schema))) is False
    assert len(calls) == 1
    loop = xgr.Grammar.from_json_schema(json.dumps({'$defs': {'probe': {'$ref': '#/$defs/probe'}},
                                                    '$ref': '#/$defs/probe'}))
    assert language_is_empty(loop) is True and language_is_empty(loop) is True
    assert len(calls) == 2
    language_is_empty(grammar, root='no_such_rule')
    assert len(calls) == 3


def test_the_analysis_is_linear_in_the_grammar():
    """Optional properties become a chain of rules that one long rule refers to all of: the analysis looked at that
    rule again each time a rule of the chain was found to derive a string (4,000 optional properties: 54 s of
    Python, twice on the way to the engine, holding the interpreter lock). Now it costs little more than reading
    the rules (1 to 2 times here). Each is the best of three timings, and the bound leaves room for a busy machine
    (the suite runs beside another; one timing there was 5 times): the old analysis was 150 times."""
    import time

    from lmdeploy_guided_spec import language
    schema = {'type': 'object', 'properties': {f'field_{i}': {'type': 'string'} for i in range(4000)}}
    text = str(xgr.Grammar.from_json_schema(json.dumps(schema)))

    def best_of_three(work):
        timings = []
        for _ in range(3):
            start = time.perf_counter()
            work()
            timings.append(time.perf_counter() - start)
        return min(timings)

    parse_s = best_of_three(lambda: language._rules(text))
    assert language._language_is_empty(text, 'root') is False
    analysis_s = best_of_three(lambda: language._language_is_empty(text, 'root'))
    assert analysis_s < 10 * parse_s + 1, f'{analysis_s:.2f} s, reading the rules {parse_s:.2f} s'
