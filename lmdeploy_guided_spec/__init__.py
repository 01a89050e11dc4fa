"""Grammar-constrained output together with speculative decoding: the engine-agnostic core.

This package imports torch and xgrammar, never lmdeploy; the lmdeploy wiring lives in the patch series and
the command-line tooling in :mod:`lmdeploy_guided_spec.tools`.
"""
from .bitmask import ALL_ALLOWED, allocate_bitmask, apply_bitmask_, bitmask_words, pack_bool_mask, unpack_bitmask
from .errors import GuidedSpecError, VocabMapError
from .manager import SpecGrammarManager
from .step import DraftGrammar, commit, fill_bitmask, verification_bitmask
from .version import __version__
from .vocab_map import DraftVocabMap

__all__ = [
    'ALL_ALLOWED', 'allocate_bitmask', 'apply_bitmask_', 'bitmask_words', 'pack_bool_mask', 'unpack_bitmask',
    'GuidedSpecError', 'VocabMapError', 'SpecGrammarManager', 'DraftGrammar', 'commit',
    'fill_bitmask', 'verification_bitmask', 'DraftVocabMap', '__version__'
]
