"""JSON-schema keywords that xgrammar accepts but does not enforce.

xgrammar converts a JSON schema into a grammar. For some keywords the grammar it builds admits instances the schema
forbids: the keyword is dropped (``not``, ``if``/``then``/``else``, ``uniqueItems``, ...), only partly translated
(``oneOf`` becomes ``anyOf``; ``allOf`` of several schemas makes the schema that holds it any JSON value, its own
``type`` and ``required`` included) or cannot be followed (a ``$ref``
outside the document). Output constrained by such a grammar may not satisfy the schema, with no error from the
compiler. :func:`unenforced_keywords` finds these uses in a schema so that a server can refuse a strict request and
warn about any other.

The list is xgrammar's behaviour, not a reading of its documentation: ``tests/unit/test_unenforced.py`` compiles
a schema for each entry with the installed xgrammar and checks that a matcher accepts an instance the schema forbids
(and that the keywords left out of the list are enforced), so an xgrammar that starts enforcing one fails there.

What is named, each with an instance xgrammar accepts although the schema forbids it:

- ``allOf`` of several schemas: ``{"allOf": [{"type": "integer"}, {"minimum": 5}]}`` accepts ``3``;
- ``oneOf`` whose branches can overlap (both match); only distinct ``type`` s or a required ``const`` tag property
  count as disjoint here;
- ``not`` (``{"type": "integer", "not": {"const": 3}}`` accepts ``3``), ``if`` / ``then`` / ``else``,
  ``dependentRequired``, ``dependentSchemas``, ``dependencies``, ``$dynamicRef``, ``$recursiveRef``: dropped;
- ``contains`` (with ``minContains``, ``maxContains``): no item needs to match;
- ``uniqueItems: true``: ``[1, 1]``;
- ``multipleOf`` on a non-integer type: ``{"type": "number", "multipleOf": 0.5}`` accepts ``0.3``;
- the JSON Schema formats xgrammar does not build: ``idn-email``, ``idn-hostname``, ``iri``, ``iri-reference``,
  ``regex``;
- a ``$ref`` outside the document (a URL, another file, an ``$anchor`` name): any JSON value;
- constraining keywords next to a ``$ref``: ``{"$ref": "#/$defs/i", "minimum": 5}`` accepts ``3``;
- ``required`` names not under ``properties``: ``{"type": "object", "required": ["a"]}`` accepts ``{}``;
- number, string and array keywords in a schema without ``type``: ``{"minimum": 5}`` accepts ``3``;
"""
from __future__ import annotations

from collections.abc import Mapping

from .depth import depth_error, tag_schemas

__all__ = ['KNOWN_FORMATS', 'unenforced_keywords', 'tag_unenforced_keywords', 'strict_tool_error']

# formats whose grammar xgrammar builds (a violating string is rejected); any other format constrains nothing
KNOWN_FORMATS = frozenset({'email', 'date', 'date-time', 'time', 'duration', 'uuid', 'ipv4', 'ipv6', 'hostname',
                           'uri', 'uri-reference', 'uri-template', 'json-pointer', 'relative-json-pointer'})
# the formats JSON Schema defines (2020-12); a format of a schema's own (json-editor's 'grid', 'int32') is an
# annotation that validators ignore too, so it is not named
_SPEC_FORMATS = KNOWN_FORMATS | {'idn-email', 'idn-hostname', 'iri', 'iri-reference', 'regex'}
_IGNORED = ('not', 'if', 'then', 'else', 'dependentRequired', 'dependentSchemas', 'dependencies', 'contains',
            'minContains', 'maxContains', '$dynamicRef', '$recursiveRef')
# keywords that only act once a type is known; xgrammar infers objects and arrays from properties / items
_TYPED = ('minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum', 'multipleOf', 'minLength', 'maxLength',
          'pattern', 'format', 'minItems', 'maxItems')
_INFERS_TYPE = ('type', 'const', 'enum', '$ref', 'anyOf', 'oneOf', 'allOf', 'properties', 'items', 'prefixItems')
# keywords that constrain an instance; next to a $ref xgrammar drops them (annotations and keywords of a schema's
# own, such as propertyOrder or x-..., constrain nothing anyway)
_CONSTRAINING = frozenset({
    'type', 'enum', 'const', 'multipleOf', 'maximum', 'exclusiveMaximum', 'minimum', 'exclusiveMinimum', 'maxLength',
    'minLength', 'pattern', 'format', 'maxItems', 'minItems', 'uniqueItems', 'maxContains', 'minContains', 'contains',
    'maxProperties', 'minProperties', 'required', 'dependentRequired', 'dependencies', 'properties',
    'patternProperties', 'additionalProperties', 'propertyNames', 'items', 'prefixItems', 'additionalItems',
    'unevaluatedItems', 'unevaluatedProperties', 'allOf', 'anyOf', 'oneOf', 'not', 'if', 'then', 'else',
    'dependentSchemas', '$dynamicRef', '$recursiveRef'})
# subschemas: keyword -> how they are held
_ONE = ('additionalProperties', 'items', 'not', 'if', 'then', 'else', 'contains', 'propertyNames',
        'unevaluatedProperties', 'unevaluatedItems', 'additionalItems')
_MANY = ('allOf', 'anyOf', 'oneOf', 'prefixItems')
_NAMED = ('properties', 'patternProperties', '$defs', 'definitions', 'dependentSchemas')


def _types(schema: dict) -> set[str] | None:
    kind = schema.get('type')
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list) and all(isinstance(k, str) for k in kind):
        return set(kind)
    return None


def _tag(branch: dict, name: str):
    """The const of property ``name`` that a oneOf branch requires, or None."""
    prop = (branch.get('properties') or {}).get(name)
    if not isinstance(prop, dict) or name not in (branch.get('required') or []):
        return None
    if 'const' in prop:
        return ('const', repr(prop['const']))
    enum = prop.get('enum')
    if isinstance(enum, list) and len(enum) == 1:
        return ('const', repr(enum[0]))
    return None


def _disjoint(branches: list) -> bool:
    """Whether no instance can match two of the oneOf ``branches`` (decided for the plain cases only)."""
    if not all(isinstance(b, dict) for b in branches):
        return False
    kinds = [_types(b) for b in branches]
    if all(kinds):
        seen: set[str] = set()
        for kind in kinds:
            # every integer is a number
            kind = kind | {'number'} if 'integer' in kind else kind
            if kind & seen:
                break
            seen |= kind | ({'integer'} if 'number' in kind else set())
        else:
            return True
    names = set.intersection(*(set(b.get('properties') or {}) for b in branches)) if branches else set()
    for name in sorted(names):
        tags = [_tag(b, name) for b in branches]
        if all(tags) and len(set(tags)) == len(tags):
            return True
    return False


def _check(schema: dict, path: str, found: list[str]) -> None:
    def note(what: str) -> None:
        found.append(f'{what} at #{path}')

    for key in _IGNORED:
        if key in schema and not (key in ('minContains', 'maxContains') and 'contains' in schema):
            note(key)
    if isinstance(schema.get('allOf'), list) and len(schema['allOf']) > 1:
        note('allOf')
    if isinstance(schema.get('oneOf'), list) and len(schema['oneOf']) > 1 and not _disjoint(schema['oneOf']):
        note('oneOf')
    if schema.get('uniqueItems') is True:
        note('uniqueItems')
    kinds = _types(schema)
    if 'multipleOf' in schema and kinds is not None and kinds != {'integer'}:
        note('multipleOf')
    fmt = schema.get('format')
    if isinstance(fmt, str) and fmt in _SPEC_FORMATS - KNOWN_FORMATS:
        note(f'format {fmt!r}')
    ref = schema.get('$ref')
    if isinstance(ref, str):
        if ref != '#' and not ref.startswith('#/'):
            note(f'$ref {ref!r}')
        siblings = sorted(k for k in schema if k in _CONSTRAINING)
        if siblings:
            note(f'{", ".join(siblings)} next to $ref')
    required = schema.get('required')
    if isinstance(required, list) and not isinstance(ref, str):
        declared = schema.get('properties') if isinstance(schema.get('properties'), dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in declared]
        if missing:
            note(f'required {", ".join(map(repr, missing))} (not under properties)')
    if not any(k in schema for k in _INFERS_TYPE):
        untyped = [k for k in _TYPED if k in schema]
        if untyped:
            note(f'{", ".join(untyped)} without type')


def _walk(schema, path: str, found: list[str]) -> None:
    if not isinstance(schema, dict):
        return
    _check(schema, path, found)
    for key in _ONE:
        if isinstance(schema.get(key), dict):
            sub = schema[key]
            # property names are strings: a pattern there needs no type
            _walk({'type': 'string', **sub} if key == 'propertyNames' else sub, f'{path}/{key}', found)
    for key in _MANY:
        if isinstance(schema.get(key), list):
            for i, sub in enumerate(schema[key]):
                _walk(sub, f'{path}/{key}/{i}', found)
    for key in _NAMED:
        if isinstance(schema.get(key), dict):
            for name, sub in schema[key].items():
                _walk(sub, f'{path}/{key}/{name}', found)


def unenforced_keywords(schema) -> list[str]:
    """The uses of keywords in ``schema`` that xgrammar would not enforce, each with its JSON pointer.

    Parameters
    ----------
    schema : dict
        A JSON schema (the ``schema`` of a ``json_schema`` response format); anything else yields ``[]``.

    Returns
    -------
    list of str
        One entry per use, in document order, e.g. ``"not at #/properties/age"``,
        ``"$ref 'https://example.com/a.json' at #"``; empty when xgrammar enforces the whole schema as far as this
        module knows.
    """
    found: list[str] = []
    _walk(schema, '', found)
    return found


def _servable(schema) -> bool:
    """Whether ``schema`` is an object within the entry check's nesting limit (a deeper one is refused there; the
    walk here recurses)."""
    return isinstance(schema, Mapping) and depth_error({'type': 'json_schema',
                                                        'json_schema': {'schema': schema}}) is None


def tag_unenforced_keywords(tag) -> list[str]:
    """:func:`unenforced_keywords` of every ``json_schema`` format in an xgrammar structural tag (e.g. the tools'
    parameters lmdeploy puts in one for ``tool_choice="required"``), in the order of :func:`~.depth.tag_schemas`;
    schemas past the nesting limit are skipped (the entry check refuses them)."""
    if not isinstance(tag, Mapping):
        return []
    return [keyword for schema in tag_schemas(dict(tag)) if _servable(schema)
            for keyword in unenforced_keywords(schema)]


def strict_tool_error(tools) -> str | None:
    """Why a forced call of ``tools`` cannot be served as the tools ask, or None.

    OpenAI's ``strict: true`` on a function asks for arguments that satisfy its ``parameters``. A forced call
    (``tool_choice="required"`` or by name) constrains them with a grammar; a strict function whose parameters use
    keywords xgrammar does not enforce would get arguments that may not satisfy them, as a strict ``json_schema``
    response format would (which the entry check refuses).

    Parameters
    ----------
    tools : list of dict
        OpenAI tools, ``{"type": "function", "function": {"name", "parameters", "strict"}}``; other entries and
        functions without ``strict: true`` are skipped, and so are parameters past the nesting limit.
    """
    for tool in tools or ():
        function = tool.get('function') if isinstance(tool, Mapping) else None
        if not isinstance(function, Mapping) or function.get('strict') is not True:
            continue
        parameters = function.get('parameters')
        keywords = unenforced_keywords(parameters) if _servable(parameters) else []
        if keywords:
            return (f'the function {function.get("name")!r} is strict, but the grammar compiler does not enforce '
                    f'{"; ".join(keywords)} in its parameters. Remove these keywords, or set strict to false to accept '
                    'arguments that follow the rest of the schema')
    return None
