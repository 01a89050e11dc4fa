"""Real-world schemas (JSONSchemaBench) through lmdeploy's own ``pipeline`` on the CPU path, with SmolLM2.

The schemas are the 120 of ``../shared/data/jsonschemabench/`` (12 per category, see its SOURCE.md), plus the 22
hand-written ones of ``benchmarks/data/forced_schemas/`` as the category ``handwritten``. For every schema:

* **compile**: xgrammar compiles it for SmolLM2's tokenizer under lmdeploy's default whitespace (``any``) and under
  ``single``; compile time per schema; a schema that fails is listed with the reason and not asked for;
* **requests**, greedy, two prompt kinds: ``object`` ("produce one JSON object for this schema") and ``extract`` (a
  short document holding values, then "extract as JSON"; the document is written from the non-speculative output of
  the ``object`` prompt, so it is deterministic), under each whitespace option;
* **columns**, one engine process each, every request alone: guided non-speculative decoding, ``grammar`` k=4 and
  k=8 (forced drafts and guessed drafts: the request's formatting, context lookup), ``grammar`` k=8 with forced
  drafts only (``LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS=0``), and ``eagle`` k=4 with SmolLM2's small EAGLE draft.
  The patch series hands the prompt tokens to the core at prefill (context lookups copy from the prompt);
  ``--no-prompt-ids`` takes them away (:func:`drop_prompt_ids`), for a side-by-side of the two.

Reported per category and overall: schemas compiled and compile time, valid outputs (``jsonschema`` with a format
checker), the share of output tokens the grammar forces (along the non-speculative output), tokens per target
forward and wall seconds per column, rejected draft tokens per verification step, and whether every output is
identical token for token to the non-speculative one. Tokens per target forward counts every output token (EOS
included) over every target forward of the request (prefill included). Wall times are seconds on this machine,
measured in one run side by side; compare them as ratios.

``--quick`` runs two schemas of four categories, 96 new tokens, non-speculative and grammar k=8 only. Two columns
run only when named in ``--columns``: ``grammar k=8 fixed guesses`` and ``grammar k=1 forced only`` (every step
verifies two positions: the cost of one extra position, the bound for free text). ``--dump FILE`` writes every
request and its non-speculative output for ``benchmarks/guess_replay.py``.
Last line: ``jsb_grammar_tokens_per_forward <grammar k=8, default whitespace, all JSONSchemaBench categories>``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / 'shared' / 'data' / 'jsonschemabench'
HANDWRITTEN = ROOT / 'benchmarks' / 'data' / 'forced_schemas'
SYSTEM = 'You write JSON. Reply with one JSON object that follows the requested schema.'
#: Characters of a schema put into a prompt (some real-world schemas are far longer than SmolLM2's context).
SCHEMA_CHARS = 6000
WHITESPACE = {'any': dict(any_whitespace=True), 'single': dict(any_whitespace=False)}
#: column -> (speculative method or None, draft tokens, guessed drafts: on, off, or 'fixed' (every source may guess a
#: whole window whatever its acceptance, :func:`fixed_guess_budgets`))
COLUMNS = {
    'non-spec': (None, 0, True),
    'grammar k=4': ('grammar', 4, True),
    'grammar k=8': ('grammar', 8, True),
    'grammar k=8 forced only': ('grammar', 8, False),
    'grammar k=8 fixed guesses': ('grammar', 8, 'fixed'),
    'grammar k=1 forced only': ('grammar', 1, False),
    'eagle k=4': ('eagle', 4, True),
}
HEADLINE = 'grammar k=8'
#: Left out of the default columns, asked for with --columns: a side-by-side for the adaptive guess budgets, and the
#: cost of verifying one extra position per step (k=1: every step verifies two positions, drafts only forced tokens)
QUICK_ONLY = ('grammar k=8 fixed guesses', 'grammar k=1 forced only')


# -- schemas and prompts ---------------------------------------------------------------------------------------------
def load_schemas(categories: list[str] | None, per_category: int, handwritten: bool) -> list[dict]:
    """``{category, name, schema}`` of the selected schemas (sorted by file name within a category)."""
    items = []
    for folder in sorted(p for p in DATA.iterdir() if p.is_dir()):
        if categories and folder.name not in categories:
            continue
        for path in sorted(folder.glob('*.json'))[:per_category or None]:
            items.append(dict(category=folder.name, name=path.stem, schema=json.loads(path.read_text())))
    if handwritten and (not categories or 'handwritten' in categories):
        for path in sorted(HANDWRITTEN.glob('*.json'))[:per_category or None]:
            item = json.loads(path.read_text())
            items.append(dict(category='handwritten', name=item['name'], schema=item['schema'],
                              prompt=item['prompt']))
    return items


def _schema_text(schema: dict) -> str:
    text = json.dumps(schema, separators=(',', ':'))
    return text if len(text) <= SCHEMA_CHARS else text[:SCHEMA_CHARS] + ' ...'


def object_messages(item: dict) -> list[dict]:
    ask = item.get('prompt') or 'Produce one JSON object with realistic values.'
    return [{'role': 'system', 'content': SYSTEM},
            {'role': 'user', 'content': f'{ask}\nJSON schema: {_schema_text(item["schema"])}'}]


def _leaves(value, path: str = ''):
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from _leaves(sub, f'{path} {key}'.strip())
    elif isinstance(value, list):
        if all(not isinstance(v, (dict, list)) for v in value):
            yield path, ', '.join(str(v) for v in value)
        else:
            for index, sub in enumerate(value):
                yield from _leaves(sub, f'{path} {index + 1}')
    else:
        yield path, str(value)


def document(instance) -> str:
    """A short document that holds the values of an instance, one line per value."""
    lines = [f'{path or "value"}: {text}' for path, text in _leaves(instance)]
    return 'Notes from the record:\n' + '\n'.join(lines[:40])


def extract_messages(item: dict, instance) -> list[dict]:
    return [{'role': 'system', 'content': SYSTEM},
            {'role': 'user', 'content': f'{document(instance)}\n\nExtract the information above as one JSON object. '
                                        f'JSON schema: {_schema_text(item["schema"])}'}]


def response_format(item: dict, whitespace: str) -> dict:
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'schema', 'schema': item['schema']}}
    if whitespace != 'any':
        fmt['whitespace'] = whitespace
    return fmt


# -- compile and check -----------------------------------------------------------------------------------------------
def tokenizer_and_info():
    import xgrammar as xgr
    from transformers import AutoTokenizer

    from lmdeploy_guided_spec.support import tiny_models
    path = tiny_models.build_smollm2()
    tok = AutoTokenizer.from_pretrained(str(path))
    vocab = json.loads((Path(path) / 'config.json').read_text())['vocab_size']
    return tok, xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab), vocab


def compile_all(items: list[dict], info, whitespaces: list[str]) -> dict:
    """``{(name, whitespace): (compiled or None, seconds, error)}``, each compiled cold."""
    import xgrammar as xgr
    results = {}
    for item in items:
        for whitespace in whitespaces:
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            start = time.perf_counter()
            try:
                compiled = compiler.compile_json_schema(json.dumps(item['schema']), **WHITESPACE[whitespace])
                error = None
            except Exception as exc:  # noqa: BLE001 - every failure is a finding to list
                compiled, error = None, f'{type(exc).__name__}: {str(exc).splitlines()[0][:120]}'
            results[item['name'], whitespace] = (compiled, time.perf_counter() - start, error)
    return results


def validity(text: str, schema: dict) -> tuple[bool, str]:
    """Whether ``text`` is an instance of ``schema`` (format checker on), and why not."""
    import jsonschema
    try:
        instance = json.loads(text)
    except ValueError as exc:
        return False, f'not JSON: {exc}'
    try:
        cls = jsonschema.validators.validator_for(schema)
        cls(schema, format_checker=cls.FORMAT_CHECKER).validate(instance)
    except jsonschema.ValidationError as exc:
        return False, f'invalid: {exc.message[:100]}'
    except Exception as exc:  # noqa: BLE001 - a schema jsonschema cannot use is reported, not fatal
        return False, f'schema not checkable: {type(exc).__name__}'
    return True, ''


def forced_share(tokens: list[int], compiled, vocab: int, forced_tokenizer) -> tuple[int, int]:
    """(tokens the grammar forces along ``tokens``, tokens walked)."""
    import xgrammar as xgr

    from lmdeploy_guided_spec.bitmask import allocate_bitmask
    from lmdeploy_guided_spec.forced import forced_token
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    mask = allocate_bitmask(1, vocab)
    forced = walked = 0
    for token in tokens:
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(mask, 0)
        forced += forced_token(matcher, mask[0], vocab, forced_tokenizer) == token
        walked += 1
        if not matcher.accept_token(token):
            break
    return forced, walked


# -- one engine process per column -----------------------------------------------------------------------------------
def drop_prompt_ids(spec_agent) -> None:
    """Context lookups see the output only: ``SpecGrammarManager.propose`` of this process gets no prompt ids
    (the series passes them at prefill)."""
    guided_spec = spec_agent.guided_spec
    propose = guided_spec.propose

    def without_prompt_ids(*args, prompt_ids=None, **kwargs):
        return propose(*args, **kwargs)

    guided_spec.propose = without_prompt_ids


def fixed_guess_budgets() -> None:
    """Every guess source of this process may draft a whole window, however its guesses fared (the core shrinks
    a source's guesses per request after rejections and grows them after acceptances)."""
    from lmdeploy_guided_spec.guess import RequestHistory

    RequestHistory.budget = lambda self, source, num_spec_tokens: num_spec_tokens


def engine_worker(spec: dict) -> None:
    """Run every request of ``spec['requests']`` (a JSON file) alone, greedy; print one RESULT line."""
    from lmdeploy_guided_spec.support.harness import enable_cpu_triton
    enable_cpu_triton()
    import torch

    from lmdeploy_guided_spec import cpu
    from lmdeploy_guided_spec.cpu import models
    cpu.activate()
    torch.set_num_threads(spec['threads'])
    os.environ['LMDEPLOY_GUIDED_SPEC_GUESS_DRAFTS'] = '1' if spec['guesses'] else '0'
    if spec['guesses'] == 'fixed':
        fixed_guess_budgets()
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig
    from lmdeploy.pytorch.engine.model_agent import agent

    counts = {'target': 0}
    forward = agent.model_forward

    def counting(*args, **kwargs):
        counts['target'] += 1
        return forward(*args, **kwargs)

    agent.model_forward = counting
    speculative_config = None
    if spec['method'] == 'grammar':
        speculative_config = SpeculativeConfig(method='grammar', num_speculative_tokens=spec['k'])
    elif spec['method'] == 'eagle':
        speculative_config = SpeculativeConfig(method='eagle', model=models.resolve('smollm2-eagle'),
                                               num_speculative_tokens=spec['k'])
    pipe = pipeline(models.resolve('smollm2'),
                    backend_config=PytorchEngineConfig(max_batch_size=2, cache_max_entry_count=0.2, session_len=8192),
                    speculative_config=speculative_config, log_level='ERROR')
    guesses = None
    if spec['method'] == 'grammar':
        spec_agent = pipe.async_engine.engine.executor.model_agent.spec_agent
        guesses = spec_agent.guided_spec.guesses
        if not spec['prompt_ids']:
            drop_prompt_ids(spec_agent)
    requests = json.loads(Path(spec['requests']).read_text())
    results = []
    try:
        for request in requests:
            config = GenerationConfig(response_format=request['format'], max_new_tokens=spec['max_new_tokens'],
                                      do_sample=False)
            before = counts['target']
            stats_before = dict(guesses.stats) if guesses is not None else {}
            start = time.perf_counter()
            try:
                out = pipe([request['messages']], gen_config=config)[0]
                tokens, text, reason, error = list(out.token_ids), out.text, out.finish_reason, None
            except Exception as exc:  # noqa: BLE001 - a failed request is listed, the others go on
                tokens, text, reason, error = [], '', 'error', f'{type(exc).__name__}: {exc}'[:200]
            seconds = time.perf_counter() - start
            stats = {}
            if guesses is not None:
                stats = {k: v - stats_before.get(k, 0) for k, v in guesses.stats.items()}
            # the EOS that ended a request is a generated token
            results.append(dict(id=request['id'], tokens=tokens + ([-1] if reason == 'stop' else []), text=text,
                                reason=reason, error=error, seconds=seconds, forwards=counts['target'] - before,
                                stats=stats))
            print(f'  {spec["label"]} {request["id"]}: {len(results[-1]["tokens"])} tokens, '
                  f'{results[-1]["forwards"]} forwards, {seconds:.1f} s', file=sys.stderr, flush=True)
    finally:
        pipe.close()
    print('RESULT ' + json.dumps(results))


def run_column(label: str, requests: list[dict], args) -> dict[str, dict]:
    method, k, guesses = COLUMNS[label]
    with tempfile.NamedTemporaryFile('w', suffix='.json', delete=False) as f:
        json.dump(requests, f)
    spec = dict(label=label, method=method, k=k, guesses=guesses, requests=f.name, prompt_ids=not args.no_prompt_ids,
                max_new_tokens=args.max_new_tokens, threads=args.threads)
    try:
        proc = subprocess.run([sys.executable, __file__, '--engine-worker', json.dumps(spec)],
                              stdout=subprocess.PIPE, text=True, timeout=args.column_timeout or None)
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('RESULT ')]
    if proc.returncode or not lines:
        raise SystemExit(f'column {label} failed with exit code {proc.returncode}')
    return {r['id']: r for r in json.loads(lines[-1][len('RESULT '):])}


# -- tables ----------------------------------------------------------------------------------------------------------
def _ratio(a: float, b: float) -> str:
    return f'{a / b:.2f}' if b else '-'


def _rejected_per_step(column: dict, ids: list[str]) -> str:
    """Draft tokens verification rejected (or never reached) per verification step of the guided requests."""
    stats = [column[i]['stats'] for i in ids]
    steps = sum(s.get('steps', s.get('windows', 0)) for s in stats)
    drafted = sum(v for s in stats for k, v in s.items() if k.endswith('_drafted'))
    accepted = sum(v for s in stats for k, v in s.items() if k.endswith('_accepted'))
    return f'{(drafted - accepted) / steps:.2f}' if steps else '-'


def print_tables(items, compiled, requests, runs, columns, shares, whitespaces, kinds) -> dict:
    """Per whitespace and prompt kind: one row per category and overall; returns headline figures."""
    categories = sorted({item['category'] for item in items}, key=lambda c: (c == 'handwritten', c))
    by_name = {item['name']: item for item in items}
    figures = {}
    print('\n== compile (SmolLM2 tokenizer, cold, per schema) ==')
    print(f'{"category":<16} {"schemas":>7} ' + ' '.join(f'{"ok " + w:>9} {"ms med":>7}' for w in whitespaces))
    for category in categories + ['overall']:
        names = [i['name'] for i in items if category in ('overall', i['category'])]
        cells = []
        for w in whitespaces:
            ok = [n for n in names if compiled[n, w][0] is not None]
            times = [compiled[n, w][1] * 1e3 for n in ok]
            cells.append(f'{len(ok):>9} {statistics.median(times) if times else 0:>7.1f}')
        print(f'{category:<16} {len(names):>7} ' + ' '.join(cells))
    for whitespace in whitespaces:
        for kind in kinds:
            chosen = [r for r in requests if r['whitespace'] == whitespace and r['kind'] == kind]
            if not chosen:
                continue
            print(f'\n== whitespace {whitespace}, prompt {kind}: tokens per target forward (wall s) '
                  'rejected draft tokens per step ==')
            head = f'{"category":<16} {"reqs":>4} {"valid":>5} {"forced":>6} {"tokens":>6} '
            print(head + ' '.join(f'{c:>29}' for c in columns) + ' identical')
            for category in categories + ['overall']:
                rows = [r for r in chosen if category in ('overall', by_name[r['name']]['category'])]
                if category == 'overall':
                    rows = [r for r in rows if by_name[r['name']]['category'] != 'handwritten']
                if not rows:
                    continue
                ids = [r['id'] for r in rows]
                base = runs[columns[0]]
                valid = sum(validity(base[i]['text'], by_name[r['name']]['schema'])[0] for i, r in zip(ids, rows))
                forced = sum(shares.get(i, (0, 0))[0] for i in ids)
                walked = sum(shares.get(i, (0, 0))[1] for i in ids)
                cells = []
                totals = {}
                for column in columns:
                    tokens = sum(len(runs[column][i]['tokens']) for i in ids)
                    forwards = sum(runs[column][i]['forwards'] for i in ids)
                    seconds = sum(runs[column][i]['seconds'] for i in ids)
                    totals[column] = (tokens, forwards, seconds)
                    rejected = _rejected_per_step(runs[column], ids)
                    cells.append(f'{_ratio(tokens, forwards):>15} ({seconds:>5.0f}) {rejected:>5}')
                same = sum(all(runs[c][i]['tokens'] == base[i]['tokens'] for c in columns) for i in ids)
                tokens0 = totals[columns[0]][0]
                print(f'{category:<16} {len(rows):>4} {valid:>5} {_ratio(forced, walked):>6} {tokens0:>6} '
                      + ' '.join(cells) + f' {same}/{len(rows)}')
                if category == 'overall':
                    figures[whitespace, kind] = {c: totals[c] for c in columns}
                    figures[whitespace, kind, 'identical'] = same == len(rows)
    return figures


# -- the benchmark ---------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--categories', default='', help='comma list of categories (default: all, handwritten too)')
    parser.add_argument('--per-category', type=int, default=12, help='schemas per category (0: all)')
    parser.add_argument('--max-new-tokens', type=int, default=256)
    parser.add_argument('--columns', help=f'comma list from: {", ".join(COLUMNS)} (default: all but '
                        f'{" and ".join(map(repr, QUICK_ONLY))})')
    parser.add_argument('--whitespace', default='any,single', help='comma list from: any, single')
    parser.add_argument('--kinds', default='object,extract', help='prompt kinds: object, extract')
    parser.add_argument('--no-prompt-ids', action='store_true',
                        help='context lookups see the output only (the series passes the prompt ids at prefill)')
    parser.add_argument('--no-handwritten', action='store_true', help='leave out the 22 hand-written schemas')
    parser.add_argument('--quick', action='store_true',
                        help='2 schemas of 4 categories, 96 new tokens, whitespace any, non-spec and grammar k=8 '
                        '(unless --columns names others)')
    parser.add_argument('--threads', type=int, default=1,
                        help="torch threads (default 1: the other core is the grammar worker's)")
    parser.add_argument('--column-timeout', type=float, default=0, help='seconds per column (0: no limit)')
    parser.add_argument('--dump', metavar='FILE',
                        help='write every request and its non-speculative output to FILE (JSON), for '
                        'benchmarks/guess_replay.py')
    parser.add_argument('--engine-worker', metavar='JSON', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_worker:
        engine_worker(json.loads(args.engine_worker))
        return 0
    if args.quick:
        args.categories = args.categories or 'Github_easy,Glaiveai2K,JsonSchemaStore,handwritten'
        args.per_category, args.max_new_tokens = 2, 96
        args.columns, args.whitespace = args.columns or 'non-spec,grammar k=8', 'any'
    args.columns = args.columns or ','.join(c for c in COLUMNS if c not in QUICK_ONLY)
    columns = [c.strip() for c in args.columns.split(',') if c.strip()]
    if columns[0] != 'non-spec':
        columns.insert(0, 'non-spec')
    whitespaces = [w.strip() for w in args.whitespace.split(',') if w.strip()]
    kinds = [k.strip() for k in args.kinds.split(',') if k.strip()]
    items = load_schemas([c for c in args.categories.split(',') if c] or None, args.per_category,
                         not args.no_handwritten)
    print(f'{len(items)} schemas, SmolLM2-135M-Instruct, greedy, max {args.max_new_tokens} new tokens, '
          f'{args.threads} torch thread(s); columns: {", ".join(columns)}; whitespace: {", ".join(whitespaces)}; '
          f'prompts: {", ".join(kinds)}')
    tok, info, vocab = tokenizer_and_info()
    compiled = compile_all(items, info, whitespaces)
    failed = [(i, w, compiled[i['name'], w][2]) for i in items for w in whitespaces if compiled[i['name'], w][2]]
    usable = [i for i in items if all(compiled[i['name'], w][0] is not None for w in whitespaces)]

    def requests_of(kind: str, instances: dict | None = None) -> list[dict]:
        out = []
        for item in usable:
            if kind == 'extract' and (instances is None or item['name'] not in instances):
                continue
            messages = object_messages(item) if kind == 'object' else extract_messages(item, instances[item['name']])
            for whitespace in whitespaces:
                out.append(dict(id=f'{item["category"]}/{item["name"]}/{kind}/{whitespace}', name=item['name'],
                                kind=kind, whitespace=whitespace, messages=messages,
                                format=response_format(item, whitespace)))
        return out

    requests = requests_of('object') if 'object' in kinds else []
    runs: dict[str, dict] = {}
    if 'extract' in kinds:
        # documents come from the non-speculative output of the object prompt under the first whitespace option
        seed = requests if 'object' in kinds else requests_of('object')
        first = [r for r in seed if r['whitespace'] == whitespaces[0]]
        base = run_column('non-spec', first, args)
        instances = {}
        for request in first:
            try:
                instances[request['name']] = json.loads(base[request['id']]['text'])
            except ValueError:
                pass
        extract = requests_of('extract', instances)
        requests = requests + extract
        if 'object' in kinds:
            # the object requests of the first whitespace already ran in this column
            rest = [r for r in requests if r['id'] not in base]
            runs['non-spec'] = {**base, **run_column('non-spec', rest, args)} if rest else base
    for column in columns:
        if column not in runs:
            runs[column] = run_column(column, requests, args)
    forced_tokenizer = None
    from lmdeploy_guided_spec.forced import ForcedTokenizer
    forced_tokenizer = ForcedTokenizer.from_huggingface(tok, info, vocab_size=vocab)
    shares = {}
    for request in requests:
        tokens = [t for t in runs['non-spec'][request['id']]['tokens'] if t >= 0]
        compiled_grammar = compiled[request['name'], request['whitespace']][0]
        shares[request['id']] = forced_share(tokens, compiled_grammar, vocab, forced_tokenizer)
    figures = print_tables(items, compiled, requests, runs, columns, shares, whitespaces, kinds)
    by_name = {item['name']: item for item in items}
    if args.dump:
        Path(args.dump).write_text(json.dumps([
            dict(id=r['id'], kind=r['kind'], whitespace=r['whitespace'], messages=r['messages'],
                 schema=by_name[r['name']]['schema'], tokens=runs['non-spec'][r['id']]['tokens'],
                 forwards={c: runs[c][r['id']]['forwards'] for c in columns}) for r in requests]))

    print('\n== schemas that fail ==')
    for item, whitespace, error in failed:
        print(f'{item["category"]}/{item["name"]} ({whitespace}): does not compile: {error}')
    for request in requests:
        result = runs['non-spec'][request['id']]
        if result['error']:
            print(f'{request["id"]}: request failed: {result["error"]}')
            continue
        ok, why = validity(result['text'], by_name[request['name']]['schema'])
        if not ok:
            reason = f'{why} (finish: {result["reason"]})'
            print(f'{request["id"]}: no valid output: {reason}')

    print('\n== wall time against non-spec (JSONSchemaBench, overall) ==')
    for key, totals in figures.items():
        if len(key) == 2:
            base_seconds = totals['non-spec'][2]
            print(f'whitespace {key[0]}, {key[1]}: ' + ', '.join(
                f'{c} {_ratio(totals[c][2], base_seconds)}x' for c in columns[1:]))
    identical = all(v for k, v in figures.items() if len(k) == 3)
    print(f'outputs identical to non-speculative: {"yes" if identical else "NO"}')
    headline = [figures[key] for key in figures if len(key) == 2 and key[0] == 'any']
    if HEADLINE in columns and headline:
        tokens = sum(t[HEADLINE][0] for t in headline)
        forwards = sum(t[HEADLINE][1] for t in headline)
        print(f'jsb_grammar_tokens_per_forward {tokens / forwards:.3f}')
    return 0 if identical else 1


if __name__ == '__main__':
    sys.exit(main())
