"""Cost model (Leviathan et al. 2023, eq. 1 and Theorem 3.8) against the reference numbers and brute force."""

from __future__ import annotations

import itertools

import pytest

from exactspec.decoding import costmodel


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


def test_expected_tokens_by_gamma_enumerates_where_a_round_first_rejects():
    """Entry g is the mean of committed tokens over every accept/reject pattern of g draft positions, with position k
    accepted with probability a_k given that the earlier ones were; a constant rate gives eq. 1."""
    acceptance = [0.9, 0.5, 0.3, 0.8]
    totals = costmodel.expected_tokens_by_gamma(acceptance)
    for gamma in range(len(acceptance) + 1):
        mean, reach = 0.0, 1.0
        for first_rejection in range(gamma):  # positions 0..first_rejection-1 accepted, then a rejection
            mean += reach * (1 - acceptance[first_rejection]) * (first_rejection + 1)
            reach *= acceptance[first_rejection]
        mean += reach * (gamma + 1)  # every drafted token accepted, plus the bonus token
        assert totals[gamma] == pytest.approx(mean)
    constant = costmodel.expected_tokens_by_gamma([0.7] * 5)
    assert constant == pytest.approx([costmodel.expected_tokens_per_round(0.7, g) for g in range(6)])


def test_chain_speedup_enumerates_rounds_with_acceptance_by_position():
    """Per-position acceptance: brute force over the round's first rejection; a constant rate gives Theorem 3.8."""
    acceptance, draft_ms = [0.6, 0.45, 0.3], 2.0
    target_ms = {1: 10.0, 2: 12.0, 3: 15.0, 4: 19.0}
    best = costmodel.chain_speedup(acceptance, draft_ms, target_ms)
    speedups = [1.0]
    for gamma in range(1, 4):
        tokens, reach = 0.0, 1.0
        for n in range(gamma + 1):  # n drafts accepted, then a rejection (or the end of the chain)
            stop = 1 - acceptance[n] if n < gamma else 1.0
            tokens += reach * stop * (n + 1)
            reach *= acceptance[n] if n < gamma else 0.0
        speedups.append(tokens * 10.0 / (gamma * draft_ms + target_ms[gamma + 1]))
    assert best.gamma == max(range(4), key=speedups.__getitem__)
    assert best.speedup == pytest.approx(max(speedups))
    constant = costmodel.chain_speedup([0.8] * 6, 1.0, {n: 10.0 for n in range(1, 8)})
    reference = costmodel.best_gamma(0.8, 0.1, max_gamma=6)
    assert constant.gamma == reference.gamma and constant.speedup == pytest.approx(reference.speedup)
    assert costmodel.chain_speedup([0.2, 0.1], 5.0, {1: 10.0, 2: 20.0, 3: 30.0}).gamma == 0  # drafting never pays
    with pytest.raises(ValueError, match="call sizes \\[3\\]"):
        costmodel.chain_speedup([0.5, 0.5], 1.0, {1: 10.0, 2: 11.0})


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
