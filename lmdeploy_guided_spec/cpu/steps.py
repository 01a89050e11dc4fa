"""What every target forward of lmdeploy's speculative agent did, recorded in the engine's own process.

:class:`StepRecorder` wraps ``SpecModelAgent.async_sampling_logits`` (the sampling after each target forward:
the first token at prefill, rejection sampling of a drafted window when decoding) and records, per request row,
the drafted tokens and the tokens the step committed. It observes; it changes nothing. It sees the engine only
when the engine runs in this process (``pipeline``); the api_server's engine runs in a child process.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ['RowStep', 'StepRecorder']


@dataclass
class RowStep:
    """One request row of one target forward."""
    session_id: int
    #: the drafted window (empty at prefill)
    drafts: list[int]
    #: the tokens this step committed: accepted drafts plus the bonus or corrected token
    output: list[int]

    @property
    def accepted(self) -> int:
        """How many drafted tokens the target accepted."""
        return max(0, len(self.output) - 1) if self.drafts else 0


@dataclass
class StepRecorder:
    """Record every step of ``SpecModelAgent`` while in the ``with`` block (optionally calling ``on_step``)."""
    on_step: Callable[[list[RowStep]], None] | None = None
    steps: list[list[RowStep]] = field(default_factory=list)

    def __post_init__(self):
        self._lock = threading.Lock()
        self._original = None

    def rows(self, session_id: int | None = None) -> list[RowStep]:
        """All recorded rows, of one session if given, in order."""
        with self._lock:
            return [r for step in self.steps for r in step if session_id is None or r.session_id == session_id]

    def __enter__(self) -> StepRecorder:
        from lmdeploy.pytorch.spec_decode.spec_agent import SpecModelAgent
        self._original = SpecModelAgent.async_sampling_logits
        original, recorder = self._original, self

        async def async_sampling_logits(agent, model_inputs, extra_inputs, sampling_inputs):
            drafts = extra_inputs.output_draft_token_ids if model_inputs.is_decoding else None
            drafts = None if drafts is None else drafts.tolist()
            out = await original(agent, model_inputs, extra_inputs, sampling_inputs)
            if not model_inputs.is_dummy and out.output_token_ids is not None:
                recorder._record(sampling_inputs, drafts, out.output_token_ids.tolist())
            return out

        SpecModelAgent.async_sampling_logits = async_sampling_logits
        return self

    def __exit__(self, *exc) -> None:
        from lmdeploy.pytorch.spec_decode.spec_agent import SpecModelAgent
        SpecModelAgent.async_sampling_logits = self._original

    def _record(self, sampling_inputs, drafts, outputs) -> None:
        ctx = sampling_inputs.session_ctx or [{} for _ in outputs]
        step = [RowStep(int(c.get('session_id', -1)), list(drafts[b]) if drafts else [], [t for t in row if t >= 0])
                for b, (c, row) in enumerate(zip(ctx, outputs))]
        with self._lock:
            self.steps.append(step)
        if self.on_step is not None:
            self.on_step(step)
