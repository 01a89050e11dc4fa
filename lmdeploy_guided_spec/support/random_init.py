"""Models of a realistic size with random weights, initialised by the engine on its own device: no weight files.

A Llama-3.1-8B-shaped target holds 16 GB of bf16 weights; writing them to disk and loading them back costs more
time than a lent GPU machine has. Here a checkpoint is a config, the tokenizer files and a ``model.safetensors``
that holds only the small tensors a model cannot do without (an Eagle3 draft's ``d2t`` and ``t2d``), and
:func:`install` makes lmdeploy fill every parameter of the models it builds in this process with random values on
their device before it loads that file: ``normal(0, std)``, norm weights 1. lmdeploy's pipeline runs its engine in
the calling process (one rank), so the benchmark process installs it before it builds the pipeline.

Weights are random: what such a model generates means nothing, and an MTP or Eagle3 draft's acceptance is that of
chance. Forced drafts (the ``grammar`` method, forced tokens in windows) are accepted whatever the weights.
"""
from __future__ import annotations

import functools
import threading
from pathlib import Path

import torch

from . import tiny_models

__all__ = ['llama31_8b_config', 'build_weightless_llama', 'build_weightless_eagle3', 'install', 'Filled']

#: the Eagle3 heads published for Llama-3.1-8B draft over a 32,000-token vocabulary
EAGLE3_DRAFT_VOCAB = 32000


def llama31_8b_config(**overrides) -> dict:
    """Config of a Llama-3.1-8B-shaped target with the Llama-3.2 test tokenizer (same vocabulary), bf16."""
    cfg = tiny_models.llama_target_config(hidden_size=4096, num_layers=32, dtype='bfloat16')
    cfg.update(intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
               max_position_embeddings=131072, tie_word_embeddings=False,
               rope_scaling=dict(rope_type='llama3', factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192))
    cfg.update(overrides)
    return cfg


def _write(out: Path, cfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    LlamaConfig(**cfg).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / 'model.safetensors'),
              metadata={'format': 'pt'})
    tiny_models._save_tokenizer('llama3', out)


def build_weightless_llama(root: Path | None = None, **config) -> Path:
    """A Llama target of ``config`` (default :func:`llama31_8b_config`) without weights: config, tokenizer and an
    empty ``model.safetensors``. Cached like the tiny models (``<root>/llama3-weightless-<hash>``)."""
    cfg = llama31_8b_config(**config)
    return tiny_models._cached(root, 'llama3-weightless', {'config': cfg, 'tokenizer': 'llama3'},
                               lambda out: _write(out, cfg, {}))


def build_weightless_eagle3(root: Path | None = None, *, draft_vocab_size: int = EAGLE3_DRAFT_VOCAB,
                            **target_config) -> Path:
    """An Eagle3 draft for :func:`build_weightless_llama` of the same ``target_config``: config, tokenizer and a
    ``model.safetensors`` with only ``d2t`` and ``t2d`` (the draft vocabulary: the lowest ids plus EOS)."""
    target = llama31_8b_config(**target_config)
    cfg = tiny_models.eagle3_draft_config(target, draft_vocab_size=draft_vocab_size)
    eos = target['eos_token_id']
    draft_ids = tiny_models.eagle3_draft_ids(cfg['vocab_size'], draft_vocab_size,
                                             eos if isinstance(eos, list) else [eos])
    t2d = torch.zeros(cfg['vocab_size'], dtype=torch.bool)
    t2d[draft_ids] = True
    tensors = {'d2t': draft_ids - torch.arange(draft_vocab_size), 't2d': t2d}
    return tiny_models._cached(root, 'llama3-eagle3-weightless', {'config': cfg, 'tokenizer': 'llama3'},
                               lambda out: _write(out, cfg, tensors))


class Filled:
    """What :func:`install` did: per model class, the parameters it filled and the tensors it then loaded."""

    def __init__(self):
        self.models: list[dict] = []
        self._lock = threading.Lock()
        #: (module, original load_model_weights) of every module :func:`install` patched
        self._patched: list[tuple] = []

    def uninstall(self) -> None:
        """Let lmdeploy load weights as before :func:`install` (for the models it builds from now on)."""
        for module, original in self._patched:
            module.load_model_weights = original
        self._patched.clear()

    def record(self, model: torch.nn.Module, filled: int) -> None:
        floating = sum(1 for p in model.parameters() if p.is_floating_point())
        with self._lock:
            self.models.append(dict(model=type(model).__name__, filled=filled, floating=floating))


def _fill_(model: torch.nn.Module, std: float, generator_seed: int) -> int:
    """Fill every floating-point parameter of ``model`` in place: norms with 1, the rest ``normal(0, std)``."""
    filled = 0
    gens: dict[torch.device, torch.Generator] = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.is_floating_point():
                continue
            module_name = name.rsplit('.', 1)[0].rsplit('.', 1)[-1]
            if 'norm' in module_name:  # input_layernorm, post_attention_layernorm, hidden_norm, norm
                param.fill_(1.0)
            else:
                gen = gens.get(param.device)
                if gen is None:
                    gen = gens[param.device] = torch.Generator(device=param.device).manual_seed(generator_seed)
                param.normal_(0.0, std, generator=gen)
            filled += 1
    return filled


def install(*, std: float = 0.02, seed: int = 0) -> Filled:
    """Make lmdeploy fill the parameters of every model it builds in this process (target and draft) with random
    values before it loads their checkpoint files (which then hold only what the model cannot do without).

    Wraps ``load_model_weights`` where lmdeploy's model agent and speculative proposers call it; call before the
    engine is built. Returns the record of what was filled; its ``uninstall()`` undoes this.
    """
    from lmdeploy.pytorch.engine.model_agent import agent
    from lmdeploy.pytorch.spec_decode.proposers import base
    from lmdeploy.pytorch.weight_loader import model_weight_loader

    original = model_weight_loader.load_model_weights
    record = Filled()

    @functools.wraps(original)
    def load_model_weights(model, checkpoint_path, *args, **kwargs):
        filled = _fill_(model, std, seed)
        record.record(model, filled)
        return original(model, checkpoint_path, *args, **kwargs)

    for module in (agent, base):
        if getattr(module, 'load_model_weights', None) is not None:
            record._patched.append((module, module.load_model_weights))
            module.load_model_weights = load_model_weights
    return record
