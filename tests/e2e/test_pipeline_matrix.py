"""``pipeline`` with speculative decoding and ``response_format``: every proposer, format, decoding mode, streaming
or not. Greedy output must equal lmdeploy's guided decoding without speculation, token for token."""
import pytest
from e2e_helpers import METHODS, PROMPTS, check_valid, gen_config, generate, response_format, stream

FORMATS = ('json_schema', 'regex_schema', 'json_object')


@pytest.fixture(scope='module')
def references(engines):
    """Greedy guided outputs without speculation, per (method, format)."""
    cache = {}

    def get(method, kind):
        if (method, kind) not in cache:
            fmt = response_format(kind)
            cache[method, kind] = generate(engines(METHODS[method], spec=False), PROMPTS[:3], [gen_config(fmt)] * 3)
        return cache[method, kind]

    return get


@pytest.mark.parametrize('streaming', [False, True], ids=['batch', 'stream'])
@pytest.mark.parametrize('mode', ['greedy', 'sampling'])
@pytest.mark.parametrize('kind', FORMATS)
@pytest.mark.parametrize('method', list(METHODS))
def test_guided_speculative_pipeline(engines, references, method, kind, mode, streaming):
    fmt = response_format(kind)
    configs = [gen_config(fmt, sampling=mode == 'sampling', seed=100 + i) for i in range(3)]
    run = stream if streaming else generate
    outputs = run(engines(METHODS[method]), PROMPTS[:3], configs)
    for out in outputs:
        assert out.finish_reason == 'stop', out
        check_valid(out.text, fmt)
    if mode == 'greedy':
        assert [o.token_ids for o in outputs] == [r.token_ids for r in references(method, kind)]
