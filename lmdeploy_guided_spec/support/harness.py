"""Drive the patched lmdeploy speculative components on the CPU with scripted models.

The harness builds lmdeploy's own ``SpecModelAgent`` (through ``build_spec_agent``), its proposer
(``deepseek_mtp``, ``eagle3``, or ``grammar`` and ``fsm``, which have no draft model), ``GuidedDecodingManager``,
``RejectionSampler`` and ``FusedLogitsProcessor`` and runs whole generations through them. Only the neural
networks are replaced: the target and the draft are functions from a token prefix to logits, and the draft forward
hands the proposer hidden states its stub ``get_logits`` turns into those logits. lmdeploy's Triton kernels run
under ``TRITON_INTERPRET=1``, which must be set before lmdeploy is imported (:func:`enable_cpu_triton`).

This module imports lmdeploy; the core library does not.
"""
from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ['enable_cpu_triton', 'GenRequest', 'StepRecord', 'SpecHarness', 'run_non_speculative', 'PrefixModel',
           'count_preemptions']

#: A scripted model: token prefix (generated tokens so far) -> logits ``(vocab,)``.
PrefixModel = Callable[[Sequence[int]], torch.Tensor]


class _InterpreterDriver:
    """The Triton driver lmdeploy queries for its target while kernels run in the interpreter."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget
        return GPUTarget('cpu', 0, 32)


def enable_cpu_triton() -> None:
    """Run lmdeploy's Triton kernels with the interpreter on CPU tensors; call before importing lmdeploy.

    lmdeploy asks Triton's active driver for the current target when its kernel package is imported; with no GPU
    there is no active driver, so an interpreter driver that reports a CPU target stands in. This CPU shim is for
    tests and the check command only; it is not part of the patch series.
    """
    os.environ.setdefault('TRITON_INTERPRET', '1')
    import triton
    from triton.runtime import interpreter
    try:
        triton.runtime.driver.active.get_current_target()
    except RuntimeError:
        triton.runtime.driver.set_active(_InterpreterDriver())
    # Compiled launches accept a grid given as a list (lmdeploy passes some that way); the interpreter wants a tuple.
    executor = interpreter.GridExecutor
    if not getattr(executor, '_accepts_list_grid', False):
        init = executor.__init__

        def __init__(self, fn, arg_names, grid, *args, **kwargs):
            init(self, fn, arg_names, tuple(grid) if isinstance(grid, list) else grid, *args, **kwargs)

        executor.__init__ = __init__
        executor._accepts_list_grid = True


@dataclass
class GenRequest:
    """One generation request of a harness run."""
    session_id: int
    response_format: dict | None = None
    max_new_tokens: int = 64
    temperature: float = 1.0
    greedy: bool = True
    top_k: int = 0
    seed: int = 0
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class StepRecord:
    """What one target forward did for one request."""
    session_id: int
    drafts: list[int]
    output: list[int]
    accepted_drafts: int
    guided: bool


def _sampling_inputs(requests: Sequence[GenRequest], eos_token_id: int):
    from lmdeploy.pytorch.engine.logits_process import SamplingInputs
    batch = len(requests)
    greedy = all(r.greedy for r in requests)
    top_k = [1 if r.greedy else r.top_k for r in requests]
    max_top_k = 0 if 0 in top_k else max(top_k)
    return SamplingInputs(
        temperature=torch.tensor([r.temperature for r in requests], dtype=torch.float32),
        stop_words=torch.full((batch, 1), eos_token_id, dtype=torch.long),
        stop_mask=torch.ones(batch, 1, dtype=torch.bool),
        top_k=None if greedy else torch.tensor(top_k),
        random_seeds=torch.tensor([r.seed for r in requests], dtype=torch.long),
        random_offsets=torch.tensor([len(r.tokens) for r in requests], dtype=torch.long),
        max_top_k=1 if greedy else max_top_k,
        response_formats=tuple(r.response_format for r in requests),
        logits_processors=[None] * batch,
        max_num_logprobs=-1,
        num_ignore_eos=torch.zeros(batch, dtype=torch.long),
        batch_size=batch,
        session_ctx=[{'session_id': r.session_id, 'seq_id': r.session_id} for r in requests],
        session_to_cleanup=[],
    )


def _model_inputs(batch: int, seq_len: int, is_decoding: bool):
    from lmdeploy.pytorch.model_inputs import ModelInputs
    return ModelInputs(
        input_ids=torch.zeros(1, batch * seq_len, dtype=torch.long),
        seq_length=torch.full((batch, ), seq_len, dtype=torch.long),
        history_lengths=torch.zeros(batch, dtype=torch.long),
        block_offsets=torch.zeros(batch, 1, dtype=torch.long),
        is_decoding=is_decoding,
        num_ignored_history=torch.zeros(batch, dtype=torch.long),
        max_q_seqlen=seq_len,
        max_kv_seqlen=seq_len,
        sum_kv_seqlen=batch * seq_len,
    )


def _finish(req: GenRequest, tokens: Sequence[int], eos_token_id: int) -> None:
    """Append tokens the way lmdeploy's stopping criteria cut them: at EOS and at max_new_tokens."""
    for token in tokens:
        if token < 0:
            break
        req.tokens.append(int(token))
        if token == eos_token_id:
            req.finish_reason = 'stop'
            return
        if len(req.tokens) >= req.max_new_tokens:
            req.finish_reason = 'length'
            return


class _StubDraftModel(torch.nn.Module):
    """Stands in for the draft network: ``get_logits`` returns the scripted draft's logits per batch row."""

    def __init__(self, harness: SpecHarness):
        super().__init__()
        self._harness = harness

    def get_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._harness._draft_logits().unsqueeze(0)


class SpecHarness:
    """Run generations through the patched ``SpecModelAgent`` on the CPU.

    Parameters
    ----------
    tokenizer : PreTrainedTokenizerBase
        A real tokenizer; lmdeploy's ``GuidedDecodingManager`` compiles grammars for it.
    vocab_size : int
        The target model's padded vocabulary size.
    target, draft : PrefixModel
        Scripted target and draft. For ``eagle3`` the draft returns logits over the draft vocabulary; ``grammar``
        and ``fsm`` take no draft (None).
    method : str, default: 'deepseek_mtp'
        The proposer: ``deepseek_mtp``, ``eagle``, ``qwen3_5_mtp`` (same ``get_outputs``), ``eagle3``, or the
        draft-free ``grammar`` and ``fsm``.
    num_spec_tokens : int, default: 3
    draft_id_to_target_id : LongTensor, optional
        Absolute target id of every draft id (``eagle3`` only).
    spec_model : str, default: 'scripted'
        The speculative model path of the config.
    fsm_path : str, optional
        The FSM file of method ``fsm``.
    on_step : callable, optional
        Called with every :class:`StepRecord` (progress output of the check command).
    """

    def __init__(self, tokenizer, vocab_size: int, target: PrefixModel, draft: PrefixModel | None, *,
                 method: str = 'deepseek_mtp', num_spec_tokens: int = 3,
                 draft_id_to_target_id: torch.Tensor | None = None, spec_model: str = 'scripted',
                 fsm_path: str | None = None, on_step: Callable[[StepRecord], None] | None = None):
        from lmdeploy.pytorch.config import BackendConfig, MiscConfig, ModelConfig, SpecDecodeConfig
        from lmdeploy.pytorch.distributed import DistContext
        from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
        from lmdeploy.pytorch.spec_decode import build_spec_agent
        from lmdeploy.pytorch.strategies import build_strategy_factory
        from transformers import LlamaConfig

        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_id = tokenizer.eos_token_id
        self.target, self.draft = target, draft
        self.num_spec_tokens = num_spec_tokens
        self.on_step = on_step
        self.records: list[StepRecord] = []
        self.target_forwards = 0

        hf_config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, architectures=['LlamaForCausalLM'],
                                bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
        model_config = ModelConfig.from_hf_config(hf_config, model_path='scripted')
        spec_config = SpecDecodeConfig(model=spec_model, method=method, num_speculative_tokens=num_spec_tokens,
                                       model_config=model_config, fsm_path=fsm_path)
        misc_config = MiscConfig()
        factory = build_strategy_factory(model_config, misc_config, specdecode_config=spec_config)
        self.guided_decoding_manager = GuidedDecodingManager(tokenizer, vocab_size)
        # GuidedDecodingManager keeps its matchers in a class attribute; give this harness its own.
        self.guided_decoding_manager.processors = {}
        self.agent = build_spec_agent(spec_config, BackendConfig(), DistContext.build(),
                                      factory.build_model_inputs_strategy(), factory.build_model_agent_strategy(),
                                      misc_config, device='cpu', guided_decoding_manager=self.guided_decoding_manager)
        self.draft_free = self.agent.proposer.draft_free
        if not self.draft_free:
            self.agent.proposer.model = _StubDraftModel(self)
        if method == 'eagle3':
            if draft_id_to_target_id is None:
                raise ValueError('method eagle3 needs draft_id_to_target_id')
            self.agent.proposer.draft_id_to_target_id = draft_id_to_target_id
        self.agent._forward_impl = self._draft_forward
        self._batch: list[GenRequest] = []
        self._window: list[list[int]] = []
        self._window_open = False
        self._to_cleanup: list[int] = []

    # -- the stubbed draft network -----------------------------------------------------------------------------
    def _draft_forward(self, inputs) -> dict:
        batch = len(self._batch)
        if self._window_open:
            # every forward after the first one of a window consumes the previous draft tokens
            for row, token in enumerate(inputs.input_ids.flatten()[:batch].tolist()):
                self._window[row].append(token)
        self._window_open = True
        hidden = torch.zeros(1, inputs.input_ids.numel(), 8)
        return {'hidden_states': hidden, 'hidden_states_prenorm': hidden, 'model_metas': None}

    def _draft_logits(self) -> torch.Tensor:
        return torch.stack([self.draft(req.tokens + drafts) for req, drafts in zip(self._batch, self._window)])

    # -- one engine step ---------------------------------------------------------------------------------------
    async def _propose(self, sampling_inputs) -> torch.Tensor:
        from lmdeploy.pytorch.strategies.ar_spec.model_agent import ARSpecExtraInputs
        batch = len(self._batch)
        self._window = [[] for _ in range(batch)]
        self._window_open = False
        extra = ARSpecExtraInputs(last_token_indices=torch.arange(batch),
                                  num_rejected_tokens=torch.zeros(batch, dtype=torch.long))
        # without a draft model the agent's own entry point drafts (no draft inputs to prepare)
        forward = self.agent.async_model_forward if self.draft_free else self.agent._async_model_forward
        out = await forward(_model_inputs(batch, 1, True), extra, sampling_inputs)
        return out.output_draft_token_ids

    async def _verify(self, drafts: torch.Tensor | None, sampling_inputs):
        from lmdeploy.pytorch.strategies.ar_spec.model_agent import ARSpecExtraInputs
        batch = len(self._batch)
        if drafts is None:
            logits = torch.stack([self.target(r.tokens) for r in self._batch])
            inputs = _model_inputs(batch, 1, False)
        else:
            rows = drafts.tolist()
            logits = torch.stack([
                self.target(r.tokens + rows[b][:i]) for b, r in enumerate(self._batch)
                for i in range(self.num_spec_tokens + 1)
            ])
            inputs = _model_inputs(batch, self.num_spec_tokens + 1, True)
        self.target_forwards += 1
        extra = ARSpecExtraInputs(target_logits=logits, output_draft_token_ids=drafts)
        out = await self.agent.async_sampling_logits(inputs, extra, sampling_inputs)
        return out.output_token_ids

    async def _generate(self, requests: list[GenRequest]) -> list[GenRequest]:
        pending = list(requests)
        finished_sessions, self._to_cleanup = self._to_cleanup, []
        drafts = None
        self._batch = pending
        while pending:
            sampling_inputs = _sampling_inputs(pending, self.eos_token_id)
            sampling_inputs.session_to_cleanup = finished_sessions
            output = await self._verify(drafts, sampling_inputs)
            output_rows = output.tolist()
            for b, req in enumerate(pending):
                guided = req.response_format is not None
                window = [] if drafts is None else drafts[b].tolist()
                kept = [t for t in output_rows[b] if t >= 0]
                if self.eos_token_id in kept:
                    kept = kept[:kept.index(self.eos_token_id) + 1]
                record = StepRecord(req.session_id, window, kept, max(0, len(kept) - 1) if window else 0, guided)
                self.records.append(record)
                if self.on_step is not None:
                    self.on_step(record)
                _finish(req, kept, self.eos_token_id)
            done = [r for r in pending if r.finish_reason is not None]
            finished_sessions = [r.session_id for r in done]
            if done:
                keep = [b for b, r in enumerate(pending) if r.finish_reason is None]
                pending = [pending[b] for b in keep]
                self._batch = pending
                if not pending:
                    break
            # the proposer drafts for the requests still running, after the tokens just committed
            drafts = await self._propose(_sampling_inputs(pending, self.eos_token_id))
        # the engine hands finished sessions to the next step's sampling inputs; so does the next generate()
        self._to_cleanup = finished_sessions
        return requests

    def generate(self, requests: list[GenRequest]) -> list[GenRequest]:
        """Generate every request in one batch until each hits EOS or its token budget."""
        return asyncio.run(self._generate(requests))


def run_non_speculative(tokenizer, vocab_size: int, target: PrefixModel, requests: list[GenRequest]) -> None:
    """Reference: lmdeploy's own guided non-speculative sampling (``FusedLogitsProcessor`` with the manager)."""
    from lmdeploy.pytorch.engine.guided_process import GuidedDecodingManager
    from lmdeploy.pytorch.engine.logits_process import FusedLogitsProcessor

    manager = GuidedDecodingManager(tokenizer, vocab_size)
    manager.processors = {}

    async def _no_stream():
        # the only CUDA call on this path waits for the compute stream; CPU tensors need no wait
        return None

    async def _run():
        pending = list(requests)
        while pending:
            sampling_inputs = _sampling_inputs(pending, tokenizer.eos_token_id)
            processor = FusedLogitsProcessor(sampling_inputs, guided_decoding_manager=manager)
            processor._wait_stream_once = _no_stream
            logits = torch.stack([target(r.tokens) for r in pending])
            scores, _ = await processor(logits)
            next_ids = processor.sampling(scores)
            await processor.accept_guided_tokens(next_ids)
            for req, token in zip(pending, next_ids.tolist()):
                _finish(req, [token], tokenizer.eos_token_id)
            pending = [r for r in pending if r.finish_reason is None]

    asyncio.run(_run())


def count_preemptions(setattr_=setattr) -> list[int]:
    """Count the decoding sequences lmdeploy's scheduler preempts (a full KV cache), one entry per step, from now on
    in this process (where the scheduler runs). ``setattr_`` installs the counter on ``Scheduler`` (a test's
    ``monkeypatch.setattr`` takes it away again)."""
    from lmdeploy.pytorch.messages import MessageStatus
    from lmdeploy.pytorch.paging.scheduler import Scheduler

    counts: list[int] = []
    schedule_running = Scheduler.schedule_running

    def counted(self, running, *args, **kwargs):
        was_running = [seq.status == MessageStatus.RUNNING for seq in running]
        valid = schedule_running(self, running, *args, **kwargs)
        counts.append(sum(before and not kept for before, kept in zip(was_running, valid)))
        return valid

    setattr_(Scheduler, 'schedule_running', counted)
    return counts
