"""The cost of one token mask deep into real-world schemas, against the mask limit.

The limit is ``LMDEPLOY_GUIDED_SPEC_MASK_LIMIT_MS`` (250 ms by default).
The engine refuses a running request at its second token mask over the limit (core ``MaskClock``), whatever the
position; the compile service probes only a grammar's first 16 tokens. This walks the schemas of
``../shared/data/jsonschemabench/`` (120, 12 per category, see its SOURCE.md) far past the probe: each schema is
compiled as the engine compiles it (``compile._compile``, lmdeploy's default whitespace ``any``), in a child process
of its own (a compile past ``--compile-limit`` seconds of CPU time is listed and skipped, as the compile service
refuses it), then walked ``--walks`` times for up to ``--tokens`` tokens. A walk picks random tokens the mask allows,
steered into the grammar's structure as the probe is (no whitespace-only tokens, mostly tokens that close nothing,
half the time tokens with a double quote, which open keys) and never a stop token, so that it goes deep. Every fill
is timed in CPU time of its thread, as the clock times it (the machine may be busy).

Reported per category: schemas walked, masks filled, the slowest mask and where, the 99th percentile; then the
schemas over 10, 50, 100 ms and over the limit, and those that failed or were skipped.
Last line: ``mask_walk_max_ms <the slowest mask of every walk>``.
"""
from __future__ import annotations

import argparse
import multiprocessing
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
DATA = ROOT.parent / 'shared' / 'data' / 'jsonschemabench'


def _choose(allowed: np.ndarray, kinds, rng) -> int | None:
    """A token of ``allowed`` steered into the structure (see the module's docstring)."""
    if not allowed.any():
        return None
    pool = allowed
    for keep, chance in ((~kinds.blank, 1.0), (~kinds.closes, 0.8)):
        narrowed = pool & keep
        if narrowed.any() and rng.random() < chance:
            pool = narrowed
    if rng.random() < 0.5 and (pool & kinds.quotes).any():
        pool = pool & kinds.quotes
    return int(rng.choice(np.flatnonzero(pool)))


def _walk_schema(conn, text: str, tokenizer: str, walks: int, tokens: int, compile_limit: float) -> None:
    """In a child: compile ``text``, send ('compiled', cpu seconds), then one ('walk', fills, worst position) per
    walk; or ('error', reason) / ('slow', cpu seconds)."""
    import xgrammar as xgr

    from lmdeploy_guided_spec import compile as compile_module
    from lmdeploy_guided_spec.testing import tokenizer_info
    try:
        info = tokenizer_info(tokenizer)
        kinds = compile_module.probe_tokens(info)
        compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        start = time.process_time()
        grammar = compile_module._compile(compiler, 'json_schema', text, {})
        spent = time.process_time() - start
        if spent > compile_limit:
            conn.send(('slow', spent))
            return
        conn.send(('compiled', spent))
        vocab = info.vocab_size
        stops = [t for t in info.stop_token_ids if 0 <= t < vocab]
        bitmask = xgr.allocate_token_bitmask(1, vocab)
        for seed in range(walks):
            rng = np.random.default_rng(seed)
            matcher = xgr.GrammarMatcher(grammar, terminate_without_stop_token=True)
            fills = []
            for _ in range(tokens + 1):
                start = time.thread_time()
                matcher.fill_next_token_bitmask(bitmask)
                fills.append((time.thread_time() - start) * 1e3)
                allowed = np.unpackbits(bitmask[0].numpy().view(np.uint8), bitorder='little')[:vocab].astype(bool)
                allowed[stops] = False
                token = _choose(allowed, kinds, rng)
                if matcher.is_terminated() or token is None or not matcher.accept_token(token):
                    break
            conn.send(('walk', fills))
    except Exception as err:  # noqa: BLE001 - a schema xgrammar refuses is listed, not fatal
        conn.send(('error', f'{type(err).__name__}: {" ".join(str(err).split())[:200]}'))
    finally:
        conn.close()


def walk(path: Path, tokenizer: str, walks: int, tokens: int, compile_limit: float) -> dict:
    """The walks of one schema, in a child process killed after twice the compile limit plus five minutes."""
    context = multiprocessing.get_context('fork')
    receiver, sender = context.Pipe(duplex=False)
    child = context.Process(target=_walk_schema, args=(sender, path.read_text(), tokenizer, walks, tokens,
                                                       compile_limit))
    child.start()
    sender.close()
    record = {'fills': []}
    deadline = time.monotonic() + 2 * compile_limit + 300
    try:
        while True:
            if not receiver.poll(max(0.0, deadline - time.monotonic())):
                record['status'] = 'killed (took too long)'
                break
            try:
                kind, value = receiver.recv()
            except EOFError:
                record.setdefault('status', 'ok' if record['fills'] else f'child ended ({child.exitcode})')
                break
            if kind == 'walk':
                record['fills'].append(value)
            elif kind == 'compiled':
                record['compile_s'] = value
            elif kind == 'slow':
                record['status'] = f'compile past the limit ({value:.0f} s)'
            else:
                record['status'] = value
    finally:
        child.kill()
        child.join()
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--tokenizer', default='llama3', help='a tokenizer of lmdeploy_guided_spec.testing')
    parser.add_argument('--walks', type=int, default=3, help='walks per schema (seeds 0, 1, ...)')
    parser.add_argument('--tokens', type=int, default=400, help='the most tokens of a walk')
    parser.add_argument('--compile-limit', type=float, default=20.0, help='CPU seconds a compile may take')
    parser.add_argument('--only', help='walk only the schemas whose path holds this text')
    args = parser.parse_args(argv)
    from lmdeploy_guided_spec.compile import mask_limit_ms_from_env
    limit_ms = mask_limit_ms_from_env()
    paths = sorted(p for p in DATA.glob('*/*.json') if not args.only or args.only in str(p))
    by_category: dict[str, list] = {}
    left_out = []
    started = time.monotonic()
    for path in paths:
        name = f'{path.parent.name}/{path.name}'
        record = walk(path, args.tokenizer, args.walks, args.tokens, args.compile_limit)
        if not record['fills']:
            left_out.append((name, record.get('status', 'no walk')))
            continue
        fills = np.concatenate([np.asarray(f) for f in record['fills']])
        worst_walk = max(range(len(record['fills'])), key=lambda i: max(record['fills'][i]))
        worst = record['fills'][worst_walk]
        by_category.setdefault(path.parent.name, []).append(
            (name, fills, float(max(worst)), int(np.argmax(worst)), sum(len(f) - 1 for f in record['fills'])))
        print(f'  {time.monotonic() - started:6.0f} s  {name:<52} slowest {max(worst):7.2f} ms at token '
              f'{int(np.argmax(worst))}', flush=True)
    print(f'\n{args.walks} walk(s) of up to {args.tokens} tokens per schema, tokenizer {args.tokenizer}; '
          f'the mask limit is {limit_ms:g} ms\n')
    print(f'{"category":<22} {"schemas":>7} {"masks":>8} {"tokens":>8} {"p99 ms":>7} {"max ms":>7}  slowest at')
    every = []
    for category, rows in sorted(by_category.items()):
        fills = np.concatenate([row[1] for row in rows])
        every.append(fills)
        name, _, slowest, position, _ = max(rows, key=lambda row: row[2])
        print(f'{category:<22} {len(rows):>7} {fills.size:>8} {sum(row[4] for row in rows):>8} '
              f'{np.percentile(fills, 99):>7.2f} {slowest:>7.2f}  {name.split("/")[1]}, token {position}')
    all_fills = np.concatenate(every) if every else np.zeros(1)
    rows = [row for category in by_category.values() for row in category]
    print(f'{"all":<22} {len(rows):>7} {all_fills.size:>8} {sum(row[4] for row in rows):>8} '
          f'{np.percentile(all_fills, 99):>7.2f} {all_fills.max():>7.2f}')
    print()
    for bound in (10, 50, 100, limit_ms):
        over = [row[0] for row in rows if row[2] > bound]
        print(f'schemas with a mask over {bound:g} ms: {len(over)}' + (f' ({", ".join(over[:6])})' if over else ''))
    for name, why in left_out:
        print(f'not walked: {name}: {why}')
    print(f'mask_walk_max_ms {all_fills.max():.2f}')
    return 0


if __name__ == '__main__':
    raise SystemExit(main())
