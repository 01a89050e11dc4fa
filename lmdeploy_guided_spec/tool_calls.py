"""A document or tool calls: the grammar of a response format beside tools the model may call.

OpenAI's Chat Completions API takes a ``response_format`` and ``tools`` together: with ``tool_choice="auto"`` the
answer is either calls of the tools or a message in the format. A grammar of the format alone covers the whole
output, so a call can never start (lmdeploy, vLLM). The grammar here accepts exactly one of the two: the document,
as the compile service compiles the format alone (the exact pattern rules and the whitespace option of
:mod:`.regular` kept), or the calls, as the structural tag a tool parser builds for ``tool_choice="required"``
(xgrammar's ``get_model_structural_tag``: text after the calls is free, as it is there).

A response format carries the calls' format under :data:`CALLS_KEY`; the compile service's kind
``document_or_calls`` takes :func:`document_or_calls_source`. With a reasoning parser on, the document (or calls)
follows a reasoning block (:data:`REASONING_KEY`): the model reasons freely, then answers in the format; a grammar of
the format alone made it answer at once, and the parser, which starts in the block, took the document for reasoning.

The document's grammar is written out as EBNF (a ``grammar`` element of the tag): inside a structural tag, a
``json_schema`` element has no separators option and xgrammar's own rules of patterns and bounded strings.
"""
from __future__ import annotations

import copy
import json
from typing import Any

__all__ = ['CALLS_KEY', 'DOCUMENT_KINDS', 'REASONING_KEY', 'admit_reasoning_open_tag', 'document_grammar',
           'document_or_calls_source', 'document_or_calls_tag', 'reasoning_block', 'reasoning_tags']

#: The key of a response format (lmdeploy's dict) that holds the format of the calls that may stand instead of the
#: document: the ``format`` of the structural tag of the tools' calls.
CALLS_KEY = 'tool_calls'

#: The key of a response format that holds the reasoning block its document (or calls) follow, a reasoning parser
#: on: ``{"open": <the open tag, or None>, "close": <the close tag>, "excludes": [<text the reasoning may not hold>]}``
#: (``excludes`` optional: a tool parser's open tag, which it would read as a call there). The model reasons, then
#: answers in the format.
REASONING_KEY = 'reasoning'

#: The longest reasoning tag or excluded text taken (``<think>``, ``</think>``, ``<tool_call>``: a few characters), and
#: the most texts excluded.
_MAX_TAG_CHARS = 64
_MAX_EXCLUDES = 8

#: The whitespace a model writes between its reasoning and its answer (Qwen3, DeepSeek-R1: ``</think>\n\n``).
_AFTER_REASONING = r'[ \t\r\n]{0,4}'

#: Grammar kinds of the compile service a document may be.
DOCUMENT_KINDS = ('json_schema', 'regex', 'builtin_json')


def document_grammar(kind: str, source: str | dict | None, options: dict | None = None) -> str:
    """The EBNF text of the grammar the compile service compiles for ``(kind, source, options)``: a JSON schema
    with the exact rules of :func:`.regular.exact_patterns_grammar` where it needs them, a regex as the
    deterministic grammar of :func:`.regular.deterministic_grammar` where there is one, any JSON value.

    Raises ``ValueError`` for a kind that is not a document's and xgrammar's ``RuntimeError`` for a source that does
    not parse; converting a schema costs what compiling it does (seconds for a hostile one): call it off the event
    loop, in the compile service (kind ``document_or_calls``).
    """
    # here, not at the top: depth.py reads CALLS_KEY where a request enters, without xgrammar
    import xgrammar as xgr

    from . import regular
    options = dict(options or {})
    if kind == 'json_schema':
        if isinstance(source, (dict, list, bool)):
            source = json.dumps(source)
        if 'separators' in options and options['separators'] is not None:
            options['separators'] = tuple(options['separators'])
        ebnf = regular.exact_patterns_grammar(source, **options)
        return ebnf if ebnf is not None else str(xgr.Grammar.from_json_schema(source, **options))
    if options:
        raise ValueError(f'a {kind} document takes no options, got {sorted(options)}')
    if kind == 'regex':
        ebnf = regular.deterministic_grammar(source)
        return ebnf if ebnf is not None else str(xgr.Grammar.from_regex(source))
    if kind == 'builtin_json':
        return str(xgr.Grammar.builtin_json_grammar())
    raise ValueError(f'a document is one of {", ".join(DOCUMENT_KINDS)}, not {kind!r}')


def document_or_calls_source(kind: str, source: str | dict | None, options: dict | None, calls: dict | None,
                             reasoning: dict | None = None) -> str:
    """The source of the compile service's kind ``document_or_calls``: the document's ``(kind, source, options)``,
    the calls' format that may stand instead of it (or None) and the reasoning block both follow (a
    :data:`REASONING_KEY` value, or None), as JSON text (the key of the service's cache)."""
    if isinstance(source, (dict, list, bool)):
        source = json.dumps(source)
    body: dict[str, Any] = {'document': {'kind': kind, 'source': source, 'options': dict(options or {})},
                            'calls': calls}
    if reasoning is not None:
        body['reasoning'] = reasoning
    return json.dumps(body, sort_keys=True)


def document_or_calls_tag(source: str | dict) -> dict:
    """The xgrammar structural tag of a :func:`document_or_calls_source`: the document's grammar
    (:func:`document_grammar`), or ``or`` of it and the calls' format, after the reasoning block where there is one.
    Raises ``ValueError`` for a malformed source."""
    parsed = json.loads(source) if isinstance(source, str) else source
    if not isinstance(parsed, dict) or not isinstance(parsed.get('document'), dict) or not isinstance(
            parsed.get('calls'), (dict, type(None))):
        raise ValueError('a document_or_calls source is {"document": {"kind", "source", "options"}, "calls": {...} '
                         'or null, "reasoning": {"open", "close"} (optional)}')
    document: dict[str, Any] = parsed['document']
    ebnf = document_grammar(document.get('kind'), document.get('source'), document.get('options'))
    answer: dict[str, Any] = {'type': 'grammar', 'grammar': ebnf}
    if parsed['calls'] is not None:
        answer = {'type': 'or', 'elements': [answer, parsed['calls']]}
    if parsed.get('reasoning') is not None:
        answer = {'type': 'sequence', 'elements': [
            reasoning_block(*reasoning_tags(parsed['reasoning'])), {'type': 'regex', 'pattern': _AFTER_REASONING},
            answer]}
    return {'type': 'structural_tag', 'format': answer}


def _printable(text: str) -> bool:
    """No control character but whitespace (tab, newline, carriage return), no lone surrogate."""
    return all(c.isprintable() or c in '\t\n\r' for c in text)


def reasoning_tags(value) -> tuple[str | None, str, tuple[str, ...]]:
    """The ``(open, close, excludes)`` of a :data:`REASONING_KEY` value; ``ValueError`` for one that is not
    ``{"open": str or None, "close": str, "excludes": [str, ...]}`` (``excludes`` optional, at most 8) with printable
    texts (no control character but whitespace: DeepSeek-V3.2's calls open with ``\\n\\n<｜DSML｜...>``; no lone
    surrogate) of 1 to 64 characters."""
    if not isinstance(value, dict) or set(value) - {'open', 'close', 'excludes'}:
        raise ValueError(f'response_format {REASONING_KEY} is {{"open": <tag or null>, "close": <tag>, "excludes": '
                         '[<text>, ...] (optional)}')
    open_tag, close_tag, excludes = value.get('open'), value.get('close'), value.get('excludes', [])
    if not isinstance(excludes, list) or len(excludes) > _MAX_EXCLUDES:
        raise ValueError(f'response_format {REASONING_KEY} excludes is a list of at most {_MAX_EXCLUDES} texts')
    for text in [close_tag, *excludes] if open_tag is None else [open_tag, close_tag, *excludes]:
        if not isinstance(text, str) or not text or len(text) > _MAX_TAG_CHARS or not _printable(text):
            raise ValueError(f'response_format {REASONING_KEY} texts are printable strings of 1 to {_MAX_TAG_CHARS} '
                             f'characters (the open tag may be null), got {text!r}')
    return open_tag, close_tag, tuple(excludes)


def reasoning_block(open_tag: str | None, close_tag: str, excludes: tuple[str, ...] = ()) -> dict:
    """The structural tag format of a reasoning block: free text up to ``close_tag``, neither tag nor any of
    ``excludes`` inside it; it starts inside, as after a chat template that opens it, or with the model's own
    ``open_tag``."""
    text = {'type': 'any_text', 'excludes': [tag for tag in (open_tag, close_tag, *excludes) if tag]}
    block: dict[str, Any] = {'type': 'tag', 'begin': '', 'content': text, 'end': close_tag}
    return _may_open(open_tag, block) if open_tag else block


def _may_open(open_tag: str, block: dict) -> dict:
    """A reasoning block that starts inside, or with ``open_tag`` once."""
    return {'type': 'sequence', 'elements': [
        {'type': 'optional', 'content': {'type': 'const_string', 'value': open_tag}}, block]}


def admit_reasoning_open_tag(response_format: dict, open_tag: str | None, close_tag: str | None,
                             excludes: tuple[str, ...] | list[str] = ()) -> dict:
    """The structural tag ``response_format`` of calls with reasoning on, whose reasoning block may also begin with
    its ``open_tag`` and whose text holds none of ``excludes``.

    The tags of calls with reasoning on (xgrammar's ``get_model_structural_tag(..., reasoning='enabled')``) start
    inside the reasoning block, as after a chat template that opens it (the prompt ends in ``<think>\\n``: DeepSeek-R1,
    Qwen3's thinking models), and exclude the open tag from the block's text. A template that leaves the tag to the
    model (Qwen3's hybrid template with thinking on) then has the model's first token masked. lmdeploy's response
    parser takes both (it drops an open tag the model writes); with this, so does the grammar. ``excludes`` is what
    the reasoning may not hold: the tool parser's open tag, as the parser reads a call written in the reasoning as a
    call, its arguments unconstrained.

    Returns a new dict; a tag whose first part is not such a block (reasoning off, other shapes) is returned as it
    is, and so is one with nothing to change (the open tag is admitted only where the block's text excludes it).
    """
    if not close_tag or not isinstance(response_format, dict) or response_format.get('type') != 'structural_tag':
        return response_format
    result = copy.deepcopy(response_format)
    parent: Any = result
    key: Any = 'format'
    node = result.get('format')
    while isinstance(node, dict) and node.get('type') == 'sequence' and node.get('elements'):
        parent, key, node = node['elements'], 0, node['elements'][0]
    if not isinstance(node, dict):
        return response_format
    content = node.get('content')
    if not (node.get('type') == 'tag' and node.get('begin') == '' and node.get('end') == close_tag
            and isinstance(content, dict) and content.get('type') == 'any_text'):
        return response_format
    excluded = list(content.get('excludes') or ())
    admits = bool(open_tag) and open_tag in excluded
    added = [text for text in dict.fromkeys(excludes) if text and text not in excluded]
    if not admits and not added:
        return response_format
    content['excludes'] = excluded + added
    if admits:
        parent[key] = _may_open(open_tag, node)
    return result
