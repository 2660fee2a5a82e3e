"""The statistics of certification: randomized probability-integral transforms and their tests.

For a token x drawn from a distribution p over ordered ids, the randomized PIT

    u = F(x - 1) + v * p(x),   F(x - 1) = sum_{y < x} p(y),   v ~ Uniform(0, 1) independent,

is exactly Uniform(0, 1) (Brockwell 2007). Applied to every generated token with p the target's processed
distribution given that token's own prefix, the u of one sequence are i.i.d. uniform under the exact law
(Rosenblatt 1952: the chain of conditional transforms), so a uniformity test of all u checks the law of whole
sequences on a real vocabulary without enumerating it. A wrong law with per-token total-variation distance delta
moves the u's distribution function by up to delta, so a Kolmogorov-Smirnov test on n values detects shifts down
to about its critical value sqrt(ln(2 / alpha) / (2 n)).

Which subsets may be tested apart: any chosen by what happened before a token (its position in its round is
fixed by the earlier acceptances), never by what happened to the token itself. Accepted draft tokens alone
follow min(p, q) and replacements the residual, not p, so a test on them would reject a correct sampler.

Where prefixes repeat (code, low temperature), the next token after a prefix seen m times is a sample of m
draws from that prefix's p: a chi-square goodness of fit on exactly the real vocabulary, much stronger than the
PIT test against errors that concentrate on a few tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy import stats

__all__ = ["TestResult", "chi_square_parts", "holm", "ks_critical_value", "ks_uniform", "pit_values", "token_goodness_of_fit"]


def pit_values(
    probs: torch.Tensor,  # (n, V) float64 rows: the distribution each token was supposed to follow
    tokens: torch.Tensor,  # (n,) int64
    uniforms: torch.Tensor,  # (n,) float64 in [0, 1): the randomization v
) -> torch.Tensor:  # (n,) float64
    """u = F(x - 1) + v p(x) per row (the equation in the module docstring)."""
    below = torch.cumsum(probs, dim=-1).gather(1, tokens[:, None])[:, 0] - probs.gather(1, tokens[:, None])[:, 0]
    return (below + uniforms * probs.gather(1, tokens[:, None])[:, 0]).clamp(0.0, 1.0)


@dataclass(frozen=True)
class TestResult:
    __test__ = False  # not a pytest test class

    name: str
    n: int
    statistic: float
    p_value: float
    adjusted_p: float = float("nan")  # Holm-adjusted over the family
    rejected: bool = False


def ks_uniform(name: str, values: np.ndarray) -> TestResult:
    """Kolmogorov-Smirnov test of ``values`` against Uniform(0, 1) (exact p-value for small n, asymptotic above)."""
    result = stats.kstest(values, "uniform")
    return TestResult(name, len(values), float(result.statistic), float(result.pvalue))


def chi_square_parts(counts: dict[int, int], probs: torch.Tensor) -> tuple[float, int]:
    """``(statistic, degrees of freedom)`` of Pearson's chi-square of token counts against ``probs`` ``(V,)``;
    categories expected fewer than 5 times are merged into one tail category. A token of probability 0 that
    occurs gives an infinite statistic."""
    n = sum(counts.values())
    if any(probs[token] == 0 for token in counts):
        return math.inf, 1
    expected = probs.numpy() * n
    big = expected >= 5
    observed = np.zeros_like(expected)
    for token, count in counts.items():
        observed[token] = count
    obs = list(observed[big]) + [observed[~big].sum()]
    exp = list(expected[big]) + [expected[~big].sum()]
    if exp[-1] < 1e-12:
        obs, exp = obs[:-1], exp[:-1]
    return float(sum((o - e) ** 2 / e for o, e in zip(obs, exp))), len(obs) - 1


def token_goodness_of_fit(name: str, groups: list[tuple[dict[int, int], torch.Tensor]]) -> TestResult:
    """One chi-square test over several groups of next-token counts, each against its own distribution (the
    statistics and degrees of freedom add up across independent groups)."""
    parts = [chi_square_parts(counts, probs) for counts, probs in groups]
    statistic, dof = sum(p for p, _ in parts), sum(d for _, d in parts)
    n = sum(sum(counts.values()) for counts, _ in groups)
    if dof == 0:
        return TestResult(name, n, 0.0, 1.0)
    return TestResult(name, n, statistic, 0.0 if math.isinf(statistic) else float(stats.chi2.sf(statistic, dof)))


def holm(results: list[TestResult], alpha: float) -> list[TestResult]:
    """Holm's step-down adjustment: the family-wise false-positive rate is at most ``alpha``."""
    order = sorted(range(len(results)), key=lambda i: results[i].p_value)
    adjusted, running = [0.0] * len(results), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(results) - rank) * results[i].p_value))
        adjusted[i] = running
    return [TestResult(r.name, r.n, r.statistic, r.p_value, a, a < alpha) for r, a in zip(results, adjusted)]


def ks_critical_value(n: int, alpha: float) -> float:
    """The KS distance a sample of n uniforms exceeds with probability alpha (asymptotic): about the smallest
    per-token total-variation distance the uniformity test detects."""
    return math.sqrt(math.log(2 / alpha) / (2 * n)) if n else math.inf
