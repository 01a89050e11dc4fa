"""Sampling: guided speculative decoding draws from the same grammar-masked distribution as guided decoding without
speculation (rejection sampling on masked logits).

Statistic: for each of the first four token positions, Pearson's chi-square test of homogeneity between the tokens
sampled with and without speculation (N requests each, fixed seeds; categories with fewer than 5 expected draws are
pooled). The test fails when any position has p < 0.001. The draft must be accepted in part, so that the rejection
sampler, not only the first-token sampler, produces most tokens.
"""
import functools
import math
from collections import Counter

import pytest
from e2e_helpers import METHODS, gen_config, generate, method_pipeline, response_format

from lmdeploy_guided_spec.cpu.steps import StepRecorder

N = 256
POSITIONS = 4
P_MIN = 1e-3
# four free choices of four words each; the grammar forces nothing else but the end
REGEX = r'(cat|dog|owl|bee)( (red|tan|big|old)){3}'


def chi2_sf(x: float, dof: int) -> float:
    """Survival function of the chi-square distribution (regularized upper incomplete gamma, no scipy)."""
    a, z = dof / 2.0, x / 2.0
    if z <= 0:
        return 1.0
    if z < a + 1:
        term = total = 1.0 / a
        n = a
        while term > total * 1e-15:
            n += 1
            term *= z / n
            total += term
        return max(0.0, 1.0 - total * math.exp(-z + a * math.log(z) - math.lgamma(a)))
    # continued fraction (Lentz)
    tiny = 1e-300
    b, c, d = z + 1 - a, 1 / tiny, 1 / (z + 1 - a)
    h = d
    for i in range(1, 500):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        h *= d * c
        if abs(d * c - 1) < 1e-15:
            break
    return math.exp(-z + a * math.log(z) - math.lgamma(a)) * h


def homogeneity_p(a: Counter, b: Counter) -> tuple[float, int]:
    """p-value and degrees of freedom of Pearson's chi-square test that two samples share one distribution."""
    na, nb = sum(a.values()), sum(b.values())
    total = na + nb
    cells, other = [], [0, 0]
    for key in set(a) | set(b):
        row = [a[key], b[key]]
        if (row[0] + row[1]) * min(na, nb) / total < 5:
            other = [other[0] + row[0], other[1] + row[1]]
        else:
            cells.append(row)
    if sum(other):
        cells.append(other)
    stat = 0.0
    for row in cells:
        for count, n in zip(row, (na, nb)):
            expected = (row[0] + row[1]) * n / total
            stat += (count - expected)**2 / expected
    dof = len(cells) - 1
    return (chi2_sf(stat, dof) if dof > 0 else 1.0), dof


def test_chi2_sf_matches_known_quantiles():
    assert chi2_sf(3.841, 1) == pytest.approx(0.05, abs=1e-3)
    assert chi2_sf(11.345, 3) == pytest.approx(0.01, abs=1e-3)
    assert chi2_sf(30.578, 15) == pytest.approx(0.01, abs=1e-3)


@pytest.mark.one_method({'0.18': ['deepseek_mtp'], '0.14': ['eagle3']})
@pytest.mark.parametrize('method', list(METHODS))
def test_sampled_token_distribution_matches(engines, method):
    fmt = response_format('regex_schema', regex=REGEX)
    configs = [gen_config(fmt, sampling=True, seed=1000 + i, temperature=1.0, top_k=40, max_new_tokens=32)
               for i in range(N)]
    prompts = ['Name an animal and three adjectives.'] * N
    with StepRecorder() as recorder:
        spec = generate(engines(METHODS[method]), prompts, configs)
    ref = generate(engines(METHODS[method], spec=False), prompts, configs)
    decoding = [row for row in recorder.rows() if row.drafts]
    accepted = sum(row.accepted for row in decoding)
    drafted = sum(len(row.drafts) for row in decoding)
    assert 0 < accepted < drafted, 'the rejection sampler must accept some drafts and reject others'
    for out in spec + ref:
        assert out.finish_reason == 'stop', out
    for pos in range(POSITIONS):
        p, dof = homogeneity_p(Counter(o.token_ids[pos] for o in spec if len(o.token_ids) > pos),
                               Counter(o.token_ids[pos] for o in ref if len(o.token_ids) > pos))
        assert dof >= 1, f'position {pos}: a single category, nothing to compare'
        assert p >= P_MIN, f'position {pos}: chi-square p = {p:.2e} ({dof} dof)'


def _three_letters(letters: dict, all_ids, logits):
    """A logits processor that leaves the model three tokens with fixed logits (``{token id: logit}``)."""
    kept = logits.new_full(logits.shape, float('-inf'))
    for token, value in letters.items():
        kept[token] = value
    return logits.copy_(kept)


@pytest.mark.one_method({'0.18': ['grammar'], '0.14': ['eagle3']})
@pytest.mark.parametrize('method', ['eagle3', 'grammar'])
def test_top_k_top_p_and_min_p_hold_at_every_verified_position(engines, method):
    """The rejection sampler applied ``top_k``, ``top_p`` and ``min_p`` to the bonus token alone: a draft token was
    verified against the logits before them, so speculative decoding sampled tokens they exclude (about 12 in 40 of
    each), with or without a grammar, and the draft-free ``grammar`` method changed how every sampled request
    samples. With three tokens of logits 0, -0.1 and -0.2, ``top_k=2`` never samples the third, and ``top_p=0.2``
    (the first holds 37 %) or ``min_p=0.95`` (the second is 90 % as likely) only the first, as without
    speculation."""
    pipe = method_pipeline(engines, method)
    vocab = pipe.async_engine.tokenizer.model.model.get_vocab()
    a, b, c = (vocab[letter] for letter in 'abc')
    processor = functools.partial(_three_letters, {a: 0.0, b: -0.1, c: -0.2})
    settings = [({'top_k': 2}, {a, b}), ({'top_p': 0.2, 'top_k': 0}, {a}), ({'min_p': 0.95, 'top_k': 0}, {a})]
    fmts = [None, response_format('regex_schema', regex='[abc]{40}')]
    cases = [(setting, allowed, fmt, seed) for setting, allowed in settings for fmt in fmts for seed in range(3)]
    configs = [gen_config(fmt, sampling=True, seed=seed, temperature=1.0, max_new_tokens=40, ignore_eos=fmt is None,
                          logits_processors=[processor], **setting) for setting, _, fmt, seed in cases]
    with StepRecorder() as recorder:
        outputs = generate(pipe, ['Letters:'] * len(configs), configs)
    assert sum(row.accepted for row in recorder.rows() if row.drafts) > 0, 'no draft was accepted: nothing verified'
    # a request alone in its batch too (its draft positions are no copy of the logits)
    outputs += generate(pipe, ['Letters:'], configs[:1])
    for out, (setting, allowed, fmt, _) in zip(outputs, cases + cases[:1]):
        assert out.finish_reason in ('stop', 'length') and len(out.token_ids) == 40, (setting, fmt, out)
        assert set(out.token_ids) <= allowed, (setting, fmt, Counter(out.token_ids))
