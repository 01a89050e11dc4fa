"""Replay greedy outputs through the draft-free window: tokens per target forward without running a model.

Greedy verification accepts a draft exactly when it equals the token the model writes at its position, and greedy
guided speculative decoding writes the tokens of guided non-speculative decoding. So, given a request's prompt and
its non-speculative output, the target forwards of method ``grammar`` follow from the core alone:
``SpecGrammarManager.propose`` drafts a window, the drafts equal to the output are accepted plus the one token the
forward writes after them, ``commit`` advances the grammar, and so on. This is what the engine's ``grammar`` method
does step by step, without the model's cost, so draft sources can be compared on every request in seconds.

The input is a file written by ``benchmarks/jsonschemabench.py --dump FILE`` (each request's messages, schema,
whitespace and non-speculative output tokens, and the target forwards each engine column counted). Where the dump
holds the engine's ``grammar k=<k>`` column, the table shows its forwards beside the replay's (they agree when the
replay is faithful).

``--show ID`` prints every window of one request: the drafts, where the output left them and which source drafted
each token. Last line: ``replay_tokens_per_forward <all requests>``.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / 'benchmarks'))

from jsonschemabench import WHITESPACE, tokenizer_and_info  # noqa: E402

#: How --show names the source of a draft token.
LABELS = {'forced': 'F', 'format': 'W', 'lookup': 'L', 'model': 'M'}


def replay(manager, compiled, prompt_ids: list[int], tokens: list[int], k: int, eos: int, show=None) -> dict:
    """Step through one request; returns forwards, tokens and the drafted and accepted tokens per source."""
    import xgrammar as xgr
    matcher = xgr.GrammarMatcher(compiled)
    tokens = [eos if t < 0 else t for t in tokens]
    stats_before = dict(manager.guesses.stats) if manager.guesses is not None else {}
    # prefill writes the first token
    manager.commit({0: matcher}, [[tokens[0]]], session_ids=[0])
    pos, forwards = 1, 1
    while pos < len(tokens) and not matcher.is_terminated():
        # the series hands the prompt over at prefill: with the first window
        drafts = manager.propose({0: matcher}, 1, k, session_ids=[0],
                                 prompt_ids=[prompt_ids] if forwards == 1 else None)
        history = manager.guesses.history(matcher, create=False) if manager.guesses is not None else None
        sources = [s for _, s in history.pending] if history is not None and history.pending else []
        drafts = drafts[0].tolist()
        accepted = 0
        while accepted < k and pos + accepted < len(tokens) and drafts[accepted] == tokens[pos + accepted]:
            accepted += 1
        committed = tokens[pos:pos + accepted + 1]
        if show is not None:
            text = manager.forced_tokenizer.token_bytes
            marks = []
            for index, source in enumerate(sources):
                sign = '+' if index < accepted else ('x' if index == accepted else '.')
                marks.append(f'{sign}{LABELS.get(source, source)}:{text(drafts[index])!r}')
            want = b''.join(text(t) for t in committed)
            show.write(f'{pos:4d} accepted {accepted} wrote {want!r:40} drafts {" ".join(marks)}\n')
        manager.commit({0: matcher}, [committed], session_ids=[0])
        pos += len(committed)
        forwards += 1
    manager.forget([0])
    # drafted and accepted tokens per source, as the core counts them at every commit (GuessDrafts.stats)
    counts = {key: value - stats_before.get(key, 0) for key, value in manager.guesses.stats.items()
              if key.endswith(('_drafted', '_accepted'))} if manager.guesses is not None else {}
    # the engine runs one forward more than the request commits tokens for (lmdeploy's count, as the benchmark's)
    return dict(forwards=forwards + 1, tokens=len(tokens), **counts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('dump', help='a file of benchmarks/jsonschemabench.py --dump')
    parser.add_argument('-k', type=int, default=8, help='draft tokens per window (default 8)')
    parser.add_argument('--sources', default='format,lookup', help="guess sources ('' for forced drafts only)")
    parser.add_argument('--show', metavar='ID', help='print every window of the request ID')
    args = parser.parse_args(argv)

    import xgrammar as xgr

    from lmdeploy_guided_spec.manager import SpecGrammarManager
    tok, info, vocab = tokenizer_and_info()
    requests = json.loads(Path(args.dump).read_text())
    sources = tuple(s for s in args.sources.split(',') if s)
    manager = SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=info, guess_drafts=sources or False)
    compiler = xgr.GrammarCompiler(info)
    column = f'grammar k={args.k}'
    groups: dict[tuple, list] = defaultdict(list)
    print(f'{"request":56} {"tokens":>6} {"replay":>7} {"engine":>7}  tok/fwd')
    for request in requests:
        if args.show and request['id'] != args.show:
            continue
        compiled = compiler.compile_json_schema(json.dumps(request['schema']), **WHITESPACE[request['whitespace']])
        prompt_ids = tok.apply_chat_template(request['messages'], add_generation_prompt=True, tokenize=True)
        result = replay(manager, compiled, prompt_ids, request['tokens'], args.k, tok.eos_token_id,
                        show=sys.stdout if args.show else None)
        engine = request.get('forwards', {}).get(column)
        category = request['id'].split('/')[0]
        groups[category, request['kind'], request['whitespace']].append(result)
        groups['all', request['kind'], request['whitespace']].append(result)
        print(f'{request["id"][:56]:56} {result["tokens"]:6d} {result["forwards"]:7d} {engine or "-":>7}  '
              f'{result["tokens"] / result["forwards"]:.2f}')
    print(f'\n{"category":20} {"kind":8} {"ws":6} {"tok/fwd":>8}  accepted/drafted per source')
    for (category, kind, whitespace), results in sorted(groups.items()):
        tokens = sum(r['tokens'] for r in results)
        forwards = sum(r['forwards'] for r in results)
        per_source = ', '.join(
            f'{s} {sum(r.get(s + "_accepted", 0) for r in results)}/{sum(r.get(s + "_drafted", 0) for r in results)}'
            for s in ('forced', 'format', 'lookup'))
        print(f'{category:20} {kind:8} {whitespace:6} {tokens / forwards:8.2f}  {per_source}')
    everything = [r for (c, _, _), rs in groups.items() if c == 'all' for r in rs]
    total = sum(r['tokens'] for r in everything) / max(1, sum(r['forwards'] for r in everything))
    print(f'replay_tokens_per_forward {total:.3f}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
