"""Grammar-constrained output together with speculative decoding: the engine-agnostic core.

This package imports torch and xgrammar, never lmdeploy; the lmdeploy wiring lives in the patch series. Beside
the core: the series tooling (:mod:`lmdeploy_guided_spec.series`), the CPU path (:mod:`lmdeploy_guided_spec.cpu`),
test and demo support (:mod:`lmdeploy_guided_spec.support`) and the command line (:mod:`lmdeploy_guided_spec.cli`).
Names load on first use, so the command-line tool starts without importing torch.
"""
import importlib

from .version import __version__

_EXPORTS = {
    'ALL_ALLOWED': 'bitmask',
    'allocate_bitmask': 'bitmask',
    'apply_bitmask_': 'bitmask',
    'bitmask_words': 'bitmask',
    'keep_grammar_tokens_': 'bitmask',
    'pack_bool_mask': 'bitmask',
    'unpack_bitmask': 'bitmask',
    'GuidedSpecError': 'errors',
    'VocabMapError': 'errors',
    'FsmError': 'errors',
    'GrammarCompileError': 'errors',
    'GrammarCompileTimeout': 'errors',
    'GrammarCompileBusy': 'errors',
    'GrammarCompilerUnavailable': 'errors',
    'CheckAbandoned': 'errors',
    'GuidedFieldError': 'errors',
    'xgrammar_reason': 'errors',
    'response_format_from_fields': 'guided_fields',
    'unenforced_keywords': 'unenforced',
    'depth_error': 'depth',
    'GrammarCompileService': 'compile',
    'grammar_is_empty': 'compile',
    'SpecGrammarManager': 'manager',
    'SpecCounts': 'report',
    'startup_message': 'report',
    'DraftGrammar': 'draft',
    'GrammarWorker': 'worker',
    'commit': 'step',
    'fill_bitmask': 'step',
    'stop_only': 'step',
    'verification_bitmask': 'step',
    'DraftVocabMap': 'vocab_map',
    'ForcedTokenizer': 'forced',
    'forced_token': 'forced',
    'forced_drafts': 'forced',
    'Fsm': 'fsm',
    'FsmBuilder': 'fsm',
    'FsmMatcher': 'fsm',
    'FsmSessions': 'fsm',
}

__all__ = [*_EXPORTS, '__version__']


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
    value = getattr(importlib.import_module(f'.{module}', __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
