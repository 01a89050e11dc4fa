"""Bad input and the life of guided requests: an invalid response format fails its own request while the batch
and the engine go on, and finished sessions leave no grammar state behind."""
import re

import pytest
from e2e_helpers import (
    METHODS,
    PROMPTS,
    UNSAMPLEABLE,
    YEAR,
    check_valid,
    gen_config,
    generate,
    manager,
    method_pipeline,
    model_agent,
    response_format,
)

from lmdeploy_guided_spec.testing import fill_logits

# (format, what the reason says): the series' wording on lmdeploy 0.14.0, lmdeploy's own entry check's on 0.18.0
INVALID = [
    ({'type': 'json_schema', 'json_schema': {'name': 'bad', 'schema': {'type': 'object', 'properties': {
        'a': {'type': 'nonsense'}}}}}, 'Unsupported type'),
    ({'type': 'regex_schema', 'regex_schema': '[a-'}, 'regex_schema does not compile|Unsupported response format: '),
    ({'type': 'xml'}, "unsupported type 'xml'|unsupported format type: xml"),
]
FAILED = 'Invalid response_format|Unsupported response format|unsupported format type'
# a regex whose token masks cost over a second each in xgrammar: the compile service refuses it
SLOW = {'type': 'regex_schema', 'regex_schema': '([a-z]+ ?){1,300}'}


@pytest.mark.parametrize('method', list(METHODS))
def test_invalid_format_fails_alone(engines, method):
    pipe = engines(METHODS[method])
    good = response_format('json_schema')
    formats = [good] + [fmt for fmt, _ in INVALID] + [SLOW, None]
    configs = [gen_config(fmt, max_new_tokens=64 if fmt is not None else 8) for fmt in formats]
    outputs = generate(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(len(formats))], configs)
    assert outputs[0].finish_reason == 'stop'
    check_valid(outputs[0].text, good)
    for out, (_, message) in zip(outputs[1:], INVALID):
        assert out.finish_reason == 'error' and re.search(FAILED, out.text) and re.search(message, out.text), out
    # a grammar whose masks cost over a second each fails with the cost and the limit
    assert outputs[-2].finish_reason == 'error' and 'ms per token to match' in outputs[-2].text, outputs[-2]
    assert outputs[-1].finish_reason in ('stop', 'length')
    # the engine keeps serving
    again = generate(pipe, PROMPTS[:1], [gen_config(good)])[0]
    assert again.finish_reason == 'stop'
    check_valid(again.text, good)


def test_an_empty_prompt_fails_alone(engines):
    """An empty prompt fails its own request and the engine serves on. DeepSeek's tokenizer (Qwen's too) adds no BOS
    token, so ``''`` is no token at all: the request reached the assertion "Empty input is not allowed." of the
    engine's ``_add_message``, which stopped the engine for every request (an api_server answered HTTP 503 from
    then on to every request)."""
    pipe = engines(METHODS['deepseek_mtp'])
    good = response_format('json_schema')
    outputs = pipe(['', PROMPTS[0]], gen_config=[gen_config(None, max_new_tokens=4), gen_config(good)],
                   do_preprocess=False)
    assert outputs[0].finish_reason == 'error', outputs[0]
    assert 'empty' in (getattr(outputs[0], 'error_message', None) or outputs[0].text), outputs[0]
    assert outputs[1].finish_reason == 'stop', outputs[1]
    check_valid(outputs[1].text, good)
    again = generate(pipe, PROMPTS[1:2], [gen_config(good)])[0]
    assert again.finish_reason == 'stop'
    check_valid(again.text, good)


@pytest.mark.parametrize('method', ['non-spec', 'eagle3', 'deepseek_mtp'])
def test_a_request_without_a_finite_logit_fails_alone(engines, method):
    """A request whose logits hold a NaN or nothing finite (here a user's logits processor; bans that leave a row
    nothing, or a model's own NaN, do the same) stopped the engine for every request when sampled ("probability
    tensor contains either inf, nan or element < 0"), and greedy made up a token. Now that request fails with the
    reason, greedy or sampled, with speculative decoding or without; beside it a guided row whose tokens the
    processor banned keeps its grammar's tokens, the other requests finish and the engine serves on."""
    pipe = method_pipeline(engines, method)
    for sampling in (False, True):
        configs = [gen_config(YEAR, sampling=sampling), gen_config(None, sampling=sampling, max_new_tokens=8)]
        banned, nan = [fill_logits(float('-inf'))], [fill_logits(float('nan'))]
        configs += [gen_config(YEAR, sampling=sampling, logits_processors=banned),
                    gen_config(YEAR, sampling=sampling, logits_processors=nan),
                    gen_config(None, sampling=sampling, max_new_tokens=8, logits_processors=nan),
                    gen_config(None, sampling=sampling, max_new_tokens=8, logits_processors=banned)]
        outputs = generate(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(len(configs))], configs)
        for out in (outputs[0], outputs[2]):
            assert out.finish_reason == 'stop', (sampling, out)
            check_valid(out.text, YEAR)
        assert outputs[1].finish_reason in ('stop', 'length'), (sampling, outputs[1])
        for out in outputs[3:]:
            assert out.finish_reason == 'error' and UNSAMPLEABLE in out.text, (sampling, outputs)
    again = generate(pipe, PROMPTS[:1], [gen_config(YEAR, sampling=True)])[0]
    assert again.finish_reason == 'stop', again
    check_valid(again.text, YEAR)


@pytest.mark.parametrize('method', ['eagle3'])
def test_finished_sessions_leave_no_grammar_state(engines, method):
    pipe = engines(METHODS[method])
    kinds = ['json_schema', 'regex_schema', 'json_object', 'text']
    configs = [gen_config(response_format(kinds[i % 4]), max_new_tokens=48) for i in range(200)]
    outputs = generate(pipe, [PROMPTS[i % len(PROMPTS)] for i in range(200)], configs)
    assert len(outputs) == 200 and all(o.finish_reason in ('stop', 'length') for o in outputs)
    # sessions are cleaned up on the step after they finish: one more request is that step
    generate(pipe, PROMPTS[:1], [gen_config(None, max_new_tokens=4, ignore_eos=True)])
    assert manager(pipe).processors == {}
    assert model_agent(pipe).spec_agent.guided_spec.num_kept_windows == 0


def _slow_to_check(n: int) -> dict:
    """A response format whose entry check parses for seconds: a pattern xgrammar converts slowly (9,000 repetitions
    take about 8 s on a 2-core machine; each ``n`` is a grammar of its own, never answered from a cache)."""
    return {'type': 'json_schema', 'json_schema': {'name': f'slow{n}', 'schema': {
        'type': 'string', 'pattern': f'^[a-z]{{1,{n}}}$'}}}


def test_an_abort_reaches_a_request_in_its_entry_check(engines):
    """``Session.abort`` (and ``stop_all_session``) while the request's grammar is still checked, before it holds
    an engine handle: the request ends at once with finish_reason 'abort'. The abort was dropped (a session
    without a handle had nothing to cancel), and the request ran once its check ended, seconds later. An abort of
    a session with no request in flight does not reach the session's next request. ``Session.close`` in the check
    ends the request the same way (it failed with an internal error on 0.18.0, and ran on 0.14.0), and the
    pipeline serves on."""
    import concurrent.futures
    import time
    pipe = engines('tiny-llama')

    def last(session, fmt, max_new_tokens=8):
        """The last response of a streamed request, and its whole text."""
        outputs = list(pipe.stream_infer(PROMPTS[0], sessions=session, gen_config=gen_config(
            fmt, max_new_tokens=max_new_tokens)))
        outputs[-1].text = ''.join(out.text for out in outputs)
        return outputs[-1]

    def aborted_in_check(n: int, abort) -> tuple[float, object]:
        session = pipe.session()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            future = pool.submit(last, session, _slow_to_check(n), 64)
            time.sleep(1)
            assert not future.done(), 'the entry check ended within a second: make the pattern longer'
            abort(session)
            start = time.monotonic()
            out = future.result(timeout=120)
        return time.monotonic() - start, out, session

    took, out, session = aborted_in_check(9_000, lambda session: session.abort())
    assert out.finish_reason == 'abort' and took < 4, (out, took)
    # the session serves its next request in full
    again = last(session, YEAR)
    assert again.finish_reason == 'stop' and re.fullmatch('[0-9]{4}', again.text), again

    took, out, _ = aborted_in_check(
        9_001, lambda session: pipe._run(coro=pipe.async_engine.stop_all_session()).result())
    assert out.finish_reason == 'abort' and took < 4, (out, took)

    took, out, _ = aborted_in_check(9_002, lambda session: session.close())
    assert out.finish_reason == 'abort' and took < 4, (out, took)

    # an abort of an idle session is not kept for its next request
    idle = pipe.session()
    idle.abort()
    again = last(idle, YEAR)
    assert again.finish_reason == 'stop' and re.fullmatch('[0-9]{4}', again.text), again


# a grammar that ends a few tokens in, often inside a speculative window
ENUM = {'type': 'json_schema', 'json_schema': {'name': 'r', 'schema': {'enum': [f'value {i}' for i in range(300)]}}}


@pytest.mark.parametrize('method', list(METHODS))
def test_min_new_tokens_beyond_the_end_of_the_grammar(engines, method):
    """Sampled guided requests whose ``min_new_tokens`` reaches past the end of their grammar. lmdeploy counts
    ``min_new_tokens`` down by steps, not tokens, and decodes a stopped request once more: in that step the stop
    tokens were still banned (through the stop words, which the grammar's second mask did not look at) while the
    finished grammar allowed nothing else, a row without a finite logit, and sampling it failed the whole batch: one
    request stopped the engine for every request (found by random traffic, lmdeploy 0.14.0 with ``deepseek_mtp``).
    One request at a time: beside other requests short of their ``min_new_tokens`` the batch's bad words held the
    stop tokens, and the second mask ran. Now every request ends with a valid document and the engine serves on."""
    pipe = engines(METHODS[method])
    for seed in range(6):
        config = gen_config(ENUM, sampling=True, seed=seed, top_k=0, temperature=1.0, min_new_tokens=5,
                            max_new_tokens=24)
        out = generate(pipe, ['x' * 300], [config])[0]
        assert out.finish_reason == 'stop', (seed, out)
        check_valid(out.text, ENUM)
    again = generate(pipe, PROMPTS[:1], [gen_config(YEAR)])[0]
    assert again.finish_reason == 'stop', again
