"""The statistics of certification: randomized probability-integral transforms and their tests.

For a token x drawn from a distribution p over ordered ids, the randomized PIT

    u = F(x - 1) + v * p(x),   F(x - 1) = sum_{y < x} p(y),   v ~ Uniform(0, 1) independent,

is exactly Uniform(0, 1) (Brockwell 2007). Applied to every generated token with p the target's processed
distribution given that token's own prefix, the u of one sequence are i.i.d. uniform under the exact law
(Rosenblatt 1952: the chain of conditional transforms), so a uniformity test of all u checks the law of whole
sequences on a real vocabulary without enumerating it. A wrong law with per-token total-variation distance delta
moves the u's distribution function by up to delta, so a Kolmogorov-Smirnov test on n values detects shifts down
to about its critical value sqrt(ln(2 / alpha) / (2 n)).

The order of the vocabulary is free as long as it is fixed before the token is drawn (a function of its prefix
and of what happened earlier): with a key k(y) per token, u = P_p(k(Y) < k(x)) + v P_p(k(Y) = k(x)) is the
randomized PIT of k(X) and equally uniform. The order decides the power: by token id, errors scatter over the
ids and partly cancel in the distribution function; by p they add up when the wrong law is too flat or too sharp
(temperature, truncation); by how recently a token last occurred when penalties are wrong; by the
ratio q / p of the draft's distribution to the target's when the draft leaks into the output (a residual drawn
from p, a q that is not the one sampled from).

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

__all__ = [
    "TAIL_EDGES",
    "TestResult",
    "binned_uniform",
    "chi_square_parts",
    "holm",
    "keyed_pit_values",
    "ks_critical_value",
    "ks_uniform",
    "p_order_masses",
    "pit_values",
    "ratio_pit_values",
    "recency_pit_values",
    "token_goodness_of_fit",
]


def pit_values(
    probs: torch.Tensor,  # (n, V) float64 rows: the distribution each token was supposed to follow
    tokens: torch.Tensor,  # (n,) int64
    uniforms: torch.Tensor,  # (n,) float64 in [0, 1): the randomization v
) -> torch.Tensor:  # (n,) float64
    """u = F(x - 1) + v p(x) per row (the equation in the module docstring)."""
    below = torch.cumsum(probs, dim=-1).gather(1, tokens[:, None])[:, 0] - probs.gather(1, tokens[:, None])[:, 0]
    return (below + uniforms * probs.gather(1, tokens[:, None])[:, 0]).clamp(0.0, 1.0)


def keyed_pit_values(
    probs: torch.Tensor,  # (n, V) float64 rows: the distribution each token was supposed to follow
    keys: torch.Tensor,  # (n, V) the order of the vocabulary in each row, fixed before the token was drawn
    tokens: torch.Tensor,  # (n,) int64
    uniforms: torch.Tensor,  # (n,) float64 in [0, 1)
) -> torch.Tensor:  # (n,) float64
    """u = P_p(k(Y) < k(x)) + v P_p(k(Y) = k(x)) per row; ties are randomized together (module docstring)."""
    below, tied = _keyed_masses(probs, keys, keys.gather(1, tokens[:, None]))
    return (below + uniforms * tied).clamp(0.0, 1.0)


def _keyed_masses(probs: torch.Tensor, keys: torch.Tensor, own: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(P_p(k(Y) < own), P_p(k(Y) = own))`` per row; probs, keys ``(n, V)``, own ``(n, 1)``."""
    below = torch.where(keys < own, probs, 0.0).sum(-1)  # a select, not a product with a bool cast: 4x faster at 49k
    return below, torch.where(keys == own, probs, 0.0).sum(-1)


# The orders certification uses, each computed in as few passes over the vocabulary as it needs: the order by p
# needs two, the order by recency reuses them and corrects for the few tokens seen before, and the order by q / p
# only looks at the draft's recorded tokens (every other token has q = 0, ratio 0). Each equals
# keyed_pit_values under the key its docstring names, up to the order of floating-point sums
# (tests/test_certification.py).


def p_order_masses(
    probs: torch.Tensor, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:  # probs (n, V), tokens (n,)
    """``(P_p(p(Y) < p(x)), P_p(p(Y) = p(x)))`` per row: the parts of the PIT in the order by p (key ``p``). Tokens
    tied with x have x's probability, so their mass is ``p(x)`` times their count: one masked sum fewer."""
    own = probs.gather(1, tokens[:, None])  # (n, 1)
    below = torch.where(probs < own, probs, 0.0).sum(-1)
    return below, own[:, 0] * (probs == own).sum(-1)


def recency_pit_values(
    probs: torch.Tensor,  # (n, V) float64
    tokens: torch.Tensor,  # (n,) int64, row i's token; row i conditions on prefix + tokens[:i]
    uniforms: torch.Tensor,  # (n,) float64
    prefix: list[int],
    p_masses: tuple[torch.Tensor, torch.Tensor],  # p_order_masses(probs, tokens)
    mass: torch.Tensor,  # (n,) float64: each row's total p
) -> torch.Tensor:  # (n,) float64
    """PIT in the order by recency: tokens not in the row's prefix first, by p; then those in it, by the position of
    their last occurrence (distinct per token, so no ties). Costs ``O(n * m)`` for the ``m`` distinct tokens of
    prefix + tokens, on top of ``p_masses``: the unseen tokens' masses are the p order's minus the seen tokens'."""
    n = len(tokens)
    seen_ids, column = torch.unique(
        torch.cat([torch.as_tensor(prefix, dtype=torch.int64), tokens]), return_inverse=True
    )
    # last[i, j]: position of seen_ids[j]'s last occurrence before row i's token, -1 if none yet
    positions = torch.arange(len(prefix) + n, dtype=torch.float64)
    occurred = torch.full((len(prefix) + n + 1, len(seen_ids)), -1.0, dtype=torch.float64)
    occurred[torch.arange(1, len(prefix) + n + 1), column] = positions
    last = occurred.cummax(0).values[len(prefix) : len(prefix) + n]  # (n, m): row i sees prefix + tokens[:i]
    seen = last >= 0
    p_seen = torch.where(seen, probs.index_select(1, seen_ids), 0.0)  # (n, m)
    rows, own_column = torch.arange(n), column[len(prefix) :]
    own_p, own_last = probs[rows, tokens].unsqueeze(1), last[rows, own_column].unsqueeze(1)  # (n, 1) each
    p_below, p_tied = p_masses
    unseen_below = p_below - torch.where(p_seen < own_p, p_seen, 0.0).sum(-1)
    unseen_tied = p_tied - torch.where(seen & (p_seen == own_p), p_seen, 0.0).sum(-1)
    seen_below = mass - p_seen.sum(-1) + torch.where(last < own_last, p_seen, 0.0).sum(-1)
    is_seen = own_last[:, 0] >= 0
    below = torch.where(is_seen, seen_below, unseen_below)
    tied = torch.where(is_seen, own_p[:, 0], unseen_tied)
    return (below + uniforms * tied).clamp(0.0, 1.0)


def ratio_pit_values(
    p_recorded: torch.Tensor,  # (d, K) float64: p of the draft's recorded tokens (its K most likely) per drafted row
    mass: torch.Tensor,  # (d,) float64: each row's total p
    tokens: torch.Tensor,  # (d,) int64
    uniforms: torch.Tensor,  # (d,) float64
    q_ids: torch.Tensor,  # (d, K) int64: the recorded tokens
    q_values: torch.Tensor,  # (d, K): their q
) -> torch.Tensor:  # (d,) float64
    """PIT in the order by q / p (tokens outside ``q_ids`` count as q = 0, ratio 0, all tied): the K recorded tokens
    and one column for the rest of the vocabulary, in ``O(d * K)``."""
    ratio = q_values.to(torch.float64) / p_recorded.clamp_min(1e-300)
    rest = (mass - p_recorded.sum(-1)).clamp_min(0.0).unsqueeze(1)  # mass of the tokens with no recorded q
    keys, masses = torch.cat([ratio, ratio.new_zeros(len(tokens), 1)], 1), torch.cat([p_recorded, rest], 1)
    own = torch.where(q_ids == tokens.unsqueeze(1), ratio, 0.0).amax(
        -1, keepdim=True
    )  # the token's ratio, 0 if unrecorded
    below, tied = _keyed_masses(masses, keys, own)
    return (below + uniforms * tied).clamp(0.0, 1.0)


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


#: Bin edges of :func:`binned_uniform`: deciles, and bins down to 1e-3 wide at both ends, where an error confined to
#: tokens of small total mass (a penalty left out, the draft's favourites) lands in a key order and where the KS
#: distance hardly moves.
TAIL_EDGES = (0.0, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.97, 0.99, 0.997, 0.999, 1.0)


def binned_uniform(name: str, values: np.ndarray) -> TestResult:
    """Pearson's chi-square of ``values`` counted in :data:`TAIL_EDGES` bins against Uniform(0, 1) (bins expected
    fewer than 5 times are merged, as in :func:`chi_square_parts`)."""
    edges = np.array(TAIL_EDGES)
    counts = np.histogram(np.clip(values, 0.0, 1.0), bins=edges)[0]
    statistic, dof = chi_square_parts({i: int(c) for i, c in enumerate(counts) if c}, torch.tensor(np.diff(edges)))
    return TestResult(name, len(values), statistic, float(stats.chi2.sf(statistic, dof)) if dof else 1.0)


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
