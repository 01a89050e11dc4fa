"""Speculative windows meeting the end of a request: a batch mixing guided and unguided requests, max_new_tokens,
EOS and stop words landing inside a window. Every greedy output must equal lmdeploy's decoding without
speculation, and the step records must show the case really happened inside a window."""
import pytest
from e2e_helpers import (
    METHODS,
    NUM_SPEC_TOKENS,
    PROMPTS,
    check_valid,
    gen_config,
    generate,
    response_format,
)

from lmdeploy_guided_spec.cpu.steps import StepRecorder

pytestmark = pytest.mark.parametrize('method', list(METHODS))

# a regex whose literal parts the grammar forces, so drafts are accepted and windows run long
LONG_REGEX = r'order-[a-z]{2}-[0-9]{2}-done'


def _pair(engines, method):
    target = METHODS[method]
    return engines(target), engines(target, spec=False)


def _eos_id(pipe):
    return pipe.async_engine.tokenizer.eos_token_id


def test_mixed_batch(engines, method):
    spec, ref = _pair(engines, method)
    kinds = ['json_schema', 'text', 'regex_schema', 'text', 'json_object', 'text']
    configs = [gen_config(response_format(k), ignore_eos=(k == 'text'), max_new_tokens=24 if k == 'text' else 96)
               for k in kinds]
    outputs = generate(spec, PROMPTS[:len(kinds)], configs)
    expected = generate(ref, PROMPTS[:len(kinds)], configs)
    assert [o.token_ids for o in outputs] == [e.token_ids for e in expected]
    for kind, out in zip(kinds, outputs):
        if kind == 'text':
            # unguided requests are untouched: same tokens as without speculation, run to their budget
            assert out.finish_reason == 'length' and len(out.token_ids) == 24
        else:
            assert out.finish_reason == 'stop'
            check_valid(out.text, response_format(kind))


def _single(pipe, config):
    with StepRecorder() as recorder:
        out = generate(pipe, PROMPTS[:1], [config])[0]
    return out, [row for row in recorder.rows() if row.session_id == recorder.rows()[0].session_id]


def test_max_new_tokens_inside_a_window(engines, method):
    spec, ref = _pair(engines, method)
    fmt = response_format('regex_schema', regex=LONG_REGEX)
    full = generate(ref, PROMPTS[:1], [gen_config(fmt)])[0]
    cut_inside = 0
    assert len(full.token_ids) > 4
    for budget in range(1, len(full.token_ids)):
        out, rows = _single(spec, gen_config(fmt, max_new_tokens=budget))
        assert out.finish_reason == 'length'
        assert out.token_ids == full.token_ids[:budget]
        committed = [t for row in rows for t in row.output]
        # the last window brought more tokens than the budget had room for
        cut_inside += len(committed) > budget
    assert cut_inside > 0


def test_eos_inside_a_window(engines, method):
    spec, ref = _pair(engines, method)
    eos = _eos_id(spec)
    found = 0
    for regex in (r'[a-z]{2}', r'ab-[0-9]', r'order-[a-z]', LONG_REGEX, r'x{3}-[0-9]{2}'):
        fmt = response_format('regex_schema', regex=regex)
        out, rows = _single(spec, gen_config(fmt))
        expected = generate(ref, PROMPTS[:1], [gen_config(fmt)])[0]
        assert out.finish_reason == 'stop' and out.token_ids == expected.token_ids
        check_valid(out.text, fmt)
        for row in rows:
            if eos in row.output:
                # committed at a drafted position (not the bonus one): the window went on past EOS
                found += bool(row.drafts) and row.output.index(eos) < NUM_SPEC_TOKENS
                break
    assert found > 0


def test_stop_words_inside_a_window(engines, method):
    spec, ref = _pair(engines, method)
    fmt = response_format('regex_schema', regex=LONG_REGEX)
    full = generate(ref, PROMPTS[:1], [gen_config(fmt)])[0]
    inside = 0
    for position in range(1, min(8, len(full.token_ids) - 1)):
        stop = full.token_ids[position]
        if stop in full.token_ids[:position]:
            continue
        config = gen_config(fmt, stop_token_ids=[stop])
        out, rows = _single(spec, config)
        expected = generate(ref, PROMPTS[:1], [config])[0]
        assert out.finish_reason == 'stop'
        assert out.token_ids == expected.token_ids == full.token_ids[:position]
        committed = [t for row in rows for t in row.output]
        inside += committed.index(stop) < len(committed) - 1
    assert inside > 0
