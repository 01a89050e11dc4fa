"""Exceptions raised by lmdeploy-guided-spec, and the reason of an xgrammar error as a client should read it."""
import re

__all__ = ['GuidedSpecError', 'VocabMapError', 'FsmError', 'GrammarRejectedError', 'GrammarCompileError',
           'GrammarCompileTimeout', 'GrammarCompilerUnavailable', 'CheckAbandoned', 'GuidedFieldError',
           'xgrammar_reason']


class GuidedSpecError(Exception):
    """Base class of every error this package raises."""


class VocabMapError(GuidedSpecError, ValueError):
    """A draft-to-target vocabulary map does not fit the vocabularies it is used with."""


class FsmError(GuidedSpecError, ValueError):
    """A token FSM file (speculative method ``fsm``) cannot be read or does not describe a usable FSM."""


class GrammarRejectedError(GuidedSpecError):
    """A request's grammar rejected a token committed to it, or allows no token at all: the request fails."""


class GrammarCompileError(GuidedSpecError, ValueError):
    """A grammar source (JSON schema, regex, EBNF) does not compile; the message carries xgrammar's.

    ``reason`` is the cause alone, as a client should read it (xgrammar's message without its log prefix, for a
    source xgrammar refuses); the message also names the grammar.
    """

    def __init__(self, message: str, *, reason: str | None = None):
        super().__init__(message)
        self.reason = message if reason is None else reason


class GrammarCompileTimeout(GuidedSpecError, TimeoutError):
    """Compiling a grammar took longer than the limit; the compile was stopped."""


class GrammarCompileBusy(GrammarCompileTimeout):
    """A grammar that looks slow to parse was refused without being started: as many such grammars wait already
    (``LMDEPLOY_GUIDED_SPEC_SLOW_QUEUED``, 16 by default). Sent again later, it is served."""


class GrammarCompilerUnavailable(GuidedSpecError, RuntimeError):
    """The grammar compile service is closed, or its compiler process died while compiling."""


class CheckAbandoned(GuidedSpecError):
    """The request of an entry check went away before its answer (its client disconnected, its task was cancelled):
    the check stopped waiting, and a grammar nobody else waits for was dropped or stopped."""


class GuidedFieldError(GuidedSpecError, ValueError):
    """A vLLM / SGLang guided-decoding field of a request cannot be read as a ``response_format``.

    ``param`` names the request field, for an OpenAI-style error body.
    """

    def __init__(self, message: str, *, param: str):
        super().__init__(message)
        self.param = param


# the log prefix of xgrammar's C++ checks: "[10:31:08] /project/cpp/json_schema_converter.cc:4944: "
_XGRAMMAR_LOCATION = re.compile(r'^\[[^\]]*\]\s*\S+:\d+:\s*')


def xgrammar_reason(err: BaseException) -> str:
    """The first line of an xgrammar error without the time and source location of the C++ check that raised it
    (``Unsupported type "nonsense"``, ``Regex parsing error at position 4: Unclosed '['``); where it has no message
    (an integer bound of hundreds of digits), that it gave none, and the exception's type."""
    text = str(err).strip()
    if not text:
        return f'xgrammar failed without saying why ({type(err).__name__})'
    return _XGRAMMAR_LOCATION.sub('', text.splitlines()[0])
