"""A response format with a reasoning parser on (0.18.0 patch 0072, 0.14.0 patch 0074), read through lmdeploy's real
request and response parser classes, the grammar the engine compiles of the request (real xgrammar, the real Qwen 3
tokenizer and chat template) and the parser's reading of outputs the grammar accepts.

lmdeploy's reasoning parsers start inside the reasoning block (the default parser always, DeepSeek's when thinking is
on), and the grammar of a ``response_format`` covered the whole output: the model had to answer in the format from
its first token, without reasoning (a Qwen3 model's own first token, ``<think>``, masked), and the parser, waiting
for the block to close, gave the whole document as ``reasoning_content`` and ``content`` None. Now the model reasons,
then answers in the format: the document comes as ``content``. Tools beside the format are 0.18.0's (0.14.0 builds no
constraint of calls).
"""
import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string as accepts

pytestmark = pytest.mark.engine

VERDICT = {'type': 'json_schema', 'json_schema': {'name': 'verdict', 'schema': {
    'type': 'object', 'properties': {'ok': {'type': 'boolean'}}, 'required': ['ok'], 'additionalProperties': False}}}
THOUGHT = 'The user asks whether it is ok. It is.'


def _with_tool_constraints() -> bool:
    """lmdeploy 0.18.0: the response parser builds constraints of tool calls (0.14.0's builds none)."""
    try:
        from lmdeploy.serve.parsers import response_parser
    except ImportError:
        return False
    return hasattr(response_parser, '_check_strict_tools')


@pytest.fixture
def parser_cls():
    response_parser = pytest.importorskip('lmdeploy.serve.parsers.response_parser')
    cls = response_parser.BaseResponseParser

    def use(reasoning_parser: str | None, tool_parser: str | None = None):
        # (set_parsers leaves a parser it is not given as it was)
        cls.tool_parser_cls = cls.reasoning_parser_cls = None
        cls.set_parsers(reasoning_parser_name=reasoning_parser, tool_parser_name=tool_parser)
        return cls

    try:
        yield use
    finally:
        cls.tool_parser_cls = cls.reasoning_parser_cls = None


def _parser(cls, **fields):
    from lmdeploy.serve.openai.protocol import ChatCompletionRequest
    request = ChatCompletionRequest(model='m', messages=[{'role': 'user', 'content': 'Is it ok?'}], **fields)
    return cls(request)


def _grammar(response_format: dict) -> xgr.Grammar:
    """The grammar the engine compiles of a response format (its compile service's kind and source; the other
    ranks' compile of it must take it too)."""
    from lmdeploy_guided_spec.testing import grammar_compiler
    from lmdeploy_guided_spec.tool_calls import document_or_calls_tag
    if _with_tool_constraints():
        from lmdeploy._guided_decoding import compile_response_format, ensure_response_format_shape
        from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
        ensure_response_format_shape(response_format)
        compiled = compile_response_format(grammar_compiler('qwen3'), response_format)
        kind, source, options = GuidedDecodingManager.compile_args(response_format)
    else:
        from lmdeploy.serve.utils.response_format import response_format_error
        assert response_format_error(response_format) is None
        manager = _manager()
        kind, source, options = manager.compile_args(response_format)
        # the other ranks' compile: the matcher of the engine's own compile
        manager.processors = {}
        compiled = manager.get_processors([{'session_id': 1, 'seq_id': 1}], (response_format,))[0]
    if kind == 'document_or_calls':
        tag = json.dumps(document_or_calls_tag(source))
        if isinstance(compiled, xgr.CompiledGrammar):
            assert str(compiled.grammar) == str(grammar_compiler('qwen3').compile_structural_tag(tag).grammar)
        return xgr.Grammar.from_structural_tag(tag)
    assert kind in ('json_schema', 'regex'), kind
    return xgr.Grammar.from_json_schema(source, **options) if kind == 'json_schema' else xgr.Grammar.from_regex(source)


def _manager():
    """0.14.0's GuidedDecodingManager of the Qwen 3 tokenizer."""
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager

    from lmdeploy_guided_spec.testing import load_tokenizer, tokenizer_info
    return GuidedDecodingManager(load_tokenizer('qwen3'), tokenizer_info('qwen3').vocab_size)


def _streamed(parser, chunks) -> tuple[str, str, list]:
    """``(content, reasoning, calls)`` a stream of ``chunks`` gives, joined (its last chunk marked final)."""
    content, reasoning, calls = '', '', []
    for i, chunk in enumerate(chunks):
        for delta, _ in parser.stream_chunk(chunk, [1], final=i == len(chunks) - 1):
            content += delta.content or ''
            reasoning += delta.reasoning_content or ''
            calls += delta.tool_calls or []
    return content, reasoning, calls


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


@pytest.mark.parametrize('fmt', [VERDICT, {'type': 'json_object'}, {'type': 'regex_schema', 'regex_schema': 'yes|no'}],
                         ids=['json_schema', 'json_object', 'regex'])
def test_with_a_reasoning_parser_the_model_reasons_then_answers_in_the_format(parser_cls, fmt):
    answer = 'yes' if fmt['type'] == 'regex_schema' else '{"ok": true}'
    parser = _parser(parser_cls('default'), response_format=fmt)
    grammar = _grammar(parser.request.response_format)
    # the model opens the block (Qwen3's hybrid template) or the template did (DeepSeek-R1, thinking models)
    for output in (f'<think>\n{THOUGHT}\n</think>\n\n{answer}', f'{THOUGHT}</think>{answer}'):
        assert accepts(grammar, output), output
        content, calls, reasoning = _parser(parser_cls('default'), response_format=fmt).parse_complete(output, [])
        assert content.strip() == answer and THOUGHT in reasoning and not calls, (content, reasoning)
    # the answer is the format's: not without the reasoning's end, not off the format, nothing after it
    for output in (answer, f'<think>{THOUGHT}</think>\n\nmaybe', f'{THOUGHT}</think>{answer}</think>'):
        assert not accepts(grammar, output), output


def test_token_by_token_with_the_qwen3_tokenizer(parser_cls):
    """The model's own first token, ``<think>`` (one token of the Qwen 3 tokenizer), is allowed: it was masked."""
    from lmdeploy_guided_spec.testing import grammar_compiler, load_tokenizer
    tokenizer = load_tokenizer('qwen3')
    fmt = _parser(parser_cls('default'), response_format=VERDICT).request.response_format
    matcher = xgr.GrammarMatcher(grammar_compiler('qwen3').compile_grammar(_grammar(fmt)))
    for token in tokenizer.encode(f'<think>\n{THOUGHT}\n</think>\n\n{{"ok": false}}', add_special_tokens=False):
        assert matcher.accept_token(token), tokenizer.decode([token])
    assert matcher.accept_token(tokenizer.eos_token_id) and matcher.is_terminated()


def test_without_reasoning_the_format_covers_the_whole_output(parser_cls):
    """Thinking off (the template closes the block: Qwen3's ``enable_thinking: false``), or a reasoning parser that
    starts outside the block, or none: the document from the first token, as before."""
    for parsers, fields in (('default', {'chat_template_kwargs': {'enable_thinking': False}}), ('deepseek-v3', {}),
                            (None, {})):
        cls = parser_cls(parsers)
        parser = _parser(cls, response_format=VERDICT, **fields)
        grammar = _grammar(parser.request.response_format)
        assert accepts(grammar, '{"ok": true}') and not accepts(grammar, f'{THOUGHT}</think>{{"ok": true}}')
        assert parser.parse_complete('{"ok": true}', [])[0] == '{"ok": true}'
    # DeepSeek's parser with thinking on starts inside
    parser = _parser(parser_cls('deepseek-v3'), response_format=VERDICT,
                     chat_template_kwargs={'enable_thinking': True})
    assert accepts(_grammar(parser.request.response_format), f'{THOUGHT}</think>\n\n{{"ok": true}}')


@pytest.mark.skipif('not _with_tool_constraints()', reason='0.14.0 builds no constraint of calls')
def test_tools_beside_reasoning_and_a_format(parser_cls):
    """Tools the model may call beside a format, reasoning on: the answer after the reasoning is the document or
    calls, as with reasoning off (the calls were impossible there: patch 0073), and no call can hide in the
    reasoning: the tool parser would take a ``<tool_call>`` written there for a call whose arguments nothing
    constrained."""
    tool = {'type': 'function', 'function': {'name': 'save_year', 'parameters': {
        'type': 'object', 'properties': {'year': {'type': 'integer'}}, 'required': ['year']}}}
    cls = parser_cls('default', 'qwen3')
    grammar = _grammar(_parser(cls, response_format=VERDICT, tools=[tool]).request.response_format)
    assert accepts(grammar, f'{THOUGHT}</think>\n\n{{"ok": true}}')
    call = '<tool_call>\n{"name": "save_year", "arguments": {"year": 1999}}\n</tool_call>'
    assert accepts(grammar, f'<think>{THOUGHT}</think>\n\n{call}')
    assert not accepts(grammar, f'{THOUGHT}</think>\n\n{call.replace("1999", "x")}')
    assert not accepts(grammar, f'{THOUGHT} {call}</think>\n\n{{"ok": true}}')
    content, calls, reasoning = _parser(cls, response_format=VERDICT, tools=[tool]).parse_complete(
        f'{THOUGHT}</think>\n\n{call}', [])
    assert [c.function.name for c in calls] == ['save_year'] and reasoning.strip() == THOUGHT, (content, reasoning)


def test_a_document_holding_tags_is_read_whole(parser_cls):
    """A JSON string of the document may hold ``<think>`` or the tool parser's ``<tool_call>`` (the grammar allows
    them there): the document is the answer's text; the parser cut such a "block" out of it (the reasoning got the
    rest of the document, the content stopped at the tag), with reasoning on or off."""
    for parsers, fields, before in ((('default', 'qwen3'), {}, f'{THOUGHT}</think>\n\n'),
                                    (('default', 'qwen3'), {'chat_template_kwargs': {'enable_thinking': False}}, ''),
                                    ((None, 'qwen3'), {}, '')):
        cls = parser_cls(*parsers)
        for inner in ('<think>b', '<tool_call>b', 'a</think>b'):
            document = json.dumps({'note': inner})
            fmt = _parser(cls, response_format={'type': 'json_object'}, **fields).request.response_format
            assert accepts(_grammar(fmt), before + document), (fields, inner)
            parser = _parser(cls, response_format={'type': 'json_object'}, **fields)
            content, calls, reasoning = parser.parse_complete(before + document, [])
            assert content.strip() == document and not calls, (fields, content, reasoning)
            assert (reasoning or '') == (THOUGHT if before else ''), reasoning
            if hasattr(parser, 'validate_complete'):
                # 0.14.0 checks the tool tags of an answer whose client asked for its token ids: a tag inside a
                # document made its finish_reason parse_error
                assert parser.validate_complete(before + document), (fields, inner)


@pytest.mark.skipif('not _with_tool_constraints()', reason='0.14.0 builds no constraint of calls')
@pytest.mark.parametrize('thinking', [True, False], ids=['reasoning', 'no reasoning'])
def test_beside_tools_a_document_holding_tags_is_read_whole(parser_cls, thinking):
    """Tools beside the format (the answer is the document or calls): the answer that does not begin with a call is
    the document, read whole, streamed or not; the parser read a ``<tool_call>`` or ``<think>`` inside one of its
    strings as a call or reasoning (the content stopped at the tag). An answer that begins with a call is calls."""
    tool = {'type': 'function', 'function': {'name': 'f', 'parameters': {
        'type': 'object', 'properties': {'n': {'type': 'integer'}}, 'required': ['n']}}}
    fields = {'tools': [tool], 'chat_template_kwargs': {'enable_thinking': thinking}}
    cls = parser_cls('default', 'qwen3')
    before = f'{THOUGHT}</think>\n\n' if thinking else ''
    fmt = _parser(cls, response_format={'type': 'json_object'}, **fields).request.response_format
    for inner in ('<think>b', '<tool_call>b', 'a</think>b', '<tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</'):
        document = json.dumps({'note': inner})
        assert accepts(_grammar(fmt), before + document), inner
        for cut in (None, 1, 3, len(before) + 12):
            parser = _parser(cls, response_format={'type': 'json_object'}, **fields)
            if cut is None:
                content, calls, reasoning = parser.parse_complete(before + document, [])
            else:
                content, reasoning, calls = _streamed(parser, _pieces(before + document, cut))
            assert content.strip() == document and not calls, (inner, cut, content, reasoning)
            assert (reasoning or '') == (THOUGHT if thinking else ''), (inner, cut, reasoning)
    call = '<tool_call>\n{"name": "f", "arguments": {"n": 1}}\n</tool_call>'
    assert accepts(_grammar(fmt), before + call)
    for cut in (None, 2):
        parser = _parser(cls, response_format={'type': 'json_object'}, **fields)
        if cut is None:
            content, calls, reasoning = parser.parse_complete(before + call, [])
        else:
            content, _, calls = _streamed(parser, _pieces(before + call, cut))
        # (the whitespace the grammar allows before the calls is not content either)
        assert [c.function.name for c in calls if c.function.name] == ['f'] and not content, (cut, content, calls)


@pytest.mark.skipif('not _with_tool_constraints()', reason='0.14.0 builds no constraint of calls')
@pytest.mark.parametrize('parsers', ['deepseek-v32', 'deepseek-v4'])
def test_a_tool_tag_that_begins_with_whitespace_stays_out_of_the_reasoning(parser_cls, parsers):
    """DeepSeek-V3.2's and V4's tool parsers open a call with ``\\n\\n<｜DSML｜...>``: with thinking on, tools beside
    a format were refused (HTTP 400 naming a ``reasoning`` key the user never sent: the texts of a reasoning block
    were printable only); they take the document after the reasoning, and no call in it."""
    tool = {'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object', 'properties': {}}}}
    cls = parser_cls(parsers, parsers)
    parser = _parser(cls, response_format=VERDICT, tools=[tool], chat_template_kwargs={'thinking': True})
    grammar = _grammar(parser.request.response_format)
    tag = parser.tool_parser.get_tool_open_tag()
    assert tag.startswith('\n\n')
    assert accepts(grammar, f'{THOUGHT}</think>{{"ok": true}}')
    assert not accepts(grammar, f'{THOUGHT}{tag}</think>{{"ok": true}}')
    assert parser.parse_complete(f'{THOUGHT}</think>{{"ok": true}}', [])[0] == '{"ok": true}'


@pytest.mark.skipif('not _with_tool_constraints()', reason='0.14.0 builds no constraint of calls')
def test_with_a_tool_parser_no_call_hides_in_the_reasoning(parser_cls):
    """The parser looks for calls in the reasoning wherever a tool parser is on (tools or not): the grammar keeps the
    tool parser's open tag out of the reasoning alike."""
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    for fields in ({}, {'tools': [{'type': 'function', 'function': {'name': 'f', 'parameters': {
            'type': 'object', 'properties': {}}}}]}):
        fmt = _parser(parser_cls('default', 'qwen3'), response_format=VERDICT, **fields).request.response_format
        grammar = _grammar(fmt)
        assert accepts(grammar, f'{THOUGHT}</think>{{"ok": true}}')
        assert not accepts(grammar, f'{THOUGHT} {call}</think>{{"ok": true}}'), fields


@pytest.mark.parametrize('parser, kwargs, reasons', [
    ('default', {'thinking': True}, True),
    ('default', {'enable_thinking': True}, True),
    ('default', {'enable_thinking': False}, False),
    ('deepseek-v3', {'enable_thinking': True}, True),
    ('deepseek-v3', {}, False),
    ('deepseek-v32', {'thinking': True}, True),
    ('deepseek-v4', {'thinking': True}, True),
    ('deepseek-v4', {'thinking': False}, False),
])
def test_the_reasoning_parsers_and_their_switches(parser_cls, parser, kwargs, reasons):
    """Each reasoning parser's switch of thinking: the document follows the reasoning exactly where the parser starts
    inside the block, so that what it reads as reasoning is the reasoning."""
    from lmdeploy.serve.parsers.reasoning_parser import ReasoningParserManager
    if parser not in ReasoningParserManager.module_dict:
        pytest.skip(f'this lmdeploy has no reasoning parser {parser}')
    cls = parser_cls(parser)
    fields = {'chat_template_kwargs': kwargs} if kwargs else {}
    grammar = _grammar(_parser(cls, response_format=VERDICT, **fields).request.response_format)
    output = f'{THOUGHT}</think>\n\n{{"ok": true}}' if reasons else '{"ok": true}'
    assert accepts(grammar, output) and not accepts(grammar, '{"ok": true}' if reasons else output + ' ')
    content, _, reasoning = _parser(cls, response_format=VERDICT, **fields).parse_complete(output, [])
    assert content.strip() == '{"ok": true}' and (reasoning or '') == (THOUGHT if reasons else ''), (content, reasoning)


@pytest.mark.parametrize('fmt, message', [
    ({'type': 'json_object', 'reasoning': {'close': 5}}, 'printable strings'),
    ({'type': 'json_object', 'reasoning': {'close': '</think>', 'depth': 3}}, r'"open": <tag or null>'),
    ({'type': 'text', 'reasoning': {'close': '</think>'}}, 'applies to json_schema, json_object and regex_schema only'),
])
def test_a_malformed_reasoning_key_is_refused_where_the_request_enters(fmt, message):
    """The reasoning key is the parser's, but a pipeline user may write one: a malformed one is refused by the entry
    check (an HTTP 400, the request failed alone), never compiled into the engine."""
    import re
    if _with_tool_constraints():
        from lmdeploy._guided_decoding import ensure_response_format_shape
        with pytest.raises(ValueError, match=re.escape(message)):
            ensure_response_format_shape(fmt)
    else:
        from lmdeploy.serve.utils.response_format import response_format_error
        assert message in (response_format_error(fmt) or ''), response_format_error(fmt)
        if fmt['type'] != 'text':  # text compiles nothing
            with pytest.raises(ValueError, match=re.escape(message)):
                _manager().compile_args(fmt)


@pytest.mark.parametrize('cut', [1, 2, 5, 7], ids=lambda n: f'cut after {n}')
def test_a_streamed_close_tag_split_across_chunks_ends_the_reasoning(parser_cls, cut):
    """A model may write ``</think>`` in pieces (the grammar takes the text however it is tokenized; a tiny model's
    '</', 'think', '>'), and speculative decoding streams several tokens per chunk: a chunk may end inside the tag.
    lmdeploy 0.14.0's parser gave the chunk to the reasoning whole, so it never saw the tag, and the document came as
    reasoning (0.14.0 patch 0075; 0.18.0 holds back a part of the tag). The reasoning that ends with a part of the tag
    when the output ends keeps it."""
    cls = parser_cls('default')
    parser = _parser(cls, response_format=VERDICT)
    output = f'{THOUGHT}</think>\n\n{{"ok": true}}'
    split = len(THOUGHT) + cut
    content, reasoning, _ = _streamed(parser, (output[:split], output[split:]))
    assert reasoning == THOUGHT and content.strip() == '{"ok": true}', (reasoning, content)
    # cut by max_tokens inside the tag: the part is reasoning, given with the last chunk
    parser = _parser(cls, response_format=VERDICT)
    content, reasoning, _ = _streamed(parser, (THOUGHT, '</thi'))
    assert not content and reasoning == THOUGHT + '</thi', (content, reasoning)


@pytest.mark.parametrize('tail', ['<', '<tool', '<thi'], ids=repr)
def test_a_stream_that_ends_with_a_part_of_an_open_tag_keeps_it(parser_cls, tail):
    """The answer after the reasoning may end with what begins an open tag (``a <``, a call cut by ``max_tokens``
    inside its tag): the parser holds it back for the next chunk, and the last chunk gives it as content. lmdeploy
    0.14.0's parser dropped it (0.14.0 patch 0075); 0.18.0 gives it."""
    cls = parser_cls('default', 'qwen3')
    parser = _parser(cls, tools=[{'type': 'function', 'function': {'name': 'f', 'parameters': {'type': 'object'}}}])
    content, reasoning, calls = _streamed(parser, (f'{THOUGHT}</think>', 'It is a ', tail))
    assert not calls and reasoning == THOUGHT and content == 'It is a ' + tail, (reasoning, content, calls)


@pytest.mark.parametrize('chunks', [('hm <', 'think> x</think>ok'), ('hm ', '<think> x</think>ok')],
                         ids=['held back', 'chunk boundary'])
def test_a_streamed_open_tag_inside_the_reasoning_is_kept(parser_cls, chunks):
    """The parser drops the model's own open tag where the reasoning begins; one written inside the reasoning (free
    text without a format) is its text, as the whole output reads: a stream dropped it where a chunk began with it,
    which the held-back part of a close tag (``<``) made likely (0.14.0 patch 0075, 0.18.0 patch 0075)."""
    cls = parser_cls('default')
    whole = _parser(cls).parse_complete(''.join(chunks), [])
    content, reasoning, _ = _streamed(_parser(cls), chunks)
    assert (reasoning, content) == ('hm <think> x', 'ok') == (whole[2], whole[0]), (reasoning, content, whole)
    # the model's own open tag where the reasoning begins is dropped, streamed or not
    assert _streamed(_parser(cls), ('<think>', 'hm</think>'))[1] == 'hm'
    assert _parser(cls).parse_complete('<think>hm</think>', [])[2] == 'hm'


@pytest.mark.parametrize('between', ['', '\n\n', ' \t\r\n'], ids=repr)
def test_the_content_after_the_reasoning_is_the_document_exactly(parser_cls, between):
    """The whitespace the grammar allows between the reasoning's close tag and the document (a model writes
    ``</think>\\n\\n``) is not content: ``content`` is the document, as a client matches it (a regex_schema's
    ``yes``, not ``\\n\\nyes``), streamed or not."""
    cls = parser_cls('default')
    for fmt, answer in ((VERDICT, '{"ok": true}'), ({'type': 'regex_schema', 'regex_schema': 'yes|no'}, 'yes')):
        output = f'{THOUGHT}</think>{between}{answer}'
        assert accepts(_grammar(_parser(cls, response_format=fmt).request.response_format), output)
        assert _parser(cls, response_format=fmt).parse_complete(output, [])[0] == answer
        for cut in (1, 2, len(THOUGHT) + 9):
            content = _streamed(_parser(cls, response_format=fmt), _pieces(output, cut))[0]
            assert content == answer, (fmt, cut, content)
