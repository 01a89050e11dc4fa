"""Seeded random traffic for a running api_server, to hunt the defects that only mixed, hostile traffic shows.

Waves of 1 to 8 concurrent requests on ``/v1/chat/completions``, ``/v1/completions``, ``/generate`` and, where the
server has them, the Responses API's ``/v1/responses`` and Anthropic's ``/v1/messages``, each a random mix of what
clients send: every ``response_format`` kind (Anthropic's ``output_format``) and the guided fields of vLLM and
SGLang, tools with every ``tool_choice``, schemas built to hurt (recursive, deep, wide,
unsatisfiable, invalid), sampling settings in and out of range, ``n``, logprobs, stop words, penalties,
``min_new_tokens``, ``ignore_eos``, a ``session_id`` other requests may hold, prompts empty, long or made of token
ids, streams read to the end or left after a few chunks. After each wave a guided greedy request must answer a valid
document. Run against a server of the CPU path (docs/en/developing.md)::

    .venv/bin/python tests/e2e/random_traffic.py --url http://127.0.0.1:23333 --seed 1 --seconds 600

A failure is a request answered HTTP 5xx, a connection the server dropped, a stream that does not end with ``[DONE]``
(a Responses API stream: with its status event; an Anthropic one: with ``message_stop`` or its error) or carries an
internal error, a request the engine could not sample (its logits held no finite value: through the API that is the
engine's fault, not the request's), a guided answer that stopped but is not a valid document, a forced tool call
(``required``, ``any``, by name) that stopped without a call or whose call is not of an offered function with valid
arguments (streamed or not: a stream's deltas are joined), or a wave's check request that does not answer one. Each
is printed with its request body (the seed replays the bodies, not the server's timing).
``tests/e2e/test_server_traffic.py::test_random_traffic`` runs a few waves of it.
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import json
import random
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import jsonschema
from e2e_helpers import UNSAMPLEABLE, check_valid

PERSON = {'type': 'object', 'properties': {'name': {'type': 'string', 'maxLength': 12},
                                           'age': {'type': 'integer', 'minimum': 0, 'maximum': 150}},
          'required': ['name', 'age'], 'additionalProperties': False}
LINKED = {'$defs': {'n': {'type': 'object', 'properties': {'v': {'type': 'integer'},
                                                           'next': {'anyOf': [{'$ref': '#/$defs/n'},
                                                                              {'type': 'null'}]}},
                          'required': ['v', 'next'], 'additionalProperties': False}},
          '$ref': '#/$defs/n'}


def _deep(depth: int) -> dict:
    schema: dict = {'type': 'integer'}
    for _ in range(depth):
        schema = {'type': 'array', 'items': schema, 'maxItems': 2}
    return schema


#: JSON schemas whose every document xgrammar's grammar allows is valid (checked with jsonschema) ...
EXACT_SCHEMAS = [
    PERSON,
    LINKED,
    {'enum': ['alpha', 'beta', 'gamma delta', 3, None]},
    {'type': 'array', 'items': {'type': 'integer'}, 'minItems': 2, 'maxItems': 4},
    {'type': 'string', 'pattern': '^[0-9]{2,5}$'},
    {'type': 'object', 'properties': {'a': {'type': 'array', 'items': {
        'type': 'object', 'properties': {'b': {'type': 'number'}, 'c': {'type': 'boolean'}}, 'required': ['b'],
        'additionalProperties': False}}}, 'additionalProperties': False},
    {'anyOf': [{'type': 'integer'}, {'type': 'null'}, {'type': 'string', 'maxLength': 3}]},
    _deep(12),
    {'type': 'object', 'properties': {f'k{i}': {'type': 'boolean'} for i in range(40)},
     'required': [f'k{i}' for i in range(40)], 'additionalProperties': False},
    {'enum': [f'value {i}' for i in range(300)]},
    {},
    {'type': 'object', 'additionalProperties': False},
    {'const': 'only'},
]
#: ... schemas xgrammar serves but checks less than jsonschema does (formats), only parsed ...
LOOSE_SCHEMAS = [
    {'type': 'string', 'format': 'date'},
    {'type': 'object', 'properties': {'when': {'type': 'string', 'format': 'date-time'},
                                      'mail': {'type': 'string', 'format': 'email'}}, 'required': ['when']},
]
#: ... and schemas a server refuses or serves as it documents (without instances, invalid)
HOSTILE_SCHEMAS = [
    {'$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'},
    {'type': 'nope'},
    {'not': {}},
    {'type': 'integer', 'minimum': 5, 'maximum': 1},
    {'$ref': '#/$defs/missing'},
    {'type': 'string', 'pattern': '('},
    {'type': 'array', 'minItems': 3, 'maxItems': 1},
    'not an object',
]
YEAR = {'type': 'object', 'properties': {'year': {'type': 'integer', 'minimum': 1900, 'maximum': 2100}},
        'required': ['year'], 'additionalProperties': False}
#: functions of ``tools``: ``(name, parameters)``, the parameters None where the function has none (an empty
#: object); checked like EXACT_SCHEMAS where they are among them
FUNCTIONS = [('save_person', PERSON), ('save_year', YEAR), ('link', LINKED), ('ping', None),
             ('no_args', {'type': 'object', 'properties': {}}), ('loop', HOSTILE_SCHEMAS[0]),
             ('bad_type', HOSTILE_SCHEMAS[1]), ('never', HOSTILE_SCHEMAS[2])]
REGEXES = ['[a-c]{3,9}', '(yes|no)', r'\d{1,3}(\.\d{1,3}){3}', '(', '', 'a{1000}']
PROMPTS = ['hi', 'A JSON person, please.', '{"a":', 'Ünïcødé ✓ 日本語', '', 'x' * 300, 'word ' * 2000]


@dataclass
class Outcome:
    """What became of one request."""
    key: tuple
    failure: str | None = None
    body: dict = field(default_factory=dict)
    #: the message of a refusal (HTTP 4xx)
    refusal: str | None = None


#: How a guided answer that stopped is checked: ``'valid'``, an instance of its format (``check_valid``); ``'json'``,
#: a JSON document; ``None``, not at all.
Check = str | None


def fresh_schema(rng: random.Random) -> dict:
    """A schema the server has most likely not compiled yet (a random property name and string bound): its grammar
    compiles while other requests decode, in the engine and, with ``--tp``, in every rank process; a bounded string
    takes xgrammar seconds to compile. One in four bounds its string by a pattern that looks slow to parse (a
    counted repetition past 2,000, parsed in about a second): it queues among such grammars, and where as many wait
    already (``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``) it is refused with HTTP 429, by the server's checker or the
    engine's compile service."""
    name = f'note_{rng.randrange(10**6)}'
    text = ({'type': 'string', 'pattern': f'^[a-z ]{{1,{rng.randint(2001, 2400)}}}$'} if rng.random() < 0.25
            else {'type': 'string', 'maxLength': rng.randint(1, 60)})
    return {'type': 'object', 'properties': {name: text,
                                             'n': {'type': 'integer', 'minimum': 0, 'maximum': rng.randint(1, 999)}},
            'required': [name, 'n'], 'additionalProperties': False}


def _schema_format(rng: random.Random) -> tuple[dict, Check]:
    """A ``response_format`` of a JSON schema, and how its answer is checked."""
    kind = rng.random()
    if kind < 0.1:
        schema, check = fresh_schema(rng), 'valid'
    elif kind < 0.6:
        schema, check = rng.choice(EXACT_SCHEMAS), 'valid'
    elif kind < 0.75:
        schema, check = rng.choice(LOOSE_SCHEMAS), 'json'
    else:
        schema, check = rng.choice(HOSTILE_SCHEMAS), None
    return {'type': 'json_schema', 'json_schema': {'name': 'r', 'schema': copy.deepcopy(schema)}}, check


def response_format(rng: random.Random) -> tuple[dict | None, Check]:
    """A ``response_format`` (or None), and how its answer is checked."""
    pick = rng.random()
    if pick < 0.2:
        return None, None
    if pick < 0.3:
        return {'type': 'text'}, None
    if pick < 0.4:
        return {'type': 'json_object'}, 'json'
    if pick < 0.55:
        return {'type': 'regex_schema', 'regex_schema': rng.choice(REGEXES)}, None
    return _schema_format(rng)


def sampling(rng: random.Random, hostile: bool) -> dict:
    """Sampling settings of an OpenAI request; out of range or of the wrong type too when ``hostile``."""
    p: dict = {'max_tokens': rng.choice([1, 2, 3, 8, 24, 64])}

    def maybe(prob: float) -> bool:
        return rng.random() < prob

    def pick(valid: list, invalid: list):
        return rng.choice(valid + invalid if hostile else valid)

    if maybe(.5):
        p['temperature'] = pick([0, 0.0001, 0.5, 1.0, 2.0], [-1.0, 3.0])
    if maybe(.3):
        p['top_p'] = pick([0.0001, 0.1, 0.9, 1.0], [0.0, 1.5])
    if maybe(.3):
        p['top_k'] = pick([0, 1, 2, 40, 200_000], [-1, 10**12])
    if maybe(.2):
        p['min_p'] = pick([0.0, 0.5, 0.99, 1.0], [-0.1, 2.0])
    if maybe(.2):
        p['min_new_tokens'] = pick([1, 5, 30], [0, -3])
    if maybe(.2):
        p['repetition_penalty'] = pick([0.5, 1.0, 1.3, 5.0], [0.0, -1.0])
    if maybe(.15):
        p['presence_penalty'] = pick([-2.0, 0.0, 2.0], [9.0])
    if maybe(.15):
        p['frequency_penalty'] = pick([-2.0, 1.0, 2.0], [-9.0])
    if maybe(.2):
        p['stop'] = rng.choice(['"', '}', ['a', 'b'], '\n', ',', '', []])
    if maybe(.1):
        p['stop_token_ids'] = pick([[0]], [[10**15], [-1]])
    if maybe(.15):
        p['ignore_eos'] = rng.choice([True, False])
    if maybe(.2):
        p['seed'] = rng.randrange(1 << 31)
    if maybe(.1):
        p['n'] = pick([1, 2], [0])
    if maybe(.1):
        p['skip_special_tokens'] = False
    if maybe(.1):
        p['include_stop_str_in_output'] = True
    if maybe(.1):
        p['repetition_ngram_size'] = rng.choice([1, 2])
        p['repetition_ngram_threshold'] = rng.choice([1, 3])
    if maybe(.1):
        p['session_id'] = rng.randrange(1, 20)
    if hostile and maybe(.2):
        p[rng.choice(['max_tokens', 'temperature', 'top_k'])] = rng.choice(['ten', None, [], -5])
    return p


def guided_fields(rng: random.Random) -> tuple[dict, dict | None, Check]:
    """The vLLM and SGLang fields of a guided ``/generate`` or ``/v1/completions`` request (valid, conflicting,
    malformed), or a ``response_format``."""
    pick = rng.random()
    if pick < 0.5:
        fmt, check = response_format(rng)
        return ({} if fmt is None else {'response_format': fmt}), fmt, check
    fields = rng.choice([
        {'guided_json': PERSON}, {'guided_json': json.dumps(PERSON)}, {'guided_regex': '[ab]{2,6}'},
        {'guided_choice': ['yes', 'no', 'maybe']}, {'guided_grammar': 'root ::= "x" | "y"'},
        {'structured_outputs': {'json': PERSON}}, {'structured_outputs': {'choice': ['a', 'b']}},
        {'structured_outputs': {'regex': '[0-9]+'}}, {'regex': '[0-9]{3}'}, {'json_schema': json.dumps(PERSON)},
        {'ebnf': 'root ::= "q"'}, {'guided_json': PERSON, 'guided_regex': 'a'}, {'guided_choice': []},
        {'guided_json': 'not json'}, {'guided_regex': '('}, {'structured_outputs': {'json': PERSON, 'regex': 'a'}},
        {'guided_decoding_backend': 'outlines', 'guided_json': PERSON},
        {'guided_whitespace_pattern': ' ', 'guided_json': PERSON}])
    return fields, None, None


def text_format(fmt: dict | None) -> dict | None:
    """The Responses API's ``text.format`` of a chat ``response_format`` (a kind it lacks, e.g. ``regex_schema``,
    passes as it is: the server refuses it)."""
    if fmt is None or fmt.get('type') != 'json_schema':
        return fmt
    return {'type': 'json_schema', 'name': fmt['json_schema']['name'], 'schema': fmt['json_schema']['schema']}


def tools(rng: random.Random, hostile: bool) -> tuple[list[dict], str | dict | None]:
    """OpenAI ``tools`` (1 to 3 of FUNCTIONS, ``strict`` or not) and a ``tool_choice`` (None: not sent): ``none``,
    ``auto``, ``required``, one of them by name or, when ``hostile``, a name not among them or a malformed one."""
    picked = rng.sample(FUNCTIONS, rng.randrange(1, 4))
    out = []
    for name, parameters in picked:
        function: dict = {'name': name, 'description': f'{name.replace("_", " ")}.'}
        if parameters is not None:
            function['parameters'] = copy.deepcopy(parameters)
        if rng.random() < 0.3:
            function['strict'] = rng.choice([True, False])
        out.append({'type': 'function', 'function': function})
    choices: list = [None, 'none', 'auto', 'required', 'required',
                     {'type': 'function', 'function': {'name': rng.choice(picked)[0]}}]
    if hostile:
        choices += [{'type': 'function', 'function': {'name': 'missing'}}, {'type': 'function'}, 'sometimes']
    return out, rng.choice(choices)


def anthropic_body(rng: random.Random, model: str, hostile: bool) -> tuple[dict, dict | None, Check]:
    """A request of Anthropic's Messages API (``/v1/messages``): structured outputs (``output_format``), tools,
    sampling; the chat ``response_format`` its output format stands for, and how its answer is checked."""
    body: dict = {'model': model, 'max_tokens': rng.choice([1, 8, 24, 64]) if not hostile else rng.choice([0, 8]),
                  'messages': [{'role': 'user', 'content': rng.choice(PROMPTS)}]}
    if rng.random() < 0.5:
        body['temperature'] = rng.choice([0, 0.5, 1.0] + ([-1.0, 3.0] if hostile else []))
    if rng.random() < 0.2:
        body['top_p'] = rng.choice([0.1, 0.9] + ([1.5] if hostile else []))
    if rng.random() < 0.2:
        body['top_k'] = rng.choice([1, 40] + ([-1] if hostile else []))
    if rng.random() < 0.15:
        body['stop_sequences'] = rng.choice([['"'], ['}', '\n'], []])
    if rng.random() < 0.1:
        body['system'] = 'Answer in JSON.'
    fmt, check = None, None
    pick = rng.random()
    if pick < 0.5:
        fmt, check = _schema_format(rng)
        output_format = {'type': 'json_schema', 'schema': fmt['json_schema']['schema']}
        if hostile and rng.random() < 0.3:
            output_format = rng.choice([{'type': 'json_object'}, {'type': 'json_schema'}, {'type': 'text'}])
            fmt, check = None, None
        body['output_format'] = output_format
    elif pick < 0.7:
        openai_tools, choice = tools(rng, hostile)
        body['tools'] = [{'name': t['function']['name'], 'description': t['function']['description'],
                          'input_schema': t['function'].get('parameters', {'type': 'object'})} for t in openai_tools]
        if choice in ('auto', 'required'):
            body['tool_choice'] = {'type': 'any' if choice == 'required' else 'auto'}
        elif isinstance(choice, dict) and 'function' in choice:
            body['tool_choice'] = {'type': 'tool', 'name': choice['function']['name']}
        if rng.random() < 0.3:
            # Anthropic's parallel_tool_calls false: at most one tool_use block
            body['tool_choice'] = {'type': 'auto', **body.get('tool_choice', {}),
                                   'disable_parallel_tool_use': rng.choice([True, True, False])}
    return body, fmt, check


def _parallel_tool_calls(rng: random.Random, body: dict) -> None:
    """Sometimes OpenAI's ``parallel_tool_calls`` (chat and Responses), mostly false."""
    if rng.random() < 0.2:
        body['parallel_tool_calls'] = rng.choice([False, False, True])


def build(rng: random.Random, model: str, responses: bool = False, messages: bool = False,
          logit_bias: dict | None = None) -> tuple[str, dict, dict | None, Check, int | None]:
    """One request: ``(endpoint, body, response_format, check, chunks to read before leaving or None)``; with
    ``responses``, of the Responses API (``/v1/responses``) too, with ``messages``, of Anthropic's Messages API
    (``/v1/messages``) too; with ``logit_bias``, half the chat requests send it, and none goes without a limit of
    its output."""
    endpoint = rng.choice(['/v1/chat/completions'] * 3 + ['/v1/completions', '/generate']
                          + ['/v1/responses'] * responses + ['/v1/messages'] * messages)
    hostile = rng.random() < 0.25
    params = sampling(rng, hostile)
    if endpoint == '/v1/chat/completions':
        fmt, check = response_format(rng)
        body = {'model': model, 'messages': [{'role': 'user', 'content': rng.choice(PROMPTS)}], **params}
        if fmt is not None:
            body['response_format'] = fmt
        if rng.random() < 0.15:
            body['logprobs'] = True
            body['top_logprobs'] = rng.choice([0, 1, 5, 20])
        if hostile and rng.random() < 0.1:
            body['messages'] = rng.choice([[], [{'role': 'user'}], 'hi'])
        if rng.random() < 0.25:
            body['tools'], choice = tools(rng, hostile)
            if rng.random() < 0.15:
                # OpenAI's allowed_tools: some of the tools, in a mode
                names = [t['function']['name'] for t in body['tools']]
                allowed = rng.sample(names, rng.randrange(1, len(names) + 1))
                choice = {'type': 'allowed_tools', 'allowed_tools': {
                    'mode': rng.choice(['auto', 'required']),
                    'tools': [{'type': 'function', 'function': {'name': name}} for name in allowed]}}
            if choice is not None:
                body['tool_choice'] = choice
            _parallel_tool_calls(rng, body)
        if logit_bias is not None and rng.random() < 0.5:
            body['logit_bias'] = logit_bias
        if logit_bias is not None and body.get('max_tokens', 0) is None:
            # a server with a reasoning parser: the tiny model's reasoning, which the bias does not end when it
            # decodes greedily (it cycles through the biased tokens), would run to the end of the context (minutes
            # on CPU ranks)
            body['max_tokens'] = 64
    elif endpoint == '/v1/completions':
        fields, fmt, check = guided_fields(rng)
        body = {'model': model, 'prompt': rng.choice([*PROMPTS, ['a', 'b'], [1, 2, 3]]), **params, **fields}
        if rng.random() < 0.15:
            body['logprobs'] = rng.choice([0, 1, 5])
        if rng.random() < 0.05:
            body['echo'] = True
        if rng.random() < 0.05:
            body['suffix'] = 'x'
    elif endpoint == '/v1/responses':
        fmt, check = response_format(rng)
        params['max_output_tokens'] = params.pop('max_tokens', None)
        if logit_bias is not None and params['max_output_tokens'] is None:
            # the Responses API ignores logit_bias: a tiny model's reasoning would run to the end of the context
            params['max_output_tokens'] = 64
        body = {'model': model, 'input': rng.choice(PROMPTS), **params}
        if rng.random() < 0.3:
            body['input'] = [{'role': 'user', 'content': rng.choice(PROMPTS)}]
        if fmt is not None:
            body['text'] = {'format': text_format(fmt)}
        if rng.random() < 0.2:
            # the Responses API's function tools are flat: {"type": "function", "name", "parameters", "strict"}
            openai_tools, choice = tools(rng, hostile)
            body['tools'] = [{'type': 'function', **t['function']} for t in openai_tools]
            if isinstance(choice, dict) and isinstance(choice.get('function'), dict):
                choice = {'type': 'function', **choice['function']}
            if choice is not None:
                body['tool_choice'] = choice
            _parallel_tool_calls(rng, body)
    elif endpoint == '/v1/messages':
        body, fmt, check = anthropic_body(rng, model, hostile)
    else:
        fields, fmt, check = guided_fields(rng)
        params.pop('n', None)
        body = {'prompt': rng.choice(PROMPTS), **params, **fields}
        if rng.random() < 0.15:
            body.pop('prompt')
            body['input_ids'] = rng.choice([[1, 2, 3], [10**9], [-5], []] if hostile else [[1, 2, 3], [42, 7]])
        if rng.random() < 0.1:
            body['return_logprob'] = True
            body['top_logprobs_num'] = rng.choice([0, 2])
    body['stream'] = rng.random() < 0.4
    leave_after = rng.randrange(1, 6) if body['stream'] and rng.random() < 0.3 else None
    return endpoint, body, fmt, check, leave_after


def _texts(endpoint: str, payload: dict) -> list[tuple[str | None, str | None]]:
    """``(text, finish_reason)`` of each choice of a non-streamed answer."""
    if endpoint == '/generate':
        reason = (payload.get('meta_info') or {}).get('finish_reason') or {}
        return [(payload.get('text'), reason.get('type') if isinstance(reason, dict) else reason)]
    if endpoint == '/v1/completions':
        return [(c.get('text'), c.get('finish_reason')) for c in payload.get('choices', [])]
    if endpoint == '/v1/responses':
        if any(item.get('type') == 'function_call' for item in payload.get('output') or []):
            return [(payload.get('output_text'), 'tool_calls')]  # calls instead of the document
        return [(payload.get('output_text'), 'stop' if payload.get('status') == 'completed' else payload.get('status'))]
    if endpoint == '/v1/messages':
        text = ''.join(block.get('text', '') for block in payload.get('content') or [] if block.get('type') == 'text')
        return [(text, 'stop' if payload.get('stop_reason') == 'end_turn' else payload.get('stop_reason'))]
    # (after the reasoning too: the whitespace before the document is not content)
    return [((c.get('message') or {}).get('content'), c.get('finish_reason')) for c in payload.get('choices', [])]


def _message(text: str) -> str:
    """The message of an error answer, cut to a line of a table."""
    try:
        payload = json.loads(text)
    except json.JSONDecodeError:
        return text[:70]
    if isinstance(payload, dict):
        inner = payload.get('error', payload)
        message = inner.get('message', inner.get('detail', payload)) if isinstance(inner, dict) else inner
        text = message if isinstance(message, str) else json.dumps(message)
    return ' '.join(text.split())[:70]


def check_document(text: str | None, fmt: dict, check: Check) -> str | None:
    """What is wrong with a guided answer that stopped, or None."""
    try:
        if check == 'valid':
            check_valid(text or '', fmt)
        else:
            json.loads(text or '')
    except json.JSONDecodeError as e:
        return f'not JSON ({e}): {text!r}'
    except jsonschema.ValidationError as e:
        return f'not valid for its schema ({e.message}): {text!r}'
    return None


_EXACT_PARAMETERS = [PERSON, YEAR, LINKED]


def _forced_tools(endpoint: str, body: dict) -> tuple[dict, str | None, bool] | None:
    """``({name: parameters}, the one name or None, forced)`` of a request whose calls are constrained: its
    tool_choice forces a call (``required``, Anthropic's ``any``, a named one), or with tool_choice ``auto`` (not
    forced) a response format beside the tools lets the answer be calls or the document, or a tool is strict; else
    None."""
    choice = body.get('tool_choice')
    if endpoint == '/v1/messages':
        functions = {t['name']: t['input_schema'] for t in body['tools']}
        if isinstance(choice, dict) and choice.get('type') in ('any', 'tool'):
            return functions, choice.get('name'), True
        if (choice is None or choice.get('type') == 'auto') and body.get('output_format'):
            return functions, None, False
        return None
    if endpoint == '/v1/responses':
        functions = {t['name']: t.get('parameters') for t in body['tools']}
        if choice == 'required' or isinstance(choice, dict) and 'name' in choice:
            return functions, choice.get('name') if isinstance(choice, dict) else None, True
        if choice in (None, 'auto') and ((body.get('text') or {}).get('format', {}).get('type', 'text') != 'text'
                                         or any(t.get('strict') for t in body['tools'])):
            return functions, None, False
        return None
    functions = {t['function']['name']: t['function'].get('parameters') for t in body['tools']}
    if isinstance(choice, dict) and choice.get('type') == 'allowed_tools':
        allowed = {t['function']['name'] for t in choice['allowed_tools']['tools']}
        functions = {name: parameters for name, parameters in functions.items() if name in allowed}
        choice = choice['allowed_tools']['mode']
        body = {**body, 'tools': [t for t in body['tools'] if t['function']['name'] in allowed]}
    if choice == 'required' or isinstance(choice, dict) and isinstance(choice.get('function'), dict):
        return functions, choice['function'].get('name') if isinstance(choice, dict) else None, True
    if choice in (None, 'auto') and ((body.get('response_format') or {}).get('type', 'text') != 'text'
                                     or any(t['function'].get('strict') for t in body['tools'])):
        return functions, None, False
    return None


def streamed_answer(endpoint: str, events: list[dict]) -> dict:
    """The answer a stream's events (its ``data:`` objects) add up to, in the shape of the non-streamed answer, as
    far as :func:`check_tool_calls` reads it: the chat choices' tool calls (name and the arguments' deltas joined)
    and finish reasons, the Responses API's completed response, Anthropic's tool_use blocks (their input's JSON
    deltas joined) and stop reason."""
    if endpoint == '/v1/responses':
        done = [e['response'] for e in events if e.get('type') in ('response.completed', 'response.incomplete')
                and isinstance(e.get('response'), dict)]
        return done[-1] if done else {}
    if endpoint == '/v1/messages':
        blocks: dict = {}
        answer: dict = {'content': []}
        for e in events:
            if e.get('type') == 'content_block_start' and (e.get('content_block') or {}).get('type') == 'tool_use':
                blocks[e['index']] = {'type': 'tool_use', 'name': e['content_block'].get('name'), 'json': ''}
            elif e.get('type') == 'content_block_delta' and e.get('index') in blocks:
                blocks[e['index']]['json'] += (e.get('delta') or {}).get('partial_json') or ''
            elif e.get('type') == 'message_delta':
                answer['stop_reason'] = (e.get('delta') or {}).get('stop_reason')
        answer['content'] = [{'type': 'tool_use', 'name': b['name'], 'input': b['json'] or '{}'}
                             for _, b in sorted(blocks.items())]
        return answer
    choices: dict = {}
    for e in events:
        for c in e.get('choices') or []:
            choice = choices.setdefault(c.get('index', 0), {'calls': {}, 'finish_reason': None})
            for call in (c.get('delta') or {}).get('tool_calls') or []:
                entry = choice['calls'].setdefault(call.get('index', 0), {'name': None, 'arguments': ''})
                function = call.get('function') or {}
                entry['name'] = entry['name'] or function.get('name')
                entry['arguments'] += function.get('arguments') or ''
            choice['finish_reason'] = c.get('finish_reason') or choice['finish_reason']
    return {'choices': [{'finish_reason': c['finish_reason'], 'message': {'tool_calls': [
        {'function': call} for _, call in sorted(c['calls'].items())]}} for _, c in sorted(choices.items())]}


def check_tool_calls(endpoint: str, body: dict, payload: dict) -> str | None:
    """What is wrong with the calls of a non-streamed answer whose calls are constrained (:func:`_forced_tools`), or
    None: a call of a function not offered (or not the named one), arguments that are not a JSON object or not an
    instance of exact parameters (a function without parameters: ``{}``), an answer to a forced tool_choice that
    stopped without a call, or, with ``parallel_tool_calls`` false, more than one call or text after a forced call
    (the output ends with it), and Anthropic's ``disable_parallel_tool_use`` with more than one tool_use block
    (constrained or not: the server keeps the first). Answers cut by ``max_tokens`` are not checked."""
    if endpoint == '/v1/messages' and (body.get('tool_choice') or {}).get('disable_parallel_tool_use') is True:
        uses = [b for b in payload.get('content') or [] if b.get('type') == 'tool_use']
        if len(uses) > 1:
            return f'disable_parallel_tool_use, and {len(uses)} tool_use blocks: {json.dumps(payload)[:300]}'
    constrained = _forced_tools(endpoint, body)
    if constrained is None or body.get('stop') or body.get('stop_sequences'):
        return None
    functions, named, forced = constrained
    if endpoint == '/v1/messages':
        calls = [(b.get('name'), b.get('input')) for b in payload.get('content') or [] if b.get('type') == 'tool_use']
        answers = [(payload.get('stop_reason'), calls, None)]
    elif endpoint == '/v1/responses':
        calls = [(item.get('name'), item.get('arguments')) for item in payload.get('output') or []
                 if item.get('type') == 'function_call']
        text = ''.join(part.get('text') or '' for item in payload.get('output') or [] if item.get('type') == 'message'
                       for part in item.get('content') or [])
        answers = [('stop' if payload.get('status') == 'completed' else payload.get('status'), calls, text)]
    else:
        answers = []
        for c in payload.get('choices', []):
            calls = [(t['function']['name'], t['function']['arguments'])
                     for t in (c.get('message') or {}).get('tool_calls') or []]
            answers.append((c.get('finish_reason'), calls, (c.get('message') or {}).get('content')))
    # parallel_tool_calls false: one call, and a forced one (no text may come before it) ends the output
    single = body.get('parallel_tool_calls') is False and endpoint != '/v1/messages'
    for reason, calls, text in answers:
        if reason not in ('stop', 'tool_calls', 'end_turn', 'tool_use'):
            # cut by max_tokens: the call may be cut too
            continue
        if forced and reason in ('stop', 'end_turn') and not calls:
            return f'a forced tool call stopped without a call: {json.dumps(payload)[:300]}'
        if single and calls and (len(calls) > 1 or forced and text):
            return f'parallel_tool_calls false, and the answer went on after its call: {json.dumps(payload)[:300]}'
        for name, arguments in calls:
            if name not in functions or named is not None and name != named:
                return f'a call of {name!r}, not of {named or sorted(functions)}'
            try:
                args = json.loads(arguments) if isinstance(arguments, str) else arguments
            except json.JSONDecodeError as e:
                return f'the arguments of {name!r} are not JSON ({e}): {arguments!r}'
            parameters = functions[name]
            if parameters is not None and parameters not in _EXACT_PARAMETERS:
                # hostile parameters ({"not": {}}: xgrammar drops "not" and allows any JSON value) are served with a
                # warning, or refused when strict: their arguments need only be JSON
                continue
            if not isinstance(args, dict) or 'raw_arguments' in args:
                return f'the arguments of {name!r} are not a JSON object: {arguments!r}'
            if parameters is None and args != {}:
                return f'{name!r} takes no parameters, its arguments: {arguments!r}'
            if parameters is not None:
                try:
                    jsonschema.validate(args, parameters)
                except jsonschema.ValidationError as e:
                    return f'the arguments of {name!r} are not valid ({e.message}): {arguments!r}'
    return None


async def send(client: aiohttp.ClientSession, base: str, endpoint: str, body: dict, fmt: dict | None, check: Check,
               leave_after: int | None, forced_tools: bool = True) -> Outcome:
    """Send one request and judge what came back; with ``forced_tools``, the calls of a forced tool_choice too."""
    mode = 'left' if leave_after is not None else 'stream' if body.get('stream') else 'plain'
    try:
        # Anthropic's API requires its version header
        headers = {'anthropic-version': '2023-06-01'} if endpoint == '/v1/messages' else None
        async with client.post(f'{base}{endpoint}', json=body, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=300)) as r:
            key = (endpoint, mode, r.status)
            if r.status >= 500:
                return Outcome(key, f'HTTP {r.status}: {(await r.text())[:300]}', body)
            if r.status != 200:
                text = await r.text()
                if 'wait already' in text and r.status != 429:
                    # the server is busy, not the request wrong: a client sends a 429 again, not a 400
                    return Outcome(key, f'a busy grammar compiler answered HTTP {r.status}: {text[:300]}', body)
                return Outcome(key, body=body, refusal=_message(text))
            if body.get('stream'):
                chunks, done, events = 0, False, []
                async for line in r.content:
                    line = line.strip()
                    if not line:
                        continue
                    chunks += 1
                    if leave_after is not None and chunks >= leave_after:
                        return Outcome(key, body=body)
                    if line.startswith(b'data: {'):
                        try:
                            events.append(json.loads(line[6:]))
                        except json.JSONDecodeError:
                            return Outcome(key, f'a stream event that is not JSON: {line[:300]!r}', body)
                    if line in (b'data: [DONE]', b'event: message_stop', b'event: error') or line.startswith(
                            b'event: response.') and line.endswith((b'.completed', b'.incomplete', b'.failed')):
                        # the chat and completions streams end with [DONE], a Responses API stream with its status,
                        # an Anthropic one with message_stop (or its error)
                        done = True
                    elif b'"error"' in line and b'nternal' in line:
                        return Outcome(key, f'an internal error in the stream: {line[:300]!r}', body)
                    elif UNSAMPLEABLE.encode() in line:
                        return Outcome(key, f'unsampleable logits: {line[:300]!r}', body)
                if not done:
                    return Outcome(key, 'the stream ended without [DONE]', body)
                if forced_tools and body.get('tools'):
                    problem = check_tool_calls(endpoint, body, streamed_answer(endpoint, events))
                    if problem is not None:
                        return Outcome((endpoint, mode, 'invalid call'), problem, body)
                return Outcome(key, body=body)
            payload = await r.json(content_type=None)
            if UNSAMPLEABLE in json.dumps(payload):
                return Outcome(key, f'unsampleable logits: {json.dumps(payload)[:300]}', body)
            if forced_tools and body.get('tools'):
                problem = check_tool_calls(endpoint, body, payload)
                if problem is not None:
                    return Outcome((endpoint, mode, 'invalid call'), problem, body)
            stop_words = body.get('stop') or body.get('include_stop_str_in_output') or body.get('stop_sequences')
            if check is not None and not stop_words:
                for text, reason in _texts(endpoint, payload):
                    if reason == 'stop' and text is not None:
                        problem = check_document(text, fmt, check)
                        if problem is not None:
                            return Outcome((endpoint, mode, 'invalid'), problem, body)
            return Outcome(key, body=body)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return Outcome((endpoint, mode, type(e).__name__), f'{type(e).__name__}: {e}', body)


async def check_request(client: aiohttp.ClientSession, base: str, model: str) -> str | None:
    """A guided greedy request answers a valid person: what went wrong, or None. (Thinking off: a server with a
    reasoning parser lets the model reason first, and a tiny random model never ends its reasoning.)"""
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'p', 'schema': PERSON}}
    body = {'model': model, 'messages': [{'role': 'user', 'content': 'A person.'}], 'max_tokens': 64,
            'temperature': 0, 'response_format': fmt, 'chat_template_kwargs': {'enable_thinking': False}}
    try:
        async with client.post(f'{base}/v1/chat/completions', json=body,
                               timeout=aiohttp.ClientTimeout(total=120)) as r:
            if r.status != 200:
                return f'the check request answered HTTP {r.status}: {(await r.text())[:300]}'
            choice = (await r.json())['choices'][0]
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f'the check request failed: {type(e).__name__}: {e}'
    if choice['finish_reason'] != 'stop':
        return f'the check request did not stop: {choice}'
    problem = check_document(choice['message']['content'], fmt, 'valid')
    return None if problem is None else f'the check request: {problem}'


async def _model(client: aiohttp.ClientSession, base: str, wait_s: float, out) -> str:
    """The model the server serves, once it answers ``/v1/models`` (a server still starting is waited for)."""
    deadline = time.monotonic() + wait_s
    said = False
    while True:
        try:
            async with client.get(f'{base}/v1/models', timeout=aiohttp.ClientTimeout(total=10)) as r:
                if r.status == 200:
                    return (await r.json())['data'][0]['id']
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f'{base} did not answer /v1/models within {wait_s:.0f} s')
        if not said:
            print(f'waiting for {base} to answer /v1/models', file=out, flush=True)
            said = True
        await asyncio.sleep(2)


async def _paths(client: aiohttp.ClientSession, base: str) -> dict:
    """The server's OpenAPI paths (``/openapi.json``)."""
    async with client.get(f'{base}/openapi.json', timeout=aiohttp.ClientTimeout(total=30)) as r:
        return (await r.json()).get('paths', {}) if r.status == 200 else {}


async def run(base: str, seed: int, *, requests: int | None = None, seconds: float | None = None,
              wait_s: float = 0, forced_tools: bool = True, logit_bias: dict | None = None,
              out=sys.stdout) -> tuple[list[Outcome], list[Outcome]]:
    """Waves of random requests until ``requests`` were sent or ``seconds`` passed: ``(outcomes, failures)``, the
    failed check requests among the failures. Progress goes to ``out`` after each wave. A server that does not
    answer yet is waited for up to ``wait_s``. Without ``forced_tools`` the calls of a forced ``tool_choice`` are
    not checked (lmdeploy 0.14.0 does not enforce it). ``logit_bias`` goes with half the chat requests."""
    rng = random.Random(seed)
    outcomes_all: list[Outcome] = []
    failures: list[Outcome] = []
    # idle connections are dropped after 3 s: lmdeploy's api_server (uvicorn) closes them after 5 s
    # (UVICORN_TIMEOUT_KEEP_ALIVE), and aiohttp's default of 15 s reused one the server was closing at that moment
    # ("Can not write request body", once in 392 requests): a race of the client's pool, not of the server
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(keepalive_timeout=3)) as client:
        model = await _model(client, base, wait_s, out)
        paths = await _paths(client, base)
        extra = dict(responses='/v1/responses' in paths, messages='/v1/messages' in paths, logit_bias=logit_bias)
        start = time.monotonic()
        sent, wave = 0, 0
        while (requests is None or sent < requests) and (seconds is None or time.monotonic() - start < seconds):
            size = rng.randrange(1, 9)
            if requests is not None:
                size = min(size, requests - sent)
            outcomes = await asyncio.gather(*[send(client, base, *build(rng, model, **extra), forced_tools)
                                              for _ in range(size)])
            sent += size
            wave += 1
            outcomes_all.extend(outcomes)
            for outcome in outcomes:
                if outcome.failure is not None:
                    failures.append(outcome)
            problem = await check_request(client, base, model)
            if problem is not None:
                failures.append(Outcome(('check',), problem))
            print(f'wave {wave}: {sent} requests, {len(failures)} failures, {time.monotonic() - start:.0f} s',
                  file=out, flush=True)
    return outcomes_all, failures


def report(outcomes: list[Outcome], failures: list[Outcome], out=sys.stdout) -> None:
    """The table of outcomes, the refusals by message, the failures with their bodies, and the line
    ``random_traffic_failures N``."""
    counts = collections.Counter(o.key for o in outcomes)
    print(f'{"endpoint":<22} {"mode":<7} {"status":<20} {"requests":>8}', file=out)
    for (endpoint, mode, status), n in sorted(((k, v) for k, v in counts.items()), key=lambda kv: str(kv[0])):
        print(f'{endpoint:<22} {mode:<7} {str(status):<20} {n:>8}', file=out)
    refusals = collections.Counter(o.refusal for o in outcomes if o.refusal is not None)
    if refusals:
        print(f'\n{"refusals (HTTP 4xx), by message":<72} {"requests":>8}', file=out)
        for message, n in refusals.most_common():
            print(f'{message:<72} {n:>8}', file=out)
    for outcome in failures:
        print(f'FAILED {outcome.key}: {outcome.failure}\n    {json.dumps(outcome.body)[:600]}', file=out)
    print(f'random_traffic_failures {len(failures)}', file=out, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--url', default='http://127.0.0.1:23333', help='the api_server (default: %(default)s)')
    parser.add_argument('--seed', type=int, default=0, help='seed of the request bodies (default: %(default)s)')
    parser.add_argument('--seconds', type=float, default=None, help='stop starting waves after this long')
    parser.add_argument('--requests', type=int, default=None, help='stop after this many requests')
    parser.add_argument('--wait', type=float, default=600,
                        help='seconds to wait for a server that is still starting (default: %(default)s)')
    parser.add_argument('--tool-choice-unenforced', action='store_true',
                        help="don't check the calls of tool_choice required / any / by name: the server does not "
                             'enforce them (lmdeploy 0.14.0)')
    parser.add_argument('--logit-bias', type=json.loads, default=None, metavar='JSON',
                        help='a logit_bias sent with half the chat requests, e.g. the tokens of "</think>", which end '
                             "a tiny model's reasoning on a server with a reasoning parser")
    args = parser.parse_args(argv)
    if args.seconds is None and args.requests is None:
        args.seconds = 300
    outcomes, failures = asyncio.run(run(args.url.rstrip('/'), args.seed, requests=args.requests,
                                         seconds=args.seconds, wait_s=args.wait,
                                         forced_tools=not args.tool_choice_unenforced,
                                         logit_bias=args.logit_bias))
    report(outcomes, failures)
    return 1 if failures else 0


if __name__ == '__main__':
    sys.exit(main())
