"""A generation's round records and the cost model's time for them (exactspec.decoding.stats)."""

from __future__ import annotations

import pytest

from exactspec.decoding.stats import GenerationStats, RoundRecord


def stats_of(*rounds: tuple[int, int]) -> GenerationStats:
    """(drafted, accepted) per round after a first round whose target call took 0.2 s (the prefill)."""
    stats = GenerationStats([RoundRecord(0, 0, 1, 0.0, 0.2, 0.0)])
    for drafted, accepted in rounds:
        stats.observe(RoundRecord(drafted, accepted, accepted + 1, 0.0, 0.0, 0.0))
    return stats


def test_modelled_seconds_charge_each_round_its_own_gamma():
    """prefill as measured + sum over later rounds of gamma d + c(gamma + 1): here 0.2 + (10) + (2 * 3 + 16) + (4 * 3 + 30) ms."""
    costs = {1: 10.0, 3: 16.0, 5: 30.0}
    assert stats_of((0, 0), (2, 1), (4, 4)).modelled_seconds(costs, 3.0) == pytest.approx(0.2 + (10 + 22 + 42) / 1000)
    assert stats_of((0, 0)).modelled_seconds(costs, None) == pytest.approx(0.21)  # plain rounds need no draft cost
    assert stats_of((1, 0)).modelled_seconds(costs, 3.0) is None  # c(2) was not measured
    assert stats_of((2, 0)).modelled_seconds(costs, None) is None  # a draft without a draft cost
