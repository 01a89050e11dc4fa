"""The constraints lmdeploy's response parser puts on the calls of tools the model may call (``tool_choice`` auto),
read through its real request and parser classes and checked with the grammar the engine compiles of them (real
xgrammar, the real Qwen 3 tokenizer, lmdeploy's Qwen 3 tool parser).

- Beside a ``response_format`` the answer is the document or calls (0.18.0 patch 0067): the format's grammar covered
  the whole output and no call could start.
- A ``strict`` tool without a ``response_format`` gets calls that follow its parameters, the text around them free
  (0.18.0 patch 0068, OpenAI's strict): lmdeploy constrained no call with tool_choice auto.
- An ``allowed_tools`` tool_choice constrains as its mode says (0.18.0 patch 0069): lmdeploy only hid the other tools.
- Where nothing is constrained (a tool parser without a structural tag) nothing is refused either.
- With reasoning on, a forced call's reasoning block may begin with the model's own ``<think>`` (0.18.0 patch 0070).
- With reasoning on, calls are constrained as with it off, after the reasoning, and none hides in the reasoning
  (0.18.0 patch 0073).
- ``parallel_tool_calls: false`` ends the output with one call (0.18.0 patch 0071).
"""
import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

pytestmark = pytest.mark.engine

YEAR = {'type': 'object', 'properties': {'year': {'type': 'integer', 'minimum': 1900, 'maximum': 2100}},
        'required': ['year'], 'additionalProperties': False}
VERDICT = {'type': 'json_schema', 'json_schema': {'name': 'verdict', 'schema': {
    'type': 'object', 'properties': {'ok': {'type': 'boolean'}}, 'required': ['ok'], 'additionalProperties': False}}}
CALL = '<tool_call>\n{"name": "save_year", "arguments": {"year": 1999}}\n</tool_call>'
OFF = CALL.replace('1999', '1850')  # the arguments break the parameters' minimum


def _parsers(tool_parser: str, reasoning_parser: str | None = None):
    response_parser = pytest.importorskip('lmdeploy.serve.parsers.response_parser')
    cls = getattr(response_parser, 'BaseResponseParser', None)
    if cls is None or not hasattr(response_parser, '_check_strict_tools'):
        pytest.skip('this lmdeploy has no structural-tag tool constraints (0.14.0)')
    cls.set_parsers(reasoning_parser_name=reasoning_parser, tool_parser_name=tool_parser)
    try:
        yield cls
    finally:
        cls.tool_parser_cls = cls.reasoning_parser_cls = None


@pytest.fixture
def parser_cls():
    yield from _parsers('qwen3')


def _parsed(parser_cls, **fields) -> dict | None:
    from lmdeploy.serve.openai.protocol import ChatCompletionRequest
    request = ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'Save a year.'}], **fields)
    return parser_cls(request).request.response_format


def _grammar(response_format: dict) -> xgr.Grammar:
    """The grammar the engine compiles of a response format (its compile service's kind and source; the engine's own
    compile of it must take it too), as xgrammar reads it for a string check."""
    from lmdeploy._guided_decoding import compile_response_format
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager

    from lmdeploy_guided_spec.testing import grammar_compiler
    from lmdeploy_guided_spec.tool_calls import document_or_calls_tag
    assert isinstance(compile_response_format(grammar_compiler('qwen3'), response_format), xgr.CompiledGrammar)
    kind, source, _ = GuidedDecodingManager.compile_args(response_format)
    if kind == 'document_or_calls':
        return xgr.Grammar.from_structural_tag(json.dumps(document_or_calls_tag(source)))
    assert kind == 'structural_tag', kind
    return xgr.Grammar.from_structural_tag(source)


def _tool(strict=None) -> dict:
    function = {'name': 'save_year', 'parameters': YEAR}
    if strict is not None:
        function['strict'] = strict
    return {'type': 'function', 'function': function}


def test_a_response_format_beside_tools_admits_the_document_or_calls(parser_cls):
    for choice in ({}, {'tool_choice': 'auto'}):
        fmt = _parsed(parser_cls, tools=[_tool()], response_format=VERDICT, **choice)
        grammar = _grammar(fmt)
        assert accepts(grammar, '{"ok": true}') and accepts(grammar, CALL)
        assert not accepts(grammar, OFF) and not accepts(grammar, 'Sure. ' + CALL) and not accepts(grammar, 'x')
    # tool_choice none: the document alone, as the format says
    from lmdeploy_guided_spec.tool_calls import CALLS_KEY
    fmt = _parsed(parser_cls, tools=[_tool()], response_format=VERDICT, tool_choice='none')
    assert fmt['type'] == 'json_schema' and CALLS_KEY not in fmt, fmt


def test_a_strict_tool_the_model_may_call_gets_calls_that_follow_its_parameters(parser_cls):
    fmt = _parsed(parser_cls, tools=[_tool(strict=True)])
    assert fmt is not None and fmt['type'] == 'structural_tag', fmt
    grammar = _grammar(fmt)
    # free text, a call, text after it; no call is needed
    for text in ('Hello there.', CALL, 'Let me save it. ' + CALL + ' Done.', ''):
        assert accepts(grammar, text), text
    for text in (OFF, 'Saving. ' + CALL.replace('save_year', 'drop_year')):
        assert not accepts(grammar, text), text
    # without strict, lmdeploy's own way: no constraint
    assert _parsed(parser_cls, tools=[_tool()]) is None
    assert _parsed(parser_cls, tools=[_tool(strict=False)]) is None


def test_a_strict_tool_with_keywords_the_grammar_does_not_enforce_is_refused():
    unenforced = {'type': 'object', 'properties': {'age': {'type': 'integer', 'not': {'const': 3}}}}
    tool = {'type': 'function', 'function': {'name': 'save_age', 'parameters': unenforced, 'strict': True}}
    for reasoning_parser in (None, 'default'):
        for cls in _parsers('qwen3', reasoning_parser):
            for fields in ({}, {'response_format': VERDICT}):
                with pytest.raises(ValueError, match="save_age.*not at"):
                    _parsed(cls, tools=[tool], **fields)


def _allowed(mode: str, *names: str) -> dict:
    return {'type': 'allowed_tools', 'allowed_tools': {
        'mode': mode, 'tools': [{'type': 'function', 'function': {'name': name}} for name in names]}}


def test_allowed_tools_constrain_as_their_mode_says(parser_cls):
    ping = {'type': 'function', 'function': {'name': 'ping', 'parameters': {
        'type': 'object', 'properties': {}, 'additionalProperties': False}}}
    tools = [_tool(strict=True), ping]
    ping_call = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
    # mode required: a call of an allowed tool, nothing else
    grammar = _grammar(_parsed(parser_cls, tools=tools, tool_choice=_allowed('required', 'save_year')))
    assert accepts(grammar, CALL) and not accepts(grammar, ping_call) and not accepts(grammar, 'Hello.')
    # mode auto beside a format: the document or a call of an allowed tool
    grammar = _grammar(_parsed(parser_cls, tools=tools, tool_choice=_allowed('auto', 'ping'), response_format=VERDICT))
    assert accepts(grammar, '{"ok": false}') and accepts(grammar, ping_call) and not accepts(grammar, CALL)
    # mode auto with a strict allowed tool: free text, its calls follow its parameters
    grammar = _grammar(_parsed(parser_cls, tools=tools, tool_choice=_allowed('auto', 'save_year')))
    assert accepts(grammar, 'Hi. ' + CALL) and not accepts(grammar, OFF) and not accepts(grammar, ping_call)
    # mode auto, only tools without strict allowed: free, as lmdeploy serves it
    assert _parsed(parser_cls, tools=tools, tool_choice=_allowed('auto', 'ping')) is None


@pytest.mark.parametrize('tool_parser', ['llama3', 'internlm'],
                         ids=['llama3: no structural tag', 'internlm: its own required format'])
def test_where_the_calls_are_not_constrained_a_strict_tool_is_not_refused(tool_parser):
    """A strict tool whose parameters use keywords the grammar does not enforce is refused only where its calls are
    constrained: with a tool parser that builds no constraint of them, the request is served as lmdeploy serves it.
    (InternLM's parser builds its own format of required calls, which 0067 puts beside a response_format: there the
    strict tool is refused.)"""
    from lmdeploy_guided_spec.tool_calls import CALLS_KEY
    unenforced = {'type': 'object', 'properties': {'age': {'type': 'integer', 'not': {'const': 3}}}}
    tool = {'type': 'function', 'function': {'name': 'save_age', 'parameters': unenforced, 'strict': True}}
    for cls in _parsers(tool_parser):
        assert _parsed(cls, tools=[tool]) is None
        if tool_parser == 'internlm':
            with pytest.raises(ValueError, match='save_age'):
                _parsed(cls, tools=[tool], response_format=VERDICT)
            loose = {'type': 'function', 'function': {'name': 'save_age', 'parameters': unenforced}}
            assert CALLS_KEY in _parsed(cls, tools=[loose], response_format=VERDICT)
            continue
        fmt = _parsed(cls, tools=[tool], response_format=VERDICT)
        assert fmt['type'] == 'json_schema' and CALLS_KEY not in fmt, fmt


_REASONED = ('Year 1999.\n</think>\n\n' + CALL, '<think>\nYear 1999.\n</think>\n\n' + CALL)


@pytest.mark.parametrize('choice', ['required', {'type': 'function', 'function': {'name': 'save_year'}},
                                    _allowed('required', 'save_year')], ids=['required', 'named', 'allowed_tools'])
def test_with_reasoning_on_a_forced_call_admits_the_models_own_reasoning_open_tag(choice):
    """With reasoning on, lmdeploy builds the tag of forced calls that starts inside the reasoning block, right for
    a template that opens it (DeepSeek-R1, Qwen3 thinking models: the prompt ends in ``<think>\\n``) and excluding
    the open tag from its text. Qwen3's hybrid template with thinking on leaves the tag to the model, whose first
    token, ``<think>``, was masked (real Qwen 3 tokenizer: not an allowed first token). The response parser takes
    both (it drops an open tag the model writes): the grammar now does too (patch 0070)."""
    for cls in _parsers('qwen3', 'default'):
        fmt = _parsed(cls, tools=[_tool()], tool_choice=choice)
        grammar = _grammar(fmt)
        for text in _REASONED:
            assert accepts(grammar, text), text
        # the block is still reasoning: one open tag at its start, no other, and it ends before the calls
        assert not accepts(grammar, '<think>\n<think>x</think>\n\n' + CALL)
        assert not accepts(grammar, 'x <think> y</think>\n\n' + CALL) and not accepts(grammar, CALL)
        # token by token: the model's own first token, '<think>' (one token of the Qwen 3 tokenizer)
        from lmdeploy_guided_spec.testing import grammar_compiler, load_tokenizer
        matcher = xgr.GrammarMatcher(grammar_compiler('qwen3').compile_grammar(grammar))
        assert matcher.accept_token(load_tokenizer('qwen3').convert_tokens_to_ids('<think>'))


@pytest.mark.parametrize('fields', [
    {'tool_choice': 'required'},
    {'tool_choice': {'type': 'function', 'function': {'name': 'save_year'}}},
    {'tool_choice': _allowed('required', 'save_year')},
    {'response_format': VERDICT},
    {'tool_choice': _allowed('auto', 'save_year'), 'response_format': VERDICT},
    {},
], ids=['required', 'named', 'allowed_tools', 'beside a format', 'allowed_tools beside a format', 'strict, auto'])
def test_with_reasoning_on_calls_are_constrained_after_the_reasoning_and_none_hides_in_it(fields):
    """Reasoning on (a reasoning parser that starts inside the block): the calls follow their parameters after the
    reasoning, as with it off. lmdeploy's parser reads a call written inside the reasoning as a call, and the
    reasoning block of forced calls admitted one (its arguments unconstrained: a strict tool's call broke its
    parameters, ``parallel_tool_calls: false`` got two calls); beside a format, reasoning on, no call could start;
    a strict tool's calls with tool_choice auto were not constrained (patch 0073)."""
    for cls in _parsers('qwen3', 'default'):
        fmt = _parsed(cls, tools=[_tool(strict=True)], **fields)
        assert fmt is not None, fields
        grammar = _grammar(fmt)
        for text in _REASONED:
            assert accepts(grammar, text), text
            assert not accepts(grammar, text.replace('1999', '1850')), text
        # a call inside the reasoning, one that follows the parameters or one that does not
        for inside in (CALL, OFF):
            assert not accepts(grammar, f'Hm {inside} hm</think>\n\n{CALL}'), inside
        if 'response_format' in fields:
            assert accepts(grammar, 'Hm.</think>\n\n{"ok": true}') and not accepts(grammar, 'Hm.</think>\n\nx')
        if not fields:
            assert accepts(grammar, 'Hm.</think>\n\nNo call.') and accepts(grammar, 'Hm.</think>\n\nSo: ' + CALL)
        # the parser reads the reasoning, then the call
        from lmdeploy.serve.openai.protocol import ChatCompletionRequest
        request = ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'Save a year.'}],
                                        tools=[_tool(strict=True)], **fields)
        content, calls, reasoning = cls(request).parse_complete(_REASONED[1], [])
        assert [call.function.name for call in calls] == ['save_year'] and reasoning.strip() == 'Year 1999.', (
            content, calls, reasoning)
        assert json.loads(calls[0].function.arguments) == {'year': 1999}


def test_internlms_required_calls_admit_the_open_tag_and_stop_after_one():
    for cls in _parsers('internlm', 'default'):
        fmt = _parsed(cls, tools=[_tool()], tool_choice='required')
        grammar = xgr.Grammar.from_structural_tag(json.dumps(fmt))
        call = '<|action_start|><|plugin|>{"name": "save_year", "parameters": {"year": 1999}}<|action_end|>'
        for text in ('hm</think>\n\n' + call, '<think>hm</think>\n\n' + call, 'hm</think>\n\n' + call + '\n' + call):
            assert accepts(grammar, text), text
        # parallel_tool_calls false: its own format stops after the first call too
        one = xgr.Grammar.from_structural_tag(json.dumps(
            _parsed(cls, tools=[_tool()], tool_choice='required', parallel_tool_calls=False)))
        assert accepts(one, 'hm</think>\n\n' + call) and not accepts(one, 'hm</think>\n\n' + call + '\n' + call)


PING = {'type': 'function', 'function': {'name': 'ping', 'parameters': {
    'type': 'object', 'properties': {}, 'additionalProperties': False}}}
PING_CALL = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'


@pytest.mark.parametrize('fields', [
    {'tool_choice': 'required'},
    {'tool_choice': {'type': 'function', 'function': {'name': 'save_year'}}},
    {'tool_choice': _allowed('required', 'save_year', 'ping')},
    {'response_format': VERDICT},
    {},
], ids=['required', 'named', 'allowed_tools', 'beside a format', 'strict, auto'])
def test_parallel_tool_calls_false_ends_the_output_after_one_call(parser_cls, fields):
    """OpenAI's ``parallel_tool_calls: false``: at most one call. lmdeploy dropped the calls after the first from the
    answer, and the grammar let the model write them (tokens spent for nothing, and the text after them); now the
    output ends with the first call."""
    tools = [_tool(strict=True), PING]
    many = _grammar(_parsed(parser_cls, tools=tools, **fields))
    one = _grammar(_parsed(parser_cls, tools=tools, parallel_tool_calls=False, **fields))
    named = 'function' in fields.get('tool_choice', {})
    second = CALL if named else PING_CALL
    assert accepts(many, CALL + '\n' + second)
    assert accepts(one, CALL) and not accepts(one, CALL + '\n' + second) and not accepts(one, CALL + ' Done.')
    if not fields:
        assert accepts(one, 'Let me save it. ' + CALL) and accepts(one, 'No call.')
