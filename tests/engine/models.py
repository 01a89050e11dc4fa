"""Scripted target and draft models for the engine tests: logits as a function of the token prefix."""
import torch

from lmdeploy_guided_spec import testing

from grammars import dumps


class PrefixLM:
    """Seeded random logits per prefix, plus ``bias`` on the next token of ``path`` while the prefix follows it."""

    def __init__(self, vocab_size, path=(), bias=0.0, seed=0, scale=1.0):
        self.vocab_size, self.path, self.bias, self.seed, self.scale = vocab_size, list(path), bias, seed, scale

    def __call__(self, prefix):
        g = torch.Generator().manual_seed(hash((self.seed, tuple(prefix))) % (2**31))
        logits = torch.randn(self.vocab_size, generator=g) * self.scale
        n = len(prefix)
        if self.bias and n < len(self.path) and list(prefix) == self.path[:n]:
            logits[self.path[n]] += self.bias
        return logits


class DraftOverMap:
    """An Eagle3-style draft: a target-vocabulary model read through ``draft_id_to_target_id``."""

    def __init__(self, model, draft_id_to_target_id):
        self.model, self.ids = model, draft_id_to_target_id

    def __call__(self, prefix):
        return self.model(prefix)[self.ids]


def instance_path(name, instance):
    tok = testing.load_tokenizer(name)
    return tok.encode(dumps(instance), add_special_tokens=False) + [tok.eos_token_id]


def draft_map(vocab_size, draft_vocab, seed, must_have=()):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(vocab_size, generator=g)[:draft_vocab]
    ids = torch.unique(torch.cat([ids, torch.tensor(sorted(set(must_have)), dtype=torch.long)]))
    return torch.sort(ids).values
