"""Cost model (Leviathan et al. 2023, eq. 1 and Theorem 3.8) against the reference numbers and brute force."""

from __future__ import annotations

import itertools

import pytest

from exactspec import costmodel


def test_reference_timing_example():
    # gamma 2, alpha 0.5, 100 ms target, 20 ms draft: 1.75 tokens/round, 80 ms/token, 1.25x
    assert costmodel.expected_tokens_per_round(0.5, 2) == pytest.approx(1.75)
    assert costmodel.ms_per_token(0.5, 2, 100, 20) == pytest.approx(80.0)
    assert costmodel.speedup(0.5, 2, 0.2) == pytest.approx(1.25)
    # the same with a 50 ms draft: about 114.3 ms/token, 0.875x
    assert costmodel.ms_per_token(0.5, 2, 100, 50) == pytest.approx(114.2857, abs=1e-4)
    assert costmodel.speedup(0.5, 2, 0.5) == pytest.approx(0.875)


@pytest.mark.parametrize("alpha,gamma", [(0.3, 1), (0.7, 3), (0.9, 5), (1.0, 4), (0.0, 3)])
def test_expected_tokens_matches_brute_force_enumeration(alpha, gamma):
    """Enumerate accept/reject patterns: tokens = accepted prefix length + 1."""
    expected = 0.0
    for pattern in itertools.product([True, False], repeat=gamma):
        prob = 1.0
        for accepted in pattern:
            prob *= alpha if accepted else 1 - alpha
        prefix = next((i for i, a in enumerate(pattern) if not a), gamma)
        expected += prob * (prefix + 1)
    assert costmodel.expected_tokens_per_round(alpha, gamma) == pytest.approx(expected)


def test_gamma_zero_is_plain_decoding_and_verify_cost_enters_the_denominator():
    assert costmodel.speedup(0.9, 0, 0.1) == 1.0
    assert costmodel.speedup(0.8, 4, 0.1, verify_cost=1.2) == pytest.approx(
        costmodel.expected_tokens_per_round(0.8, 4) / (4 * 0.1 + 1.2)
    )


def test_best_gamma_is_the_argmax_and_zero_when_speculation_does_not_pay():
    best = costmodel.best_gamma(0.8, 0.1, max_gamma=20)
    assert best.speedup == max(costmodel.speedup(0.8, g, 0.1) for g in range(21))
    assert costmodel.speedup(0.8, best.gamma, 0.1) == best.speedup
    assert costmodel.best_gamma(0.1, 0.9).gamma == 0


def test_estimate_alpha_is_the_maximum_likelihood_estimate():
    rounds = [(4, 4), (4, 1), (4, 0), (2, 2)]  # 7 accepted, 2 rejections
    assert costmodel.estimate_alpha(rounds) == pytest.approx(7 / 9)
    with pytest.raises(ValueError, match="no round drafted"):
        costmodel.estimate_alpha([(0, 0)])
    with pytest.raises(ValueError, match="cannot accept"):
        costmodel.estimate_alpha([(2, 3)])


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda: costmodel.speedup(1.5, 2, 0.1), "alpha must be a probability"),
        (lambda: costmodel.speedup(0.5, -1, 0.1), "gamma must be an integer"),
        (lambda: costmodel.speedup(0.5, 2, -0.1), "cost ratio"),
        (lambda: costmodel.ms_per_token(0.5, 2, 0, 10), "target time"),
        (lambda: costmodel.speedup(0.5, 2, 0.1, verify_cost=0), "verify_cost"),
    ],
)
def test_bad_arguments_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
