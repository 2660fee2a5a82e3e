"""The adaptive gamma policy: it follows the cost model on its estimates, drops to plain decoding
when speculation does not pay, probes again with a growing wait, and keeps the output law."""

from __future__ import annotations

import pytest

from exactspec import GREEDY, GenerationConfig, MarkovLM, SpeculativeDecoder
from exactspec.costmodel import best_gamma
from exactspec.policy import AdaptiveConfig, AdaptiveGamma, RunningMean
from exactspec.stats import RoundRecord


def feed(policy: AdaptiveGamma, rounds: int, alpha_pattern, draft_ms: float, target_ms_of) -> None:
    """Feed rounds as the policy asks for them; acceptance from a deterministic pattern."""
    for r in range(rounds):
        gamma = policy.next_gamma()
        accepted = 0
        while accepted < gamma and alpha_pattern(r, accepted):
            accepted += 1
        policy.observe(RoundRecord(gamma, accepted, accepted + 1, gamma * draft_ms / 1000, target_ms_of(gamma + 1) / 1000, 0.0))


def test_matches_the_cost_model_optimum_for_iid_acceptance():
    """With acceptance alpha at every position and flat verify cost, the choice is costmodel.best_gamma."""
    policy = AdaptiveGamma(AdaptiveConfig(max_gamma=8, smoothing=0.02))
    for i in range(8):
        for _ in range(500):
            policy.accept[i].update(0.8)
    policy.draft_ms = RunningMean(0.1, 0.02)
    policy.target_ms = {n: RunningMean(1.0, 0.02, count=10) for n in range(1, 10)}
    expected = best_gamma(policy.accept[0].value, 0.1, max_gamma=8).gamma
    assert expected == 6 and policy.next_gamma() == expected
    policy.draft_ms = RunningMean(0.6, 0.02)  # a dearer draft: shorter drafts
    assert policy.next_gamma() == best_gamma(policy.accept[0].value, 0.6, max_gamma=8).gamma < 6


def test_a_useless_draft_drops_to_plain_decoding_and_probes_rarely():
    policy = AdaptiveGamma()
    feed(policy, 400, lambda r, i: False, draft_ms=0.3, target_ms_of=lambda n: 2.0 + 0.05 * n)
    choices = []
    for _ in range(400):
        choices.append(policy.next_gamma())
        policy.observe(RoundRecord(choices[-1], 0, 1, choices[-1] * 0.0003, (2.0 + 0.05 * (choices[-1] + 1)) / 1000, 0.0))
    probes = sum(g > 0 for g in choices)
    assert probes <= 400 / 64 + 1  # the wait has grown to at least 64 plain rounds


def test_a_good_draft_keeps_speculating_and_recovers_after_a_bad_patch():
    policy = AdaptiveGamma()
    feed(policy, 200, lambda r, i: False, draft_ms=0.2, target_ms_of=lambda n: 2.0)
    assert policy.next_gamma() == 0
    feed(policy, 3000, lambda r, i: (r * 7 + i) % 10 != 0, draft_ms=0.2, target_ms_of=lambda n: 2.0)
    assert policy.next_gamma() >= 4


def test_adaptive_speculation_keeps_greedy_output_and_the_sampling_law():
    target = MarkovLM.random(6, 2, seed=21)
    draft = MarkovLM(target.table + MarkovLM.random(6, 2, seed=22, scale=0.7).table, 2)
    config = GenerationConfig(max_new_tokens=60)
    plain = SpeculativeDecoder(target, None, GREEDY).generate([1, 2], config)
    adaptive = SpeculativeDecoder(target, draft, GREEDY, policy=AdaptiveGamma()).generate([1, 2], config)
    assert adaptive.tokens == plain.tokens
    gammas = {r.drafted for r in adaptive.stats.rounds}
    assert len(gammas) > 1


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="initial_gamma"):
        AdaptiveConfig(max_gamma=2, initial_gamma=4)
    with pytest.raises(ValueError, match="smoothing"):
        AdaptiveConfig(smoothing=0)


def test_one_slow_call_at_a_rare_size_does_not_ban_that_size():
    """The target cost is a weighted line over sizes, so a single outlier barely moves it."""
    policy = AdaptiveGamma()
    policy.target_ms = {4: RunningMean(5.0, 0.1, count=150), 5: RunningMean(9.0, 0.1, count=1), 3: RunningMean(4.9, 0.1, count=20)}
    n_bar, t_bar, slope = policy.target_cost_line()
    assert t_bar + slope * (5 - n_bar) < 5.4
