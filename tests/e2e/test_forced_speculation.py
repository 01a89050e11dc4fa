"""Methods ``grammar`` and ``fsm`` (no draft model) through ``pipeline`` and ``api_server`` on the CPU path.

Greedy output must equal lmdeploy's guided decoding without speculation (grammar), or not depend on the number of
draft tokens (fsm, which has no non-speculative counterpart in lmdeploy); every output must keep to its grammar or
FSM; the grammar forces part of the JSON, so steps commit more than one token. vLLM's FSM example, in the file
vLLM writes, runs through both with ``fsm_path``.
"""
import json
import os
import re
import signal
import subprocess

import openai
import pytest
from e2e_helpers import (
    ENGINE_KWARGS,
    PERSON,
    PROMPTS,
    STARTUP_S,
    check_valid,
    draft_free_pipeline,
    gen_config,
    generate,
    metric,
    model_agent,
    spawn_server,
    start_server,
    stop_server,
    stream,
)

from lmdeploy_guided_spec.fsm import Fsm

SINGLE = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}, 'whitespace': 'single'}
COMPACT_OBJECT = {'type': 'json_object', 'whitespace': 'compact'}
REGEX = {'type': 'regex_schema', 'regex_schema': r'(yes|no), because [a-z ]{1,20}\. Confidence: (low|high)'}


def _record_commits(pipe) -> list[int]:
    """Tokens committed per step for guided rows, recorded from the engine's grammar commits."""
    guided = model_agent(pipe).spec_agent.guided_spec
    counts: list[int] = []
    commit_async = guided.commit_async

    def recording(matchers, token_ids, **kwargs):
        rows = token_ids.tolist()
        for row in matchers:
            tokens = rows[row] if isinstance(rows[row], list) else [rows[row]]
            counts.append(sum(1 for t in tokens if t >= 0))
        return commit_async(matchers, token_ids, **kwargs)

    guided.commit_async = recording
    return counts


def _answer_fsm(tokenizer) -> dict:
    """'Answer:' then ' yes' and EOS, or ' no, because' + free text (wildcard) until '.' and EOS."""
    t = {p: tokenizer.encode(p, add_special_tokens=False) for p in ('Answer', ':', ' yes', ' no', ',', ' because', '.')}
    assert all(len(ids) == 1 for ids in t.values())
    t = {p: ids[0] for p, ids in t.items()}
    eos = tokenizer.eos_token_id
    graph = {0: {t['Answer']: 1}, 1: {t[':']: 2}, 2: {t[' yes']: 3, t[' no']: 4}, 3: {eos: 9}, 4: {t[',']: 5},
             5: {t[' because']: 6}, 6: {-1: 6, t['.']: 7}, 7: {eos: 9}, 9: {}}
    return {str(s): {str(tok): nxt for tok, nxt in edges.items()} for s, edges in graph.items()}


def _vllm_example(tokenizer) -> tuple[dict, set[str]]:
    """vLLM's FSM example as ``CustomFSM.graph`` (states 5 and 6, after EOS, are not in it), and its two texts."""
    hello, world, test, example = (tokenizer.encode(p, add_special_tokens=False)[0]
                                   for p in ('hello', ' world', ' test', ' example'))
    eos = tokenizer.eos_token_id
    graph = {0: {hello: 1}, 1: {world: 2}, 2: {test: 3, example: 4}, 3: {eos: 5}, 4: {eos: 6}}
    return graph, {'hello world test', 'hello world example'}


@pytest.fixture(scope='module')
def vllm_example(cpu_path, tmp_path_factory):
    """The path of vLLM's example FSM, written as ``CustomFSM.save`` writes it, and its two texts."""
    from lmdeploy_guided_spec import testing
    graph, texts = _vllm_example(testing.load_tokenizer('llama3'))
    path = tmp_path_factory.mktemp('fsm') / 'vllm_fsm.json'
    with open(path, 'w') as f:
        json.dump(graph, f)
    return path, texts


@pytest.fixture(scope='module')
def fsm_file(cpu_path, tmp_path_factory):
    from lmdeploy_guided_spec import testing
    path = tmp_path_factory.mktemp('fsm') / 'answer_fsm.json'
    path.write_text(json.dumps(_answer_fsm(testing.load_tokenizer('llama3'))))
    return path


@pytest.mark.parametrize('target', ['tiny-llama', 'tiny-deepseek-mtp'])
def test_grammar_pipeline_equals_non_speculative(engines, target):
    """Any target architecture (DeepSeek's config accepts no other speculative method than deepseek_mtp upstream),
    JSON with both whitespace options, a regex and an unguided request in one batch, batch and streaming."""
    formats = [SINGLE, COMPACT_OBJECT, REGEX, None]
    configs = [gen_config(f, max_new_tokens=64) for f in formats]
    reference = generate(engines(target, spec=False), PROMPTS[:4], configs)
    pipe = draft_free_pipeline(engines, target, 'grammar', 6)
    commits = _record_commits(pipe)
    outputs = generate(pipe, PROMPTS[:4], configs)
    streamed = stream(pipe, PROMPTS[:4], configs)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference]
    assert [o.token_ids for o in streamed] == [r.token_ids for r in reference]
    for out, fmt in zip(outputs[:3], formats[:3]):
        if out.finish_reason == 'stop':
            check_valid(out.text, fmt)
    assert json.loads(outputs[0].text) and ': ' in outputs[0].text, 'single spaces after colons'
    assert max(commits) > 2, 'forced drafts are accepted: some steps commit several tokens'


def test_fsm_pipeline_keeps_to_the_fsm(cpu_path, engines, fsm_file):
    """Requests without a response_format follow the FSM (greedy output does not depend on k); a request with one
    follows its grammar, exactly as without speculation."""
    from lmdeploy_guided_spec import testing
    tok = testing.load_tokenizer('llama3')
    fsm = Fsm.load(fsm_file, vocab_size=128256, stop_token_ids=[128001, 128008, 128009])
    configs = [gen_config(None, max_new_tokens=24), gen_config(SINGLE, max_new_tokens=64)]
    # sampling in a batch of its own: lmdeploy 0.14.0 reads per-request greedy flags from per-position rows in
    # rejection sampling, so batches that mix greedy and sampling requests are not exercised here
    sampled = gen_config(None, max_new_tokens=24, do_sample=True, temperature=1.0, top_k=40, random_seed=3)
    runs = {}
    for k in (2, 5):
        pipe = draft_free_pipeline(engines, 'tiny-llama', 'fsm', k, str(fsm_file))
        commits = _record_commits(pipe)
        runs[k] = (generate(pipe, PROMPTS[:2], configs) + generate(pipe, PROMPTS[2:3], [sampled]), commits)
    (two, _), (five, commits) = runs[2], runs[5]
    assert two[0].token_ids == five[0].token_ids and two[1].token_ids == five[1].token_ids
    for out in (five[0], five[2]):
        m = fsm.matcher()
        assert all(m.accept_token(t) for t in out.token_ids), out
        assert out.text.startswith('Answer:'), out.text
        if out.finish_reason == 'stop':
            # the response leaves out the EOS that ended it: the FSM must allow one here
            assert m.is_terminated() or any(m.fork().accept_token(eos) for eos in fsm.stop_token_ids), out
        else:
            assert out.finish_reason == 'length' and len(out.token_ids) == 24, out
    reference = generate(engines('tiny-llama', spec=False), PROMPTS[1:2], configs[1:2])
    assert five[1].token_ids == reference[0].token_ids
    assert max(commits) >= 2, "'Answer' ':' and the other single edges are drafted and accepted"
    assert tok.decode(five[0].token_ids[:2]) == 'Answer:'


def test_vllm_example_through_the_pipeline(cpu_path, engines, vllm_example):
    """vLLM's example: the FSM writes "hello world", the model picks " test" or " example", EOS ends it; greedy
    and sampling; "hello" and " world" are drafted and accepted."""
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec.cpu import models
    path, texts = vllm_example
    pipe = draft_free_pipeline(engines, 'tiny-llama', 'fsm', 3, str(path))
    commits = _record_commits(pipe)
    configs = [gen_config(None, max_new_tokens=10), gen_config(None, max_new_tokens=10, sampling=True, seed=1)]
    outputs = generate(pipe, ['Generate text:', PROMPTS[1]], configs) + stream(pipe, ['Generate text:'], configs[:1])
    for out in outputs:
        assert out.text in texts and out.finish_reason == 'stop' and len(out.token_ids) == 3, out
    assert max(commits) >= 2, "' world' is drafted and accepted, with the branch as the bonus token"
    with pytest.raises(ValueError, match='give the FSM file as fsm_path only'):
        pipeline(models.resolve('tiny-llama'), backend_config=PytorchEngineConfig(**ENGINE_KWARGS),
                 speculative_config=SpeculativeConfig(method='fsm', model=str(path), fsm_path=str(path),
                                                      num_speculative_tokens=3))


# -- api_server ----------------------------------------------------------------------------------------------------
def _chat(base: str, fmt, prompt='Describe a person as JSON.', max_tokens=64):
    client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=120, max_retries=0)
    kwargs = dict(model=client.models.list().data[0].id, messages=[{'role': 'user', 'content': prompt}],
                  max_tokens=max_tokens, temperature=0)
    if fmt is not None:
        kwargs['response_format'] = fmt
    choice = client.chat.completions.create(**kwargs).choices[0]
    return choice.message.content, choice.finish_reason


@pytest.mark.one_method({'0.18': ['fsm'], '0.14': ['grammar']})
@pytest.mark.parametrize('method', ['grammar', 'fsm'])
def test_api_server(cpu_path, vllm_example, tmp_path, method):
    """Requests with a response_format follow it; with method fsm (vLLM's example as --speculative-fsm-path) the
    others follow the FSM, through chat and completions."""
    path, texts = vllm_example
    args = ['--speculative-algorithm', method, '--speculative-num-draft-tokens', '4']
    if method == 'fsm':
        args += ['--speculative-fsm-path', str(path)]
    proc, base = start_server(args, tmp_path / 'server.log')
    try:
        text, reason = _chat(base, SINGLE)
        assert reason == 'stop', text
        check_valid(text, SINGLE)
        assert ': ' in text
        text, reason = _chat(base, COMPACT_OBJECT)
        assert reason == 'stop' and isinstance(json.loads(text), dict) and ': ' not in text, text
        # lmdeploy 0.18's entry check writes "unsupported response_format whitespace 'none'"
        with pytest.raises(openai.BadRequestError, match="unsupported (response_format )?whitespace 'none'") as err:
            _chat(base, {'type': 'json_object', 'whitespace': 'none'})
        assert err.value.param == 'response_format'
        text, reason = _chat(base, None, prompt='Will it rain tomorrow?', max_tokens=16)
        if method == 'fsm':
            assert text in texts and reason == 'stop', (text, reason)
            client = openai.OpenAI(base_url=f'{base}/v1', api_key='none', timeout=120, max_retries=0)
            choice = client.completions.create(model=client.models.list().data[0].id, prompt='Generate text:',
                                               max_tokens=10, temperature=0).choices[0]
            assert choice.text in texts and choice.finish_reason == 'stop', choice
        # the drafts the grammar forced are counted in lmdeploy's Prometheus metrics, next to drafted and accepted
        forced = metric(base, 'spec_decode_num_forced_tokens_total')
        drafted = metric(base, 'spec_decode_num_draft_tokens_total')
        assert 0 < forced <= drafted, (forced, drafted)
        assert proc.poll() is None
    finally:
        stop_server(proc)


# -- bad FSM files -------------------------------------------------------------------------------------------------
# found while the speculative config is built (the structure of the file) or while the engine builds the proposer
# (token ids against the model's vocabulary)
BAD_FSMS = {
    'negative next state': ({'0': {'5': 1}, '1': {'6': -7}}, 'state 1: next state -7 of token 6 is negative'),
    'bad token id': ({'0': {'999999': 0}}, r'state 0: token id 999999 is outside the vocabulary \[0, 128256\)'),
    'not an integer': ({'0': {'5': 'one'}}, "state 0: next state of token 5 'one' is not an integer"),
    'missing start state': ({'1': {'5': 1}}, 'there is no start state 0; generation starts there'),
}


def _write_bad_fsm(directory, kind: str):
    """The FSM file of ``BAD_FSMS[kind]`` in ``directory``, and the message its error must carry."""
    graph, message = BAD_FSMS[kind]
    path = directory / f"{kind.replace(' ', '_')}.json"
    path.write_text(json.dumps(graph))
    return path, message


@pytest.fixture(params=list(BAD_FSMS))
def bad_fsm(request, tmp_path):
    return _write_bad_fsm(tmp_path, request.param)


def test_pipeline_rejects_bad_fsm_files(cpu_path, engines, bad_fsm):
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from lmdeploy_guided_spec import FsmError
    from lmdeploy_guided_spec.cpu import models
    path, message = bad_fsm
    with pytest.raises(FsmError, match=f'FSM file {path}: {message}'):
        spec = SpeculativeConfig(method='fsm', model=str(path), num_speculative_tokens=3)
        pipeline(models.resolve('tiny-llama'), backend_config=PytorchEngineConfig(**ENGINE_KWARGS),
                 speculative_config=spec, log_level='ERROR')
    # the engines of the session still serve
    out = generate(engines('tiny-llama', spec=False), PROMPTS[:1], [gen_config(SINGLE, max_new_tokens=8)])
    assert len(out[0].token_ids) == 8


@pytest.mark.parametrize('kind', ['missing start state', 'bad token id'])
def test_api_server_refuses_to_start_with_a_bad_fsm_file(cpu_path, tmp_path, kind):
    """The server exits with an error that names the file and the fault instead of serving."""
    path, message = _write_bad_fsm(tmp_path, kind)
    log = tmp_path / 'server.log'
    proc, _ = spawn_server(['--speculative-algorithm', 'fsm', '--speculative-num-draft-tokens', '3',
                            '--speculative-fsm-path', str(path)], log)
    try:
        proc.wait(timeout=STARTUP_S)
    except subprocess.TimeoutExpired:
        stop_server(proc)
        pytest.fail(f'api_server still running with a bad FSM file:\n{log.read_text()[-4000:]}')
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # an engine process left behind, if any
        except ProcessLookupError:
            pass
    text = log.read_text()
    assert proc.returncode != 0, text[-4000:]
    assert re.search(f'FsmError: FSM file {path}: {message}', text), text[-4000:]
