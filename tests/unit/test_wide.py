"""The wide objects of a grammar's schemas (lmdeploy_guided_spec.wide): the objects of thousands of optional
properties that the compile service probes on their own, wherever they sit."""
import json
from pathlib import Path

import pytest

from lmdeploy_guided_spec.tool_calls import document_or_calls_source
from lmdeploy_guided_spec.wide import WIDE_OPTIONAL_PROPERTIES, wide_objects

from grammars import wide_object

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
#: the repository's own real-world schemas, and JSONSchemaBench's where the checkout sits beside the shared data
SCHEMA_DIRS = [ROOT / 'benchmarks' / 'data' / 'forced_schemas', ROOT.parent / 'shared' / 'data' / 'jsonschemabench']
#: twenty words the output must write before the object: more tokens than the probe of the whole grammar walks
INTRO = {'const': 'word ' * 20}


def _places(kind: str, source, **kwargs) -> list[tuple[str, int]]:
    return [(wide.place, wide.optional) for wide in wide_objects(kind, source, **kwargs)]


def test_an_object_behind_a_long_const_is_found_and_the_top_too():
    hidden = {'type': 'object', 'properties': {'intro': INTRO, 'data': wide_object(600)},
              'required': ['intro', 'data']}
    assert _places('json_schema', json.dumps(hidden)) == [('/properties/data', 600)]
    assert _places('json_schema', hidden) == [('/properties/data', 600)]
    # the top of a schema: a long required property before its optional ones hides them from the probe too
    top = {'type': 'object', 'properties': {'intro': INTRO, **wide_object(600)['properties']}, 'required': ['intro']}
    assert _places('json_schema', top) == [('', 600)]


def test_required_properties_are_not_counted():
    names = [f'field_{i}' for i in range(600)]
    half = {**wide_object(600), 'required': names[:300]}
    everything = {**wide_object(600), 'required': names}
    for inner, expected in ((half, []), (everything, [])):
        assert _places('json_schema', {'type': 'array', 'items': inner}) == expected
    assert _places('json_schema', {'type': 'array', 'items': half}, least=300) == [('/items', 300)]
    assert WIDE_OPTIONAL_PROPERTIES == 512


def test_wide_objects_in_definitions_and_alternatives_widest_first():
    schema = {'$defs': {'Big': wide_object(700), 'Small': wide_object(10)},
              'anyOf': [{'$ref': '#/$defs/Big'}, {'type': 'object', 'properties': {'x': wide_object(900)}}]}
    found = wide_objects('json_schema', schema)
    assert [(w.place, w.optional) for w in found] == [('/anyOf/1/properties/x', 900), ('/$defs/Big', 700)]
    # each alone keeps the definitions around it, so that a reference inside it resolves
    assert found[0].schema['$defs'].keys() == {'Big', 'Small'}
    # ... merged with its own
    own = {'$defs': {'Outer': {'type': 'integer'}}, 'type': 'array',
           'items': {**wide_object(600), '$defs': {'Inner': {'type': 'string'}}}}
    assert wide_objects('json_schema', own)[0].schema['$defs'].keys() == {'Outer', 'Inner'}
    assert found[0].schema['properties'] == wide_object(900)['properties']
    # the skeleton: the same keys, integer values
    assert set(found[0].skeleton['properties']) == set(found[0].schema['properties'])
    assert {json.dumps(v) for v in found[0].skeleton['properties'].values()} == {'{"type": "integer"}'}
    # at most `most`
    assert len(wide_objects('json_schema', schema, most=1)) == 1


def test_a_key_with_a_slash_is_escaped_in_the_place():
    schema = {'type': 'object', 'properties': {'a/b~c': wide_object(600)}}
    assert _places('json_schema', schema) == [('/properties/a~1b~0c', 600)]


def test_tool_parameters_are_found_at_their_top():
    """A tool's parameters follow the call's header (more tokens than the probe walks): their top counts."""
    tools = {'type': 'structural_tag', 'format': {'type': 'triggered_tags', 'triggers': ['<tool_call>'], 'tags': [
        {'type': 'tag', 'begin': '<tool_call>\n{"name": "a", "arguments": ', 'end': '}\n</tool_call>',
         'content': {'type': 'json_schema', 'json_schema': wide_object(10)}},
        {'type': 'tag', 'begin': '<tool_call>\n{"name": "b", "arguments": ', 'end': '}\n</tool_call>',
         'content': {'type': 'json_schema', 'json_schema': wide_object(600)}}]}}
    assert [optional for _, optional in _places('structural_tag', json.dumps(tools))] == [600]
    source = document_or_calls_source('json_schema', {'type': 'object', 'properties': {'x': wide_object(700)}}, {},
                                      tools)
    # the widest first: the document's object, then the call's parameters (the tag's index of its schemas)
    (document, width), (call, call_width) = _places('document_or_calls', source)
    assert (document, width, call_width) == ('[0]/properties/x', 700, 600) and call in ('[1]', '[2]'), call


@pytest.mark.parametrize('kind,source', [('regex', '[a-z]+'), ('ebnf', 'root ::= "a"'), ('json_schema', '{bad'),
                                         ('structural_tag', 'null'), ('document_or_calls', '[]'),
                                         ('builtin_json', None)])
def test_other_sources_have_none(kind, source):
    assert wide_objects(kind, source) == []


def test_no_real_world_schema_has_a_wide_object():
    """Ordinary schemas pay no probe of their own (the widest object of JSONSchemaBench has 230 optional
    properties)."""
    paths = sorted(path for folder in SCHEMA_DIRS for path in folder.rglob('*.json'))
    assert len(paths) >= 20
    for path in paths:
        assert wide_objects('json_schema', path.read_text()) == [], path
    bench = [path for path in paths if 'jsonschemabench' in path.parts]
    if bench:  # its widest object is found with a lower bar
        assert any(wide_objects('json_schema', path.read_text(), least=200) for path in bench)
