"""The list of JSON-schema keywords xgrammar does not enforce, checked against the installed xgrammar itself.

Each UNENFORCED case is a schema using one keyword and an instance the schema forbids: the test compiles the schema
as the engine does (``any`` whitespace; a pattern xgrammar does not compile exactly gets exact rules) and asserts
that the matcher ACCEPTS the instance and that ``unenforced_keywords`` names the keyword. Each ENFORCED case
asserts the opposite: the matcher rejects the instance and nothing is named. An xgrammar that starts (or stops)
enforcing a keyword fails here; move the case and the keyword in ``lmdeploy_guided_spec/unenforced.py`` and the
docs' list (usage.md) with it.
"""
import glob
import json
from pathlib import Path

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from lmdeploy_guided_spec.regular import exact_patterns_grammar
from lmdeploy_guided_spec.unenforced import (
    KNOWN_FORMATS,
    strict_tool_error,
    tag_unenforced_keywords,
    unenforced_keywords,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIRS = [ROOT / 'benchmarks' / 'data' / 'forced_schemas', ROOT.parent / 'shared' / 'data' / 'jsonschemabench']
AB = {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}

# name: (schema, instance the schema forbids, what unenforced_keywords names)
UNENFORCED = {
    'allOf': ({'allOf': [{'type': 'integer'}, {'type': 'integer', 'minimum': 5}]}, '3', 'allOf at #'),
    # xgrammar 0.2.8 makes the whole object that holds the allOf any JSON value: its own type and required go too
    'allOf beside type': ({'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a'],
                           'allOf': [{'required': ['a']}, {'properties': {'a': {'minimum': 1}}}]}, '"a string"',
                          'allOf at #'),
    'oneOf overlapping': ({'oneOf': [{'type': 'integer', 'minimum': 0}, {'type': 'integer', 'maximum': 10}]}, '5',
                          'oneOf at #'),
    'oneOf integer and number': ({'oneOf': [{'type': 'integer'}, {'type': 'number'}]}, '1', 'oneOf at #'),
    'not': ({'type': 'integer', 'not': {'const': 3}}, '3', 'not at #'),
    'if/then': ({'type': 'object', 'properties': AB, 'if': {'properties': {'a': {'const': 1}}},
                 'then': {'required': ['b']}}, '{"a": 1}', 'if at #'),
    'dependentRequired': ({'type': 'object', 'properties': AB, 'dependentRequired': {'a': ['b']}}, '{"a": 1}',
                          'dependentRequired at #'),
    'dependentSchemas': ({'type': 'object', 'properties': AB, 'dependentSchemas': {'a': {'required': ['b']}}},
                         '{"a": 1}', 'dependentSchemas at #'),
    'dependencies': ({'type': 'object', 'properties': AB, 'dependencies': {'a': ['b']}}, '{"a": 1}',
                     'dependencies at #'),
    'uniqueItems': ({'type': 'array', 'items': {'type': 'integer'}, 'uniqueItems': True}, '[1, 1]',
                    'uniqueItems at #'),
    'contains': ({'type': 'array', 'items': {'type': 'integer'}, 'contains': {'const': 5}}, '[1, 2]',
                 'contains at #'),
    'minContains': ({'type': 'array', 'items': {'type': 'integer'}, 'contains': {'const': 5}, 'minContains': 2},
                    '[1, 2]', 'contains at #'),
    'maxContains': ({'type': 'array', 'items': {'type': 'integer'}, 'contains': {'const': 5}, 'maxContains': 1},
                    '[5, 5]', 'contains at #'),
    'multipleOf on a number': ({'type': 'number', 'multipleOf': 0.5}, '0.3', 'multipleOf at #'),
    'format idn-email': ({'type': 'string', 'format': 'idn-email'}, '"nope"', "format 'idn-email' at #"),
    'format idn-hostname': ({'type': 'string', 'format': 'idn-hostname'}, '"no pe !"',
                            "format 'idn-hostname' at #"),
    'format iri': ({'type': 'string', 'format': 'iri'}, '"no pe"', "format 'iri' at #"),
    'format iri-reference': ({'type': 'string', 'format': 'iri-reference'}, '"no pe !"',
                             "format 'iri-reference' at #"),
    'format regex': ({'type': 'string', 'format': 'regex'}, '"("', "format 'regex' at #"),
    'external $ref': ({'$ref': 'https://example.com/schemas/x.json'}, '"anything"',
                      "$ref 'https://example.com/schemas/x.json' at #"),
    'external $ref in a property': ({'type': 'object', 'properties': {'a': {'$ref': 'other.json#/x'}},
                                     'required': ['a']}, '{"a": "z"}', "$ref 'other.json#/x' at #/properties/a"),
    '$anchor $ref': ({'$defs': {'i': {'$anchor': 'num', 'type': 'integer'}}, '$ref': '#num'}, '"a"',
                     "$ref '#num' at #"),
    '$dynamicRef': ({'$dynamicRef': '#x', '$defs': {'i': {'$dynamicAnchor': 'x', 'type': 'integer'}}}, '"a"',
                    '$dynamicRef at #'),
    'keywords next to $ref': ({'$defs': {'i': {'type': 'integer'}}, '$ref': '#/$defs/i', 'minimum': 5}, '3',
                              'minimum next to $ref at #'),
    'required next to $ref': ({'$defs': {'o': {'type': 'object', 'properties': {'a': {'type': 'integer'}}}},
                               '$ref': '#/$defs/o', 'required': ['a']}, '{}', 'required next to $ref at #'),
    'required of an undeclared property': ({'type': 'object', 'required': ['a']}, '{}',
                                           "required 'a' (not under properties) at #"),
    'required beside properties': ({'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['b']},
                                   '{"a": 1}', "required 'b' (not under properties) at #"),
    'minimum without type': ({'minimum': 5}, '3', 'minimum without type at #'),
    'minLength without type': ({'minLength': 5}, '"a"', 'minLength without type at #'),
    'format without type': ({'format': 'email'}, '"x"', 'format without type at #'),
    'minItems without type': ({'minItems': 2}, '[1]', 'minItems without type at #'),
}

# name: (schema, instance the schema forbids): xgrammar rejects it, and unenforced_keywords names nothing
ENFORCED = {
    'anyOf': ({'anyOf': [{'type': 'integer'}, {'type': 'string'}]}, 'true'),
    'allOf of one schema': ({'allOf': [{'type': 'integer', 'minimum': 5}]}, '3'),
    'oneOf of distinct types': ({'oneOf': [{'type': 'integer'}, {'type': 'string'}]}, 'true'),
    'oneOf tagged by a const': ({'oneOf': [
        {'type': 'object', 'properties': {'k': {'const': 'a'}, 'v': {'type': 'integer'}}, 'required': ['k', 'v']},
        {'type': 'object', 'properties': {'k': {'const': 'b'}, 'v': {'type': 'string'}}, 'required': ['k', 'v']}]},
        '{"k": "a", "v": "x"}'),
    'multipleOf on an integer': ({'type': 'integer', 'multipleOf': 3}, '4'),
    'minimum': ({'type': 'integer', 'minimum': 5}, '3'),
    'exclusiveMaximum': ({'type': 'integer', 'exclusiveMaximum': 5}, '5'),
    'minimum of a number': ({'type': 'number', 'minimum': 1.5}, '1.2'),
    'minLength': ({'type': 'string', 'minLength': 3}, '"ab"'),
    'maxLength': ({'type': 'string', 'maxLength': 2}, '"abc"'),
    'pattern': ({'type': 'string', 'pattern': '^[0-9]+$'}, '"ab"'),
    'minItems': ({'type': 'array', 'items': {'type': 'integer'}, 'minItems': 2}, '[1]'),
    'maxItems': ({'type': 'array', 'items': {'type': 'integer'}, 'maxItems': 1}, '[1, 2]'),
    'prefixItems': ({'type': 'array', 'prefixItems': [{'type': 'integer'}, {'type': 'string'}], 'items': False},
                    '[1, 2]'),
    'minProperties': ({'type': 'object', 'properties': AB, 'minProperties': 1}, '{}'),
    'maxProperties': ({'type': 'object', 'properties': AB, 'maxProperties': 1}, '{"a": 1, "b": 2}'),
    'propertyNames': ({'type': 'object', 'propertyNames': {'pattern': '^[a-z]+$'}}, '{"A1": 1}'),
    'required': ({'type': 'object', 'properties': {'a': {'type': 'integer'}}, 'required': ['a']}, '{}'),
    'additionalProperties false': ({'type': 'object', 'properties': {'a': {'type': 'integer'}},
                                    'additionalProperties': False}, '{"a": 1, "b": 2}'),
    'additionalProperties schema': ({'type': 'object', 'properties': {'a': {'type': 'integer'}},
                                     'additionalProperties': {'type': 'integer'}}, '{"b": "s"}'),
    'unevaluatedProperties': ({'type': 'object', 'properties': {'a': {'type': 'integer'}},
                               'unevaluatedProperties': False}, '{"a": 1, "b": 2}'),
    'const': ({'const': 3}, '4'),
    'enum': ({'enum': [1, 2]}, '3'),
    'type list': ({'type': ['integer', 'null']}, '"a"'),
    'local $ref': ({'$defs': {'i': {'type': 'integer'}}, '$ref': '#/$defs/i'}, '"a"'),
    'definitions $ref': ({'definitions': {'i': {'type': 'integer'}}, '$ref': '#/definitions/i'}, '"a"'),
    'items without type': ({'items': {'type': 'integer'}}, '["a"]'),
    'properties without type': ({'properties': {'a': {'type': 'integer'}}}, '{"a": "x"}'),
    **{f'format {f}': ({'type': 'string', 'format': f}, '"no pe !"') for f in sorted(KNOWN_FORMATS)},
    'exact pattern': ({'type': 'string', 'pattern': '^[a-z]+(-[a-z]+)*$'}, '"a--b"'),
    'exact pattern with a loop in a loop': ({'type': 'string', 'pattern': '^([a-z]+ ?)*[.]$'}, '"ab  ."'),
    # xgrammar's compile is not exact (its automaton; its rules of a pattern beyond ASCII), the engine's is
    'pattern xgrammar\'s automaton reads inexactly': ({'type': 'string', 'pattern': '^(0|1\\d*)(x\\d+)?$'}, '"00"'),
    'pattern beyond ASCII': ({'type': 'string', 'pattern': '^.+\u00e9$'}, '"a"\u00e9"'),
}


def _accepts(schema: dict, instance: str) -> bool:
    # the options of response_format whitespace "any", lmdeploy's default; the engine's grammar of the schema:
    # xgrammar's, with exact rules for the patterns xgrammar does not compile exactly
    ebnf = exact_patterns_grammar(json.dumps(schema), any_whitespace=True)
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True) if ebnf is None else \
        xgr.Grammar.from_ebnf(ebnf)
    return _is_grammar_accept_string(grammar, instance)


@pytest.mark.parametrize('name', UNENFORCED)
def test_xgrammar_does_not_enforce(name):
    schema, instance, named = UNENFORCED[name]
    assert _accepts(schema, instance), f'xgrammar now enforces {name}: move it to ENFORCED and out of the list'
    assert named in unenforced_keywords(schema)


@pytest.mark.parametrize('name', ENFORCED)
def test_xgrammar_enforces(name):
    schema, instance = ENFORCED[name]
    assert not _accepts(schema, instance), f'xgrammar does not enforce {name}: add it to unenforced_keywords'
    assert unenforced_keywords(schema) == []


def test_nested_uses_are_found_with_their_pointers():
    schema = {'type': 'object', 'properties': {
        'tags': {'type': 'array', 'items': {'type': 'string', 'format': 'iri'}, 'uniqueItems': True},
        'age': {'anyOf': [{'type': 'integer', 'not': {'const': 0}}, {'type': 'null'}]}},
        '$defs': {'x': {'if': {'type': 'integer'}, 'then': {'minimum': 1}}}}
    assert unenforced_keywords(schema) == [
        'uniqueItems at #/properties/tags', "format 'iri' at #/properties/tags/items",
        'not at #/properties/age/anyOf/0', 'if at #/$defs/x', 'then at #/$defs/x',
        'minimum without type at #/$defs/x/then']


def test_annotations_and_formats_of_a_schema_s_own_are_not_named():
    # validators ignore them as well: output that satisfies the rest satisfies the schema
    schema = {'type': 'object', 'format': 'grid', 'properties': {
        'a': {'$ref': '#/$defs/i', 'propertyOrder': 1, 'x-intellij-html-description': 'a', 'title': 'A'},
        'b': {'type': 'string', 'format': 'int32'}},
        '$defs': {'i': {'type': 'integer'}}}
    assert unenforced_keywords(schema) == []


def test_real_world_schemas_are_read_without_error():
    paths = [p for d in SCHEMA_DIRS for p in glob.glob(str(d / '**' / '*.json'), recursive=True)]
    assert paths
    for path in paths:
        schema = json.loads(Path(path).read_text())
        assert isinstance(unenforced_keywords(schema), list)


AGE_NOT_3 = {'type': 'object', 'properties': {'age': {'type': 'integer', 'not': {'const': 3}}}, 'required': ['age']}


def _tool(name, parameters, **extra):
    return {'type': 'function', 'function': {'name': name, 'parameters': parameters, **extra}}


def _deep(levels: int) -> dict:
    schema: dict = {'not': {}}
    for _ in range(levels):
        schema = {'items': schema}
    return schema


def test_a_strict_tool_with_unenforced_keywords_is_named():
    """strict_tool_error names the strict function whose parameters use a keyword xgrammar drops, and where."""
    message = strict_tool_error([_tool('fine', {'type': 'object'}, strict=True), _tool('age', AGE_NOT_3, strict=True)])
    assert message is not None and "'age' is strict" in message and 'not at #/properties/age' in message, message


@pytest.mark.parametrize('tools', [
    [_tool('age', AGE_NOT_3)], [_tool('age', AGE_NOT_3, strict=False)],
    [_tool('fine', {'type': 'object'}, strict=True)], [_tool('none', None, strict=True)], [{'type': 'web_search'}],
    None, [],
    # past the nesting limit: the entry check refuses it (the walk would recurse thousands of levels)
    [_tool('deep', _deep(3000), strict=True)],
], ids=['not strict', 'strict false', 'enforced', 'no parameters', 'not a function', 'none', 'empty', 'too deep'])
def test_other_tools_pass(tools):
    assert strict_tool_error(tools) is None


def test_the_schemas_of_a_structural_tag_are_walked():
    """Each json_schema format of an xgrammar structural tag (as lmdeploy builds them of the tools) is walked."""
    tag = {'type': 'structural_tag', 'format': {'type': 'triggered_tags', 'triggers': ['<tool_call>'], 'tags': [
        {'begin': '<tool_call>{"name": "a", "arguments": ', 'end': '}</tool_call>',
         'content': {'type': 'json_schema', 'json_schema': AGE_NOT_3}},
        {'begin': '<tool_call>{"name": "b", "arguments": ', 'end': '}</tool_call>',
         'content': {'type': 'json_schema', 'json_schema': {'type': 'array', 'uniqueItems': True}}}]}}
    assert sorted(tag_unenforced_keywords(tag)) == ['not at #/properties/age', 'uniqueItems at #']
    assert tag_unenforced_keywords({'type': 'structural_tag', 'format': {'type': 'const_string', 'value': 'x'}}) == []
    assert tag_unenforced_keywords('not a tag') == []
