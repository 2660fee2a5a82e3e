"""The cost model of speculative decoding (Leviathan et al. 2023, section 3).

With acceptance rate ``alpha`` (each draft token accepted independently with
probability alpha), ``gamma`` draft tokens per round, and a draft call costing
``c`` target calls:

* expected committed tokens per round (eq. 1):  ``(1 - alpha**(gamma+1)) / (1 - alpha)``
* expected walltime improvement (Theorem 3.8):  ``(1 - alpha**(gamma+1)) / ((1 - alpha) (gamma c + 1))``

The theorem assumes verifying ``gamma + 1`` tokens costs one target call;
``verify_cost`` (the measured cost of that call relative to a one-token call)
generalises the denominator to ``gamma c + verify_cost``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

__all__ = [
    "expected_tokens_per_round",
    "expected_tokens_by_gamma",
    "speedup",
    "ms_per_token",
    "best_gamma",
    "estimate_alpha",
    "BestGamma",
    "chain_speedup",
]


def _check(alpha: float, gamma: int, cost_ratio: float = 0.0, verify_cost: float = 1.0) -> None:
    if not (isinstance(alpha, (int, float)) and math.isfinite(alpha) and 0 <= alpha <= 1):
        raise ValueError(f"alpha must be a probability in [0, 1], got {alpha!r}")
    if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 0:
        raise ValueError(f"gamma must be an integer >= 0, got {gamma!r}")
    if not (math.isfinite(cost_ratio) and cost_ratio >= 0):
        raise ValueError(f"the cost ratio c must be a finite number >= 0, got {cost_ratio!r}")
    if not (math.isfinite(verify_cost) and verify_cost > 0):
        raise ValueError(f"verify_cost must be a finite number > 0, got {verify_cost!r}")


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """``(1 - alpha^(gamma+1)) / (1 - alpha)``; ``gamma + 1`` when alpha = 1 (the limit)."""
    _check(alpha, gamma)
    if alpha == 1:
        return float(gamma + 1)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speedup(alpha: float, gamma: int, cost_ratio: float, verify_cost: float = 1.0) -> float:
    """Expected walltime improvement over plain decoding (Theorem 3.8 when ``verify_cost == 1``)."""
    _check(alpha, gamma, cost_ratio, verify_cost)
    round_cost = gamma * cost_ratio + (verify_cost if gamma else 1.0)
    return expected_tokens_per_round(alpha, gamma) / round_cost


def ms_per_token(alpha: float, gamma: int, target_ms: float, draft_ms: float, verify_cost: float = 1.0) -> float:
    """Expected milliseconds per committed token: ``(gamma * draft_ms + verify_cost * target_ms) / E[tokens]``."""
    if not (math.isfinite(target_ms) and target_ms > 0):
        raise ValueError(f"target time must be a finite number > 0, got {target_ms!r}")
    if not (math.isfinite(draft_ms) and draft_ms >= 0):
        raise ValueError(f"draft time must be a finite number >= 0, got {draft_ms!r}")
    return target_ms / speedup(alpha, gamma, draft_ms / target_ms, verify_cost)


def expected_tokens_by_gamma(acceptance: Sequence[float]) -> list[float]:
    """Expected committed tokens per round for every gamma in ``0..K``, with acceptance that varies by draft
    position (eq. 1 generalised): entry g is ``1 + sum_{k<=g} prod_{i<=k} a_i``, where ``a_k`` is
    P(draft position k accepted | positions 1..k-1 accepted). With a constant ``a_k = alpha`` entry g equals
    :func:`expected_tokens_per_round`."""
    totals, reach = [1.0], 1.0
    for rate in acceptance:
        reach *= rate
        totals.append(totals[-1] + reach)
    return totals


@dataclass(frozen=True)
class BestGamma:
    gamma: int
    speedup: float


def best_gamma(alpha: float, cost_ratio: float, max_gamma: int = 32, verify_cost: float = 1.0) -> BestGamma:
    """The gamma in ``0..max_gamma`` with the largest expected speedup (0 means: do not speculate)."""
    _check(alpha, max_gamma, cost_ratio, verify_cost)
    candidates = [(speedup(alpha, g, cost_ratio, verify_cost), -g) for g in range(max_gamma + 1)]
    value, negative_gamma = max(candidates)  # ties go to the smaller gamma
    return BestGamma(gamma=-negative_gamma, speedup=value)


def chain_speedup(
    acceptance: Sequence[float],  # a_k: P(draft position k accepted | positions 1..k-1 accepted), k = 1..K
    draft_ms: float,  # one draft step
    target_ms: Mapping[int, float],  # call size n in tokens -> ms, for n = 1..K+1
    plain_ms: float | None = None,  # plain decoding's ms per token; None: target_ms[1]
) -> BestGamma:
    """The best chain length gamma in ``0..K`` and its expected speedup over plain decoding, with acceptance that
    varies by draft position (eq. 1 generalised): ``E[tokens] = 1 + sum_{k<=gamma} prod_{i<=k} a_i`` per round of
    cost ``gamma * draft_ms + target_ms[gamma + 1]``, against ``plain_ms`` per token without drafting (a target that
    computes more for its draft, a feature draft's capture, is slower per call than plain decoding's)."""
    if not all(math.isfinite(a) and 0 <= a <= 1 for a in acceptance):
        raise ValueError(f"acceptance by position must be probabilities in [0, 1], got {list(acceptance)!r}")
    if not (math.isfinite(draft_ms) and draft_ms >= 0):
        raise ValueError(f"draft time must be a finite number >= 0, got {draft_ms!r}")
    missing = [n for n in range(1, len(acceptance) + 2) if not (n in target_ms and target_ms[n] > 0)]
    if missing:
        raise ValueError(f"target call times are missing or not positive for call sizes {missing}")
    plain_ms = target_ms[1] if plain_ms is None else plain_ms
    best = BestGamma(0, 1.0)
    for gamma, tokens in enumerate(expected_tokens_by_gamma(acceptance)[1:], start=1):
        value = tokens * plain_ms / (gamma * draft_ms + target_ms[gamma + 1])
        if value > best.speedup:
            best = BestGamma(gamma, value)
    return best


def estimate_alpha(rounds: Iterable[tuple[int, int]]) -> float:
    """Maximum-likelihood alpha from observed ``(drafted, accepted)`` pairs.

    Under the i.i.d. model a round with ``g`` drafted and ``n`` accepted has
    likelihood ``alpha^n (1 - alpha)^[n < g]``, so the estimate is
    ``sum n / (sum n + #rounds that stopped at a rejection)``.
    Rounds that drafted nothing carry no information. Raises ValueError with no informative round.
    """
    accepted_total = 0
    rejections = 0
    for drafted, accepted in rounds:
        if not 0 <= accepted <= drafted:
            raise ValueError(f"a round cannot accept {accepted} of {drafted} drafted tokens")
        accepted_total += accepted
        rejections += accepted < drafted
    if accepted_total + rejections == 0:
        raise ValueError("no round drafted any token: alpha cannot be estimated")
    return accepted_total / (accepted_total + rejections)
