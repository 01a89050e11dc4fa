"""How deeply the schema of a response format may nest, checked before anything walks it.

xgrammar's conversion of a JSON schema costs about the cube of its nesting depth: a chain of 100 nested objects
takes 0.5 s, 200 take 5 s, 400 take 46 s (in xgrammar 0.2.8, on one core). The entry check converts the schema where
the request enters, in the serving process with no time limit, and lmdeploy copies the request's generation config
with Python's recursive ``deepcopy``, which fails from about 250 nested objects, after the conversion has run. The 120
real-world schemas of ``data/jsonschemabench`` nest at most 22 levels of JSON objects and arrays.

:func:`depth_error` names a ``json_schema`` whose schema nests deeper than ``LMDEPLOY_GUIDED_SPEC_MAX_SCHEMA_DEPTH``
levels (64 by default, about 32 nested objects) of objects and arrays, counted without recursion (a schema given as a
JSON string is scanned, not parsed), so that the request is refused at once with the limit.
"""
from __future__ import annotations

import logging

from .env import positive_from_env, warn_bad_setting_once
from .tool_calls import CALLS_KEY

__all__ = ['DEFAULT_MAX_DEPTH', 'MAX_DEPTH_ENV', 'depth_error', 'max_depth', 'nesting_depth']

#: Environment variable: the deepest nesting of objects and arrays a response format's schema may have.
MAX_DEPTH_ENV = 'LMDEPLOY_GUIDED_SPEC_MAX_SCHEMA_DEPTH'
#: Its default: three times the deepest of the benchmark's real-world schemas.
DEFAULT_MAX_DEPTH = 64


def max_depth() -> int:
    """``LMDEPLOY_GUIDED_SPEC_MAX_SCHEMA_DEPTH``, or :data:`DEFAULT_MAX_DEPTH`; raises ``ValueError`` naming the
    variable when it is not a positive integer."""
    return positive_from_env(MAX_DEPTH_ENV, DEFAULT_MAX_DEPTH, parse=int, kind='an integer')


def _text_depth(text: str, stop_after: int | None) -> int:
    """The nesting depth of the JSON objects and arrays in ``text``, brackets inside strings skipped."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == '\\':
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in '{[':
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_after is not None and deepest > stop_after:
                    break
        elif ch in '}]':
            depth -= 1
    return deepest


def nesting_depth(value, stop_after: int | None = None) -> int:
    """The nesting depth of the objects (dicts) and arrays (lists, tuples) in ``value``; of those written in it
    where ``value`` is a JSON string. ``{}`` and ``[]`` count 1, anything else 0. With ``stop_after``, counting stops
    once the depth is past it (a result above ``stop_after`` is then a lower bound), and an object that contains
    itself counts as deeper than that; without it, such an object raises ``ValueError``.

    An object reached along several paths (a Python object may share its parts) is walked again only from a deeper
    place than before, so the cost stays within the number of objects times the depth."""
    if isinstance(value, str):
        return _text_depth(value, stop_after)
    deepest = 0
    walked: dict[int, int] = {}  # id of an object or array -> the deepest place it was walked from
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children = node.values()
        elif isinstance(node, (list, tuple)):
            children = node
        else:
            continue
        if walked.get(id(node), 0) >= depth:
            continue
        walked[id(node)] = depth
        if depth > deepest:
            deepest = depth
            if stop_after is not None and deepest > stop_after:
                break
            if stop_after is None and deepest > len(walked):
                # deeper than the number of distinct objects: a path passes one twice
                raise ValueError('the value contains itself')
        stack.extend((child, depth + 1) for child in children)
    return deepest


def depth_error(response_format, limit: int | None = None) -> str | None:
    """Why a ``json_schema`` response format nests too deeply to serve, or None.

    Parameters
    ----------
    response_format : dict
        A response format as lmdeploy takes it (``{"type": "json_schema", "json_schema": {"schema": ...}}``, the
        schema an object or a JSON string, under ``schema`` or ``json_schema``, or ``json_schema`` itself; or an
        xgrammar structural tag, ``{"type": "structural_tag", ...}``: the whole tag against twice the limit, each
        ``json_schema`` format in it against the limit); other types, and shapes the entry check refuses on other
        grounds, yield None. The format of the tool calls that may stand instead of the document
        (:data:`~lmdeploy_guided_spec.tool_calls.CALLS_KEY`) counts as a structural tag.
    limit : int, optional
        The deepest nesting allowed; by default :func:`max_depth`.
    """
    if not isinstance(response_format, dict):
        return None
    limit = _limit() if limit is None else limit
    calls = response_format.get(CALLS_KEY)
    if isinstance(calls, dict):
        problem = _tag_depth_error(calls, limit, "the tools' calls", 'the parameters of a tool')
        if problem is not None:
            return problem
    kind = response_format.get('type')
    if kind == 'json_schema':
        # where lmdeploy reads the schema: json_schema.json_schema, json_schema.schema, or json_schema itself
        schema = response_format.get('json_schema')
        if isinstance(schema, dict):
            for key in ('json_schema', 'schema'):
                if key in schema:
                    schema = schema[key]
                    break
        if isinstance(schema, (dict, list, str)) and nesting_depth(schema, stop_after=limit) > limit:
            return _too_deep('the json_schema', limit)
        return None
    if kind != 'structural_tag':
        return None
    return _tag_depth_error(response_format, limit, 'the structural_tag', 'a json_schema of the structural_tag')


def _tag_depth_error(tag: dict, limit: int, whole: str, each: str) -> str | None:
    # a structural tag's formats nest in one another (tags, sequences, triggers): the whole tag gets twice the limit,
    # and every json_schema in it the limit of one (lmdeploy 0.18 builds tags of the tools' parameters for
    # tool_choice="required", and wraps a client's json_schema in one for GPT-OSS)
    if nesting_depth(tag, stop_after=2 * limit) > 2 * limit:
        return _too_deep(whole, 2 * limit)
    for schema in tag_schemas(tag):
        if nesting_depth(schema, stop_after=limit) > limit:
            return _too_deep(each, limit)
    return None


def _too_deep(what: str, limit: int) -> str:
    return (f'{what} nests objects and arrays more than {limit} levels deep (a nested object of a schema takes two: '
            f'"properties" and its schema; the limit is set by {MAX_DEPTH_ENV}): the grammar of a schema costs about '
            'the cube of its depth to build')


def tag_schemas(tag: dict) -> list:
    """The ``json_schema`` of every ``{"type": "json_schema", ...}`` format in a structural tag, without recursion
    (the tag's depth is already bounded), each object once."""
    schemas, seen, stack = [], set(), [tag]
    while stack:
        value = stack.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict):
            if value.get('type') == 'json_schema' and 'json_schema' in value:
                schemas.append(value['json_schema'])
                continue
            stack.extend(v for v in value.values() if isinstance(v, (dict, list)))
        elif isinstance(value, list):
            stack.extend(v for v in value if isinstance(v, (dict, list)))
    return schemas


def _limit() -> int:
    """:func:`max_depth`; a malformed variable is the server's setting, not the request's fault: it is logged once
    and the default applies."""
    try:
        return max_depth()
    except ValueError as err:
        warn_bad_setting_once(logging.getLogger(__name__), f'{err}; using the default, {DEFAULT_MAX_DEPTH}')
        return DEFAULT_MAX_DEPTH
