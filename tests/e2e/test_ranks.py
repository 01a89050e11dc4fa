"""Several ranks through lmdeploy's own multiprocess executor on the CPU path (gloo where lmdeploy asks for NCCL).

``tp=2``: guided speculative decoding (``eagle3``, ``deepseek_mtp``, the draft-free ``grammar``) gives, greedy, the
same tokens as guided decoding without speculation on one rank; the per-rank draft log
(:mod:`lmdeploy_guided_spec.cpu.ranks`) shows every rank verifying the same drafts at every step. After 200 mixed
requests no rank process holds grammar state for a finished session (asked of each rank process with
``ranks.call_ranks``), and the same check sees the state left behind when the cleanup is switched off.

``dp=2`` (two engines, one rank each, MLP tensor-parallel across them), with ``eagle3`` and ``grammar``: one rank idle
(running lmdeploy's dummy forwards) while the other serves guided and unguided requests, then both serving at once,
each its own mix; greedy output equals one rank's guided decoding without speculation. The same behind
``lmdeploy serve api_server --tp 2 --dp 2`` (one server per dp rank, on the ``--server-name`` asked for).

Each test starts its engines itself (their ranks are processes of their own) and closes them; the start-up time is
printed (``-s``).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
import sys
import time

import pytest
import server_traffic as traffic
from e2e_helpers import (
    ENGINE_KWARGS,
    PERSON,
    UNSAMPLEABLE,
    YEAR,
    Output,
    banned_tokens_and_dead_ends,
    check_valid,
    environ,
    forget_at_exit,
    free_port,
    gen_config,
    generate,
    kill_at_exit,
    response_format,
    start_server,
    stop_server,
    wait_for_server,
    while_streaming,
)

from lmdeploy_guided_spec.compile import COMPILE_TIMEOUT_ENV
from lmdeploy_guided_spec.cpu import ranks
from lmdeploy_guided_spec.testing import fill_logits

# the session's cached pipelines go before these checks start engines with several rank processes each: memory
pytestmark = pytest.mark.usefixtures('no_session_pipelines')

NUM_SPEC_TOKENS = 3
ITEM = {'type': 'object', 'properties': {'sku': {'type': 'string', 'maxLength': 8},
                                         'qty': {'type': 'integer', 'minimum': 1, 'maximum': 99}},
        'required': ['sku', 'qty'], 'additionalProperties': False}
CASES = [(PERSON, 'Describe a person as JSON.'), (ITEM, 'One order line, please.'), (PERSON, 'Give me a record.')]
# method: (target, draft model name or None for the draft in the target checkpoint, '' for draft-free)
METHODS = {'eagle3': ('tiny-llama', 'tiny-llama-eagle3'), 'deepseek_mtp': ('tiny-deepseek-mtp', None),
           'grammar': ('tiny-llama', '')}


def _pipeline(target: str, *, tp: int = 1, dp: int = 1, dp_rank: int = 0, method: str | None = None,
              draft: str | None = None, env: dict | None = None, log_level: str = 'ERROR', **engine_options):
    """A pipeline whose engine runs its ranks in processes of lmdeploy's multiprocess executor; ``engine_options``
    are ``PytorchEngineConfig`` fields beyond ``ENGINE_KWARGS``."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec.cpu import models
    spec = None
    if method is not None:
        spec = SpeculativeConfig(method=method, model=models.resolve(draft) if draft else '',
                                 num_speculative_tokens=NUM_SPEC_TOKENS)
    config = PytorchEngineConfig(tp=tp, dp=dp, dp_rank=dp_rank, distributed_executor_backend='mp',
                                 **{**ENGINE_KWARGS, **engine_options})
    # the rank processes inherit this process's environment when they start
    with environ(env):
        return pipeline(models.resolve(target), backend_config=config, speculative_config=spec, log_level=log_level)


def _configs():
    return [gen_config(response_format('json_schema', schema=schema), max_new_tokens=64) for schema, _ in CASES]


def _check_drafts_agree(directory, failing: str | None = None) -> int:
    """Every rank verified the same drafts at every step; a rank that drafted itself drafted exactly those; no rank
    logged a grammar error (the requests are valid: a grammar that rejects a committed token on any rank is out of
    step with rank 0's) other than those that say ``failing`` (requests meant to fail). Returns the number of
    speculative steps. Call it while the engine is up."""
    # the last step of one rank may still be running when the last response has come back: wait until both ranks
    # logged the same number of steps and nothing more arrives
    deadline, previous = time.monotonic() + 30, None
    while True:
        logs = ranks.read_draft_logs(directory)
        verified = {r: [rec['drafts'] for rec in recs if rec['kind'] == 'verify'] for r, recs in logs.items()}
        counts = {r: len(v) for r, v in verified.items()}
        if (counts == previous and len(set(counts.values())) == 1) or time.monotonic() > deadline:
            break
        previous = counts
        time.sleep(1)
    errors = ranks.read_error_logs(directory)
    assert [e for e in errors if failing is None or failing not in e] == [], errors
    assert sorted(logs) == [0, 1], f'draft logs of ranks {sorted(logs)}'
    assert verified[0], 'no speculative step was logged'
    assert len(verified[0]) == len(verified[1]), {r: len(v) for r, v in verified.items()}
    for step, (a, b) in enumerate(zip(verified[0], verified[1])):
        assert a == b, f'step {step}: rank 0 verifies {a}, rank 1 verifies {b}'
    for r, recs in logs.items():
        own = [rec['drafts'] for rec in recs if rec['kind'] == 'draft' and not rec['dummy']]
        if own:
            assert own == verified[r], f'rank {r} drafted other tokens than it verified'
    return len(verified[0])


@pytest.mark.one_method({'0.18': ['deepseek_mtp'], '0.14': ['grammar']})
@pytest.mark.parametrize('method', list(METHODS))
def test_tp2_guided_speculative_equals_tp1(engines, method, tmp_path):
    target, draft = METHODS[method]
    configs = _configs()
    prompts = [prompt for _, prompt in CASES]
    reference = generate(engines(target, spec=False), prompts, configs)
    start = time.perf_counter()
    pipe = _pipeline(target, tp=2, method=method, draft=draft, env={ranks.DRAFT_LOG_ENV: str(tmp_path)})
    print(f'\n[tp=2 {method}] engine start-up {time.perf_counter() - start:.1f} s')
    try:
        outputs = generate(pipe, prompts, configs)
        for out, ref, fmt in zip(outputs, reference, configs):
            assert out.token_ids == ref.token_ids, (out.text, ref.text)
            if out.finish_reason == 'stop':
                check_valid(out.text, fmt.response_format)
        # read while the engine is up: closing it ends the rank processes wherever they are, and a step that runs
        # past the last response may then be logged by one rank and not the other
        steps = _check_drafts_agree(tmp_path)
    finally:
        pipe.close()
    print(f'[tp=2 {method}] {steps} speculative steps, drafts identical on both ranks')


#: a grammar slow to compile: xgrammar takes seconds for a bounded string with the Llama-3 tokenizer (7 s for 200
#: characters, 5 to 6 s for 180, on 2 cores)
SLOW_TO_COMPILE = {'type': 'object', 'properties': {'note': {'type': 'string', 'maxLength': 180}},
                   'required': ['note'], 'additionalProperties': False, 'title': 'slow to compile on every rank'}


def test_tp2_a_new_grammar_compiles_on_the_ranks_off_their_step(cpu_path, capfd):
    """tp=2 (no speculative decoding): each rank process compiles a new grammar while the engine compiles it, off
    its step, so a long unguided stream keeps decoding meanwhile and the guided request then decodes under its
    grammar. Before, only the engine compiled it off its loop: each rank compiled it again inside its step once the
    engine had scheduled the request, and the stream paused for about as long as one compile of the grammar. The
    grammar is the engine's first: a rank's compile service started with the first grammar, and the stream paused
    for the start of its processes as well (4.7 s in a hunt).

    What tells is each rank's own account: a rank whose step holds a grammar for more than a second (compiling it, or
    waiting for its compile) logs it, and no rank may hold it for half a compile (its own compile, started with the
    engine's, may end a moment later: 1.2 s once in CI). The stream's longest pause is printed, not asserted: on two
    cores the three compiles off the step take the CPU from the ranks' steps as well (4.3 s in CI beside the other
    release's suite, with no step holding the grammar)."""
    import xgrammar as xgr

    from lmdeploy_guided_spec.testing import tokenizer_info
    fmt = response_format('json_schema', schema=SLOW_TO_COMPILE)
    # how long one compile of the grammar takes here, alone (the stall the stream saw before)
    start = time.perf_counter()
    xgr.GrammarCompiler(tokenizer_info('llama3'), cache_enabled=False).compile_json_schema(
        json.dumps(SLOW_TO_COMPILE))
    alone = time.perf_counter() - start
    start = time.perf_counter()
    # the engine and both ranks compile the grammar at once, and the engine probes its masks: far from the limit
    # (its ranks log a grammar that a step held for more than a second)
    pipe = _pipeline('tiny-llama', tp=2, max_batch_size=8, env={COMPILE_TIMEOUT_ENV: '300'}, log_level='WARNING')
    print(f'\n[tp=2 compile] engine start-up {time.perf_counter() - start:.1f} s; one compile alone {alone:.1f} s')
    try:
        # the first guided request of the engine: the ranks' compile services started with their ranks (they started
        # with a first grammar, and a rank's step waited seconds for its service to start)
        outputs, gap, took = while_streaming(pipe, ['Leave a note as JSON.'], [gen_config(fmt, max_new_tokens=24)],
                                             tokens=4000)
        print(f'[tp=2 compile] the guided request took {took:.1f} s; the stream paused at most {gap:.2f} s')
        assert outputs[0].finish_reason in ('stop', 'length'), outputs[0]
        assert outputs[0].text.lstrip().startswith('{'), outputs[0].text
        if outputs[0].finish_reason == 'stop':
            check_valid(outputs[0].text, fmt)
        # the compile is slow enough that a step which compiled it, or waited for it, held it past the second after
        # which a rank logs it
        assert alone > 1.5, f'the grammar compiled in {alone:.1f} s: too fast to tell'
    finally:
        pipe.close()
    # the ranks' processes write to this test's output (the mp executor's ranks inherit it)
    out = capfd.readouterr()
    print(out.out, end='')  # (kept in the report of a failure)
    sys.stderr.write(out.err)
    held = [line for line in (out.out + out.err).splitlines() if 'inside the step' in line]
    # a compile inside the step holds it for a whole compile (at least `alone`); a rank whose own compile, started
    # with the engine's, ends a moment after it waits for that moment (three compiles on two cores: 1.2 s once)
    seconds = [float(re.search(r'inside the step, ([0-9.]+) s', line).group(1)) for line in held]
    assert all(s < alone / 2 for s in seconds), (alone, held)


def test_tp2_free_drafts_rank_that_does_not_sample_keeps_no_grammar(engines, tmp_path):
    """tp=2, ``deepseek_mtp`` (the draft model split over both ranks) drafting without the grammar's masks
    (``LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS=0``): greedy output equals guided decoding without speculation on one rank,
    sampled rows in the same batches follow their grammar, both ranks verify the same drafts, and the rank that does
    not sample never builds a matcher or a drafting window (asked with the cleanup of finished sessions switched
    off, so that whatever a rank built stays), while rank 0 holds one per guided request.

    In lmdeploy 0.14.0 the draft model of ``deepseek_mtp`` runs on rank 0 alone (only ``qwen3_5_mtp`` drafts on every
    rank there, and the CPU path has no such model): rank 1 is a ``BaseSpecModelAgent`` that takes its drafts from the
    broadcast, and the rank-1 check holds whatever the series does; the rest of the test still runs."""
    from lmdeploy import __version__ as lmdeploy_version
    target, draft = METHODS['deepseek_mtp']
    greedy = _configs()
    prompts = [prompt for _, prompt in CASES] * 2
    configs = greedy + [gen_config(c.response_format, sampling=True, seed=i, max_new_tokens=64)
                        for i, c in enumerate(greedy)]
    reference = generate(engines(target, spec=False), prompts[:len(greedy)], greedy)
    pipe = _pipeline(target, tp=2, method='deepseek_mtp', draft=draft,
                     env={ranks.DRAFT_LOG_ENV: str(tmp_path), 'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS': '0'})
    try:
        assert ranks.call_ranks(pipe, ranks.set_grammar_cleanup, False)[0]
        outputs = generate(pipe, prompts, configs)
        state = ranks.call_ranks(pipe, ranks.grammar_state)
        steps = _check_drafts_agree(tmp_path)  # while the engine is up, as above
    finally:
        pipe.close()
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids, (out.text, ref.text)
    for out, config in zip(outputs, configs):
        if out.finish_reason == 'stop':
            check_valid(out.text, config.response_format)
    assert len(state[0]['matchers']) == len(configs), state
    drafting_agent = 'BaseSpecModelAgent' if lmdeploy_version.startswith('0.14.') else 'SpecModelAgent'
    assert state[1]['spec_agent'] == drafting_agent, state
    assert state[1]['matchers'] == [] and state[1]['windows'] == 0, state
    print(f'\n[tp=2 free drafts] {steps} speculative steps, drafts identical on both ranks; rank state {state}')


def _collectives_rank(rank: int, port: int, results) -> None:
    """One of two gloo ranks: the CPU path's uneven gather and reduce-scatter against what NCCL would give."""
    from unittest import mock

    import torch
    import torch.distributed as dist
    from lmdeploy.pytorch import distributed
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=2)
    try:
        sizes = [3, 1]  # a 3-token prefill on dp rank 0 beside a 1-token dummy on dp rank 1
        gen = torch.Generator().manual_seed(0)
        tokens = [torch.randn(1, n, 8, generator=gen) for n in sizes]
        gathered, handle = ranks.gather_by_tp_sizes(tokens[rank], sizes, async_op=True)
        handle.wait()
        outs = [torch.randn(1, sum(sizes), 8, generator=gen) for _ in sizes]
        with mock.patch.object(distributed, 'get_dist_manager') as manager:
            manager.return_value.current_config.return_value.attn_tp = 1
            scattered = ranks.reduce_scatter_by_tp_sizes(outs[rank].clone(), rank, sizes, None)
        results.put((rank, torch.equal(gathered, torch.cat(tokens, -2)),
                     torch.allclose(scattered, (outs[0] + outs[1]).split(sizes, -2)[rank])))
    finally:
        dist.destroy_process_group()


def _broadcast_rank(rank: int, port: int, steps: int, results) -> None:
    """One of two gloo ranks, ``steps`` times each: lmdeploy's own broadcast of the sampled tokens
    (``broadcast_next_token`` of the speculative strategy); the same broadcasts waited for through the last one's
    ``get_future()``; the same broadcasts left unwaited before a blocking all-reduce on their group. Rank 1 reports
    per way the steps where a tensor had not arrived when the wait ended."""
    import torch
    import torch.distributed as dist
    from lmdeploy.pytorch.strategies.ar_spec.model_agent import ARSpecExtraInputs, ARSpecModelAgentStrategy

    from lmdeploy_guided_spec.cpu import activate
    activate()
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))
    dist.init_process_group('gloo', rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        ctx = type('DistContext', (), {'attn_tp_group': type('Group', (), {'gpu_group': group})})
        strategy = ARSpecModelAgentStrategy(num_spec_tokens=NUM_SPEC_TOKENS)

        def tensors(step):
            value = step if rank == 0 else -1
            return ARSpecExtraInputs(next_token_ids=torch.full((4,), value),
                                     last_token_indices=torch.full((4,), value),
                                     output_token_ids=torch.full((4, NUM_SPEC_TOKENS + 1), value),
                                     num_rejected_tokens=torch.full((4,), value))

        def broadcast_next_token(extra):
            with strategy.broadcast_next_token(extra.next_token_ids, extra, ctx):
                pass

        def future_of_the_last(extra):
            dist.broadcast(extra.next_token_ids, src=0, group=group, async_op=True)
            extra.broadcast(src=0, group=group, async_op=True).get_future().wait()

        def blocking_after(extra):
            dist.broadcast(extra.next_token_ids, src=0, group=group, async_op=True)
            extra.broadcast(src=0, group=group, async_op=True)
            dist.all_reduce(torch.zeros(1), group=group)

        stale = {}
        for way in (broadcast_next_token, future_of_the_last, blocking_after):
            stale[way.__name__] = []
            for step in range(steps):
                extra = tensors(step)
                way(extra)
                sent = (extra.next_token_ids, extra.last_token_indices, extra.output_token_ids,
                        extra.num_rejected_tokens)
                if any(bool((t != step).any()) for t in sent):
                    stale[way.__name__].append(step)
        results.put((rank, stale))
    finally:
        dist.destroy_process_group()


def _run_ranks(target, *args, timeout: float) -> list:
    """``target(rank, port, *args, results)`` in two spawned processes; what they put in ``results``, by rank order
    of arrival. Processes still running after ``timeout`` are killed and fail the test."""
    import multiprocessing
    ctx = multiprocessing.get_context('spawn')
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args, results)) for rank in range(2)]
    for proc in procs:
        proc.start()
    try:
        for proc in procs:
            proc.join(timeout)
        assert [proc.exitcode for proc in procs] == [0, 0]
        return [results.get(timeout=5) for _ in procs]
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()


def test_sampled_tokens_have_arrived_when_their_broadcast_is_waited():
    """lmdeploy broadcasts the sampled tokens of a speculative step as four asynchronous broadcasts and waits for
    the last one only, as NCCL orders them on one stream. Gloo runs asynchronous collectives on a pool of threads, so
    the CPU path orders them: a rank that does not sample reads this step's tokens, not the zeros it made (seen as a
    TP follower committing zeros to its grammar and drafting from them). The same holds when the last broadcast is
    waited for through its future, or when a blocking collective on the group follows."""
    stale = dict(_run_ranks(_broadcast_rank, 1000, timeout=240))
    counts = {(rank, way): len(steps) for rank, ways in stale.items() for way, steps in ways.items()}
    assert not any(counts.values()), f'steps (of 1,000) whose tokens had not arrived, by rank and way: {counts}'


def test_gloo_collectives_of_uneven_sizes():
    """lmdeploy's MLP under ``dp > 1`` gathers and reduce-scatters different token counts per rank, which gloo's
    own collectives reject; the CPU path's replacements give what NCCL's would."""
    assert sorted(_run_ranks(_collectives_rank, timeout=60)) == [(0, True, True), (1, True, True)]


def _settled_grammar_state(pipe, attempts: int = 3) -> dict[int, dict]:
    """Every rank's grammar state once finished sessions have been cleaned up.

    lmdeploy drops a finished session's grammar state in the next step (its id rides in the ``session_to_cleanup``
    of the next batch's sampling inputs), so a short unguided request follows the traffic; a few times, since the
    pipeline ends sessions asynchronously after their last output."""
    state = {}
    for _ in range(attempts):
        generate(pipe, ['Hi.'], [gen_config(None, max_new_tokens=2)])
        state = ranks.call_ranks(pipe, ranks.grammar_state)
        if not any(_held(s) for s in state.values()):
            break
    return state


def _held(state: dict) -> bool:
    return bool(state['matchers'] or state['windows'] or state['failures'] or state['fsm_sessions'])


def _traffic(n: int) -> tuple[list[str], list]:
    """``n`` requests cycling through json_schema (two schemas), regex, json_object and unguided, greedy and
    sampling."""
    kinds = [response_format('json_schema'), response_format('regex_schema'), None,
             response_format('json_schema', schema=ITEM), response_format('json_object'), None]
    prompts, configs = [], []
    for i in range(n):
        fmt = kinds[i % len(kinds)]
        prompts.append(f'Request {i}: answer briefly.')
        configs.append(gen_config(fmt, sampling=i % 4 == 1, seed=i, max_new_tokens=4))
    return prompts, configs


# eagle3 and deepseek_mtp (drafts of a model) leave and clean up the same state: deepseek_mtp stands for both here;
# eagle3 on tp=2 runs in test_tp2_guided_speculative_equals_tp1 and test_tp2_server_traffic
@pytest.mark.one_method({'0.18': ['grammar'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', ['deepseek_mtp', 'grammar'])
def test_tp2_no_grammar_state_left(cpu_path, method, tmp_path):
    """tp=2: after 200 guided and unguided requests, greedy and sampling, no rank process holds matchers, kept
    drafting windows, failures or FSM sessions for a finished session, every rank verified the same drafts, and no
    rank's grammar rejected a committed token on the way (with ``deepseek_mtp`` rank 1 drafts too, following rank
    0's sampled tokens). Requests whose logits cannot be sampled fail alone among them. The check sees a leak: with
    the cleanup switched off in the rank processes, a few more guided requests leave state behind."""
    target, draft = METHODS[method]
    start = time.perf_counter()
    # a batch of 64 keeps 200 requests short
    # masked drafts (whatever the caller's environment says): rank 1 then follows rank 0's grammar state
    pipe = _pipeline(target, tp=2, method=method, draft=draft, max_batch_size=64,
                     env={ranks.DRAFT_LOG_ENV: str(tmp_path), 'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS': '1'})
    print(f'\n[tp=2 leaks {method}] engine start-up {time.perf_counter() - start:.1f} s')
    try:
        prompts, configs = _traffic(200)
        start = time.perf_counter()
        outputs = generate(pipe, prompts, configs)
        print(f'[tp=2 leaks {method}] 200 requests in {time.perf_counter() - start:.1f} s')
        for out, config in zip(outputs, configs):
            assert out.finish_reason in ('stop', 'length'), out
            if config.response_format is not None and out.finish_reason == 'stop':
                check_valid(out.text, config.response_format)
        assert sum(config.response_format is not None for config in configs) >= 130
        # requests whose logits cannot be sampled (a NaN everywhere) fail alone on the sampling rank, beside
        # requests that finish, and leave no grammar state on either rank either
        nan = fill_logits(float('nan'))
        configs = [gen_config(YEAR, sampling=True, logits_processors=[nan]),
                   gen_config(None, sampling=True, max_new_tokens=8, logits_processors=[nan]),
                   gen_config(YEAR, sampling=True), gen_config(YEAR)]
        outputs = generate(pipe, prompts[:4], configs)
        for out in outputs[:2]:
            assert out.finish_reason == 'error' and UNSAMPLEABLE in out.text, outputs
        for out in outputs[2:]:
            assert out.finish_reason == 'stop', outputs
            check_valid(out.text, YEAR)
        state = _settled_grammar_state(pipe)
        assert sorted(state) == [0, 1], state
        assert state[0]['spec_agent'] == 'SpecModelAgent', state
        for rank, held in state.items():
            assert not _held(held), f'rank {rank} holds grammar state after every session finished: {held}'
        print(f'[tp=2 leaks {method}] after 200 requests: {state}')
        steps = _check_drafts_agree(tmp_path)
        print(f'[tp=2 leaks {method}] {steps} speculative steps, drafts identical on both ranks')

        # the same check sees a leak
        assert ranks.call_ranks(pipe, ranks.set_grammar_cleanup, False)[0]
        try:
            prompts, configs = _traffic(12)
            generate(pipe, prompts, configs)
            leaked = _settled_grammar_state(pipe, attempts=1)
        finally:
            ranks.call_ranks(pipe, ranks.set_grammar_cleanup, True)
        # a rank 1 that drafts beside rank 0 (lmdeploy 0.18.0) follows rank 0's grammar state, masked drafts
        # depending on it
        for rank in (0, 1) if state[1]['spec_agent'] == 'SpecModelAgent' else (0, ):
            assert len(leaked[rank]['matchers']) >= 6 and leaked[rank]['windows'] >= 6, leaked
        print(f'[tp=2 leaks {method}] with the cleanup off, 12 more requests leave: {leaked}')
    finally:
        pipe.close()


@pytest.mark.one_method({'0.18': ['eagle3'], '0.14': ['deepseek_mtp']})
@pytest.mark.parametrize('method', ['deepseek_mtp', 'eagle3'])
def test_tp2_server_traffic(cpu_path, method, tmp_path):
    """``lmdeploy serve api_server --tp 2`` with ``deepseek_mtp`` or ``eagle3`` (both ranks draft; rank 1 follows rank
    0's sampled tokens) and the openai client: concurrent greedy and sampling requests of every format, streaming and
    not, then clients that disconnect mid-stream beside requests that run to their end, then requests whose grammar
    meets a dead end or tokens that ignore_eos, min_new_tokens and the n-gram stop ban, beside a mixed round and
    requests whose patterns xgrammar compiles inexactly (each rank compiles their exact rules). The server stays up
    and answers ``/health``, guided output validates, both ranks verify the same drafts at every step and no rank's
    grammar rejects a committed token other than the dead ends' (those fail their own requests)."""
    log, drafts = tmp_path / 'server.log', tmp_path / 'drafts'
    drafts.mkdir()
    from lmdeploy_guided_spec.cpu import models
    target, draft = METHODS[method]
    args = ['--tp', '2', '--distributed-executor-backend', 'mp', '--speculative-algorithm', method,
            '--speculative-num-draft-tokens', str(NUM_SPEC_TOKENS)]
    if draft is not None:
        args += ['--speculative-draft-model', models.resolve(draft)]
    start = time.perf_counter()
    # the server's engine and rank processes inherit the draft log's directory
    with environ({ranks.DRAFT_LOG_ENV: str(drafts)}):
        proc, base = start_server(args, log, max_batch_size=16, model=target)
    print(f'\n[tp=2 server {method}] start-up {time.perf_counter() - start:.1f} s')
    try:
        start = time.perf_counter()
        traffic.check_round(asyncio.run(traffic.mixed_round(base, 0, 16)))
        finished = asyncio.run(traffic.disconnects(base, 6))
        assert len(finished) == 6
        traffic.check_round(finished)
        assert proc.poll() is None, log.read_text()[-4000:]
        assert traffic.health(base) == 200
        fmt, text, reason = asyncio.run(traffic.one(base, 'json_schema'))
        assert reason == 'stop'
        check_valid(text, fmt)
        print(f'[tp=2 server] 16 mixed requests, 6 dropped streams beside 6 whole ones: '
              f'{time.perf_counter() - start:.1f} s')

        def alive():
            assert proc.poll() is None, log.read_text()[-4000:]

        async def beside():
            # the dead ends and banned tokens run one after another while a mixed round and requests whose patterns
            # have exact rules (rank 1 compiles them itself: lmdeploy's compile, patched) share their batches
            return await asyncio.gather(asyncio.to_thread(traffic.dead_ends_and_banned_tokens, base, alive),
                                        asyncio.to_thread(traffic.patterned, base, alive, 6),
                                        traffic.mixed_round(base, 1, 8))

        start = time.perf_counter()
        dead_ends, ended, mixed = asyncio.run(beside())
        traffic.check_round(mixed)
        alive()
        assert traffic.health(base) == 200
        assert ended >= 3
        print(f'[tp=2 server] {dead_ends} dead ends and the banned-token requests beside 8 mixed ones and 6 '
              f'patterned ones: {time.perf_counter() - start:.1f} s')
        # a grammar whose masks grow slow after the probe: refused at its first mask over the limit, and the ranks,
        # which both time their masks, still draft alike
        took, status, answer, streamed = traffic.late_slow(base)
        traffic.check_late_slow_refused(status, answer, streamed)
        alive()
        print(f'[tp=2 server] a grammar whose masks grew slow refused, streamed and not: {took:.1f} s')
        # read while the server is up and idle: stopping it ends the rank processes wherever they are
        steps = _check_drafts_agree(drafts, failing=traffic.DEAD_END)
        print(f'[tp=2 server] {steps} speculative steps, drafts identical on both ranks')
    finally:
        stop_server(proc)


# the engine of dp rank 1, in a process of its own as lmdeploy's launcher runs it: each line on stdin asks it for one
# round of its own traffic (answered on stdout), and it closes when stdin closes
_RANK_1 = """
import json, sys
from lmdeploy_guided_spec import cpu
cpu.activate()
sys.path.insert(0, sys.argv[1])
import test_ranks
method, draft = (sys.argv[3] or None), (sys.argv[4] or None)
pipe = test_ranks._pipeline(sys.argv[2], tp=2, dp=2, dp_rank=1, method=method, draft=draft)
print('ready', flush=True)
for _ in sys.stdin:
    print('served ' + json.dumps(test_ranks.rank_1_traffic(pipe)), flush=True)
pipe.close()
"""

# dp rank 1's own traffic, other prompts and lengths than dp rank 0's, so the two ranks prefill, decode and finish at
# different steps: a greedy guided row, a sampled guided row, an unguided row, a regex, a short one
RANK_1_FORMATS = [response_format('json_schema', schema=ITEM), response_format('json_schema'), None,
                  response_format('regex_schema'), response_format('json_schema', schema=ITEM)]
RANK_1_PROMPTS = ['One order line, please.', 'A customer, please.', 'Name a river and its length.',
                  'Write an order code.', 'Another order line.']


def _rank_1_configs():
    return [gen_config(RANK_1_FORMATS[0], max_new_tokens=40), gen_config(RANK_1_FORMATS[1], sampling=True, seed=7),
            gen_config(None, max_new_tokens=24), gen_config(RANK_1_FORMATS[3], max_new_tokens=32),
            gen_config(RANK_1_FORMATS[4], max_new_tokens=9)]


def rank_1_traffic(pipe) -> dict:
    """One round on dp rank 1 (in its process): the batch of :data:`RANK_1_PROMPTS`, then the batch of banned tokens
    and dead ends. Returns the outputs, or the error that stopped the round."""
    import traceback
    try:
        outputs = generate(pipe, RANK_1_PROMPTS, _rank_1_configs())
        banned_tokens_and_dead_ends(pipe)
    except BaseException:  # noqa: BLE001 - reported to the test in the other process
        return {'error': traceback.format_exc()}
    return {'outputs': [[out.text, out.token_ids, out.finish_reason] for out in outputs]}


class DPEngines:
    """The two engines of ``tp=2, dp=2`` (attention data-parallel, MLP tensor-parallel over both ranks): dp rank 1
    in a child process, dp rank 0 here. Their ranks meet in one gloo process group at start-up, so both start
    together. ``env`` goes to both (their rank processes inherit it)."""

    def __init__(self, target: str, method: str | None, draft: str | None, env: dict | None = None):
        import queue
        import subprocess
        import sys
        import threading
        env = {**(env or {}), 'LMDEPLOY_DP_MASTER_ADDR': '127.0.0.1', 'LMDEPLOY_DP_MASTER_PORT': str(free_port())}
        with environ(env):
            # a session of its own, killed with its rank processes if this process gets SIGTERM before close()
            # (a stopped test run left it running for 44 minutes)
            self.rank_1 = subprocess.Popen([sys.executable, '-c', _RANK_1, os.path.dirname(__file__), target,
                                            method or '', draft or ''], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, start_new_session=True)
            kill_at_exit(self.rank_1)
            try:
                self.pipe = _pipeline(target, tp=2, dp=2, dp_rank=0, method=method, draft=draft)
            except BaseException:
                self._kill_rank_1()
                raise
        lines = []
        for line in self.rank_1.stdout:
            if line.strip() == 'ready':
                break
            lines.append(line)
        else:
            raise RuntimeError(f'the engine of dp rank 1 did not start: {"".join(lines)}')
        # keep its output flowing (a full pipe would block the process that writes it); its answers go to a queue
        self._served: queue.Queue = queue.Queue()

        def drain():
            for line in self.rank_1.stdout:
                if line.startswith('served '):
                    try:
                        answer = json.loads(line[len('served '):])
                    except ValueError:
                        answer = {'error': f'an answer of dp rank 1 that is not JSON: {line[:300]!r}'}
                    self._served.put(answer)
        self._drain = threading.Thread(target=drain, daemon=True)
        self._drain.start()

    def serve_on_rank_1(self) -> None:
        """Start one round of :func:`rank_1_traffic` on dp rank 1; :meth:`rank_1_served` waits for its outputs."""
        self.rank_1.stdin.write('serve\n')
        self.rank_1.stdin.flush()

    def rank_1_served(self, timeout: float = 300) -> list:
        answer = self._served.get(timeout=timeout)
        assert 'error' not in answer, answer['error']
        return [Output(text, ids, reason) for text, ids, reason in answer['outputs']]

    def close(self) -> None:
        """Close both engines together: a rank waits in a collective for its peer until the peer is gone."""
        import subprocess
        self.rank_1.stdin.close()
        try:
            self.pipe.close()
        finally:
            try:
                code = self.rank_1.wait(timeout=120)
            except subprocess.TimeoutExpired:
                # never leave an engine behind on a 2-core machine that runs the next tests
                self._kill_rank_1()
                code = 'killed after 120 s'
            forget_at_exit(self.rank_1)
        assert code == 0, f'dp rank 1 ended with {code}'

    def _kill_rank_1(self) -> None:
        """Kill dp rank 1 with its rank processes: it leads a process group of its own, and a kill of the leader
        alone leaves its rank processes running."""
        import signal
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.rank_1.pid, signal.SIGKILL)
        self.rank_1.wait()
        forget_at_exit(self.rank_1)


# a draft-model method and the draft-free one: each dp=2 start costs minutes on two cores, and deepseek_mtp and
# no speculation take the same paths through the dummy forwards as eagle3 (they passed when last run by hand)
@pytest.mark.one_method({'0.18': ['grammar'], '0.14': ['eagle3']})
@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_dp2_idle_rank_then_both_serve(engines, method, tmp_path):
    """dp rank 1 gets no request (its engine runs lmdeploy's dummy forwards) while dp rank 0 serves guided and
    unguided requests: everything finishes, guided output validates, and greedy output equals guided decoding
    without speculation on one rank. Then a batch of grammars that meet banned tokens or a dead end, sampled and
    greedy: the dead ends fail their own requests and the engines go on. Then both dp ranks serve at once, each its
    own mix (other prompts, lengths and dead ends on dp rank 1, so one rank prefills or idles while the other
    decodes, and their speculative steps meet in the same collectives): the same checks on both. The draft log shows
    dp rank 1 running dummy steps only in the first part, and speculative steps of its own in the last."""
    target, draft = METHODS.get(method, ('tiny-llama', None))
    formats = [response_format('json_schema'), None, response_format('regex_schema'),
               response_format('json_schema', schema=ITEM)]
    configs = [gen_config(f, max_new_tokens=48) for f in formats]
    prompts = ['Describe a person as JSON.', 'Hello!', 'Write an order code.', 'One order line, please.']
    one_rank = engines(target, spec=False)
    reference = generate(one_rank, prompts, configs)
    reference_1 = generate(one_rank, RANK_1_PROMPTS, _rank_1_configs())

    def check(outputs, references, formats, sampled=()):
        for i, (out, ref, fmt) in enumerate(zip(outputs, references, formats)):
            assert out.finish_reason in ('stop', 'length'), out
            if i not in sampled:
                assert out.token_ids == ref.token_ids, (out.text, ref.text)
            if fmt is not None and out.finish_reason == 'stop':
                check_valid(out.text, fmt)

    start = time.perf_counter()
    dp = DPEngines(target, method, draft, env={ranks.DRAFT_LOG_ENV: str(tmp_path)})
    print(f'\n[dp=2 {method}] engines start-up {time.perf_counter() - start:.1f} s')
    try:
        check(generate(dp.pipe, prompts, configs), reference, formats)
        # then rows whose grammar meets banned tokens or a dead end beside sampled ones, while dp rank 1 runs dummy
        # forwards in the same collectives: each dead end fails its own request, dp rank 0 goes on serving
        banned_tokens_and_dead_ends(dp.pipe)
        idle_steps = len(ranks.read_draft_logs(tmp_path).get(1, []))
        # then both ranks serve at once
        dp.serve_on_rank_1()
        check(generate(dp.pipe, prompts, configs), reference, formats)
        banned_tokens_and_dead_ends(dp.pipe)
        check(dp.rank_1_served(), reference_1, RANK_1_FORMATS, sampled=(1,))
    finally:
        dp.close()
    if method is not None:
        _check_dp_steps(tmp_path, idle_steps, f'dp=2 {method}')


def _check_dp_steps(directory, idle_steps: int, name: str) -> None:
    """The draft logs in ``directory`` of a ``dp=2`` run whose dp rank 1 idled for its first ``idle_steps`` records:
    dp rank 1 ran dummy steps only while idle, and each dp rank speculative steps of its own."""
    logs = ranks.read_draft_logs(directory)
    drafts = {r: [rec for rec in recs if rec['kind'] == 'draft'] for r, recs in logs.items()}
    idle = [rec for rec in logs[1][:idle_steps] if rec['kind'] == 'draft']
    assert idle and all(rec['dummy'] for rec in idle), 'dp rank 1 ran other than dummy steps while idle'
    for r in (0, 1):
        assert any(not rec['dummy'] for rec in drafts.get(r, [])), f'dp rank {r} ran no speculative step'
    print(f'[{name}] speculative (dummy) steps: ' + ', '.join(
        f'dp rank {r} {sum(not rec["dummy"] for rec in drafts[r])} ({sum(rec["dummy"] for rec in drafts[r])})'
        for r in (0, 1)))


def _machine_addresses() -> set[str]:
    """This machine's IPv4 addresses other than loopback ones (none where it has only those)."""
    addresses = set()
    with contextlib.suppress(OSError):
        addresses |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    with contextlib.suppress(OSError), socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(('192.0.2.1', 9))  # nothing is sent: the kernel picks the address of the default route
        addresses.add(s.getsockname()[0])
    return {a for a in addresses if not a.startswith('127.')}


def _consecutive_free_ports() -> int:
    """A free port whose successor is free too (one api_server per dp rank, on ``--server-port`` and the next)."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(('127.0.0.1', port + 1))
                return port
            except OSError:
                continue


@pytest.mark.one_method({'0.18': ['eagle3'], '0.14': ['grammar']})
@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_dp2_api_server(cpu_path, method, tmp_path):
    """``lmdeploy serve api_server --tp 2 --dp 2 --server-name 127.0.0.1`` starts one api_server per dp rank, on
    ``--server-port`` and the port after it, both on the address asked for (before 0053/0066 lmdeploy bound them to
    the machine's address: reachable from other machines and not on 127.0.0.1); the machine's other addresses refuse.
    Traffic through the openai client to dp rank 0 alone while dp rank 1 idles (lmdeploy's dummy forwards), then to
    both at once, with clients that disconnect mid-stream: guided output validates, both servers stay up, dp rank 1
    ran dummy steps only while idle and speculative steps of its own after."""
    log, drafts = tmp_path / 'server.log', tmp_path / 'drafts'
    drafts.mkdir()
    from lmdeploy_guided_spec.cpu import models
    target, draft = METHODS[method]
    args = ['--tp', '2', '--dp', '2', '--distributed-executor-backend', 'mp', '--speculative-algorithm', method,
            '--speculative-num-draft-tokens', str(NUM_SPEC_TOKENS)]
    if draft:
        args += ['--speculative-draft-model', models.resolve(draft)]
    port = _consecutive_free_ports()
    env = {ranks.DRAFT_LOG_ENV: str(drafts), 'LMDEPLOY_DP_MASTER_ADDR': '127.0.0.1',
           'LMDEPLOY_DP_MASTER_PORT': str(free_port())}
    start = time.perf_counter()
    with environ(env):
        proc, base = start_server(args, log, max_batch_size=8, model=target, port=port)
    try:
        base_1 = wait_for_server(proc, f'http://127.0.0.1:{port + 1}', log)
        print(f'\n[dp=2 server {method}] start-up {time.perf_counter() - start:.1f} s')
        for address in sorted(_machine_addresses()):
            for p in (port, port + 1):
                with socket.socket() as s, pytest.raises(ConnectionRefusedError):
                    s.settimeout(5)
                    s.connect((address, p))
        start = time.perf_counter()
        traffic.check_round(asyncio.run(traffic.mixed_round(base, 0, 8)))
        finished = asyncio.run(traffic.disconnects(base, 2))
        traffic.check_round(finished)
        idle_steps = len(ranks.read_draft_logs(drafts).get(1, []))

        async def both():
            return await asyncio.gather(traffic.mixed_round(base, 1, 8), traffic.mixed_round(base_1, 2, 8),
                                        traffic.disconnects(base_1, 2))
        round_0, round_1, finished = asyncio.run(both())
        for results in (round_0, round_1, finished):
            traffic.check_round(results)
        assert proc.poll() is None, log.read_text()[-4000:]
        assert traffic.health(base) == 200 and traffic.health(base_1) == 200
        print(f'[dp=2 server {method}] dp rank 0 alone, then both: {time.perf_counter() - start:.1f} s')
    finally:
        stop_server(proc)
    _check_dp_steps(drafts, idle_steps, f'dp=2 server {method}')
