"""A document or tool calls (``lmdeploy_guided_spec.tool_calls``): the grammar of a response format beside tools the
model may call accepts the document exactly as the format alone does (the exact pattern rules, the whitespace
option) or the calls of the tools' structural tag, nothing else. Real xgrammar, the real Qwen 3 tokenizer, the real
compile service."""
import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

from lmdeploy_guided_spec import GrammarCompileError, GrammarCompileService
from lmdeploy_guided_spec.compile import grammar_is_empty
from lmdeploy_guided_spec.regular import compile_json_schema, compile_regex
from lmdeploy_guided_spec.testing import TOKENIZERS, allowed_tokens, grammar_compiler, load_tokenizer, tokenizer_info
from lmdeploy_guided_spec.tool_calls import (
    REASONING_KEY,
    admit_reasoning_open_tag,
    document_grammar,
    document_or_calls_source,
    document_or_calls_tag,
    reasoning_tags,
)

pytestmark = pytest.mark.unit

VOCAB = TOKENIZERS['qwen3'].model_vocab_size
# a pattern xgrammar 0.2.8 does not compile exactly (it accepts "00"), which regular.py's rules do
CODE = {'type': 'object', 'properties': {'code': {'type': 'string', 'pattern': '^(0|1[0-9]*)(x[0-9]+)?$'}},
        'required': ['code'], 'additionalProperties': False}
SAVE = {'type': 'object', 'properties': {'year': {'type': 'integer'}}, 'required': ['year'],
        'additionalProperties': False}
TOOLS = [{'type': 'function', 'function': {'name': 'save', 'parameters': SAVE}},
         {'type': 'function', 'function': {'name': 'ping', 'parameters': {'type': 'object', 'properties': {},
                                                                          'additionalProperties': False}}}]
CALLS = xgr.get_model_structural_tag('qwen_3', TOOLS, tool_choice='required', reasoning=False).model_dump(
    mode='json')['format']
CALL = '<tool_call>\n{"name": "save", "arguments": {"year": 1999}}\n</tool_call>'
PING = '<tool_call>\n{"name": "ping", "arguments": {}}\n</tool_call>'
COMPACT = dict(any_whitespace=False, separators=(',', ':'))


def _grammar(kind, source, options):
    return xgr.Grammar.from_structural_tag(json.dumps(document_or_calls_tag(
        document_or_calls_source(kind, source, options, CALLS))))


@pytest.mark.parametrize('kind,source,options,good,bad', [
    ('json_schema', CODE, {}, ['{"code": "10x7"}', '{ "code" : "0" }'], ['{"code": "00"}', '{"code": "2"}']),
    ('json_schema', CODE, COMPACT, ['{"code":"1"}'], ['{"code": "1"}', '{"code":"00"}']),
    ('regex', r'(yes|no) [0-9]{2,4}', {}, ['yes 2024', 'no 12'], ['yes 1', 'maybe 12']),
    ('builtin_json', None, {}, ['[1, {"k": null}]', '{"k": [true]}'], ['nope']),
], ids=['exact pattern', 'compact', 'regex', 'any json'])
def test_the_document_or_the_calls_and_nothing_else(kind, source, options, good, bad):
    grammar = _grammar(kind, source, options)
    for text in good + [CALL, PING, CALL + '\n' + PING]:
        assert accepts(grammar, text), text
    # text before a call, a document followed by a call, a call of a function not offered, arguments off the
    # parameters, nothing at all
    for text in bad + ['Sure. ' + CALL, good[0] + CALL, CALL.replace('save', 'drop'),
                       CALL.replace('1999', '"1999"'), '']:
        assert not accepts(grammar, text), text


@pytest.mark.parametrize('kind,source,options', [
    ('json_schema', CODE, {}), ('json_schema', CODE, COMPACT), ('regex', r'(yes|no) [0-9]{2,4}', {})])
def test_the_document_grammar_is_the_grammar_the_service_compiles(kind, source, options):
    """The EBNF of the document compiles to the masks of the format alone (regular.py's compile), token by token
    along a document."""
    compiler = grammar_compiler('qwen3')
    if kind == 'json_schema':
        alone = compile_json_schema(compiler, json.dumps(source), **options)
        text = '{"code":"10x7"}' if options else '{"code": "10x7"}'
    else:
        alone = compile_regex(compiler, source)
        text = 'yes 2024'
    written = compiler.compile_grammar(document_grammar(kind, source, options))
    tokens = load_tokenizer('qwen3').encode(text, add_special_tokens=False)
    a, b = xgr.GrammarMatcher(alone), xgr.GrammarMatcher(written)
    for token in tokens + [None]:
        assert bool((allowed_tokens(a, VOCAB) == allowed_tokens(b, VOCAB)).all())
        if token is not None:
            assert a.accept_token(token) and b.accept_token(token)
    assert a.is_terminated() is False and a.accept_token(load_tokenizer('qwen3').eos_token_id)


def test_the_compile_service_compiles_a_document_or_calls_off_the_caller():
    with GrammarCompileService(tokenizer_info('qwen3'), timeout_s=60, max_workers=1) as service:
        source = document_or_calls_source('json_schema', CODE, {}, CALLS)
        grammar = service.submit('document_or_calls', source).result(timeout=120)
        # the same source as a dict is the same grammar (the cache's key)
        assert service.submit('document_or_calls', json.loads(source)).result(timeout=5) is grammar
        tokenizer = load_tokenizer('qwen3')
        for text in ('{"code": "1"}', PING):
            matcher = xgr.GrammarMatcher(grammar)
            for token in tokenizer.encode(text, add_special_tokens=False):
                assert matcher.accept_token(token), text
            assert matcher.accept_token(tokenizer.eos_token_id), text
        # a malformed source fails the request with the reason, not the service
        with pytest.raises(GrammarCompileError, match='document_or_calls source'):
            service.submit('document_or_calls', json.dumps({'calls': CALLS})).result(timeout=60)
        bad = document_or_calls_source('json_schema', {'type': 'nonsense'}, {}, CALLS)
        with pytest.raises(GrammarCompileError, match='nonsense'):
            service.submit('document_or_calls', bad).result(timeout=60)
        assert service.submit('document_or_calls', source).result(timeout=5) is grammar


def test_a_document_or_calls_is_checked_like_the_other_kinds():
    assert grammar_is_empty('document_or_calls', document_or_calls_source('regex', 'a+', {}, CALLS)) is False
    with pytest.raises(ValueError, match='not .ebnf'):
        document_grammar('ebnf', 'root ::= "a"')


_TOOLS = [{'type': 'function', 'function': {'name': 'save', 'parameters': {
    'type': 'object', 'properties': {'n': {'type': 'integer'}}, 'required': ['n']}}}]


@pytest.mark.parametrize('model', ['qwen_3', 'qwen_3_5', 'deepseek_r1', 'deepseek_v3_2', 'glm_4_7'])
def test_a_reasoning_block_of_forced_calls_may_begin_with_its_open_tag(model):
    """The calls' tag with reasoning on starts inside the block and excludes ``<think>`` from its text: after a
    template that leaves the open tag to the model, its first token was masked. Admitted, the block takes both
    beginnings, once, and the rest of the tag is what it was."""
    fmt = xgr.get_model_structural_tag(model, _TOOLS, tool_choice='required', reasoning='enabled').model_dump(
        mode='json')
    admitted = admit_reasoning_open_tag(fmt, '<think>', '</think>')
    assert admitted != fmt and fmt == xgr.get_model_structural_tag(
        model, _TOOLS, tool_choice='required', reasoning='enabled').model_dump(mode='json'), 'a new dict'
    grammar = xgr.Grammar.from_structural_tag(json.dumps(admitted))
    old = xgr.Grammar.from_structural_tag(json.dumps(fmt))
    compiler = xgr.GrammarCompiler(tokenizer_info('qwen3'))
    think = load_tokenizer('qwen3').convert_tokens_to_ids('<think>')
    for g, admits in ((grammar, True), (old, False)):
        matcher = xgr.GrammarMatcher(compiler.compile_grammar(g))
        assert matcher.accept_token(think) is admits
        # the block's text is what it was: no open tag after its start
        if admits:
            assert not matcher.accept_token(think)
    # reasoning off, or a block whose text admits the open tag: nothing to admit
    off = xgr.get_model_structural_tag(model, _TOOLS, tool_choice='required', reasoning='disabled').model_dump(
        mode='json')
    assert admit_reasoning_open_tag(off, '<think>', '</think>') is off
    assert admit_reasoning_open_tag(fmt, None, '</think>') is fmt
    assert admit_reasoning_open_tag({'type': 'json_object'}, '<think>', '</think>') == {'type': 'json_object'}
    free = xgr.get_model_structural_tag('minimax', _TOOLS, tool_choice='required', reasoning='enabled').model_dump(
        mode='json')  # its block's text excludes nothing
    assert admit_reasoning_open_tag(free, '<think>', '</think>') is free


def test_the_reasoning_block_of_calls_may_exclude_the_calls_open_tag():
    """The response parser reads a call written in the reasoning as a call: the block's text excludes the tool
    parser's open tag too. The open tag is admitted only where the block excluded it (minimax's excludes nothing)."""
    fmt = xgr.get_model_structural_tag('qwen_3', _TOOLS, tool_choice='required', reasoning='enabled').model_dump(
        mode='json')
    call = '<tool_call>\n{"name": "save", "arguments": {"n": 1}}\n</tool_call>'
    guarded = xgr.Grammar.from_structural_tag(json.dumps(
        admit_reasoning_open_tag(fmt, '<think>', '</think>', excludes=['<tool_call>'])))
    old = xgr.Grammar.from_structural_tag(json.dumps(fmt))
    assert accepts(old, f'hm {call} hm</think>\n\n{call}'), 'a call inside the reasoning was admitted'
    assert not accepts(guarded, f'hm {call} hm</think>\n\n{call}')
    assert accepts(guarded, f'<think>hm</think>\n\n{call}') and accepts(guarded, f'hm</think>\n\n{call}')
    # excluded already: nothing more to exclude
    assert admit_reasoning_open_tag(fmt, None, '</think>', excludes=['</think>', '<think>']) is fmt
    free = xgr.get_model_structural_tag('minimax', _TOOLS, tool_choice='required', reasoning='enabled').model_dump(
        mode='json')
    call = ('\n<minimax:tool_call>\n<invoke name="save">\n<parameter name="n">1</parameter>\n</invoke>\n'
            '</minimax:tool_call>')
    guarded = xgr.Grammar.from_structural_tag(json.dumps(
        admit_reasoning_open_tag(free, '<think>', '</think>', excludes=['<minimax:tool_call>'])))
    assert accepts(xgr.Grammar.from_structural_tag(json.dumps(free)), f'a {call} b</think>\n\n{call}')
    assert not accepts(guarded, f'a {call} b</think>\n\n{call}') and accepts(guarded, f'<think> b</think>\n\n{call}')


THINK = {'open': '<think>', 'close': '</think>'}


@pytest.mark.parametrize('calls', [None, CALLS], ids=['document', 'document or calls'])
def test_a_document_after_reasoning(calls):
    """A reasoning parser on: the model reasons (free text, its block opened by the template or by itself), then
    answers in the format; the document alone, without the block, is not an answer."""
    grammar = xgr.Grammar.from_structural_tag(json.dumps(document_or_calls_tag(
        document_or_calls_source('json_schema', CODE, {}, calls, THINK))))
    for text in ('<think>\nHm, a code.\n</think>\n\n{"code": "1"}', 'Hm.</think>{"code": "10x2"}',
                 '</think>\n{"code": "0"}'):
        assert accepts(grammar, text), text
    for text in ('{"code": "1"}', '<think>a</think>\n\n{"code": "00"}', '<think><think>a</think>{"code": "1"}',
                 'a</think> x {"code": "1"}', 'a</think>\n\n{"code": "1"}</think>'):
        assert not accepts(grammar, text), text
    assert accepts(grammar, 'a</think>\n\n' + PING) is (calls is not None)
    # a text the reasoning excludes (a tool parser's open tag, which would read as a call there)
    grammar = xgr.Grammar.from_structural_tag(json.dumps(document_or_calls_tag(document_or_calls_source(
        'json_schema', CODE, {}, calls, {**THINK, 'excludes': ['<tool_call>']}))))
    assert accepts(grammar, 'Hm.</think>{"code": "1"}') and not accepts(grammar, 'Hm <tool_call>.</think>{"code": "1"}')


def test_the_reasoning_of_a_response_format_is_checked():
    assert reasoning_tags(THINK) == ('<think>', '</think>', ()) and reasoning_tags({'close': '</think>'})[0] is None
    assert reasoning_tags({**THINK, 'excludes': ['<tool_call>']})[2] == ('<tool_call>',)
    # whitespace is text of a tag (DeepSeek-V3.2's calls open with "\n\n<｜DSML｜function_calls>")
    dsml = '\n\n<｜DSML｜function_calls>'
    assert reasoning_tags({**THINK, 'excludes': [dsml]})[2] == (dsml,)
    for bad in ('</think>', {'open': '<think>'}, {'close': ''}, {'close': 'x' * 65}, {'close': 3},
                {'open': '', 'close': '</think>'}, {**THINK, 'extra': 1}, {**THINK, 'excludes': '<a>'},
                {**THINK, 'excludes': [None]}, {**THINK, 'excludes': ['<a>'] * 9}, {'open': None, 'close': None},
                {'close': '</think\ud800>'}, {'close': '</think>\x00'}, {'close': '</think\x1b>'}):
        with pytest.raises(ValueError, match=REASONING_KEY):
            reasoning_tags(bad)
    with GrammarCompileService(tokenizer_info('qwen3'), timeout_s=60, max_workers=1) as service:
        source = document_or_calls_source('regex', '(yes|no)', {}, None, THINK)
        grammar = service.submit('document_or_calls', source).result(timeout=120)
        tokenizer = load_tokenizer('qwen3')
        matcher = xgr.GrammarMatcher(grammar)
        for token in tokenizer.encode('<think>\nok</think>\n\nyes', add_special_tokens=False):
            assert matcher.accept_token(token)
        assert matcher.accept_token(tokenizer.eos_token_id)
        with pytest.raises(GrammarCompileError, match=REASONING_KEY):
            service.submit('document_or_calls', document_or_calls_source('regex', 'a', {}, None,
                                                                          {'close': ''})).result(timeout=60)
