"""Exceptions raised by lmdeploy-guided-spec."""

__all__ = ['GuidedSpecError', 'VocabMapError', 'FsmError', 'GrammarRejectedError', 'GrammarCompileError',
           'GrammarCompileTimeout', 'GrammarCompilerUnavailable', 'GuidedFieldError']


class GuidedSpecError(Exception):
    """Base class of every error this package raises."""


class VocabMapError(GuidedSpecError, ValueError):
    """A draft-to-target vocabulary map does not fit the vocabularies it is used with."""


class FsmError(GuidedSpecError, ValueError):
    """A token FSM file (speculative method ``fsm``) cannot be read or does not describe a usable FSM."""


class GrammarRejectedError(GuidedSpecError):
    """A request's grammar rejected a token committed to it, or allows no token at all: the request fails."""


class GrammarCompileError(GuidedSpecError, ValueError):
    """A grammar source (JSON schema, regex, EBNF) does not compile; the message carries xgrammar's."""


class GrammarCompileTimeout(GuidedSpecError, TimeoutError):
    """Compiling a grammar took longer than the limit; the compile was stopped."""


class GrammarCompilerUnavailable(GuidedSpecError, RuntimeError):
    """The grammar compile service is closed, or its compiler process died while compiling."""


class GuidedFieldError(GuidedSpecError, ValueError):
    """A vLLM / SGLang guided-decoding field of a request cannot be read as a ``response_format``.

    ``param`` names the request field, for an OpenAI-style error body.
    """

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param

