"""Tiny random-weight models for the GPU tests and the GPU benchmark, built from a config and cached on disk.

No model hub is reachable where these run, so the models are built here: a tiny Llama target with the Llama-3.2
test tokenizer, a matching Eagle3 draft in the checkpoint layout lmdeploy's ``Eagle3LlamaForCausalLM`` loads, and
a tiny DeepSeek-V3-style target (MLA attention, MoE) with one multi-token-prediction layer for ``deepseek_mtp``.
Weights are random: the models are correct inputs for correctness tests and timings of the machinery, and their
draft acceptance rates mean nothing.

Each model lands in ``<root>/<name>-<hash>/`` where the hash covers the builder version, the config and the seed;
the default root is ``~/.cache/lmdeploy_guided_spec/models`` (``LMDEPLOY_GUIDED_SPEC_MODELS`` overrides it). A
directory is complete once it holds ``.complete``; builds go to a temporary directory first, so an interrupted
build never leaves a directory that looks finished.

Every builder runs on a CPU with transformers and safetensors; nothing here imports lmdeploy.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ['BUILDER_VERSION', 'default_root', 'llama_target_config', 'eagle3_draft_config', 'deepseek_mtp_config',
           'build_llama_target', 'build_eagle3_draft', 'build_deepseek_mtp_target', 'eagle3_draft_ids',
           'eagle3_weight_names', 'deepseek_mtp_weight_names']

#: Bump when a builder writes different files for the same config; old cache entries are then left unused.
BUILDER_VERSION = 1
#: Vocabulary of the Llama-3.2 text models (the tokenizer has one token more, see ``testing.TOKENIZERS``).
LLAMA3_VOCAB = 128256
#: Vocabulary of DeepSeek-V3 (the deepseek test tokenizer fits in it).
DEEPSEEK_VOCAB = 129280
_COMPLETE = '.complete'


def default_root() -> Path:
    """Cache directory of the tiny models: ``$LMDEPLOY_GUIDED_SPEC_MODELS`` or
    ``~/.cache/lmdeploy_guided_spec/models``."""
    env = os.environ.get('LMDEPLOY_GUIDED_SPEC_MODELS')
    return Path(env) if env else Path.home() / '.cache' / 'lmdeploy_guided_spec' / 'models'


def _key(name: str, spec: dict) -> str:
    blob = json.dumps({'builder': BUILDER_VERSION, 'name': name, **spec}, sort_keys=True, default=str)
    return f'{name}-{hashlib.sha256(blob.encode()).hexdigest()[:12]}'


def _cached(root: Path | None, name: str, spec: dict, build: Callable[[Path], None]) -> Path:
    """Return ``<root>/<name>-<hash>``, building it through ``build(tmpdir)`` when it is not complete yet."""
    root = Path(root) if root is not None else default_root()
    out = root / _key(name, spec)
    if (out / _COMPLETE).is_file():
        return out
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f'.{out.name}-', dir=root))
    try:
        build(tmp)
        (tmp / 'tiny_model.json').write_text(json.dumps({'builder': BUILDER_VERSION, 'name': name, **spec},
                                                        indent=1, sort_keys=True, default=str) + '\n')
        (tmp / _COMPLETE).write_text('')
        if out.exists():
            # a concurrent or interrupted build left it behind; a complete one would have been returned above
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if (out / _COMPLETE).is_file():
            # another process finished the same build first
            return out
        raise
    return out


def _save_tokenizer(name: str, out: Path) -> None:
    from ..testing import load_tokenizer
    load_tokenizer(name).save_pretrained(str(out))


def _save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    from safetensors.torch import save_file
    # safetensors refuses tensors that share storage (tied weights); every entry gets its own
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(path), metadata={'format': 'pt'})


def _random_(tensors, std: float, generator: torch.Generator) -> None:
    for t in tensors:
        t.normal_(0.0, std, generator=generator)


# -- Llama target + Eagle3 draft -----------------------------------------------------------------------------------


def llama_target_config(*, hidden_size: int = 128, num_layers: int = 8, dtype: str = 'float16') -> dict:
    """Config of the tiny Llama target (Llama-3.2 vocabulary and special tokens).

    Eight layers because lmdeploy taps the Eagle3 auxiliary hidden states after layers ``(2, L // 2, L - 3)``,
    which must be three distinct layers.
    """
    heads = max(2, hidden_size // 32)
    return dict(architectures=['LlamaForCausalLM'], vocab_size=LLAMA3_VOCAB,
                hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=num_layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=hidden_size // heads,
                max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=500000.0, bos_token_id=128000,
                eos_token_id=[128001, 128008, 128009], tie_word_embeddings=True, torch_dtype=dtype)


def eagle3_draft_config(target: dict, *, draft_vocab_size: int = 16384) -> dict:
    """Config of an Eagle3 draft for ``target`` in the layout lmdeploy loads (one decoder layer whose attention
    reads ``[embedding, hidden]``, ``draft_vocab_size``, ``target_hidden_size``)."""
    cfg = dict(target)
    cfg.update(num_hidden_layers=1, draft_vocab_size=draft_vocab_size, target_hidden_size=target['hidden_size'],
               tie_word_embeddings=False)
    return cfg


def eagle3_draft_ids(vocab_size: int, draft_vocab_size: int, eos_token_ids: list[int]) -> torch.Tensor:
    """Target id of every draft id, ascending: the lowest ids plus the EOS tokens (so the draft can stop)."""
    ids = sorted(set(range(draft_vocab_size - len(eos_token_ids))) | set(eos_token_ids))
    if len(ids) != draft_vocab_size or ids[-1] >= vocab_size:
        raise ValueError(f'cannot map {draft_vocab_size} draft ids into a vocabulary of {vocab_size} with EOS ids '
                         f'{eos_token_ids}')
    return torch.tensor(ids, dtype=torch.long)


def eagle3_weight_names(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of an Eagle3 draft checkpoint and its shape (the names lmdeploy's
    ``Eagle3LlamaForCausalLM.load_weights`` maps; no ``embed_tokens``: the draft shares the target's)."""
    h, inter = cfg['hidden_size'], cfg['intermediate_size']
    hd, nq, nkv = cfg['head_dim'], cfg['num_attention_heads'], cfg['num_key_value_heads']
    return {
        'midlayer.self_attn.q_proj.weight': (nq * hd, 2 * h),
        'midlayer.self_attn.k_proj.weight': (nkv * hd, 2 * h),
        'midlayer.self_attn.v_proj.weight': (nkv * hd, 2 * h),
        'midlayer.self_attn.o_proj.weight': (h, nq * hd),
        'midlayer.mlp.gate_proj.weight': (inter, h),
        'midlayer.mlp.up_proj.weight': (inter, h),
        'midlayer.mlp.down_proj.weight': (h, inter),
        'midlayer.input_layernorm.weight': (h, ),
        'midlayer.hidden_norm.weight': (h, ),
        'midlayer.post_attention_layernorm.weight': (h, ),
        'fc.weight': (h, 3 * cfg['target_hidden_size']),
        'norm.weight': (h, ),
        'lm_head.weight': (cfg['draft_vocab_size'], h),
        'd2t': (cfg['draft_vocab_size'], ),
        't2d': (cfg['vocab_size'], ),
    }


def build_llama_target(root: Path | None = None, *, seed: int = 0, **config) -> Path:
    """Build (or find in the cache) the tiny Llama target with the Llama-3.2 tokenizer files.

    Parameters
    ----------
    root : Path, optional
        Cache directory (default :func:`default_root`).
    seed : int, default: 0
    **config
        Overrides for :func:`llama_target_config` (``hidden_size``, ``num_layers``, ``dtype``).

    Returns
    -------
    Path
        A directory ``AutoModelForCausalLM.from_pretrained`` and lmdeploy load.
    """
    cfg = llama_target_config(**config)

    def build(out: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(seed)
        hf_config = LlamaConfig(**cfg)
        model = LlamaForCausalLM(hf_config).to(getattr(torch, cfg['torch_dtype']))
        model.save_pretrained(str(out), safe_serialization=True)
        _save_tokenizer('llama3', out)

    return _cached(root, 'llama3-target', {'config': cfg, 'seed': seed, 'tokenizer': 'llama3'}, build)


def build_eagle3_draft(root: Path | None = None, *, seed: int = 0, draft_vocab_size: int = 16384,
                       **target_config) -> Path:
    """Build (or find) an Eagle3 draft for the tiny Llama target of the same ``target_config``.

    The checkpoint holds the tensors of :func:`eagle3_weight_names`: ``d2t`` is the offset ``target_id - draft_id``
    of every draft id (lmdeploy adds ``arange`` to it), ``t2d`` marks the target ids in the draft vocabulary.
    """
    target = llama_target_config(**target_config)
    cfg = eagle3_draft_config(target, draft_vocab_size=draft_vocab_size)

    def build(out: Path) -> None:
        from transformers import LlamaConfig
        gen = torch.Generator().manual_seed(seed)
        dtype = getattr(torch, cfg['torch_dtype'])
        state = {}
        for name, shape in eagle3_weight_names(cfg).items():
            if name.endswith('norm.weight'):
                state[name] = torch.ones(shape)
            elif name not in ('d2t', 't2d'):
                w = torch.empty(shape)
                _random_([w], 0.02, gen)
                state[name] = w
        state = {k: v.to(dtype) for k, v in state.items()}
        eos = target['eos_token_id']
        draft_ids = eagle3_draft_ids(cfg['vocab_size'], draft_vocab_size, eos if isinstance(eos, list) else [eos])
        state['d2t'] = draft_ids - torch.arange(draft_vocab_size)
        t2d = torch.zeros(cfg['vocab_size'], dtype=torch.bool)
        t2d[draft_ids] = True
        state['t2d'] = t2d
        _save_safetensors(state, out / 'model.safetensors')
        LlamaConfig(**cfg).save_pretrained(str(out))
        _save_tokenizer('llama3', out)

    return _cached(root, 'llama3-eagle3-draft', {'config': cfg, 'seed': seed, 'tokenizer': 'llama3'}, build)


# -- DeepSeek-V3-style target with an MTP layer --------------------------------------------------------------------


def deepseek_mtp_config(*, hidden_size: int = 128, num_layers: int = 2, dtype: str = 'float16') -> dict:
    """Config of the tiny DeepSeek-V3-style target: MLA attention, a dense first layer then MoE layers, and one
    next-token-prediction layer (``num_nextn_predict_layers``) stored as layer ``num_layers``.

    ``kv_lora_rank`` is a power of two and at least the rope dim, as the Triton paged kernel needs for MLA without
    FlashMLA (K of ``kv_lora_rank + qk_rope_head_dim`` dims, V the leading ``kv_lora_rank`` of them).
    """
    return dict(architectures=['DeepseekV3ForCausalLM'], vocab_size=DEEPSEEK_VOCAB,
                hidden_size=hidden_size, intermediate_size=2 * hidden_size, moe_intermediate_size=hidden_size // 2,
                num_hidden_layers=num_layers, num_nextn_predict_layers=1, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=hidden_size // 2, kv_lora_rank=hidden_size // 2,
                qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=4, n_shared_experts=1,
                num_experts_per_tok=2, n_group=1, topk_group=1, topk_method='noaux_tc', scoring_func='sigmoid',
                norm_topk_prob=True, routed_scaling_factor=2.5, first_k_dense_replace=1, moe_layer_freq=1,
                max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None,
                attention_bias=False, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False, torch_dtype=dtype)


def deepseek_mtp_weight_names(cfg: dict) -> list[str]:
    """Names of the MTP layer's own tensors (besides its decoder block) in a DeepSeek-V3 checkpoint."""
    p = f'model.layers.{cfg["num_hidden_layers"]}.'
    return [p + n for n in ('embed_tokens.weight', 'enorm.weight', 'hnorm.weight', 'eh_proj.weight',
                            'shared_head.norm.weight', 'shared_head.head.weight')]


def build_deepseek_mtp_target(root: Path | None = None, *, seed: int = 0, **config) -> Path:
    """Build (or find) the tiny DeepSeek-V3-style target whose checkpoint also holds its MTP layer.

    transformers builds ``num_layers + 1`` decoder layers, the last one becoming the MTP block
    (``model.layers.<num_layers>.*``, an MoE layer like DeepSeek-V3's); the MTP layer's embedding, norms,
    ``eh_proj`` and shared head are added next to it. The saved config says ``num_layers`` layers, so transformers
    loads the main model and ignores the MTP tensors, while lmdeploy's ``deepseek_mtp`` proposer loads exactly
    those. The speculative ``model`` is this same directory.
    """
    cfg = deepseek_mtp_config(**config)

    def build(out: Path) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
        torch.manual_seed(seed)
        num_layers, h = cfg['num_hidden_layers'], cfg['hidden_size']
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, 'num_hidden_layers': num_layers + 1}))
        dtype = getattr(torch, cfg['torch_dtype'])
        state = {k: v.to(dtype) for k, v in model.state_dict().items()}
        embed, enorm, hnorm, eh_proj, norm, head = deepseek_mtp_weight_names(cfg)
        state[embed] = state['model.embed_tokens.weight']
        state[enorm] = torch.ones(h, dtype=dtype)
        state[hnorm] = torch.ones(h, dtype=dtype)
        gen = torch.Generator().manual_seed(seed + 1)
        eh = torch.empty(h, 2 * h)
        _random_([eh], 0.02, gen)
        state[eh_proj] = eh.to(dtype)
        state[norm] = torch.ones(h, dtype=dtype)
        state[head] = state['lm_head.weight']
        _save_safetensors(state, out / 'model.safetensors')
        DeepseekV3Config(**cfg).save_pretrained(str(out))
        _save_tokenizer('deepseek', out)

    return _cached(root, 'deepseek-v3-mtp-target', {'config': cfg, 'seed': seed, 'tokenizer': 'deepseek'}, build)
