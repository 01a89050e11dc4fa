"""``lmdeploy-guided-spec check``: guided speculative decoding through the patched lmdeploy, on the CPU.

Runs lmdeploy's own ``SpecModelAgent``, proposers (``deepseek_mtp``, ``eagle3``), ``GuidedDecodingManager``,
``FusedLogitsProcessor`` and ``RejectionSampler`` (Triton kernels under the interpreter) with a real tokenizer and
a JSON schema; only the networks are scripted (see :mod:`lmdeploy_guided_spec.support.harness`). The scripted
target prefers one valid instance of the schema with noise; the draft is a noisier copy, so some drafts are
accepted and some rejected. Prints what every step did and checks the result against the schema and against
lmdeploy's guided decoding without speculation.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from ..series.patching import installed_is_applied
from ..support.harness import GenRequest, StepRecord, enable_cpu_triton

DEFAULT_SCHEMA = {
    'type': 'object',
    'properties': {
        'name': {'type': 'string'},
        'age': {'type': 'integer', 'minimum': 0},
        'status': {'enum': ['active', 'activated', 'inactive']},
        'skills': {'type': 'array', 'items': {'type': 'string'}, 'maxItems': 3},
    },
    'required': ['name', 'age', 'status', 'skills'],
    'additionalProperties': False,
}
DEFAULT_INSTANCE = {'name': 'Ada Lovelace', 'age': 36, 'status': 'active', 'skills': ['math', 'poetry']}


class _ScriptedLM:
    """Seeded noise per prefix plus a bias toward ``path`` while the prefix follows it."""

    def __init__(self, vocab_size: int, path: list[int], bias: float, seed: int):
        self.vocab_size, self.path, self.bias, self.seed = vocab_size, path, bias, seed

    def __call__(self, prefix):
        g = torch.Generator().manual_seed(hash((self.seed, tuple(prefix))) % (2**31))
        logits = torch.randn(self.vocab_size, generator=g)
        n = len(prefix)
        if n < len(self.path) and list(prefix) == self.path[:n]:
            logits[self.path[n]] += self.bias
        return logits


def _load_schema(path) -> tuple[dict, dict | None]:
    if path is None:
        return DEFAULT_SCHEMA, DEFAULT_INSTANCE
    schema = json.loads(open(path, encoding='utf-8').read())
    examples = schema.get('examples') or []
    return schema, (examples[0] if examples else None)


def _fmt(tokenizer, ids) -> str:
    return ' '.join(repr(tokenizer.decode([t])) for t in ids) if ids else '-'


def _run_method(method: str, args, tokenizer, vocab_size: int, schema: dict, path: list[int]) -> bool:
    from ..support.harness import SpecHarness, run_non_speculative

    torch.manual_seed(args.seed)
    target = _ScriptedLM(vocab_size, path, bias=9.0, seed=args.seed + 1)
    draft = _ScriptedLM(vocab_size, path, bias=3.5, seed=args.seed + 2)
    ids = None
    if method == 'eagle3':
        # an Eagle3 draft vocabulary: a random quarter of the target vocabulary plus the instance's tokens
        g = torch.Generator().manual_seed(args.seed)
        ids = torch.unique(torch.cat([torch.randperm(vocab_size, generator=g)[:vocab_size // 4],
                                      torch.tensor(path, dtype=torch.long)]))
        full = draft
        draft = lambda prefix: full(prefix)[ids]  # noqa: E731
    response_format = {'type': 'json_schema', 'json_schema': {'name': 'check', 'schema': schema}}

    print(f'\n== proposer {method}, {args.num_spec_tokens} draft tokens, '
          f'{"sampling" if args.sampling else "greedy"} ==')
    print(f'{"step":>4}  {"drafts (grammar-masked)":<48} {"accepted":>8}  committed')
    step = [0]

    def on_step(record: StepRecord):
        if record.session_id != 1:
            return
        step[0] += 1
        accepted = f'{record.accepted_drafts}/{len(record.drafts)}' if record.drafts else 'prefill'
        print(f'{step[0]:>4}  {_fmt(tokenizer, record.drafts)[:48]:<48} {accepted:>8}  '
              f'{_fmt(tokenizer, record.output)}', flush=True)

    harness = SpecHarness(tokenizer, vocab_size, target, draft, method=method, num_spec_tokens=args.num_spec_tokens,
                          draft_id_to_target_id=ids, on_step=on_step)
    counts = {'draft': 0, 'verify': 0}
    guided = harness.agent.guided_spec
    begin_draft, verification_bitmask = guided.begin_draft, guided.verification_bitmask

    def counting_begin_draft(matchers, *a, **kw):
        draft_grammar = begin_draft(matchers, *a, **kw)
        mask = draft_grammar.mask_logits_

        def counted(logits):
            counts['draft'] += len(matchers)
            return mask(logits)

        draft_grammar.mask_logits_ = counted
        return draft_grammar

    def counting_verification(matchers, drafts, *rest, **kw):
        counts['verify'] += len(matchers) * (args.num_spec_tokens + 1)
        return verification_bitmask(matchers, drafts, *rest, **kw)

    guided.begin_draft, guided.verification_bitmask = counting_begin_draft, counting_verification

    def requests():
        # the guided request shares the batch with an unguided one, as in a served batch
        return [GenRequest(1, response_format, args.steps, greedy=not args.sampling, top_k=40, seed=args.seed),
                GenRequest(2, None, 8, greedy=not args.sampling, top_k=40, seed=args.seed + 1)]

    start = time.perf_counter()
    spec = requests()
    harness.generate(spec)
    elapsed = time.perf_counter() - start
    tokens = spec[0].tokens
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    guided_forwards = sum(1 for r in harness.records if r.session_id == 1)
    print(f'text: {text}')
    print(f'masks applied: {counts["draft"]} draft positions, {counts["verify"]} verification positions')
    print(f'target forwards: {guided_forwards}, tokens: {len(tokens)}, '
          f'tokens per forward: {len(tokens) / max(guided_forwards, 1):.2f} ({elapsed:.1f} s)')
    ok = _validate(text, schema, spec[0].finish_reason)
    if not args.sampling:
        ref = requests()
        run_non_speculative(tokenizer, vocab_size, target, ref)
        same = ref[0].tokens == tokens
        print(f'greedy guided decoding without speculation: {"identical" if same else "DIFFERENT"} '
              f'({len(ref[0].tokens)} tokens)')
        ok = ok and same
    return ok


def _validate(text: str, schema: dict, finish_reason: str | None) -> bool:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        print(f'valid JSON: no ({err}; finish reason {finish_reason})')
        return False
    try:
        import jsonschema
    except ImportError:
        print('valid JSON: yes (install jsonschema to validate against the schema)')
        return True
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError as err:
        print(f'valid JSON: yes; schema: INVALID ({err.message})')
        return False
    print('valid JSON: yes; schema: valid')
    return True


def main(args: argparse.Namespace) -> int:
    """Run the check; 0 when every output validates (and greedy output equals non-speculative decoding)."""
    enable_cpu_triton()
    from lmdeploy import __version__ as lmdeploy_version

    from .. import testing
    if not installed_is_applied():
        print('the installed lmdeploy is not patched; run `lmdeploy-guided-spec apply` first', file=sys.stderr)
        return 4
    if not lmdeploy_version.startswith('0.14.'):
        # the scripted harness builds lmdeploy 0.14's speculative agent by hand; later releases rebuilt that code
        print(f'check drives lmdeploy 0.14.0\'s speculative agent with scripted networks; lmdeploy {lmdeploy_version} '
              'is installed. To check this installation end to end, run: lmdeploy-guided-spec demo --model tiny',
              file=sys.stderr)
        return 5
    tokenizer = testing.load_tokenizer(args.tokenizer)
    vocab_size = testing.TOKENIZERS[args.tokenizer].model_vocab_size
    schema, instance = _load_schema(args.schema)
    path = tokenizer.encode(json.dumps(instance, ensure_ascii=False), add_special_tokens=False) if instance else []
    path.append(tokenizer.eos_token_id)
    print(f'lmdeploy {lmdeploy_version} (patched) on CPU, tokenizer {args.tokenizer} (vocab {vocab_size}); '
          f'scripted target and draft networks, real lmdeploy sampling, drafting and grammar code')
    print(f'schema: {json.dumps(schema)}')
    if instance is None:
        print('the schema has no "examples": the scripted target is pure noise, so the JSON may not finish')
    methods = ['deepseek_mtp', 'eagle3'] if args.method == 'all' else [args.method]
    results = {m: _run_method(m, args, tokenizer, vocab_size, schema, path) for m in methods}
    print('\n' + ', '.join(f'{m}: {"ok" if ok else "FAILED"}' for m, ok in results.items()))
    return 0 if all(results.values()) else 1
