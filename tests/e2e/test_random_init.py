"""Weightless checkpoints filled with random weights by the engine itself (lmdeploy_guided_spec.support.random_init),
through lmdeploy's pipeline with eagle3 on the CPU path, at a small shape of the Llama-3.1 layout.

The GPU benchmark builds Llama-3.1-8B-shaped models this way (16 GB of weights are never written to disk); here the
same code runs on the CPU: every floating-point parameter of the target and the draft is filled, the draft's
vocabulary map comes from its file, and guided speculative output follows its schema and equals decoding without
speculation (greedy).
"""
import json

import jsonschema
import pytest
import xgrammar as xgr
from e2e_helpers import ENGINE_KWARGS, PERSON, model_agent

from lmdeploy_guided_spec import testing
from lmdeploy_guided_spec.support import random_init

#: the Llama-3.1 layout (GQA, llama3 rope scaling, untied head) at a size the CPU runs
SMALL = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=8, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, torch_dtype='float16')


@pytest.fixture(scope='module')
def pipes(cpu_path):
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig
    target = random_init.build_weightless_llama(**SMALL)
    draft = random_init.build_weightless_eagle3(draft_vocab_size=4096, **SMALL)
    record = random_init.install(seed=3)
    made = {}
    try:
        made['spec'] = pipeline(str(target), backend_config=PytorchEngineConfig(**ENGINE_KWARGS),
                                speculative_config=SpeculativeConfig(method='eagle3', model=str(draft),
                                                                     num_speculative_tokens=3), log_level='ERROR')
        made['ref'] = pipeline(str(target), backend_config=PytorchEngineConfig(**ENGINE_KWARGS), log_level='ERROR')
        yield dict(record=record, draft=draft, **made)
    finally:
        for pipe in made.values():
            pipe.close()
        # later pipelines of this session load their weights again
        record.uninstall()


def test_every_parameter_is_filled_and_the_draft_map_is_loaded(pipes):
    import torch
    models = pipes['record'].models
    # target and draft of the speculative pipeline, then the target of the reference one
    assert len(models) == 3 and sum('Eagle3' in m['model'] for m in models) == 1, models
    for m in models:
        assert m['filled'] == m['floating'] > 0, m
    draft = model_agent(pipes['spec']).spec_agent.proposer.model.get_model()  # inside its graph runner
    from safetensors.torch import load_file
    d2t = load_file(str(pipes['draft'] / 'model.safetensors'))['d2t']
    loaded = draft.draft_id_to_target_id.detach().cpu()
    assert torch.equal(loaded, d2t + torch.arange(d2t.numel())), 'the draft vocabulary map was not loaded'
    stds = [float(p.detach().float().std()) for p in draft.parameters() if p.is_floating_point() and p.dim() == 2]
    assert stds and all(0.01 < std < 0.04 for std in stds), f'not filled with normal(0, 0.02): {stds}'


def test_guided_speculative_output_follows_the_schema_and_equals_greedy(pipes):
    from lmdeploy import GenerationConfig
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': PERSON}}
    prompts = [f'Request {i}: one person as JSON.' for i in range(4)]
    gen = GenerationConfig(max_new_tokens=64, do_sample=False, response_format=fmt)
    spec, ref = pipes['spec'](prompts, gen_config=gen), pipes['ref'](prompts, gen_config=gen)
    compiled = testing.grammar_compiler('llama3').compile_json_schema(json.dumps(PERSON))
    stop = set(random_init.llama31_8b_config()['eos_token_id'])
    for a, b in zip(spec, ref):
        assert a.token_ids and list(a.token_ids) == list(b.token_ids), (a.text, b.text)
        # finished or cut off, every token follows the grammar
        matcher = xgr.GrammarMatcher(compiled)
        for token in a.token_ids:
            if token in stop and matcher.is_completed():
                break
            assert matcher.accept_token(token), (token, a.text)
        if a.finish_reason == 'stop':
            assert matcher.is_completed(), a.text
            jsonschema.validate(json.loads(a.text), PERSON)
