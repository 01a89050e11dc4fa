"""Traffic as deployments see it, through ``pipeline`` on the CPU path: greedy and sampling requests in one batch,
guided and unguided side by side, a JSON schema given as a string, several engines in one process.

Each test names the defect of the issue "The engine never dies, never stalls, never drops the grammar" that it
guards against.
"""
import functools
import itertools
import json
import logging
import math
import re
import time

import pytest
from e2e_helpers import (
    METHODS,
    PERSON,
    PROMPTS,
    YEAR,
    Output,
    _text,
    banned_tokens_and_dead_ends,
    check_valid,
    gen_config,
    generate,
    manager,
    method_pipeline,
    model_agent,
    response_format,
)

MIXED = [('json_schema', False), ('json_schema', True), ('text', False), ('text', True), ('regex_schema', True),
         ('regex_schema', False)]


def _mixed_configs(seed: int):
    return [gen_config(response_format(kind), sampling=sampling, seed=seed + i,
                       max_new_tokens=96 if kind != 'text' else 24)
            for i, (kind, sampling) in enumerate(MIXED)]


def _target(method: str) -> str:
    return 'tiny-llama' if method == 'grammar' else METHODS[method]


@pytest.mark.one_method({'0.18': ['eagle3', 'grammar'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', [*METHODS, 'grammar'])
def test_mixed_greedy_and_sampling_batch(engines, method):
    """Defect 1: greedy and sampling requests in one batch (lmdeploy handed the rejection sampler batch x k rows of
    per-request flags; the CPU path's kernels raised, and the engine stopped for every request)."""
    pipe = method_pipeline(engines, method)
    prompts = PROMPTS[:len(MIXED)]
    for round_ in range(2):
        configs = _mixed_configs(seed=10 * round_)
        outputs = generate(pipe, prompts, configs)
        for out, (kind, _), config in zip(outputs, MIXED, configs):
            assert out.finish_reason in ('stop', 'length'), out
            if kind != 'text':
                assert out.finish_reason == 'stop', out
                check_valid(out.text, config.response_format)
    # greedy rows equal guided decoding without speculation, whatever sampled rows shared their batch
    greedy = [i for i, (_, sampling) in enumerate(MIXED) if not sampling]
    ref = generate(engines(_target(method), spec=False), [prompts[i] for i in greedy],
                   [configs[i] for i in greedy])
    assert [outputs[i].token_ids for i in greedy] == [r.token_ids for r in ref]


@pytest.mark.parametrize('spec', [True, False], ids=['spec', 'non-spec'])
def test_json_schema_given_as_a_string(engines, spec):
    """Defect 7: ``json_schema.schema`` as a JSON string passed the entry check, then the engine asserted a dict and
    stopped for every request."""
    pipe = engines(METHODS['eagle3'], spec=spec)
    as_string = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': json.dumps(PERSON)}}
    as_dict = response_format('json_schema')
    outputs = generate(pipe, PROMPTS[:1] * 2, [gen_config(as_string), gen_config(as_dict)])
    for out in outputs:
        assert out.finish_reason == 'stop', out
        check_valid(out.text, as_dict)
    assert outputs[0].token_ids == outputs[1].token_ids


# the turns of one chat session: formats change, the same format follows itself, an unguided turn in between; then
# a turn whose stream the client stops reading after two chunks, and turns after it
CHAT_TURNS = [response_format('regex_schema'), response_format('json_schema'), response_format('json_schema'),
              response_format('regex_schema', regex='[a-z]{5}'), None, response_format('json_schema')]
AFTER_A_STOPPED_TURN = [response_format('json_schema'), response_format('regex_schema')]


def _chat(pipe, formats, *, stop_reading: int | None = None) -> list[Output]:
    """One ``pipeline.chat`` session, a turn per format; the turn at index ``stop_reading`` is streamed and left
    after two chunks (no output). The session is closed after the last turn."""
    session, turns = None, []
    try:
        for i, fmt in enumerate(formats):
            options = dict(max_new_tokens=64) if fmt is not None else dict(max_new_tokens=16, ignore_eos=True)
            config = gen_config(fmt, **options)
            if i == stop_reading:
                session = session or pipe.session()
                chunks = pipe.chat('Give me a record.', session=session, gen_config=config, stream_response=True)
                for n, _ in enumerate(chunks, 1):
                    if n == 2:
                        break
                chunks.close()
                # lmdeploy ends the stopped request on its own event loop, and a turn sent before that fails with
                # "Session N already has an active request" (lmdeploy 0.18's pipeline, with or without a grammar)
                deadline = time.monotonic() + 30
                while session._handle is not None and time.monotonic() < deadline:
                    time.sleep(0.05)
                assert session._handle is None, 'the stopped turn did not end within 30 s'
                continue
            session = pipe.chat('Give me a record.', session=session, gen_config=config)
            response = session.response
            turns.append(Output(_text(response), list(response.token_ids or []), response.finish_reason))
    finally:
        if session is not None:
            session.close()
    return turns


@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_each_turn_of_a_chat_session_has_its_own_grammar(engines, method):
    """Defects: ``pipeline.chat`` on lmdeploy 0.14.0 continues the session's sequence for the next turn.
    - The session's grammar state outlived the turn: every later turn ran on the first turn's finished matcher,
      ending at once with guided decoding and running unguided with guided speculative decoding.
    - Speculative decoding dropped the token the last turn left to forward: the turn began with the prompt's last
      word and lost its first token; after a turn the client stopped reading, the input went after its drafts.
    """
    pipe = method_pipeline(engines, method)
    turns = _chat(pipe, CHAT_TURNS)
    reference = _chat(engines(_target(method), spec=False), CHAT_TURNS)
    for i, (turn, ref, fmt) in enumerate(zip(turns, reference, CHAT_TURNS)):
        if fmt is not None:
            assert turn.finish_reason == 'stop', (i, turn)
            check_valid(turn.text, fmt)
        assert turn.text == ref.text, (i, turn, ref)
    # what the stopped turn left in the session depends on when the stop arrived: no reference to compare with
    formats = CHAT_TURNS[:2] + AFTER_A_STOPPED_TURN
    for turn, fmt in zip(_chat(pipe, formats, stop_reading=1), formats[:1] + formats[2:]):
        assert turn.finish_reason == 'stop', turn
        check_valid(turn.text, fmt)


# prompts longer than the prefill chunk (lmdeploy splits a prompt longer than max_prefill_token_num into chunks and
# samples a token after each), beside short ones, every kind of row
CHUNK = dict(max_prefill_token_num=64)
LONG = ' '.join(PROMPTS) * 6


@pytest.mark.parametrize('method', ['eagle3'])
def test_prompts_prefilled_in_chunks(engines, method):
    """Defect: without speculative decoding the grammar accepted the token sampled after every chunk of a long
    prompt, which the engine drops: the JSON lost its first tokens (one per chunk but the last), silently."""
    prompts = [LONG, PROMPTS[0], LONG + ' Again.', PROMPTS[1], LONG[:400]]
    formats = [response_format('json_schema'), response_format('regex_schema'), response_format('json_schema'),
               None, response_format('regex_schema')]
    configs = [gen_config(fmt, max_new_tokens=64) if fmt is not None else
               gen_config(None, max_new_tokens=16, ignore_eos=True) for fmt in formats]
    reference = generate(engines(METHODS[method], spec=False, **CHUNK), prompts, configs)
    outputs = generate(engines(METHODS[method], **CHUNK), prompts, configs)
    for i, (out, ref, fmt) in enumerate(zip(outputs, reference, formats)):
        if fmt is not None:
            assert ref.finish_reason == 'stop', (i, ref)
            check_valid(ref.text, fmt)
        assert out.text == ref.text, (i, out, ref)


# a KV cache of 8 blocks of 64 tokens for 12 requests of up to 150 tokens each: the scheduler preempts decoding
# sequences (and prefills them again later with the tokens they kept)
SMALL_CACHE = dict(num_gpu_blocks=8)
DIGITS = {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9}, 'minItems': 30, 'maxItems': 30}
LETTERS = '[a-z]{50}-[0-9]{30}'


@pytest.fixture
def preemptions(monkeypatch):
    """The number of decoding sequences the scheduler preempted, one entry per decoding step."""
    from lmdeploy_guided_spec.support.harness import count_preemptions
    return count_preemptions(monkeypatch.setattr)


def test_sequences_preempted_for_a_full_kv_cache(engines, preemptions):
    """Defect: when the KV cache is full the scheduler preempts a decoding sequence and drops the token the step in
    flight samples for it; without speculative decoding the grammar had taken that token, so the JSON lost a token
    at every preemption (``3,33`` for ``3,3,3``), silently. With speculative decoding (eagle3): an unguided request
    prefilled into the row of a guided one that had left the batch took that one's grammar (its drafting window's
    masks), writing stop tokens with ``ignore_eos`` (1 run in 2)."""
    formats = [response_format('json_schema', schema=DIGITS), response_format('regex_schema', regex=LETTERS),
               None, response_format('json_object')]
    prompts = [f'{PROMPTS[i % len(PROMPTS)]} Number {i}.' for i in range(12)]
    configs = [gen_config(formats[i % 4], sampling=i % 3 == 2, seed=i, max_new_tokens=120,
                          ignore_eos=formats[i % 4] is None) for i in range(12)]
    reference = generate(engines('tiny-llama', spec=False), prompts, configs)
    del preemptions[:]
    for spec in (False, True):
        outputs = generate(engines('tiny-llama', spec=spec, **SMALL_CACHE), prompts, configs)
        assert sum(preemptions) > 0, f'spec={spec}: no sequence was preempted'
        del preemptions[:]
        for i, (out, ref, config) in enumerate(zip(outputs, reference, configs)):
            if config.response_format is not None:
                assert out.finish_reason == 'stop', (spec, i, out)
                check_valid(out.text, config.response_format)
            else:
                assert out.finish_reason == 'length', (spec, i, out)
            if not config.do_sample:
                assert out.token_ids == ref.token_ids, (spec, i, out, ref)


def test_engines_of_one_process_keep_their_own_grammar_state(engines):
    """Defect 9: ``GuidedDecodingManager.processors`` was a class attribute, shared by the engines of a process
    although their session ids restart at 0 in each."""
    one, other = engines(METHODS['eagle3']), engines(METHODS['eagle3'], spec=False)
    assert manager(one).processors is not manager(other).processors
    fmt = response_format('json_schema')
    for pipe in (one, other):
        out = generate(pipe, PROMPTS[:1], [gen_config(fmt)])[0]
        check_valid(out.text, fmt)


@pytest.fixture(scope='module')
def raw_logprob_pipes(engines):
    """eagle3 and non-speculative pipelines with ``logprobs_mode='raw_logprobs'``."""
    return {spec: engines(METHODS['eagle3'], spec=spec, logprobs_mode='raw_logprobs') for spec in (True, False)}


def test_raw_logprobs_of_guided_requests(raw_logprob_pipes):
    """Defect 8: with raw logprobs, speculative decoding took them after the grammar mask: -inf for every
    disallowed token (HTTP 500 from the api_server: not JSON compliant) and 0.0 for a forced token."""
    fmt = response_format('json_schema')
    config = gen_config(fmt, logprobs=3)
    spec, ref = (raw_logprob_pipes[s](PROMPTS[:1], gen_config=[config])[0] for s in (True, False))
    assert list(spec.token_ids) == list(ref.token_ids)
    check_valid(spec.text, fmt)
    assert len(spec.logprobs) == len(ref.logprobs) == len(spec.token_ids)
    for position, (ours, theirs) in enumerate(zip(spec.logprobs, ref.logprobs)):
        assert all(math.isfinite(v) for v in ours.values()), (position, ours)
        assert set(ours) == set(theirs), (position, ours, theirs)
        for token, value in theirs.items():
            assert ours[token] == pytest.approx(value, abs=1e-3), (position, token)


NO_INSTANCE = {'type': 'json_schema', 'json_schema': {'name': 'loop', 'schema': {
    '$defs': {'a': {'$ref': '#/$defs/a'}}, '$ref': '#/$defs/a'}}}


def nested(levels: int) -> dict:
    """A json_schema response format of ``levels`` objects, each the only property of the one around it."""
    schema = {'type': 'string'}
    for _ in range(levels):
        schema = {'type': 'object', 'properties': {'a': schema}, 'required': ['a']}
    return {'type': 'json_schema', 'json_schema': {'name': 'nested', 'schema': schema}}


@pytest.mark.parametrize('method', [*METHODS, 'grammar'])
def test_schema_without_instances_fails_alone(engines, method):
    """Defect 5: a schema that admits no instance compiled, the grammar rejected the first committed token, and the
    request went on unconstrained with finish_reason 'stop'. It fails alone at entry now; the grammar is never
    dropped. So does a schema of 300 nested objects, at once (its entry check took 19 s, then lmdeploy's copy of the
    request failed with 'Request preprocessing failed.')."""
    pipe = method_pipeline(engines, method)
    good = response_format('json_schema')
    outputs = generate(pipe, PROMPTS[:3], [gen_config(NO_INSTANCE), gen_config(nested(300)), gen_config(good)])
    assert outputs[0].finish_reason == 'error' and 'admits no instance' in outputs[0].text, outputs[0]
    assert outputs[1].finish_reason == 'error' and 'LMDEPLOY_GUIDED_SPEC_MAX_SCHEMA_DEPTH' in outputs[1].text
    assert outputs[2].finish_reason == 'stop'
    check_valid(outputs[2].text, good)


@pytest.fixture
def corrupt_digit_commits(monkeypatch):
    """Make commits of the grammar worker hand a digits-only grammar the token ``a``, which it rejects: a stand-in
    for any fault that gets a disallowed token to the commit (a stale device read, a kernel that ignored the mask).
    Rows whose matcher accepts ``a`` keep their tokens, and so do rows whose grammar is complete: their next token
    is a stop token, which every complete grammar accepts and ``a`` never (lmdeploy 0.18 builds its matchers without
    ``terminate_without_stop_token``, so a complete one is not terminated yet)."""
    from lmdeploy_guided_spec import manager as manager_module
    from lmdeploy_guided_spec.ordering import host_lists
    real_commit = manager_module.commit
    state = {'token': None, 'corrupted': 0}

    def commit(matchers, token_ids, **kwargs):
        bad = state['token']
        ids = host_lists(token_ids, kwargs.pop('ready', None))
        for row, matcher in matchers.items():
            row_ids = ids[row] if isinstance(ids[row], list) else [ids[row]]
            fork = matcher.fork()
            if bad is not None and row_ids[0] >= 0 and not fork.is_terminated() and not fork.is_completed() \
                    and not fork.accept_token(bad):
                ids[row] = [bad, *row_ids[1:]] if isinstance(ids[row], list) else bad
                state['corrupted'] += 1
        return real_commit(matchers, ids, **kwargs)

    monkeypatch.setattr(manager_module, 'commit', commit)
    return state


@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_a_committed_token_the_grammar_rejects_fails_its_request(engines, method, corrupt_digit_commits):
    """Defect 5, at run time: a committed token the grammar rejects is an error for its request, reported with the
    reason, not a fallback to unconstrained decoding (before, the request went on with finish_reason 'length' and
    only the log said so). Its neighbours, guided or not, finish as usual."""
    pipe = method_pipeline(engines, method)
    token_a, = pipe.async_engine.tokenizer.encode('a', add_bos=False)
    corrupt_digit_commits['token'] = token_a
    digits = response_format('regex_schema', regex=r'[0-9]{40}')
    letters = response_format('regex_schema', regex=r'[a-z]{40}')
    configs = [gen_config(digits, max_new_tokens=48), gen_config(letters, max_new_tokens=48),
               gen_config(None, max_new_tokens=16)]
    outputs = generate(pipe, PROMPTS[:3], configs)
    assert corrupt_digit_commits['corrupted'] >= 1
    assert outputs[0].finish_reason == 'error', outputs[0]
    assert 'rejected committed token' in outputs[0].text, outputs[0]
    assert outputs[1].finish_reason == 'stop', outputs[1]
    check_valid(outputs[1].text, letters)
    assert outputs[2].finish_reason in ('stop', 'length'), outputs[2]
    # the engine goes on serving, and holds no failure or grammar state of the finished requests
    corrupt_digit_commits['token'] = None
    again = generate(pipe, PROMPTS[:1], [gen_config(letters, max_new_tokens=48)])
    assert again[0].finish_reason == 'stop'
    check_valid(again[0].text, letters)
    # sessions are cleaned up on the step after they finish: one more request is that step
    generate(pipe, PROMPTS[:1], [gen_config(None, max_new_tokens=4, ignore_eos=True)])
    assert manager(pipe).processors == {}
    assert model_agent(pipe).spec_agent.guided_spec.failures() == {}


def _set_logits(token_ids: list[int], value: float, all_ids, logits):
    """A pipeline user's logits processor: ``value`` on ``token_ids``."""
    logits[token_ids] = value
    return logits


@pytest.mark.one_method({'0.14': ['grammar', 'non-spec']})
@pytest.mark.parametrize('method', ['eagle3', 'grammar', 'non-spec'])
def test_a_users_logits_processors_never_outweigh_the_grammar(engines, method):
    """A pipeline user's ``logits_processors`` ran after the grammar's mask without speculation: one that set a finite
    value on a token the grammar forbids had that token picked, and the request failed ("a committed token the
    grammar rejects"). With speculation they run before the mask: one that set every token the grammar allows to
    -inf left the row no finite logit (a greedy row took token 0 and failed; sampling it failed the whole batch).
    Now the grammar wins, greedy and sampled, and the processors still act where the grammar leaves them room."""
    pipe = method_pipeline(engines, method)
    vocab = pipe.async_engine.tokenizer.model.model.get_vocab()
    digit_tokens = sorted(i for token, i in vocab.items() if re.fullmatch('[0-9]+', token))
    letter, seven = vocab['x'], vocab['7']
    push_letter = functools.partial(_set_logits, [letter], 1e4)
    ban_digits = functools.partial(_set_logits, digit_tokens, float('-inf'))
    push_seven = functools.partial(_set_logits, [seven], 1e4)
    configs = [gen_config(YEAR, sampling=sampling, seed=seed, logits_processors=[processor])
               for seed, (processor, sampling) in enumerate(itertools.product([push_letter, ban_digits],
                                                                               [False, True]))]
    configs += [gen_config(YEAR, logits_processors=[push_seven]),
                gen_config(None, logits_processors=[push_letter], max_new_tokens=4, ignore_eos=True),
                gen_config(YEAR, sampling=True, seed=9)]
    outputs = generate(pipe, PROMPTS[:len(configs)], configs)
    for out in outputs[:4] + outputs[6:]:
        assert out.finish_reason == 'stop', out
        check_valid(out.text, YEAR)
    # the processors act inside the grammar's room, and without a grammar
    assert outputs[4].finish_reason == 'stop' and outputs[4].text == '7777', outputs[4]
    assert outputs[5].token_ids == [letter] * 4, outputs[5]
    again = generate(pipe, PROMPTS[:1], [gen_config(YEAR)])[0]
    assert again.finish_reason == 'stop', again
    check_valid(again.text, YEAR)


@pytest.mark.one_method({'0.14': ['grammar', 'non-spec']})
@pytest.mark.parametrize('method', ['eagle3', 'grammar', 'non-spec'])
def test_sampling_values_that_stopped_the_engine_are_served(engines, method):
    """One request stopped the engine for every request, present and later ("The inference engine is
    unavailable"): a ``top_k`` beyond the vocabulary (``torch.topk`` raised: "selected index k out of range") or a
    temperature so small that the logits divided by it overflowed (1e-38: the sampler met inf), a ``top_k`` or a stop
    token id past int64, a banned token id outside the vocabulary, a ``repetition_penalty`` of NaN or 1e-38 (the
    logits it divided overflowed). A ``top_k`` at or beyond the vocabulary limits nothing, as 0 does; a tiny
    temperature is close to greedy; stop and banned ids outside the vocabulary, which no step samples, change
    nothing; a penalty is bounded to [0.01, 100]. Beside them in the batch, guided and unguided requests, greedy
    and sampled."""
    pipe = method_pipeline(engines, method)
    person = response_format('json_schema')
    hostile = [gen_config(YEAR, sampling=True, seed=1, top_k=10**9), gen_config(None, sampling=True, seed=2,
                                                                                 top_k=10**9, max_new_tokens=8),
               gen_config(YEAR, sampling=True, seed=3, temperature=1e-38),
               gen_config(person, sampling=True, seed=4, temperature=1e-45, top_k=0),
               # past int64 (the batch's tensor overflowed); stop and banned token ids outside the vocabulary, which
               # no step samples (banned, their gather failed the whole batch)
               gen_config(YEAR, sampling=True, seed=6, top_k=2**63), gen_config(None, max_new_tokens=8,
                                                                                 stop_token_ids=[2**64]),
               gen_config(None, max_new_tokens=8, ignore_eos=True, stop_token_ids=[10**9, -1]),
               gen_config(YEAR, bad_token_ids=[10**9]),
               gen_config(YEAR, sampling=True, seed=7, repetition_penalty=1e-38),
               gen_config(None, sampling=True, seed=8, repetition_penalty=float('nan'), max_new_tokens=8),
               gen_config(YEAR, sampling=True, seed=9, repetition_penalty=float('inf')),
               gen_config(YEAR, sampling=True, seed=10, repetition_penalty=1e38)]
    beside = [gen_config(person), gen_config(YEAR, sampling=True, seed=5), gen_config(None, max_new_tokens=8)]
    configs = hostile + beside
    outputs = generate(pipe, (PROMPTS * 2)[:len(configs)], configs)
    for out, config in zip(outputs, configs):
        assert out.finish_reason in ('stop', 'length'), out
        if config.response_format is not None:
            assert out.finish_reason == 'stop', out
            check_valid(out.text, config.response_format)
    # a temperature of 1e-38 samples what greedy decoding picks, and ids outside the vocabulary change nothing
    greedy = generate(pipe, [*PROMPTS[2:4], PROMPTS[7]], [gen_config(YEAR), gen_config(person), gen_config(YEAR)])
    assert [o.token_ids for o in outputs[2:4] + outputs[7:8]] == [g.token_ids for g in greedy]


# 'not' is dropped by xgrammar (tests/unit/test_unenforced.py)
UNENFORCED = {'type': 'object', 'properties': {'age': {'type': 'integer', 'minimum': 0, 'maximum': 9,
                                                       'not': {'const': 3}}},
              'required': ['age'], 'additionalProperties': False}


def test_unenforced_keywords_strict_fails_otherwise_a_warning(engines):
    """Issue 15: a schema with keywords xgrammar does not enforce was served with no word. Through ``pipeline``, a
    strict one fails alone naming them; a non-strict one is served (the rest of the schema holds) with a warning in
    lmdeploy's log."""
    pipe = engines(METHODS['eagle3'])
    strict = {'type': 'json_schema', 'json_schema': {'name': 'age', 'schema': UNENFORCED, 'strict': True}}
    lax = {'type': 'json_schema', 'json_schema': {'name': 'age', 'schema': UNENFORCED}}
    records = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append
    logger = logging.getLogger('lmdeploy')
    level = logger.level
    # the engines of these tests log errors only
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        outputs = generate(pipe, PROMPTS[:2], [gen_config(strict), gen_config(lax)])
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert outputs[0].finish_reason == 'error', outputs[0]
    assert 'is strict' in outputs[0].text and 'not at #/properties/age' in outputs[0].text, outputs[0].text
    assert outputs[1].finish_reason == 'stop', outputs[1]
    assert 0 <= json.loads(outputs[1].text)['age'] <= 9
    warnings = [r.getMessage() for r in records
                if r.levelno == logging.WARNING and 'does not enforce' in r.getMessage()]
    assert len(warnings) == 1 and 'not at #/properties/age' in warnings[0], warnings


@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_banned_tokens_and_dead_ends_leave_the_engine_serving(engines, method):
    """Rows without a finite logit stopped the engine for every request (sampling them failed for the whole batch):
    ignore_eos, min_new_tokens or the n-gram stop together with the grammar, and a grammar that runs into a dead
    end. In one batch with sampling rows: the grammar wins where they meet, a dead end fails its own request, and
    the engine goes on."""
    banned_tokens_and_dead_ends(method_pipeline(engines, method))
