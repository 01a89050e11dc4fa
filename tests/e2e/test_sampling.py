"""Sampling: guided speculative decoding draws from the same grammar-masked distribution as guided decoding without
speculation (rejection sampling on masked logits).

Statistic: for each of the first four token positions, Pearson's chi-square test of homogeneity between the tokens
sampled with and without speculation (N requests each, fixed seeds; categories with fewer than 5 expected draws are
pooled). The test fails when any position has p < 0.001. The draft must be accepted in part, so that the rejection
sampler, not only the first-token sampler, produces most tokens.
"""
import math
from collections import Counter

import pytest
from e2e_helpers import METHODS, gen_config, generate, response_format

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
