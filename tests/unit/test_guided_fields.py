"""vLLM / SGLang guided-decoding fields read as a response_format: each mapped field's format accepts what the field
allows and nothing else (checked with xgrammar's matcher), every other field is refused with its name."""
import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from lmdeploy_guided_spec.errors import GuidedFieldError
from lmdeploy_guided_spec.guided_fields import (
    choice_regex,
    client_location,
    generate_fields_from_sampling_params,
    response_format_from_fields,
    validation_refusal,
)

pytestmark = pytest.mark.unit

PERSON = {'type': 'object', 'properties': {'name': {'type': 'string'}}, 'required': ['name']}
CHOICES = ['yes', 'no way', 'a.b', 'x|y', '(1+2)*3', 'back\\slash', '中文', 'q"uote', 'new\nline', '[a-z]{2}']


def _grammar(fmt: dict):
    if fmt['type'] == 'json_schema':
        return xgr.Grammar.from_json_schema(json.dumps(fmt['json_schema']['schema']))
    if fmt['type'] == 'json_object':
        return xgr.Grammar.from_json_schema('{"type": "object", "additionalProperties": true}')
    return xgr.Grammar.from_regex(fmt['regex_schema'])


@pytest.mark.parametrize('body, param', [
    ({'guided_json': PERSON}, 'guided_json'),
    ({'guided_json': json.dumps(PERSON)}, 'guided_json'),
    ({'structured_outputs': {'json': PERSON}}, 'structured_outputs'),
    ({'json_schema': json.dumps(PERSON)}, 'json_schema'),
    ({'guided_json': PERSON, 'guided_decoding_backend': 'xgrammar'}, 'guided_json'),
])
def test_json_fields(body, param):
    fmt, source = response_format_from_fields(body)
    assert source == param and fmt['type'] == 'json_schema' and fmt['json_schema']['schema'] == PERSON
    grammar = _grammar(fmt)
    assert _is_grammar_accept_string(grammar, '{"name": "Ann"}')
    assert not _is_grammar_accept_string(grammar, '{"age": 3}')


@pytest.mark.parametrize('body', [{'guided_regex': r'\d{3}'}, {'structured_outputs': {'regex': r'\d{3}'}},
                                  {'regex': r'\d{3}'}])
def test_regex_fields(body):
    fmt, _ = response_format_from_fields(body)
    assert fmt == {'type': 'regex_schema', 'regex_schema': r'\d{3}'}


@pytest.mark.parametrize('body', [{'guided_choice': CHOICES}, {'structured_outputs': {'choice': CHOICES}}])
def test_choice_fields_match_exactly_one_choice(body):
    fmt, _ = response_format_from_fields(body)
    grammar = _grammar(fmt)
    for choice in CHOICES:
        assert _is_grammar_accept_string(grammar, choice), choice
    for other in ['ye', 'yesno', 'aXb', 'x', 'ab', 'back\\\\slash', '']:
        assert not _is_grammar_accept_string(grammar, other), other


def test_json_object_and_whitespace():
    assert response_format_from_fields({'structured_outputs': {'json_object': True}}) == (
        {'type': 'json_object'}, 'structured_outputs')
    fmt, _ = response_format_from_fields({'structured_outputs': {'json': PERSON, 'disable_any_whitespace': True}})
    assert fmt['whitespace'] == 'single'


def test_a_text_response_format_gives_way():
    assert response_format_from_fields({'regex': 'a', 'response_format': {'type': 'text'}}) == (
        {'type': 'regex_schema', 'regex_schema': 'a'}, 'regex')


def test_no_guided_field():
    assert response_format_from_fields({'model': 'm', 'messages': [], 'response_format': None}) is None
    assert response_format_from_fields({'guided_json': None}) is None


@pytest.mark.parametrize('body, param, message', [
    ({'guided_grammar': 'root ::= "a"'}, 'guided_grammar', 'grammar (EBNF) constraints are not supported'),
    ({'structured_outputs': {'grammar': 'root ::= "a"'}}, 'structured_outputs', 'structured_outputs.grammar'),
    ({'ebnf': 'root ::= "a"'}, 'ebnf', 'response_format'),
    ({'guided_json': PERSON, 'response_format': {'type': 'json_object'}}, 'guided_json', 'send one of them'),
    ({'regex': 'a', 'response_format': {'type': 'regex_schema', 'regex_schema': 'b'}}, 'regex',
     'response_format both'),
    ({'guided_json': PERSON, 'guided_regex': 'a'}, 'guided_json', 'only one guided constraint'),
    ({'guided_json': PERSON, 'structured_outputs': {'json': PERSON}}, 'structured_outputs', 'given twice'),
    ({'guided_json': '{not json'}, 'guided_json', 'not valid JSON'),
    ({'guided_json': [1]}, 'guided_json', 'must be a JSON schema object'),
    ({'guided_regex': ''}, 'guided_regex', 'non-empty regular expression'),
    ({'guided_choice': []}, 'guided_choice', 'non-empty list of strings'),
    ({'structured_outputs': {'choice': [1, 2]}}, 'structured_outputs', 'structured_outputs.choice must be'),
    ({'guided_json': PERSON, 'guided_decoding_backend': 'outlines'}, 'guided_decoding_backend', 'xgrammar'),
    ({'guided_json': PERSON, 'guided_whitespace_pattern': ' '}, 'guided_whitespace_pattern', 'whitespace'),
    ({'structured_outputs': {'structural_tag': '{}'}}, 'structured_outputs', 'structured_outputs.structural_tag'),
    ({'structured_outputs': 'json'}, 'structured_outputs', 'must be an object'),
    ({'structured_outputs': {'regex': 'a', 'disable_any_whitespace': True}}, 'structured_outputs',
     'disable_any_whitespace'),
    ({'guided_decoding_backend': 'lm-format-enforcer'}, 'guided_decoding_backend', 'not available'),
])
def test_refused(body, param, message):
    with pytest.raises(GuidedFieldError, match=None) as err:
        response_format_from_fields(body)
    assert err.value.param == param
    assert message in str(err.value)


def test_choice_regex_escapes_only_special_characters():
    assert choice_regex(['a b', 'c.d']) == r'(a b|c\.d)'


SCHEMA_TEXT = '{"type": "object"}'


@pytest.mark.parametrize('body, expected', [
    ({'prompt': 'hi', 'sampling_params': {'json_schema': SCHEMA_TEXT, 'temperature': 0}},
     ({'type': 'json_schema', 'json_schema': {'name': 'sampling_params', 'schema': {'type': 'object'}}},
      'sampling_params')),
    ({'prompt': 'hi', 'sampling_params': {'regex': '[0-9]{4}'}},
     ({'type': 'regex_schema', 'regex_schema': '[0-9]{4}'}, 'sampling_params')),
    ({'prompt': 'hi', 'sampling_params': {'temperature': 0, 'regex': None}}, None),
    ({'prompt': 'hi', 'sampling_params': 'not an object'}, None),
    ({'prompt': 'hi', 'regex': '[0-9]', 'sampling_params': {'temperature': 0}},
     ({'type': 'regex_schema', 'regex_schema': '[0-9]'}, 'regex')),
])
def test_sampling_params_constraints_are_read_where_an_endpoint_takes_them(body, expected):
    """SGLang's /generate takes its constraints in sampling_params; an endpoint that reads that object (lmdeploy's
    /generate) maps them as it maps the top-level fields. Other endpoints do not read it."""
    assert response_format_from_fields(body, sampling_params=True) == expected
    if 'regex' not in body:
        assert response_format_from_fields(body) is None


@pytest.mark.parametrize('body, message', [
    ({'sampling_params': {'ebnf': 'root ::= "a"'}}, 'sampling_params.ebnf: grammar (EBNF) constraints'),
    ({'sampling_params': {'structural_tag': '{}'}}, 'sampling_params.structural_tag is not supported'),
    ({'sampling_params': {'regex': ''}}, 'sampling_params.regex must be a non-empty regular expression'),
    ({'sampling_params': {'json_schema': '{'}}, 'sampling_params.json_schema is not valid JSON'),
    ({'regex': 'a', 'sampling_params': {'regex': 'b'}}, 'regex is given twice'),
    ({'sampling_params': {'regex': 'b'}, 'response_format': {'type': 'json_object'}},
     'sampling_params.regex and response_format both constrain the output'),
    ({'sampling_params': {'regex': 'b', 'json_schema': SCHEMA_TEXT}}, 'only one guided constraint per request'),
])
def test_sampling_params_constraints_that_cannot_be_served_are_refused_naming_it(body, message):
    with pytest.raises(GuidedFieldError) as err:
        response_format_from_fields(body, sampling_params=True)
    assert err.value.param == 'sampling_params'
    assert message in str(err.value)


def test_sampling_params_set_the_fields_of_generate():
    """An SGLang client's sampling settings: lmdeploy's /generate dropped them, and the request ran with the defaults
    (128 tokens, temperature 1). Each maps to its field; constraints are left to response_format_from_fields, and a
    null asks for nothing."""
    body = {'prompt': 'x', 'max_tokens': 32, 'sampling_params': {
        'max_new_tokens': 32, 'temperature': 0, 'top_p': 0.9, 'top_k': -1, 'min_p': 0.05, 'stop': ['}'],
        'stop_token_ids': [2], 'repetition_penalty': 1.1, 'ignore_eos': False, 'skip_special_tokens': True,
        'spaces_between_special_tokens': False, 'no_stop_trim': True, 'json_schema': '{}', 'regex': None,
        'frequency_penalty': 0.0, 'presence_penalty': 0, 'n': 1, 'min_new_tokens': None}}
    assert generate_fields_from_sampling_params(body) == {
        'max_tokens': 32, 'temperature': 0, 'top_p': 0.9, 'top_k': 0, 'min_p': 0.05, 'stop': ['}'],
        'stop_token_ids': [2], 'repetition_penalty': 1.1, 'ignore_eos': False, 'skip_special_tokens': True,
        'spaces_between_special_tokens': False, 'include_stop_str_in_output': True}
    assert generate_fields_from_sampling_params({'prompt': 'x'}) == {}
    assert generate_fields_from_sampling_params({'sampling_params': None}) == {}
    assert generate_fields_from_sampling_params(None) == {}


@pytest.mark.parametrize('params, message', [
    ({'frequency_penalty': 0.5}, 'frequency_penalty is not supported'),
    ({'n': 2}, 'n is not supported'),
    ({'min_new_tokens': 4}, 'min_new_tokens is not supported'),
    ({'custom_params': {'token_id': 5}}, 'custom_params is not supported'),
    ({'max_new_token': 32}, 'max_new_token is not a sampling parameter this server knows; it serves '),
    ({'max_new_tokens': 8}, r'sampling_params.max_new_tokens \(8\) and max_tokens \(16\) disagree'),
])
def test_sampling_params_that_cannot_be_served_are_refused_naming_them(params, message):
    with pytest.raises(GuidedFieldError, match=message) as error:
        generate_fields_from_sampling_params({'prompt': 'x', 'max_tokens': 16, 'sampling_params': params})
    assert error.value.param == 'sampling_params'
    with pytest.raises(GuidedFieldError, match='must be an object'):
        generate_fields_from_sampling_params({'sampling_params': [params]})


@pytest.mark.parametrize('body, param', [
    ({'guided_json': '{"a":' * 5000 + '1' + '}' * 5000}, 'guided_json'),
    ({'json_schema': '[' * 100_000 + ']' * 100_000}, 'json_schema'),
    ({'structured_outputs': {'json': '{"a":' * 5000 + '1' + '}' * 5000}}, 'structured_outputs'),
    ({'sampling_params': {'json_schema': '{"a":' * 5000 + '1' + '}' * 5000}}, 'sampling_params'),
])
def test_a_schema_string_nested_too_deeply_is_refused_naming_the_limit(body, param):
    """A schema given as a JSON string thousands of levels deep: json.loads raised RecursionError, which no one
    caught (HTTP 500 with a traceback). The nesting is counted first, without recursion."""
    with pytest.raises(GuidedFieldError, match='levels deep') as error:
        response_format_from_fields(body, sampling_params=True)
    assert error.value.param == param


def test_a_refusal_names_the_field_its_client_sent():
    """The Responses API and Anthropic's Messages API build a chat request of their own request: a value that chat
    request refuses is named as the client sent it (0.18.0 answered ``response_format.whitespace`` for a
    ``text.format.whitespace``)."""
    responses = {'response_format': 'text.format', 'max_completion_tokens': 'max_output_tokens'}
    assert client_location(('response_format', 'whitespace'), responses) == 'text.format.whitespace'
    assert client_location(('response_format', 'json_schema', 'strict'), responses) == 'text.format.strict'
    assert client_location(('max_completion_tokens',), responses) == 'max_output_tokens'
    assert client_location(('response_format', 'json_schema'), {'response_format': 'output_format'}) == 'output_format'
    # a field of the chat request that the client sent under the same name, and no location at all
    assert client_location(('temperature',), responses) == 'temperature'
    assert client_location((), responses) == ''


def test_a_refusal_of_the_chat_request_says_where_and_what_as_its_client_sent_it():
    """The refusal of lmdeploy's own ``ChatCompletionRequest``, built from a Responses or Anthropic request, names the
    first error's place as that client sent it and says what is wrong there, for both APIs alike (0.18.0 spelled this
    out twice, in its Responses and Anthropic endpoints, and 0.14.0 once more)."""
    from lmdeploy.serve.openai.protocol import ChatCompletionRequest
    from pydantic import ValidationError
    messages = [{'role': 'user', 'content': 'x'}]
    schema = {'name': 'p', 'schema': PERSON}
    refusals = []
    for response_format in ({'type': 'json_schema', 'json_schema': {**schema, 'strict': [1]}},
                            {'type': 'json_schema', 'json_schema': schema, 'whitespace': ''}):
        with pytest.raises(ValidationError) as error:
            ChatCompletionRequest(model='m', messages=messages, response_format=response_format)
        refusals.append(validation_refusal(error.value, {'response_format': 'text.format'}))
        refusals.append(validation_refusal(error.value, {'response_format': 'output_format'}))
    (strict, message), (anthropic_strict, _), (whitespace, _), (anthropic_whitespace, _) = refusals
    assert (strict, anthropic_strict) == ('text.format.strict', 'output_format.strict'), refusals
    assert (whitespace, anthropic_whitespace) == ('text.format.whitespace', 'output_format.whitespace'), refusals
    assert message.startswith('Invalid text.format.strict: ') and 'boolean' in message, message
    # a field the client sent under its own name, and an error with no place
    with pytest.raises(ValidationError) as error:
        ChatCompletionRequest(model='m', messages=messages, temperature='hot')
    assert validation_refusal(error.value, {'response_format': 'text.format'})[0] == 'temperature'
    no_place = ValidationError.from_exception_data('x', [{'type': 'missing', 'loc': (), 'input': {}}])
    assert validation_refusal(no_place, {}) == ('', 'Field required')
