"""Methods grammar and fsm (no draft model) and forced drafts in draft-model windows, through the patched agent."""
import argparse
import json

import jsonschema
import pytest

from lmdeploy_guided_spec import FsmError, SpecGrammarManager, allocate_bitmask, testing, unpack_bitmask
from lmdeploy_guided_spec.fsm import Fsm
from lmdeploy_guided_spec.support.harness import GenRequest, SpecHarness, run_non_speculative

from grammars import INSTANCES, SCHEMAS, new_matcher
from models import DraftOverMap, PrefixLM, draft_map

pytestmark = pytest.mark.engine

NAME = 'llama3'
V = 128256


def _tok():
    return testing.load_tokenizer(NAME)


def _json_schema(schema, whitespace=None):
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'test', 'schema': schema}}
    if whitespace:
        fmt['whitespace'] = whitespace
    return fmt


def _path(text):
    return _tok().encode(text, add_special_tokens=False) + [_tok().eos_token_id]


def _requests(formats, max_new_tokens=96, greedy=True):
    # top_k keeps lmdeploy's multinomial kernel short under the Triton interpreter
    return [GenRequest(i + 1, f, max_new_tokens, greedy=greedy, top_k=0 if greedy else 40, seed=100 + i)
            for i, f in enumerate(formats)]


def _steps(harness, session_id):
    """Target forwards that produced tokens for a session, and how many tokens they produced."""
    records = [r for r in harness.records if r.session_id == session_id]
    return len(records), sum(len(r.output) for r in records)


@pytest.mark.parametrize('k', [2, 6])
def test_grammar_method_equals_non_speculative(k):
    """Greedy: token for token what guided decoding without speculation gives; forced drafts save forwards; the
    unguided request of the batch decodes one token per step."""
    instance = INSTANCES['nested_order'][0]
    path = _path(json.dumps(instance))
    target = PrefixLM(V, path, bias=9.0, seed=1)
    formats = [_json_schema(SCHEMAS['nested_order'], 'single'), None, {'type': 'json_object'}]
    spec = _requests(formats, 80)
    h = SpecHarness(_tok(), V, target, None, method='grammar', num_spec_tokens=k)
    h.generate(spec)
    ref = _requests(formats, 80)
    run_non_speculative(_tok(), V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    assert spec[0].tokens == path
    jsonschema.validate(json.loads(_tok().decode(spec[0].tokens, skip_special_tokens=True)), SCHEMAS['nested_order'])
    forwards, tokens = _steps(h, 1)
    assert tokens / forwards > (1.8 if k == 6 else 1.5), 'property names, separators and the end are drafted'
    assert all(r.accepted_drafts == 0 for r in h.records if r.session_id == 2), 'filler drafts are rejected'
    assert h.guided_decoding_manager.processors.keys() <= {1, 3}


def test_grammar_method_default_whitespace_and_regex():
    """lmdeploy's default whitespace forces little in JSON, a regex forces its literals; both stay exact."""
    regex = r'(yes|no), because [a-z ]{1,20}\. Confidence: (low|medium|high)'
    path = _path('no, because it rains. Confidence: high')
    target = PrefixLM(V, path, bias=9.0, seed=3)
    formats = [{'type': 'regex_schema', 'regex_schema': regex}, _json_schema(SCHEMAS['person'])]
    spec, ref = _requests(formats, 40), _requests(formats, 40)
    h = SpecHarness(_tok(), V, target, None, method='grammar', num_spec_tokens=4)
    h.generate(spec)
    run_non_speculative(_tok(), V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    assert spec[0].tokens == path
    forwards, tokens = _steps(h, 1)
    assert tokens > forwards, "' Confidence:' and EOS are forced"


def test_grammar_method_random_sampling_stays_valid():
    path = _path(json.dumps(INSTANCES['enum_prefixes'][0]))
    target = PrefixLM(V, path, bias=6.0, seed=1, scale=2.0)
    fmt = _json_schema(SCHEMAS['enum_prefixes'], 'single')
    reqs = _requests([fmt, None], 20, greedy=False)
    h = SpecHarness(_tok(), V, target, None, method='grammar', num_spec_tokens=3)
    h.generate(reqs)
    compiled = testing.grammar_compiler(NAME).compile_json_schema(json.dumps(SCHEMAS['enum_prefixes']),
                                                                  any_whitespace=False)
    for r in reqs[:1]:
        m = new_matcher(compiled)
        assert all(m.accept_token(t) for t in r.tokens if t != _tok().eos_token_id), _tok().decode(r.tokens)
    assert any(r.accepted_drafts for r in h.records if r.guided)


def test_grammar_method_without_guided_requests(monkeypatch):
    """No draft model, no grammar work: every step decodes one token and matches non-speculative decoding."""
    def _boom(*args, **kwargs):
        raise AssertionError('grammar work in an unguided batch')

    for name in ('propose', 'next_token_bitmask', 'verification_bitmask', 'commit', 'apply_'):
        monkeypatch.setattr(SpecGrammarManager, name, _boom)
    target = PrefixLM(V, seed=4)
    spec, ref = _requests([None, None], 8), _requests([None, None], 8)
    h = SpecHarness(_tok(), V, target, None, method='grammar', num_spec_tokens=3)
    h.generate(spec)
    run_non_speculative(_tok(), V, target, ref)
    assert [r.tokens for r in spec] == [r.tokens for r in ref]
    assert h.target_forwards == 8
    # no weights, no cache, nothing to warm up or capture
    assert h.agent.get_model() is None and h.agent.cache_engine is None
    h.agent.build_graph_runner()
    h.agent.warmup(4, None)


# -- method fsm ----------------------------------------------------------------------------------------------------
def _answer_fsm():
    """'Answer:' then ' yes' and EOS, or ' no, because' + free text (wildcard) until '.' and EOS."""
    tok = _tok()
    t = {piece: tok.encode(piece, add_special_tokens=False) for piece in ('Answer', ':', ' yes', ' no', ',',
                                                                          ' because', '.')}
    assert all(len(ids) == 1 for ids in t.values())
    t = {piece: ids[0] for piece, ids in t.items()}
    eos = tok.eos_token_id
    graph = {
        0: {t['Answer']: 1},
        1: {t[':']: 2},
        2: {t[' yes']: 3, t[' no']: 4},
        3: {eos: 9},
        4: {t[',']: 5},
        5: {t[' because']: 6},
        6: {-1: 6, t['.']: 7},
        7: {eos: 9},
        9: {},
    }
    return {str(s): {str(tok_id): nxt for tok_id, nxt in edges.items()} for s, edges in graph.items()}


def _fsm_reference(target, fsm: Fsm, max_new_tokens: int) -> list[int]:
    """Greedy decoding constrained by the FSM, without speculation."""
    m, tokens = fsm.matcher(), []
    bitmask = allocate_bitmask(1, V)
    while len(tokens) < max_new_tokens:
        m.fill_next_token_bitmask(bitmask, 0)
        logits = target(tokens).masked_fill(~unpack_bitmask(bitmask, V)[0], float('-inf'))
        token = int(logits.argmax())
        tokens.append(token)
        assert m.accept_token(token)
        if token == _tok().eos_token_id:
            break
    return tokens


@pytest.mark.parametrize('answer', ['no, because it rains.', 'yes'])
def test_fsm_method_follows_the_fsm(tmp_path, answer):
    """Greedy output is FSM-constrained greedy decoding; deterministic edges are drafted and accepted; a request
    with a response_format in the same batch follows its grammar."""
    path_file = tmp_path / 'answer_fsm.json'
    path_file.write_text(json.dumps(_answer_fsm()))
    fsm = Fsm.load(path_file, vocab_size=V, stop_token_ids=[_tok().eos_token_id])
    path = _path('Answer: ' + answer)
    target = PrefixLM(V, path, bias=9.0, seed=5)
    formats = [None, _json_schema(SCHEMAS['person'], 'single')]
    spec = _requests(formats, 24)
    h = SpecHarness(_tok(), V, target, None, method='fsm', num_spec_tokens=4, fsm_path=str(path_file))
    h.generate(spec)
    assert spec[0].tokens == _fsm_reference(target, fsm, 24) == path
    ref = _requests(formats, 24)[1:]
    run_non_speculative(_tok(), V, target, ref)
    assert spec[1].tokens == ref[0].tokens, 'the response_format request follows its grammar'
    forwards, tokens = _steps(h, 1)
    # deterministic edges (':', then ',' and ' because' on the 'no' branch) are drafted and accepted
    assert tokens == len(path) and forwards <= len(path) - (3 if answer.startswith('no') else 1)
    h.generate([GenRequest(9, None, 1)])
    assert len(h.agent.fsm_sessions) == 1, 'finished sessions drop their FSM state'


def test_fsm_wildcard_lets_the_target_choose(tmp_path):
    """A random target inside the FSM: only its edges are ever emitted (the wildcard allows every token, EOS
    included)."""
    fsm_dict = _answer_fsm()
    fsm = Fsm.from_dict(fsm_dict, vocab_size=V, stop_token_ids=[_tok().eos_token_id])
    target = PrefixLM(V, seed=6)
    path_file = tmp_path / 'answer_fsm.json'
    path_file.write_text(json.dumps(fsm_dict))
    spec = _requests([None], 12)
    SpecHarness(_tok(), V, target, None, method='fsm', num_spec_tokens=3, fsm_path=str(path_file)).generate(spec)
    assert spec[0].tokens == _fsm_reference(target, fsm, 12)
    m = fsm.matcher()
    assert all(m.accept_token(t) for t in spec[0].tokens)


def test_fsm_free_text_ends_at_eos(tmp_path):
    """vLLM's "free text until the model stops": 'Answer' then the wildcard, whose state the graph leaves out after
    EOS. The wildcard allows EOS, so the request stops where the target writes it."""
    tok = _tok()
    answer = tok.encode('Answer', add_special_tokens=False)[0]
    path_file = tmp_path / 'free_fsm.json'
    with open(path_file, 'w') as f:
        json.dump({0: {answer: 1}, 1: {-1: 1}}, f)
    path = _path('Answer: it rains.')
    spec = _requests([None], 24)
    SpecHarness(tok, V, PrefixLM(V, path, bias=9.0, seed=5), None, method='fsm', num_spec_tokens=3,
                fsm_path=str(path_file)).generate(spec)
    assert spec[0].tokens == path, 'EOS through the wildcard ends the request'


@pytest.mark.parametrize('content,message', [
    ('{"0": {"10": -7}}', 'state 0: next state -7 of token 10 is negative'),
    ('{"3": {}}', 'there is no start state 0'),
    ('{"0": {"-4": 1}}', 'state 0: token id -4 is negative'),
    ('{"0": {"x": 0}}', "token id 'x' is not an integer"),
])
def test_bad_fsm_files_fail_when_configured(tmp_path, content, message):
    from lmdeploy.messages import SpeculativeConfig
    path = tmp_path / 'bad_fsm.json'
    path.write_text(content)
    with pytest.raises(FsmError, match='FSM file .*bad_fsm.json') as info:
        SpeculativeConfig(method='fsm', model=str(path), num_speculative_tokens=2)
    assert message in str(info.value)


def test_fsm_token_ids_are_checked_against_the_model_vocabulary(tmp_path):
    path = tmp_path / 'fsm.json'
    path.write_text(json.dumps({'0': {str(V): 1}, '1': {}}))
    from lmdeploy.messages import SpeculativeConfig
    SpeculativeConfig(method='fsm', model=str(path), num_speculative_tokens=2)  # structure only: fine
    with pytest.raises(FsmError, match=f'token id {V} is outside the vocabulary \\[0, {V}\\) of the model'):
        SpecHarness(_tok(), V, PrefixLM(V), None, method='fsm', num_spec_tokens=2, fsm_path=str(path))


# -- configuration -------------------------------------------------------------------------------------------------
def test_speculative_config_and_cli_accept_the_methods(tmp_path):
    from lmdeploy.cli.utils import ArgumentHelper
    from lmdeploy.messages import SpeculativeConfig
    SpeculativeConfig(method='grammar', num_speculative_tokens=8)
    with pytest.raises(ValueError, match='method grammar drafts without a draft model'):
        SpeculativeConfig(method='grammar', model='/models/draft', num_speculative_tokens=8)
    with pytest.raises(ValueError, match='num_speculative_tokens must be at least 1'):
        SpeculativeConfig(method='grammar', num_speculative_tokens=0)
    with pytest.raises(ValueError, match='takes the path of an FSM JSON file as fsm_path'):
        SpeculativeConfig(method='fsm', num_speculative_tokens=2)
    with pytest.raises(FsmError, match='does not exist'):
        SpeculativeConfig(method='fsm', fsm_path=str(tmp_path / 'missing.json'), num_speculative_tokens=2)
    parser = argparse.ArgumentParser()
    ArgumentHelper.add_spec_group(parser)
    for method in ('grammar', 'fsm'):
        args = parser.parse_args(['--speculative-algorithm', method, '--speculative-num-draft-tokens', '8'])
        assert args.speculative_algorithm == method


def test_fsm_path_is_the_fsm_option(tmp_path):
    """vLLM's ``fsm_path``, in SpeculativeConfig and as --speculative-fsm-path; ``model`` still names the file
    for compatibility, and the config carries no draft model either way."""
    from lmdeploy.cli.utils import ArgumentHelper, get_speculative_config
    from lmdeploy.messages import SpeculativeConfig
    path = tmp_path / 'fsm.json'
    path.write_text(json.dumps({'0': {'5': 1}}))
    config = SpeculativeConfig(method='fsm', fsm_path=str(path), num_speculative_tokens=3)
    assert config.fsm_path == str(path) and not config.model
    legacy = SpeculativeConfig(method='fsm', model=str(path), num_speculative_tokens=3)
    assert legacy.fsm_path == str(path) and not legacy.model, 'model is read as fsm_path'
    with pytest.raises(ValueError, match='give the FSM file as fsm_path only'):
        SpeculativeConfig(method='fsm', model=str(path), fsm_path=str(path), num_speculative_tokens=3)
    with pytest.raises(ValueError, match="fsm_path applies to speculative method fsm only, not 'eagle3'"):
        SpeculativeConfig(method='eagle3', model='/models/draft', fsm_path=str(path), num_speculative_tokens=3)
    bad = tmp_path / 'bad.json'
    bad.write_text('{"0": {"x": 1}}')
    with pytest.raises(FsmError, match=f"FSM file {bad}: state 0: token id 'x' is not an integer"):
        SpeculativeConfig(method='fsm', fsm_path=str(bad), num_speculative_tokens=3)
    parser = argparse.ArgumentParser()
    ArgumentHelper.add_spec_group(parser)
    args = parser.parse_args(['--speculative-algorithm', 'fsm', '--speculative-fsm-path', str(path),
                              '--speculative-num-draft-tokens', '4'])
    spec = get_speculative_config(args)
    assert (spec.method, spec.fsm_path, spec.model, spec.num_speculative_tokens) == ('fsm', str(path), '', 4)
    args = parser.parse_args(['--speculative-algorithm', 'fsm', '--speculative-draft-model', str(path)])
    assert get_speculative_config(args).fsm_path == str(path)


def test_fsm_path_reaches_the_proposer_without_a_draft_model(tmp_path):
    """The engine's SpecDecodeConfig keeps the target as its model (nothing to load) and the FSM as fsm_path."""
    from lmdeploy.pytorch.config import CacheConfig, SpecDecodeConfig
    from transformers import LlamaConfig
    LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, architectures=['LlamaForCausalLM']).save_pretrained(tmp_path)
    path = tmp_path / 'fsm.json'
    path.write_text(json.dumps({'0': {'5': 1}}))
    cache = CacheConfig(max_batches=4, block_size=64, num_cpu_blocks=0, num_gpu_blocks=0)
    spec = SpecDecodeConfig.from_config(method='fsm', num_speculative_tokens=4, model='', fsm_path=str(path),
                                        target_cache_cfg=cache, target_model=str(tmp_path))
    assert spec.fsm_path == str(path) and spec.model == str(tmp_path) and spec.cache_config is None


@pytest.mark.parametrize('family', ['llama', 'deepseek_v3'])
def test_draft_free_config_keeps_the_target(tmp_path, family, monkeypatch):
    """No draft model: the agent keeps the target's config and no cache; any target architecture works (DeepSeek's
    config builder accepts no speculative method but deepseek_mtp)."""
    from lmdeploy.pytorch.config import CacheConfig, ModelConfig, SpecDecodeConfig
    from lmdeploy.pytorch.configurations import deepseek_v2
    from transformers import DeepseekV3Config, LlamaConfig
    monkeypatch.setattr(deepseek_v2, 'flash_mla_available', lambda: False)  # it asks CUDA
    if family == 'llama':
        config = LlamaConfig(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=2, num_key_value_heads=1, architectures=['LlamaForCausalLM'])
    else:
        config = DeepseekV3Config(vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2, moe_intermediate_size=64,
                                  n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
                                  topk_group=1, first_k_dense_replace=1, q_lora_rank=32, kv_lora_rank=32,
                                  qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, rope_scaling=None,
                                  architectures=['DeepseekV3ForCausalLM'])
    config.save_pretrained(tmp_path)
    architecture = config.architectures[0]
    cache = CacheConfig(max_batches=4, block_size=64, num_cpu_blocks=0, num_gpu_blocks=0)
    spec = SpecDecodeConfig.from_config(method='grammar', num_speculative_tokens=4, model='',
                                        target_cache_cfg=cache, target_model=str(tmp_path))
    assert spec.cache_config is None
    assert spec.model_config.hf_config.architectures == [architecture]
    assert spec.model_config.vocab_size == 1024
    target = ModelConfig.from_pretrained(str(tmp_path), spec_method='grammar', num_spec_tokens=4)
    assert target.model_paradigm == 'ar_spec'
    assert target.hf_config.architectures == [architecture]


# -- whitespace ----------------------------------------------------------------------------------------------------
def test_whitespace_option_compiles_the_same_grammar_for_both_paths():
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    from lmdeploy.serve.openai.protocol import ResponseFormat
    manager = GuidedDecodingManager(_tok(), V)
    manager.processors = {}
    ctx = [{'session_id': i, 'seq_id': i} for i in range(3)]
    formats = (_json_schema(SCHEMAS['person'], 'single'), _json_schema(SCHEMAS['person'], 'compact'),
               _json_schema(SCHEMAS['person']))
    matchers = manager.get_processors(ctx, formats)
    for row, text in enumerate(['{"name": "A", "age": 1}', '{"name":"A","age":1}', '{ "name" :"A" ,"age":1}']):
        for other, m in matchers.items():
            fork = m.fork()
            ok = all(fork.accept_token(t) for t in _tok().encode(text, add_special_tokens=False))
            assert ok == (other == row or other == 2), (row, other)
    with pytest.raises(ValueError, match="unsupported response_format whitespace 'none'"):
        manager.get_processors(ctx[:1], ({**formats[0], 'whitespace': 'none'}, ))
    with pytest.raises(ValueError, match='whitespace applies to json_schema and json_object only'):
        manager.get_processors(ctx[:1], ({'type': 'regex_schema', 'regex_schema': 'a', 'whitespace': 'single'}, ))
    # checked where a request enters too, so a bad value fails that request, not the engine
    from lmdeploy.serve.utils.response_format import response_format_error
    assert response_format_error(formats[1]) is None
    assert 'unsupported whitespace' in response_format_error({'type': 'json_object', 'whitespace': 'none'})
    assert 'json_schema and json_object only' in response_format_error(
        {'type': 'regex_schema', 'regex_schema': 'a', 'whitespace': 'single'})
    dumped = ResponseFormat(type='json_object', whitespace='compact').model_dump()
    assert dumped['whitespace'] == 'compact'
    assert ResponseFormat(type='json_object').model_dump()['whitespace'] is None


# -- forced drafts in draft-model windows --------------------------------------------------------------------------
def test_forced_drafts_stand_in_for_a_draft_vocabulary_without_the_tokens():
    """Eagle3 with a draft vocabulary that lacks every token of the output: without forced drafts nothing is
    accepted; with them, the property names, separators and EOS are, and the output does not change."""
    path = _path(json.dumps(INSTANCES['person'][0]))
    target = PrefixLM(V, path, bias=9.0, seed=1)
    ids = draft_map(V, 64, seed=11)
    assert not set(path) & set(ids.tolist())
    fmt = _json_schema(SCHEMAS['person'], 'single')
    results = {}
    for forced in (False, True):
        h = SpecHarness(_tok(), V, target, DraftOverMap(PrefixLM(V, path, bias=9.0, seed=1), ids), method='eagle3',
                        num_spec_tokens=3, draft_id_to_target_id=ids)
        h.agent.guided_spec.forced_drafts = forced
        reqs = _requests([fmt])
        h.generate(reqs)
        results[forced] = (reqs[0].tokens, h.target_forwards, sum(r.accepted_drafts for r in h.records))
    assert results[False][0] == results[True][0] == path
    assert results[False][2] == 0 < results[True][2]
    assert results[True][1] < results[False][1]


def test_grammar_proposer_is_registered_without_weights():
    from lmdeploy.pytorch.spec_decode.proposers.base import SPEC_PROPOSERS
    for method in ('grammar', 'fsm'):
        assert SPEC_PROPOSERS.module_dict[method].draft_free
    assert not SPEC_PROPOSERS.module_dict['eagle3'].draft_free
