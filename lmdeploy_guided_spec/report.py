"""What the engine tells a user: a startup line and per-request counts of speculative decoding.

* :func:`startup_message`: one line, logged once per engine at INFO, naming the series (this package's version and
  lmdeploy's), the speculative method and ``k``, and the grammar settings the core reads from the environment.
* :class:`SpecCounts`: per request, the drafted, grammar-forced and accepted draft tokens and the target forwards.
  The engine records every step (:meth:`SpecCounts.step`) and logs :meth:`SpecCounts.message` at DEBUG when the
  request finishes.

A *forced* draft is a token the grammar forces at that position (:mod:`lmdeploy_guided_spec.forced`): drafted
whatever the draft model chose, or, for the methods ``grammar`` and ``fsm``, drafted with no draft model at all.
"""
from __future__ import annotations

from dataclasses import dataclass

from .version import __version__

__all__ = ['SERIES', 'startup_message', 'grammar_settings', 'SpecCounts']

#: Name of the series in log lines.
SERIES = 'lmdeploy-guided-spec'


def grammar_settings(compile_timeout_s: float | None = None) -> dict[str, str]:
    """The grammar settings an engine runs with, as the core reads them (environment variables included).

    ``compile_timeout_s`` is the limit of the engine's compile service, or None where it has none (grammars then
    compile in the model agent, without a limit).
    """
    from .compile import (
        COMPILE_TIMEOUT_ENV,
        MASK_LIMIT_ENV,
        MATCHER_LIMIT_ENV,
        mask_limit_ms_from_env,
        matcher_limit_mb_from_env,
    )
    from .forced import DRAFT_MASKS_ENV, FORCED_DRAFTS_ENV, draft_masks_from_env, forced_drafts_from_env
    from .guess import GUESS_DRAFTS_ENV, guess_sources_from_env
    from .worker import SWITCH_INTERVAL_ENV, switch_interval_from_env
    if compile_timeout_s is None:
        compile_service = 'off (grammars compile in the model agent)'
    else:
        compile_service = f'a child process, limit {compile_timeout_s:g} s ({COMPILE_TIMEOUT_ENV})'
        for name, read, unit, what in ((MASK_LIMIT_ENV, mask_limit_ms_from_env, 'ms', 'token masks'),
                                       (MATCHER_LIMIT_ENV, matcher_limit_mb_from_env, 'MB', 'matchers')):
            try:
                value = read()
                limit = 'unlimited' if value == float('inf') else f'up to {value:g} {unit}'
            except ValueError as err:
                limit = f'invalid ({err})'
            compile_service += f', {what} {limit} ({name})'
    try:
        sources = guess_sources_from_env()
        guessed = ','.join(sources) or 'off'
    except ValueError as err:
        sources, guessed = (), f'invalid ({err})'
    try:
        seconds = switch_interval_from_env()
        switch = ("Python's" if seconds is None else f'{seconds * 1e3:g} ms') + f' ({SWITCH_INTERVAL_ENV})'
    except ValueError as err:
        switch = f'invalid ({err})'
    masked = draft_masks_from_env()
    if not forced_drafts_from_env():
        forced = f'off ({FORCED_DRAFTS_ENV}=0)'
    else:
        # forced drafts wait for the position's mask: off where the draft logits are not masked
        forced = 'on' if masked else f'off (with {DRAFT_MASKS_ENV}=0)'
    guessed += f' ({GUESS_DRAFTS_ENV})'
    if sources and forced != 'on':
        # a window's guesses take the place of its draft model's choice where forced drafts do
        guessed += '; none in draft-model windows, as forced drafts'
    return {
        'compile service': compile_service,
        'whitespace': "'any' unless a response_format says 'single' or 'compact'",
        'draft-model logits masked': 'on' if masked else f'off ({DRAFT_MASKS_ENV}=0; verification only)',
        'forced drafts in draft-model windows': forced,
        'guessed drafts': guessed,
        'switch interval': switch,
    }


def startup_message(lmdeploy_version: str, method: str | None = None, num_spec_tokens: int | None = None, *,
                    compile_timeout_s: float | None = None) -> str:
    """The engine's startup line: the series, the speculative method and ``k``, the grammar settings.

    ``method`` None: the engine runs without speculative decoding (the grammar still applies to requests with a
    ``response_format``).
    """
    if method:
        spec = f'speculative method {method!r}, k={num_spec_tokens}'
    else:
        spec = 'no speculative decoding'
    settings = '; '.join(f'{key}: {value}' for key, value in grammar_settings(compile_timeout_s).items())
    return f'{SERIES} {__version__} active on lmdeploy {lmdeploy_version}: {spec}; grammar: {settings}'


@dataclass
class SpecCounts:
    """Speculative decoding counts of one request.

    Attributes
    ----------
    forwards : int
        Target forwards that produced tokens for the request (its prefill, then one per verified window).
    drafted : int
        Draft tokens verified (``k`` per decoding forward).
    forced : int
        Of those, tokens the grammar forced.
    accepted : int
        Draft tokens the target accepted.
    tokens : int
        Tokens the forwards committed (accepted drafts plus one bonus or corrected token each, up to a stop).
    """
    forwards: int = 0
    drafted: int = 0
    forced: int = 0
    accepted: int = 0
    tokens: int = 0
    #: forced tokens of the window drafted in the last forward, verified in the next one
    pending_forced: int = 0

    def step(self, *, decoding: bool, num_spec_tokens: int, num_accepted: int, num_tokens: int,
             next_forced: int = 0) -> int:
        """Record one target forward of the request; returns the forced tokens among the drafts it verified.

        Parameters
        ----------
        decoding : bool
            The forward verified a drafted window (False: the prefill).
        num_spec_tokens : int
            ``k``, the drafts of a window.
        num_accepted : int
            Draft tokens the target accepted in this forward.
        num_tokens : int
            Tokens the forward committed for the request (accepted drafts and the bonus or corrected token, up to
            a stop).
        next_forced : int
            Forced tokens of the window drafted after this forward (verified by the next one).
        """
        forced = 0
        self.forwards += 1
        self.tokens += num_tokens
        if decoding:
            forced, self.pending_forced = self.pending_forced, 0
            self.drafted += num_spec_tokens
            self.forced += forced
            self.accepted += num_accepted
        self.pending_forced = int(next_forced)
        return forced

    @property
    def tokens_per_forward(self) -> float:
        return self.tokens / self.forwards if self.forwards else 0.0

    def message(self, session_id) -> str:
        """The DEBUG line logged when the request finishes."""
        return (f'session {session_id} speculative decoding: {self.drafted} drafted, {self.forced} forced by the '
                f'grammar, {self.accepted} accepted; {self.tokens} tokens in {self.forwards} target forwards '
                f'({self.tokens_per_forward:.2f} per forward)')
