"""Exceptions raised by lmdeploy-guided-spec."""

__all__ = ['GuidedSpecError', 'VocabMapError', 'FsmError']


class GuidedSpecError(Exception):
    """Base class of every error this package raises."""


class VocabMapError(GuidedSpecError, ValueError):
    """A draft-to-target vocabulary map does not fit the vocabularies it is used with."""


class FsmError(GuidedSpecError, ValueError):
    """A token FSM file (speculative method ``fsm``) cannot be read or does not describe a usable FSM."""
