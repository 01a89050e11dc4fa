"""Schemas, regexes and valid instances shared by the tests, and grammar helpers."""
import json
import time

import xgrammar as xgr

from lmdeploy_guided_spec import testing

SCHEMAS = {
    'person': {
        'type': 'object',
        'properties': {
            'name': {'type': 'string'},
            'age': {'type': 'integer', 'minimum': 0},
            'email': {'type': 'string'},
        },
        'required': ['name', 'age'],
        'additionalProperties': False,
    },
    'nested_order': {
        'type': 'object',
        'properties': {
            'order_id': {'type': 'string', 'pattern': '^[A-Z]{2}[0-9]{4}$'},
            'customer': {
                'type': 'object',
                'properties': {'first_name': {'type': 'string'}, 'last_name': {'type': 'string'}},
                'required': ['first_name', 'last_name'],
                'additionalProperties': False,
            },
            'items': {
                'type': 'array',
                'items': {
                    'type': 'object',
                    'properties': {'sku': {'type': 'string'}, 'qty': {'type': 'integer'}, 'price': {'type': 'number'}},
                    'required': ['sku', 'qty'],
                },
                'minItems': 1,
            },
        },
        'required': ['order_id', 'customer', 'items'],
        'additionalProperties': False,
    },
    'enum_prefixes': {
        'type': 'object',
        'properties': {
            'status': {'enum': ['active', 'activated', 'activation_pending', 'inactive']},
            'level': {'enum': [1, 10, 100]},
            'note': {'type': 'string'},
        },
        'required': ['status', 'level', 'note'],
        'additionalProperties': False,
    },
    'escapes_unicode': {
        'type': 'object',
        'properties': {
            'text': {'type': 'string'},
            'tags': {'type': 'array', 'items': {'type': 'string'}},
            'ratio': {'type': 'number'},
            'ok': {'type': 'boolean'},
        },
        'required': ['text', 'tags', 'ratio', 'ok'],
    },
}

# Valid instances of the schemas above: the token paths the properties walk along.
INSTANCES = {
    'person': [{'name': 'Ada Lovelace', 'age': 36}, {'name': 'Zoë', 'age': 0, 'email': 'z@example.org'}],
    'nested_order': [{
        'order_id': 'AB1234',
        'customer': {'first_name': 'Grace', 'last_name': 'Hopper'},
        'items': [{'sku': 'X-1', 'qty': 2, 'price': 9.5}, {'sku': 'Y', 'qty': 1}],
    }],
    'enum_prefixes': [{'status': 'activation_pending', 'level': 100, 'note': 'a'},
                      {'status': 'active', 'level': 1, 'note': ''}],
    'escapes_unicode': [{'text': 'line1\nline2 \"quoted\" \\ tab\t – 日本語 🙂', 'tags': ['α', 'β'], 'ratio': -1.5e-3,
                         'ok': True}],
}

REGEXES = {
    'date_or_time': r'(\d{4}-\d{2}-\d{2}|\d{2}:\d{2})',
    'answer': r'(yes|no|maybe)( because [a-z ]{1,20})?\.',
    'repeated': r'(ab|cd)+x{2,3}',
}
REGEX_INSTANCES = {
    'date_or_time': ['2024-01-31', '23:59'],
    'answer': ['yes.', 'maybe because it rains.'],
    'repeated': ['ababcdxx', 'cdxxx'],
}


def wide_object(n: int, *, required: bool = False, prefix: str = 'field') -> dict:
    """An object of ``n`` integer properties named ``<prefix>_<i>``: xgrammar's compile time grows faster than
    ``n``. Optional, its matcher holds about ``n**3`` bytes once it has read a key (3,000: about 0.1 GB; 8,000:
    1.9 GB); ``required``, it stays small (6,000: 1 MB)."""
    names = [f'{prefix}_{i}' for i in range(n)]
    schema = {'type': 'object', 'properties': {name: {'type': 'integer'} for name in names},
              'additionalProperties': False}
    return {**schema, 'required': names} if required else schema


def dumps(instance) -> str:
    """The JSON text a model emits for an instance (json.dumps separators, unicode kept)."""
    return json.dumps(instance, ensure_ascii=False)


def compile_schema(name: str, schema) -> xgr.CompiledGrammar:
    return testing.grammar_compiler(name).compile_json_schema(json.dumps(schema))


def compile_regex(name: str, regex: str) -> xgr.CompiledGrammar:
    return testing.grammar_compiler(name).compile_regex(regex)


def new_matcher(compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
    # lmdeploy's GuidedDecodingManager builds its matchers this way
    return xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)

#: An order with a customer and two or three items (the values of extraction prompts: a name, a city, skus)
ORDER = {
    'type': 'object',
    'properties': {
        'order_id': {'type': 'string', 'maxLength': 8},
        'customer': {'type': 'object', 'properties': {'name': {'type': 'string', 'maxLength': 24},
                                                      'city': {'type': 'string', 'maxLength': 16}},
                     'required': ['name', 'city'], 'additionalProperties': False},
        'items': {'type': 'array', 'minItems': 2, 'maxItems': 3,
                  'items': {'type': 'object', 'properties': {'sku': {'type': 'string', 'maxLength': 8},
                                                             'qty': {'type': 'integer', 'maximum': 99}},
                            'required': ['sku', 'qty'], 'additionalProperties': False}},
    },
    'required': ['order_id', 'customer', 'items'],
    'additionalProperties': False,
}


def mask_costs(matcher: xgr.GrammarMatcher, ids, vocab_size: int, limit_s: float = 10) -> list[float]:
    """The seconds of each ``fill_next_token_bitmask`` (CPU time of this thread, as the engine's clock counts: a
    busy machine does not make a mask slow) while ``matcher`` accepts ``ids`` one by one; fails once the walk has
    taken ``limit_s`` of wall time."""
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    costs = []
    start = time.perf_counter()
    for token in ids:
        tick = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask)
        costs.append(time.thread_time() - tick)
        assert matcher.accept_token(token)
        assert time.perf_counter() - start < limit_s, f'{len(costs)} tokens took {limit_s} s'
    return costs
