"""The wide objects of a grammar's JSON schemas: the objects whose matcher may grow huge past a probe's reach.

xgrammar 0.2.8's matcher of an object with thousands of optional properties grows once it has read one of its keys,
about with the cube of their number (3,000 properties: about 0.2 GB, and as much again for each fork; 8,000: 1.9 GB).
The compile service probes the first tokens of a grammar (:func:`.compile.grammar_cost`), which reach such an object
at the top of a schema, or after a free string the probe leaves at once, but not behind text that takes more tokens
than the probe walks: a ``const`` of twenty words, a string of ``minLength`` 200, the calls' header of a structural
tag. :func:`wide_objects` finds those objects in the schemas of a grammar's source, so that the service probes each
on its own. The schemas of JSONSchemaBench have at most 230 optional properties in an object, none of them wide.
"""
from __future__ import annotations

import json
from typing import NamedTuple

from .depth import tag_schemas

__all__ = ['WIDE_OPTIONAL_PROPERTIES', 'WIDE_OBJECT_PROBES', 'WideObject', 'wide_objects']

#: Optional properties from which an object is wide. Its matcher holds about 17 MB once it has read a key at 1,500
#: optional properties, 75 MB at 2,000 (the compile service's limit is 64 MB by default); at 500 it holds nothing
#: measurable.
WIDE_OPTIONAL_PROPERTIES = 512
#: Wide objects of one source probed on their own, the widest first (each costs a compile of the object).
WIDE_OBJECT_PROBES = 4
#: Keywords whose value is a map of names to definitions, kept beside a wide object probed on its own so that its
#: references (``#/$defs/...``, ``#/definitions/...``) resolve.
_DEFINITIONS = ('$defs', 'definitions')


class WideObject(NamedTuple):
    """A wide object: where it is (a JSON pointer into its schema; the schema's index in the source first when the
    source holds several), how many optional properties it has, and the schema of the object alone (with the
    definitions of the schemas around it), then the same with every property's value an integer (for an object
    whose own schema does not compile alone, e.g. a ``$ref`` into the properties of the schema around it)."""
    place: str
    optional: int
    schema: dict
    skeleton: dict


def source_schemas(kind: str, source) -> list:
    """The JSON schemas of a compile's source (``kind`` as :mod:`.compile` names it; JSON text or parsed): the schema
    of a ``json_schema``; the ``json_schema`` formats of a structural tag; the document's schema and the calls'
    formats of a ``document_or_calls`` source. None (an empty list) for other kinds, or a source that is not JSON."""
    try:
        parsed = json.loads(source) if isinstance(source, (str, bytes)) else source
        if kind == 'json_schema':
            return [parsed]
        if kind == 'structural_tag':
            return tag_schemas(parsed)
        if kind == 'document_or_calls':
            document, calls = parsed.get('document') or {}, parsed.get('calls')
            schemas = []
            if document.get('kind') == 'json_schema' and document.get('source') is not None:
                schemas += source_schemas('json_schema', document['source'])
            return schemas + (tag_schemas(calls) if isinstance(calls, (dict, list)) else [])
    except (TypeError, ValueError, AttributeError, RecursionError):
        pass
    return []


def wide_objects(kind: str, source, *, least: int = WIDE_OPTIONAL_PROPERTIES,
                 most: int = WIDE_OBJECT_PROBES) -> list[WideObject]:
    """The objects with at least ``least`` optional properties in the schemas of a compile's source, the widest first,
    at most ``most``; the top of a schema too (a long required property before the optional ones hides them from
    the probe of the whole grammar). Walked without recursion, each value once."""
    schemas = source_schemas(kind, source)
    found: list[WideObject] = []
    seen: set[int] = set()
    for index, schema in enumerate(schemas):
        top = '' if len(schemas) == 1 else f'[{index}]'
        # (value, its place, the definitions of the schemas around it)
        stack = [(schema, top, {})]
        while stack:
            value, place, definitions = stack.pop()
            if id(value) in seen:
                continue
            seen.add(id(value))
            if isinstance(value, list):
                stack.extend((v, f'{place}/{i}', definitions) for i, v in enumerate(value)
                             if isinstance(v, (dict, list)))
                continue
            if not isinstance(value, dict):
                continue
            own = {key: value[key] for key in _DEFINITIONS if isinstance(value.get(key), dict)}
            if own:
                definitions = {**definitions, **{key: {**definitions.get(key, {}), **own[key]} for key in own}}
            properties = value.get('properties')
            if isinstance(properties, dict):
                required = value.get('required')
                required = set(required) if isinstance(required, list) and all(
                    isinstance(name, str) for name in required) else set()
                optional = sum(1 for name in properties if name not in required)
                if optional >= least:
                    # its own definitions and those around it (merged above)
                    alone = {**value, **definitions}
                    skeleton = {**alone, 'properties': {name: {'type': 'integer'} for name in properties}}
                    found.append(WideObject(place, optional, alone, skeleton))
            stack.extend((v, f'{place}/{_escape(key)}', definitions) for key, v in value.items()
                         if isinstance(v, (dict, list)))
    found.sort(key=lambda wide: -wide.optional)
    return found[:most]


def _escape(key: str) -> str:
    """A key as a JSON pointer writes it."""
    return str(key).replace('~', '~0').replace('/', '~1')
