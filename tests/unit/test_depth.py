"""The nesting limit of a response format's schema (:mod:`lmdeploy_guided_spec.depth`)."""
import glob
import json
import random
import time
from pathlib import Path

import pytest

from lmdeploy_guided_spec.depth import DEFAULT_MAX_DEPTH, MAX_DEPTH_ENV, depth_error, max_depth, nesting_depth

ROOT = Path(__file__).resolve().parents[2]
SCHEMA_DIRS = [ROOT / 'benchmarks' / 'data' / 'forced_schemas', ROOT.parent / 'shared' / 'data' / 'jsonschemabench']


def _chain(levels: int) -> dict:
    """``levels`` objects, each the only property of the one around it: 2 levels of JSON per object, and 1 for the
    string inside."""
    schema = {'type': 'string'}
    for _ in range(levels):
        schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return schema


def _format(schema) -> dict:
    return {'type': 'json_schema', 'json_schema': {'name': 'deep', 'schema': schema}}


def _reference(value) -> int:
    if isinstance(value, dict):
        return 1 + max((_reference(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_reference(v) for v in value), default=0)
    return 0


def test_depth_of_objects_arrays_and_their_text():
    rng = random.Random(0)

    def build(level):
        r = rng.random()
        if level > 6 or r < 0.3:
            return rng.choice([1, 'x', None, 'a [string] with {brackets} and \\" quotes', [], {}])
        if r < 0.65:
            return {f'k{i}': build(level + 1) for i in range(rng.randint(1, 3))}
        return [build(level + 1) for _ in range(rng.randint(1, 3))]

    for _ in range(300):
        value = {'root': build(0)}
        assert nesting_depth(value) == _reference(value) == nesting_depth(json.dumps(value)), value


def test_real_world_schemas_are_served():
    files = [path for folder in SCHEMA_DIRS for path in glob.glob(str(folder / '**' / '*.json'), recursive=True)]
    assert len(files) >= 20
    for path in files:
        schema = json.loads(Path(path).read_text())
        assert depth_error(_format(schema)) is None, path
        assert depth_error(_format(json.dumps(schema))) is None, path


@pytest.mark.parametrize('as_text', [False, True])
def test_a_schema_past_the_limit_is_named_at_once(as_text):
    """31 objects (63 levels) pass, 32 (65 levels) do not; 100,000 are refused in well under a second, without recursion
    (xgrammar needs 46 s for 400 such objects, Python's own walks fail past about 1,000 levels)."""
    def fmt(levels):
        schema = _chain(levels)
        return _format(json.dumps(schema) if as_text else schema)

    assert nesting_depth(_chain(31)) == 63
    assert depth_error(fmt(31)) is None
    message = depth_error(fmt(32))
    assert message is not None and MAX_DEPTH_ENV in message and f'{DEFAULT_MAX_DEPTH} levels' in message
    deep = '{"type":"array","items":' * 100_000 + '{}' + '}' * 100_000
    schema = json.loads('{}')
    for _ in range(100_000):
        schema = {'type': 'array', 'items': schema}
    start = time.perf_counter()
    assert depth_error(_format(deep if as_text else schema)) is not None
    assert time.perf_counter() - start < 1


def test_other_formats_and_shapes_are_left_to_the_entry_check():
    assert depth_error(None) is None
    assert depth_error({'type': 'regex_schema', 'regex_schema': '(' * 500 + 'a' + ')' * 500}) is None
    assert depth_error({'type': 'json_schema'}) is None
    assert depth_error({'type': 'json_schema', 'json_schema': 7}) is None


def test_the_schema_is_found_where_lmdeploy_reads_it():
    deep = _chain(40)
    for json_schema in ({'name': 'a', 'schema': deep}, {'name': 'a', 'json_schema': deep}, deep, json.dumps(deep)):
        assert depth_error({'type': 'json_schema', 'json_schema': json_schema}) is not None, json_schema


def _required_tool_call(parameters: dict) -> dict:
    """The structural tag lmdeploy 0.18 builds for tool_choice="required" (a Qwen 3 tool parser)."""
    import xgrammar as xgr
    tool = {'type': 'function', 'function': {'name': 'f', 'description': 'a tool', 'parameters': parameters}}
    return xgr.get_model_structural_tag('qwen_3', [tool], tool_choice='required').model_dump(mode='json')


def test_the_schemas_of_a_structural_tag_have_the_limit_of_a_json_schema():
    """The schemas of a structural tag (the tools of tool_choice="required"; a client's json_schema that lmdeploy
    wraps for GPT-OSS) go into xgrammar's conversion as a json_schema's do, with the same limit; the tag's own
    nesting of formats gets twice the limit."""
    files = [path for folder in SCHEMA_DIRS for path in glob.glob(str(folder / '**' / '*.json'), recursive=True)]
    deepest = max((json.loads(Path(path).read_text()) for path in files), key=nesting_depth)
    served = _required_tool_call(deepest)
    assert served['type'] == 'structural_tag' and nesting_depth(served) > nesting_depth(deepest)
    assert depth_error(served) is None
    message = depth_error(_required_tool_call(_chain(40)))
    assert message is not None and message.startswith('a json_schema of the structural_tag nests'), message
    assert MAX_DEPTH_ENV in message and f'{DEFAULT_MAX_DEPTH} levels' in message

    def wrapped(schema):
        return {'type': 'structural_tag', 'format': {'type': 'json_schema', 'json_schema': schema}}

    # what passes as a json_schema passes inside a tag, what does not, does not
    assert depth_error(wrapped(_chain(31))) is None and depth_error(_format(_chain(31))) is None
    assert depth_error(wrapped(_chain(32))) is not None and depth_error(_format(_chain(32))) is not None
    assert depth_error(wrapped(json.dumps(_chain(32)))) is not None
    # formats nested in formats, no schema at all
    tag = {'type': 'const_string', 'value': 'x'}
    for _ in range(100):
        tag = {'type': 'sequence', 'elements': [tag]}
    message = depth_error({'type': 'structural_tag', 'format': tag})
    assert message is not None and message.startswith('the structural_tag nests') and \
        f'{2 * DEFAULT_MAX_DEPTH} levels' in message


def test_the_calls_beside_a_document_have_the_limit_of_a_structural_tag():
    """A response format beside tools the model may call carries the format of the calls (lmdeploy_guided_spec.
    tool_calls): their parameters get the limit of a json_schema, named as the tools'."""
    for document in (_format(_chain(3)), {'type': 'json_object'}, {'type': 'regex_schema', 'regex_schema': 'a+'}):
        served = {**document, 'tool_calls': _required_tool_call(_chain(3))['format']}
        assert depth_error(served) is None
        message = depth_error({**document, 'tool_calls': _required_tool_call(_chain(40))['format']})
        assert message is not None and message.startswith('the parameters of a tool nests'), message
    # the document's own limit holds beside calls
    message = depth_error({**_format(_chain(40)), 'tool_calls': _required_tool_call(_chain(3))['format']})
    assert message is not None and message.startswith('the json_schema nests'), message


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv(MAX_DEPTH_ENV, '4')
    assert max_depth() == 4
    assert depth_error(_format(_chain(1))) is None
    assert 'more than 4 levels' in depth_error(_format(_chain(2)))
    for bad in ('0', '-1', 'deep', '1e3'):
        monkeypatch.setenv(MAX_DEPTH_ENV, bad)
        with pytest.raises(ValueError, match=MAX_DEPTH_ENV):
            max_depth()


def test_a_malformed_limit_is_the_servers_setting_not_the_requests_fault(monkeypatch, caplog):
    """Read at every request: a malformed value is logged once and the default applies (it raised out of the entry
    check, an HTTP 400 blaming the client on 0.18.0, an unanswered pipeline call on 0.14.0)."""
    monkeypatch.setenv(MAX_DEPTH_ENV, '1e3')
    with caplog.at_level('WARNING'):
        assert depth_error(_format(_chain(31))) is None
        assert depth_error(_format(_chain(32))) is not None
    assert [r.getMessage() for r in caplog.records if MAX_DEPTH_ENV in r.getMessage()] == [
        f"{MAX_DEPTH_ENV}='1e3' is not an integer; using the default, {DEFAULT_MAX_DEPTH}"]


def test_shared_and_cyclic_objects():
    """A Python object may share its parts, or contain itself: each part is walked again only from a deeper place
    (sharing both children of 40 levels of pairs took forever), and an object that contains itself is deeper than
    any limit."""
    node: dict = {'type': 'string'}
    for _ in range(40):
        node = {'anyOf': [node, node]}
    start = time.perf_counter()
    assert nesting_depth(node) == 81
    assert time.perf_counter() - start < 1
    loop: dict = {'type': 'object', 'properties': {}}
    loop['properties']['self'] = loop
    assert depth_error(_format(loop)) is not None
    with pytest.raises(ValueError, match='contains itself'):
        nesting_depth(loop)
    # a part shared at a shallow and a deep place counts at the deep one
    leaf = [[[]]]
    assert nesting_depth({'a': leaf, 'b': {'c': {'d': leaf}}}) == 6
