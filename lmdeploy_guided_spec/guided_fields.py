"""The guided-decoding fields of vLLM and SGLang requests, read as an OpenAI-style ``response_format``.

Clients written for vLLM send ``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar`` (through the
openai client's ``extra_body``) or the newer ``structured_outputs={"json": ...}``; clients written for SGLang send
top-level ``json_schema``, ``regex`` and ``ebnf``. A server that does not know these fields drops them and answers
with unconstrained output. :func:`response_format_from_fields` reads them from a request body and returns the
``response_format`` that asks for the same constraint, or raises :class:`GuidedFieldError` naming the field and what
to send instead: a guided field is mapped or refused, never ignored.

========================================  =====================================================================
field                                     response_format
========================================  =====================================================================
``guided_json``, ``structured_outputs.json``, SGLang ``json_schema`` (object or JSON text)
                                          ``{"type": "json_schema", "json_schema": {"name": ..., "schema": ...}}``
``guided_regex``, ``structured_outputs.regex``, SGLang ``regex``
                                          ``{"type": "regex_schema", "regex_schema": ...}``
``guided_choice``, ``structured_outputs.choice`` (a list of strings)
                                          ``{"type": "regex_schema", "regex_schema": "(a|b|c)"}`` (each choice
                                          matched literally, as vLLM matches one of the choices)
``structured_outputs.json_object: true``  ``{"type": "json_object"}``
``guided_grammar``, ``structured_outputs.grammar``, SGLang ``ebnf``
                                          refused: the server has no grammar response format
========================================  =====================================================================

``guided_decoding_backend`` / ``structured_outputs.backend`` may say ``xgrammar`` or ``auto`` (the grammar compiler
is xgrammar); ``structured_outputs.disable_any_whitespace: true`` asks for the ``single`` whitespace of JSON output.
For an endpoint that takes SGLang's ``sampling_params`` object (``/generate``), its ``json_schema`` and ``regex`` are
read as the top-level fields are (``sampling_params=True``); its ``ebnf`` and ``structural_tag`` are refused.
Its other keys (``max_new_tokens``, ``temperature``, ...) set the fields of lmdeploy's ``/generate`` they name
(:func:`generate_fields_from_sampling_params`).
"""
from __future__ import annotations

import json
from collections.abc import Mapping

from .depth import depth_error
from .errors import GuidedFieldError

__all__ = ['GUIDED_FIELDS', 'response_format_from_fields', 'choice_regex', 'SAMPLING_PARAMS_SERVED',
           'generate_fields_from_sampling_params']

# top-level request fields read here: vLLM's, then SGLang's
GUIDED_FIELDS = ('guided_json', 'guided_regex', 'guided_choice', 'guided_grammar', 'guided_decoding_backend',
                 'guided_whitespace_pattern', 'structured_outputs', 'json_schema', 'regex', 'ebnf')

# structured_outputs keys (vLLM's StructuredOutputsParams) and the guided_* field each stands for
_STRUCTURED = {'json': 'guided_json', 'regex': 'guided_regex', 'choice': 'guided_choice', 'grammar': 'guided_grammar'}
_LABELS = {v: k for k, v in _STRUCTURED.items()} | {'guided_decoding_backend': 'backend',
                                                    'guided_whitespace_pattern': 'whitespace_pattern'}
_BACKENDS = ('xgrammar', 'auto')
_REGEX_SPECIAL = set('\\.^$*+?()[]{}|/-')
_POINTER = 'send response_format instead'
_GRAMMAR = ('grammar (EBNF) constraints are not supported by this server; describe the output with response_format '
            '{"type": "json_schema", ...} or {"type": "regex_schema", "regex_schema": ...} instead')


#: keys of SGLang's ``sampling_params`` that constrain the output
_SAMPLING_PARAMS_FIELDS = ('json_schema', 'regex', 'ebnf', 'structural_tag')


def choice_regex(choices) -> str:
    """A regex matching exactly one of ``choices``, each character literal.

    Parameters
    ----------
    choices : list of str
        The strings the output may be, as vLLM's ``guided_choice`` takes them.

    Raises
    ------
    GuidedFieldError
        ``choices`` is not a non-empty list of strings.
    """
    if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) for c in choices):
        raise GuidedFieldError('guided_choice must be a non-empty list of strings', param='guided_choice')
    # xgrammar's regex escapes: a backslash before each special character, nothing else escaped
    return '(' + '|'.join(''.join('\\' + ch if ch in _REGEX_SPECIAL else ch for ch in c) for c in choices) + ')'


def _json_schema(value, name: str, param: str) -> dict:
    if isinstance(value, str):
        # the nesting first, counted without recursion: json.loads of thousands of levels raised RecursionError
        # (HTTP 500 with a traceback)
        too_deep = depth_error({'type': 'json_schema', 'json_schema': {'schema': value}})
        if too_deep is not None:
            raise GuidedFieldError(f'{name}: {too_deep}', param=param)
        try:
            value = json.loads(value)
        except (ValueError, RecursionError) as err:
            raise GuidedFieldError(f'{name} is not valid JSON: {err}', param=param) from err
    if not isinstance(value, dict):
        raise GuidedFieldError(f'{name} must be a JSON schema object, got {type(value).__name__}', param=param)
    return {'type': 'json_schema', 'json_schema': {'name': param, 'schema': value}}


def _regex(value, name: str, param: str) -> dict:
    if not isinstance(value, str) or not value:
        raise GuidedFieldError(f'{name} must be a non-empty regular expression', param=param)
    return {'type': 'regex_schema', 'regex_schema': value}


def _structured(value) -> dict[str, object]:
    """The constraint fields of vLLM's ``structured_outputs``, under their ``guided_*`` names."""
    param = 'structured_outputs'
    if not isinstance(value, Mapping):
        raise GuidedFieldError(f'{param} must be an object', param=param)
    fields = {}
    for key, item in value.items():
        if item is None or item is False:
            continue
        if key in _STRUCTURED:
            fields[_STRUCTURED[key]] = item
        elif key == 'json_object':
            fields['json_object'] = item
        elif key == 'backend':
            fields['guided_decoding_backend'] = item
        elif key == 'disable_any_whitespace':
            fields['disable_any_whitespace'] = item
        elif key == 'whitespace_pattern':
            fields['guided_whitespace_pattern'] = item
        else:
            raise GuidedFieldError(f'{param}.{key} is not supported by this server; {_POINTER} '
                                   '(json_schema, regex_schema, json_object)', param=param)
    return fields


def response_format_from_fields(body: Mapping, *, sampling_params: bool = False) -> tuple[dict, str] | None:
    """The ``response_format`` that vLLM / SGLang guided fields of a request body ask for.

    Parameters
    ----------
    body : Mapping
        The request body as JSON (a chat completion, completion or generate request); only the fields of
        :data:`GUIDED_FIELDS` are read (and ``sampling_params``, see below), nothing is changed.
    sampling_params : bool
        Also read the constraints of SGLang's ``sampling_params`` object (``json_schema``, ``regex``; ``ebnf`` and
        ``structural_tag`` are refused), as SGLang's ``/generate`` takes them; the error's ``param`` is
        ``sampling_params``.

    Returns
    -------
    tuple of (dict, str) or None
        The response_format (lmdeploy's shape: ``json_schema``, ``regex_schema`` or ``json_object``) and the name
        of the field it came from (for error messages); None when the body has no guided field.

    Raises
    ------
    GuidedFieldError
        A guided field that cannot be mapped (a grammar, a whitespace pattern, an unknown backend or key), more than
        one constraint, a guided field together with a ``response_format`` other than text, or a malformed value.
        ``param`` names the field.
    """
    present = {k: body[k] for k in GUIDED_FIELDS if k in body and body[k] is not None}
    params = body.get('sampling_params') if sampling_params else None
    nested = {k: params[k] for k in _SAMPLING_PARAMS_FIELDS if params.get(k) is not None} \
        if isinstance(params, Mapping) else {}
    if not present and not nested:
        return None
    fields = dict(present)
    origin = {k: k for k in present}  # the top-level field each constraint came from (the error's param)
    label = {}  # how messages name a constraint that came from structured_outputs or sampling_params
    for key, item in nested.items():
        if key in fields:
            raise GuidedFieldError(f'{key} is given twice (as {key} and in sampling_params)', param='sampling_params')
        if key == 'structural_tag':
            raise GuidedFieldError(f'sampling_params.structural_tag is not supported by this server; {_POINTER} '
                                   '(json_schema, regex_schema, json_object)', param='sampling_params')
        fields[key] = item
        origin[key] = 'sampling_params'
        label[key] = f'sampling_params.{key}'
    if 'structured_outputs' in fields:
        for key, item in _structured(fields.pop('structured_outputs')).items():
            if key in fields:
                raise GuidedFieldError(f'{key} is given twice (as {key} and in structured_outputs)',
                                       param='structured_outputs')
            fields[key] = item
            origin[key] = 'structured_outputs'
            label[key] = 'structured_outputs.' + _LABELS.get(key, key)
    backend = fields.pop('guided_decoding_backend', None)
    if backend is not None and backend not in _BACKENDS:
        param = origin['guided_decoding_backend']
        raise GuidedFieldError(f'guided decoding backend {backend!r} is not available; this server compiles grammars '
                               f'with xgrammar (use {" or ".join(_BACKENDS)}, or leave the field out)', param=param)
    if 'guided_whitespace_pattern' in fields:
        raise GuidedFieldError('a whitespace pattern is not supported; response_format "whitespace" takes any, '
                               'single or compact', param=origin['guided_whitespace_pattern'])
    disable_any_whitespace = fields.pop('disable_any_whitespace', False)
    constraints = [k for k in fields if k != 'json_object' or fields[k] is True]
    if 'json_object' in fields and fields['json_object'] is not True:
        raise GuidedFieldError('structured_outputs.json_object must be true or false', param='structured_outputs')
    if not constraints:
        if disable_any_whitespace:
            raise GuidedFieldError('structured_outputs.disable_any_whitespace needs a json or json_object '
                                   'constraint', param='structured_outputs')
        return None
    if len(constraints) > 1:
        names = ', '.join(label.get(k, k) for k in constraints)
        raise GuidedFieldError(f'only one guided constraint per request, got {names}', param=origin[constraints[0]])
    key = constraints[0]
    param = origin[key]
    name = label.get(key, key)
    # {"type": "text"} constrains nothing; the guided field takes its place
    given = body.get('response_format')
    if given is not None and not (isinstance(given, Mapping) and given.get('type') == 'text'):
        raise GuidedFieldError(f'{name} and response_format both constrain the output; send one of them',
                               param=param)
    value = fields[key]
    if key in ('guided_grammar', 'ebnf'):
        raise GuidedFieldError(f'{name}: {_GRAMMAR}', param=param)
    if key in ('guided_json', 'json_schema'):
        fmt = _json_schema(value, name, param)
    elif key == 'json_object':
        fmt = {'type': 'json_object'}
    elif key in ('guided_regex', 'regex'):
        fmt = _regex(value, name, param)
    else:  # guided_choice
        try:
            fmt = {'type': 'regex_schema', 'regex_schema': choice_regex(value)}
        except GuidedFieldError as err:
            raise GuidedFieldError(str(err).replace('guided_choice', name), param=param) from None
    if disable_any_whitespace:
        if fmt['type'] == 'regex_schema':
            raise GuidedFieldError('structured_outputs.disable_any_whitespace applies to json and json_object '
                                   'only', param='structured_outputs')
        fmt['whitespace'] = 'single'
    return fmt, param


#: SGLang ``sampling_params`` keys that lmdeploy's ``/generate`` serves, and the request field each sets
SAMPLING_PARAMS_SERVED = {
    'max_new_tokens': 'max_tokens',
    'stop': 'stop',
    'stop_token_ids': 'stop_token_ids',
    'temperature': 'temperature',
    'top_p': 'top_p',
    'top_k': 'top_k',
    'min_p': 'min_p',
    'repetition_penalty': 'repetition_penalty',
    'ignore_eos': 'ignore_eos',
    'skip_special_tokens': 'skip_special_tokens',
    'spaces_between_special_tokens': 'spaces_between_special_tokens',
    'no_stop_trim': 'include_stop_str_in_output',
}

# keys /generate cannot serve, with the value that asks for nothing (null always does)
_SAMPLING_PARAMS_DEFAULTS = {
    'frequency_penalty': 0, 'presence_penalty': 0, 'min_new_tokens': 0, 'n': 1, 'custom_params': {},
    'logit_bias': {}, 'return_hidden_states': False,
}


def generate_fields_from_sampling_params(body: Mapping | None) -> dict:
    """The fields of lmdeploy's ``/generate`` request that the SGLang ``sampling_params`` object of ``body`` sets.

    lmdeploy's ``/generate`` takes its sampling settings as top-level fields, and its request model dropped a
    ``sampling_params`` object: a client written for SGLang got the defaults (128 tokens, temperature 1) without a
    word, and its JSON was cut short. Each key of :data:`SAMPLING_PARAMS_SERVED` maps to its field
    (``max_new_tokens`` to ``max_tokens``, ``no_stop_trim`` to ``include_stop_str_in_output``, SGLang's
    ``top_k=-1``, no limit, to lmdeploy's 0); ``json_schema`` and ``regex`` are read by
    :func:`response_format_from_fields`. A null value asks for nothing. The values' types are the request model's
    to check.

    Raises
    ------
    GuidedFieldError
        ``param='sampling_params'``: it is not an object, a key this server cannot serve with a value that asks for
        something (``frequency_penalty``, ``presence_penalty``, ``min_new_tokens``, ``n`` other than 1, ...), an
        unknown key, or a key whose field the body also sets, to another value.
    """
    params = body.get('sampling_params') if isinstance(body, Mapping) else None
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise GuidedFieldError(f'sampling_params must be an object, got {type(params).__name__}',
                               param='sampling_params')
    fields = {}
    for key, value in params.items():
        if value is None or key in _SAMPLING_PARAMS_FIELDS:
            continue
        field = SAMPLING_PARAMS_SERVED.get(key)
        if field is None:
            if key in _SAMPLING_PARAMS_DEFAULTS:
                if value == _SAMPLING_PARAMS_DEFAULTS[key]:
                    continue
                raise GuidedFieldError(f'sampling_params.{key} is not supported by this server\'s /generate (got '
                                       f'{value!r}); leave it out', param='sampling_params')
            served = ', '.join(sorted([*SAMPLING_PARAMS_SERVED, 'json_schema', 'regex']))
            raise GuidedFieldError(f'sampling_params.{key} is not a sampling parameter this server knows; it serves '
                                   f'{served}', param='sampling_params')
        if key == 'top_k' and value == -1:  # SGLang's "no limit" is lmdeploy's 0
            value = 0
        if field in body and body[field] is not None and body[field] != value:
            raise GuidedFieldError(f'sampling_params.{key} ({value!r}) and {field} ({body[field]!r}) disagree; send '
                                   'one of them', param='sampling_params')
        fields[field] = value
    return fields


def client_location(loc, fields: Mapping[str, str]) -> str:
    """Where a pydantic error (its ``loc``) of a chat request that an endpoint built from its own request is, named as
    that endpoint's client sent it: ``fields`` maps a chat request field to the client's (the Responses API's
    ``{"response_format": "text.format", "max_completion_tokens": "max_output_tokens"}``). A renamed
    ``response_format`` holds the keys of its ``json_schema`` itself, as ``text.format`` and Anthropic's
    ``output_format`` do: ``response_format.json_schema.strict`` is ``text.format.strict``. A refusal that named the
    chat request's field sent the client looking for a field it never sent."""
    parts = [str(part) for part in loc]
    if not parts or parts[0] not in fields:
        return '.'.join(parts)
    rest = parts[1:]
    if parts[0] == 'response_format' and rest[:1] == ['json_schema']:
        rest = rest[1:]
    return '.'.join([fields[parts[0]], *rest])


def validation_refusal(err, fields: Mapping[str, str]) -> tuple[str, str]:
    """The refusal of a pydantic ``ValidationError`` (``err``) of a chat request that an endpoint built from its own
    request: ``(location, message)``, where ``location`` is its first error's place named as the endpoint's client
    sent it (:func:`client_location`; ``''`` when it has none) and ``message`` says where and what it is (``Invalid
    text.format.strict: Input should be a valid boolean``). The Responses API and Anthropic's Messages API answer
    it with HTTP 400, as the chat endpoint answers its own."""
    first = next(iter(err.errors()), {})
    location = client_location(first.get('loc', ()), fields)
    detail = first.get('msg', 'invalid value')
    return location, (f'Invalid {location}: {detail}' if location else detail)
