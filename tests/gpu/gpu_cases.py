"""Requests, grammars and checks shared by the GPU tests and their engine worker.

The tiny models have random weights: what they generate means nothing, so the checks are structural. Every guided
output must be accepted, token by token, by a fresh matcher of its grammar (compiled the way lmdeploy compiles it);
an output that stopped must be a complete instance; greedy speculative output must equal greedy non-speculative
output.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'enum': ['ann', 'bob', 'cyd']},
        'age': {'type': 'integer', 'minimum': 0, 'maximum': 120},
        'ok': {'type': 'boolean'},
        'tags': {'type': 'array', 'items': {'enum': ['a', 'b']}, 'maxItems': 2},
    },
    'required': ['name', 'age', 'ok'],
    'additionalProperties': False,
}
# fixed length, so even a random model finishes it
REGEX = r'[A-Z]{2}-[0-9]{3}'

FORMAT_KINDS = ('json_schema', 'regex_schema', 'json_object')
BATCH_SIZES = (1, 8, 64)
MAX_NEW_TOKENS = 48
NUM_SPEC_TOKENS = 3

# Greedy outputs of two engine configurations may part where the two best allowed tokens of a position are a near
# tie: the speculative target forward computes the window in other kernels and GEMM shapes than one-token decoding,
# and fp16 rounding differs by ~1e-3 relative. Such a divergence is accepted (and counted); any other is a bug.
NEAR_TIE_ABS = 0.02
NEAR_TIE_REL = 0.005


# A full KV cache: 8 blocks of 64 tokens for 12 requests of up to 120 new tokens, so the scheduler preempts decoding
# sequences and prefills them again (as tests/e2e/test_deployment.py does on the CPU path)
DIGITS = {'type': 'array', 'items': {'type': 'integer', 'minimum': 0, 'maximum': 9}, 'minItems': 30, 'maxItems': 30}
LETTERS = '[a-z]{50}-[0-9]{30}'
PREEMPT_KINDS = ('digits', 'letters', 'text', 'json_object')
#: workload name -> (the jobs, PytorchEngineConfig fields beyond the worker's own, environment of the engine)
WORKLOADS = {
    'jobs': ('jobs', {}, {}),
    'preempt': ('preempt_jobs', dict(num_gpu_blocks=8), {}),
    'preempt-ref': ('preempt_jobs', {}, {}),
    # draft models draft without the grammar's masks; verification alone keeps the output
    'free-drafts': ('jobs', {}, {'LMDEPLOY_GUIDED_SPEC_DRAFT_MASKS': '0'}),
}


def targets(models: dict[str, Path], method: str) -> tuple[Path, Path]:
    """Target and draft directories of a speculative method, from the tiny models ``llama``, ``eagle3`` and
    ``deepseek``."""
    if method == 'eagle3':
        return models['llama'], models['eagle3']
    if method == 'deepseek_mtp':
        # the MTP layer lives in the target's own checkpoint
        return models['deepseek'], models['deepseek']
    raise ValueError(f'no tiny models for method {method!r}')


def response_format(kind: str) -> dict | None:
    """lmdeploy ``response_format`` of a format kind (None: unguided)."""
    if kind == 'json_schema':
        return {'type': 'json_schema', 'json_schema': {'name': 'person', 'schema': SCHEMA}}
    if kind == 'regex_schema':
        return {'type': 'regex_schema', 'regex_schema': REGEX}
    if kind == 'json_object':
        return {'type': 'json_object'}
    if kind == 'digits':
        return {'type': 'json_schema', 'json_schema': {'name': 'digits', 'schema': DIGITS}}
    if kind == 'letters':
        return {'type': 'regex_schema', 'regex_schema': LETTERS}
    if kind == 'text':
        return None
    raise ValueError(f'unknown format kind {kind!r}')


def jobs() -> list[dict]:
    """The batched pipeline calls every engine configuration runs: format kind x greedy/sampling x batch size.

    Batches of 8 and more mix in unguided requests (every fourth), which must be left untouched.
    """
    out = []
    for kind in FORMAT_KINDS:
        for greedy in (True, False):
            for batch in BATCH_SIZES:
                kinds = ['text' if batch >= 8 and i % 4 == 3 else kind for i in range(batch)]
                prompts = [f'Request {i}: describe one person as {kind.replace("_", " ")}.' for i in range(batch)]
                gen = [dict(max_new_tokens=MAX_NEW_TOKENS, do_sample=not greedy, temperature=1.0,
                            top_k=1 if greedy else 40, top_p=1.0 if greedy else 0.95, random_seed=1000 + i,
                            logprobs=5 if greedy else None, kind=k) for i, k in enumerate(kinds)]
                out.append(dict(name=f'{kind}-{"greedy" if greedy else "sampling"}-{batch}', kind=kind, greedy=greedy,
                                batch=batch, prompts=prompts, gen=gen))
    return out


def preempt_jobs() -> list[dict]:
    """One batch of 12 long requests for a full KV cache: a 30-digit array, a fixed-length regex, unguided rows
    that ignore their stop tokens and ``json_object``; every third row sampled."""
    prompts = [f'Request {i}: write what is asked, at length.' for i in range(12)]
    gen = []
    for i in range(12):
        kind, greedy = PREEMPT_KINDS[i % 4], i % 3 != 2
        gen.append(dict(max_new_tokens=120, do_sample=not greedy, temperature=1.0, top_k=1 if greedy else 40,
                        top_p=1.0 if greedy else 0.95, random_seed=2000 + i, logprobs=5 if greedy else None,
                        ignore_eos=kind == 'text', kind=kind))
    return [dict(name='preempt-12', kind='mixed', greedy=None, batch=12, prompts=prompts, gen=gen)]


def guided_matcher(manager, session_id: int, kind: str):
    """A fresh matcher of ``kind``'s grammar from an lmdeploy ``GuidedDecodingManager``, compiled as the engine
    compiles it, on any release: 0.14 takes ``(session_id, seq_id, schema, kind)``, later releases
    ``(session_id, seq_id, response_format)``."""
    import inspect
    if len(inspect.signature(manager.get_processor).parameters) == 3:
        return manager.get_processor(session_id, 0, response_format(kind))
    schema = {'json_schema': json.dumps(SCHEMA), 'regex_schema': REGEX, 'digits': json.dumps(DIGITS),
              'letters': LETTERS, 'json_object': '{"type" : "object", "additionalProperties": true}'}[kind]
    lmdeploy_kind = {'digits': 'json_schema', 'letters': 'regex_schema'}.get(kind, kind)
    return manager.get_processor(session_id, 0, schema, lmdeploy_kind)


def check_guided_output(manager, session_id: int, kind: str, token_ids: list[int], text: str, finish_reason: str,
                        eos_token_ids: set[int]) -> None:
    """Raise AssertionError unless ``token_ids`` follow the grammar of ``kind``.

    ``manager`` is an lmdeploy ``GuidedDecodingManager`` for the model's tokenizer and vocabulary, so the grammar
    is compiled exactly as the engine compiled it; ``session_id`` must be fresh.
    """
    matcher = guided_matcher(manager, session_id, kind)
    try:
        for pos, token in enumerate(token_ids):
            if token in eos_token_ids and (matcher.is_terminated() or matcher.is_completed()):
                continue
            assert not matcher.is_terminated(), f'token {token} at {pos} after the grammar terminated: {text!r}'
            assert matcher.accept_token(token), f'token {token} at {pos} is rejected by the grammar: {text!r}'
        if finish_reason == 'stop':
            assert matcher.is_terminated() or matcher.is_completed(), f'stopped before the grammar completed: {text!r}'
            if kind in ('regex_schema', 'letters'):
                assert re.fullmatch(REGEX if kind == 'regex_schema' else LETTERS, text), text
            else:
                value = json.loads(text)
                if kind in ('json_schema', 'digits'):
                    import jsonschema
                    jsonschema.validate(value, SCHEMA if kind == 'json_schema' else DIGITS)
                else:
                    assert isinstance(value, dict), text
    finally:
        manager.remove_processor(session_id)


def dict_logprobs(out: dict) -> dict:
    """An output as the worker saved it (JSON: logprobs as ``[token, value]`` pairs) with logprobs as dicts, the form
    :func:`compare_greedy` reads."""
    if out.get('logprobs') is None:
        return out
    return dict(out, logprobs=[{int(t): v for t, v in step} for step in out['logprobs']])


def _near_tie(lps: dict[int, float] | None, a: int, b: int) -> bool:
    if not lps or a not in lps or b not in lps:
        return False
    va, vb = lps[a], lps[b]
    return abs(va - vb) <= NEAR_TIE_ABS + NEAR_TIE_REL * max(abs(va), abs(vb))


def compare_greedy(spec: dict, ref: dict) -> str | None:
    """Compare one request's greedy outputs: None when equal, 'near-tie' when they part at a near tie of the two
    tokens (by either run's logits), else a description of the mismatch."""
    a_ids, b_ids = spec['token_ids'], ref['token_ids']
    if a_ids == b_ids:
        return None
    pos = next((i for i, (x, y) in enumerate(zip(a_ids, b_ids)) if x != y), min(len(a_ids), len(b_ids)))
    if pos >= min(len(a_ids), len(b_ids)):
        return f'one output is a prefix of the other: {len(a_ids)} vs {len(b_ids)} tokens ({spec["finish_reason"]} ' \
               f'vs {ref["finish_reason"]})'
    a, b = a_ids[pos], b_ids[pos]
    spec_lps = (spec.get('logprobs') or [None] * (pos + 1))[pos]
    ref_lps = (ref.get('logprobs') or [None] * (pos + 1))[pos]
    if _near_tie(spec_lps, a, b) or _near_tie(ref_lps, a, b):
        return 'near-tie'
    return f'token {pos}: speculative {a} vs non-speculative {b}; logits there: spec {spec_lps}, ref {ref_lps}'
