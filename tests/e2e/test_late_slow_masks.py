"""A grammar whose token masks grow slow only after its first tokens is refused alone, and the other requests
keep decoding.

The compile service probes the masks of a grammar's first 16 tokens (``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS``), and
no more. The regular expression below passes that probe: its fixed prefix takes more than 16 tokens of the
Llama-3 vocabulary, and each of its masks takes microseconds. The words after the prefix are another matter: with
the vocabulary's words allowed, each mask costs xgrammar 0.8 s, then 1.2 s, 1.5 s, 2.3 s, 3 s, ... of CPU time, on
the engine's grammar worker, and every request of the batch waited for each (the stream below paused for seconds at
each step, for as long as the request ran). Now a mask over the limit refuses its request after its step, with the
cost and the limit, non-speculative or speculative (0.18.0 patch 0093, 0.14.0 patch 0092).
"""
import logging
from importlib.metadata import version

import pytest
import server_traffic as traffic
from e2e_helpers import PROMPTS, gen_config, while_streaming

from lmdeploy_guided_spec.compile import MASK_LIMIT_ENV

#: a fixed prefix of 20 digits and spaces (41 tokens as the tiny model writes it), then up to 300 words: the masks of
#: the words grow slow with the words read (xgrammar 0.2.8 on a 2-core EPYC: 0.8 s for the second word, 3 s for the
#: sixth). The request asks for all its tokens (``min_new_tokens``): one word is a whole output, which the model may end
LATE_SLOW = traffic.LATE_SLOW
#: the longest pause of the running stream: one step's slow masks (1.2 to 2.3 s of CPU time on that machine: the
#: request is refused at its second mask over the limit, and the step scheduled before the refusal was read fills a
#: third), with a margin for a machine that runs another test suite beside this one (CI runs both releases at once)
MAX_GAP_S = 8
#: how long the two requests may take: the prefix, then three slow masks; before the fix the 7 slow masks of the
#: request's 48 tokens took 29 s and 35 s on that machine
MAX_TOOK_S = 20


@pytest.mark.parametrize('spec', [False, True], ids=['plain', 'eagle3'])
def test_a_grammar_whose_masks_grow_slow_late_is_refused_alone(engines, spec, caplog):
    """The request is refused at its first mask over the limit, with the cost and the limit in the log; the request
    beside it and a long stream go on, and neither waited for more than that mask."""
    pipe = engines('tiny-llama', spec=spec)
    # the request's own fault is a warning of the log
    caplog.set_level(logging.WARNING, logger='lmdeploy')
    configs = [gen_config(LATE_SLOW, max_new_tokens=48, min_new_tokens=48), gen_config(None, max_new_tokens=16)]
    outputs, gap, took = while_streaming(pipe, PROMPTS[:2], configs)
    slow, plain = outputs
    assert slow.finish_reason == 'error', (slow, took)
    # the reason is in the log (a pipeline's output of a request that failed while it ran holds its text so far)
    reasons = [r.getMessage() for r in caplog.records if traffic.LATE_SLOW_REASON in r.getMessage()]
    assert reasons and MASK_LIMIT_ENV in reasons[0], reasons
    if not version('lmdeploy').startswith('0.14.'):
        # lmdeploy 0.18's pipeline also gives the reason with the response
        assert slow.error_message and traffic.LATE_SLOW_REASON in slow.error_message, slow
    assert plain.finish_reason in ('stop', 'length'), plain
    assert gap < MAX_GAP_S, f'the stream paused {gap:.1f} s beside the slow masks ({took:.1f} s)'
    assert took < MAX_TOOK_S, f'the requests took {took:.1f} s'


@pytest.mark.parametrize('spec', [False, True], ids=['plain', 'eagle3'])
def test_the_next_turn_of_a_chat_whose_grammar_was_refused_is_served(engines, spec):
    """``pipeline.chat`` keeps its session id from turn to turn (lmdeploy 0.14.0 keeps the session itself): the turns
    after a refused one, unguided and guided, are served. A drafting window fills its last masks after its step, so
    the refused turn's masks may be counted after the refusal; they must not refuse the next turn."""
    from e2e_helpers import PERSON, check_valid
    pipe = engines('tiny-llama', spec=spec)
    session = pipe.chat('Some words.', gen_config=gen_config(LATE_SLOW, max_new_tokens=48, min_new_tokens=48))
    try:
        assert session.response.finish_reason == 'error', session.response
        fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
        for config in (gen_config(None, max_new_tokens=16), gen_config(fmt, max_new_tokens=96)):
            session = pipe.chat('Now a person.', session=session, gen_config=config)
            assert session.response.finish_reason in ('stop', 'length'), session.response
        assert session.response.finish_reason == 'stop', session.response
        check_valid(session.response.text, fmt)
    finally:
        session.close()
