"""Exceptions raised by lmdeploy-guided-spec."""

__all__ = ['GuidedSpecError', 'VocabMapError']


class GuidedSpecError(Exception):
    """Base class of every error this package raises."""


class VocabMapError(GuidedSpecError, ValueError):
    """A draft-to-target vocabulary map does not fit the vocabularies it is used with."""


