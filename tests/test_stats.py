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
    """prefill as measured + sum over later rounds of gamma d + c(gamma + 1): here
    0.2 + (10) + (2 * 3 + 16) + (4 * 3 + 30) ms."""
    costs = {1: 10.0, 3: 16.0, 5: 30.0}
    assert stats_of((0, 0), (2, 1), (4, 4)).modelled_seconds(costs, 3.0) == pytest.approx(0.2 + (10 + 22 + 42) / 1000)
    assert stats_of((0, 0)).modelled_seconds(costs, None) == pytest.approx(0.21)  # plain rounds need no draft cost
    assert stats_of((1, 0)).modelled_seconds(costs, 3.0) is None  # c(2) was not measured
    assert stats_of((2, 0)).modelled_seconds(costs, None) is None  # a draft without a draft cost


def test_acceptance_is_broken_down_by_the_source_that_drafted():
    """Lookup and draft rounds apart (a draft's 1 of 2 and 0 of 2 against lookup's 3 of 3); plain rounds in neither."""
    stats = GenerationStats([RoundRecord(0, 0, 1, 0.0, 0.2, 0.0)])
    for drafted, accepted, source in ((2, 1, "draft"), (3, 3, "lookup"), (2, 0, "draft"), (0, 0, "draft")):
        stats.observe(RoundRecord(drafted, accepted, accepted + 1, 0.0, 0.0, 0.0, source=source))
    sources = stats.by_source()
    assert sources["draft"] == {
        "rounds": 2,
        "drafted": 4,
        "accepted": 1,
        "acceptance_by_position": [0.5, 0.0],
        "tokens_per_round": 1.5,
    }
    assert (
        sources["lookup"]["acceptance_by_position"] == [1.0, 1.0, 1.0] and sources["lookup"]["tokens_per_round"] == 4.0
    )
    assert set(sources) == {"draft", "lookup"} and stats.summary()["acceptance_by_source"] == sources
