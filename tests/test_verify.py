"""Exact tests of the verifier (exactspec.decoding.verify).

The single-position tests check the law identity min(p,q) + P(reject) residual = p
for hundreds of pairs. The block tests integrate the *real* verifier
(``verify_with_uniforms``) exactly over its uniforms. The correct verifier is
constant on cells of the uniform space: acceptance uniform ``u_i`` splits at
``a_i = min(1, p/q)``, the sampling uniform at the correct correction
distribution's CDF. Each cell is probed just inside its boundaries (an
acceptance cell next to its threshold, a sampling interval near both ends), so
a verifier with a shifted threshold or a different correction distribution puts
a probe in the wrong cell and moves mass. Any change to the acceptance test,
the residual, the bonus or the truncation after a rejection fails these tests;
no randomness is involved.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from conftest import disjoint_pair, random_distribution

from exactspec.decoding import verify
from exactspec.decoding.verify import (
    greedy_token,
    output_law,
    residual_distribution,
    verify_greedy,
    verify_point_mass,
    verify_stochastic,
    verify_with_uniforms,
)

KINDS = ["dense", "sparse", "one_hot", "tiny"]


def pairs(count: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    for i in range(count):
        vocab = 2 + i % 7
        if i % 10 == 0:
            yield disjoint_pair(generator, vocab)
        elif i % 10 == 1:
            p = random_distribution(generator, vocab, KINDS[i % 4])
            yield p, p.clone()
        else:
            yield (
                random_distribution(generator, vocab, KINDS[i % 4]),
                random_distribution(generator, vocab, KINDS[(i // 4) % 4]),
            )


# ------------------------------------------------------------ single position


def test_worked_example_numbers():
    p = torch.tensor([0.6, 0.3, 0.1], dtype=torch.float64)
    q = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    assert torch.allclose(verify.acceptance_probabilities(p, q), torch.tensor([1.0, 1.0, 0.4], dtype=torch.float64))
    assert torch.allclose(verify.accepted_mass(p, q), torch.tensor([0.5, 0.25, 0.1], dtype=torch.float64))
    assert float(verify.rejection_probability(p, q)) == pytest.approx(0.15)
    assert torch.allclose(residual_distribution(p, q), torch.tensor([2 / 3, 1 / 3, 0.0], dtype=torch.float64))
    assert torch.allclose(output_law(p, q), p, atol=1e-15)
    assert torch.allclose(verify.naive_output_law(p, q), torch.tensor([0.59, 0.295, 0.115], dtype=torch.float64))
    assert float(verify.independent_match_rate(p, p)) == pytest.approx(0.46)


@pytest.mark.parametrize("seed", range(3))
def test_output_law_equals_target_for_hundreds_of_pairs(seed):
    for p, q in pairs(200, seed):
        law = output_law(p, q)
        assert torch.isfinite(law).all()
        assert (law - p).abs().max() < 1e-12, (p, q, law)


def test_naive_replacement_law_differs_whenever_rejection_is_possible():
    for p, q in pairs(200):
        if verify.rejection_probability(p, q) > 1e-6 and (p - residual_distribution(p, q)).abs().max() > 1e-6:
            assert (verify.naive_output_law(p, q) - p).abs().max() > 1e-9


def test_equal_distributions_never_reject_and_residual_is_not_normalised():
    p = torch.tensor([0.7, 0.3, 0.0], dtype=torch.float64)
    assert float(verify.rejection_probability(p, p)) == 0.0
    assert torch.equal(residual_distribution(p, p), torch.zeros(3, dtype=torch.float64))
    generator = torch.Generator().manual_seed(0)
    tokens = torch.multinomial(p.float().expand(500, 3), 1, generator=generator)  # (500, 1)
    result = verify_stochastic(tokens, p.expand(500, 1, 3), p.expand(500, 2, 3), generator)
    assert (result.num_accepted == 1).all()


def test_disjoint_supports_always_reject_and_draw_from_target():
    p = torch.tensor([0.5, 0.5, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.0, 0.0, 0.2, 0.8], dtype=torch.float64)
    assert float(verify.rejection_probability(p, q)) == pytest.approx(1.0)
    assert torch.allclose(residual_distribution(p, q), p)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.full((1000, 1), 3)
    result = verify_stochastic(tokens, q.expand(1000, 1, 4), p.expand(1000, 2, 4), generator)
    assert (result.num_accepted == 0).all()
    assert set(result.tokens[:, 0].tolist()) == {0, 1}


def test_target_zero_probability_token_is_never_accepted():
    p = torch.tensor([1.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.5, 0.5], dtype=torch.float64)
    generator = torch.Generator().manual_seed(2)
    result = verify_stochastic(
        torch.ones((2000, 1), dtype=torch.int64), q.expand(2000, 1, 2), p.expand(2000, 2, 2), generator
    )
    assert (result.num_accepted == 0).all() and (result.tokens[:, 0] == 0).all()


def test_tiny_probabilities_do_not_produce_nan():
    p = torch.tensor([1 - 2e-300, 1e-300, 1e-300], dtype=torch.float64)
    q = torch.tensor([1e-300, 1 - 2e-300, 1e-300], dtype=torch.float64)
    assert (output_law(p, q) - p).abs().max() < 1e-15
    generator = torch.Generator().manual_seed(3)
    result = verify_stochastic(
        torch.ones((100, 1), dtype=torch.int64), q.expand(100, 1, 3), p.expand(100, 2, 3), generator
    )
    assert (result.tokens[:, 0] == 0).all()


def test_sample_from_intervals_have_exactly_the_probability_mass():
    """Inverse-CDF quadrature: 100k evenly spaced uniforms hit each token in proportion p(x)."""
    p = torch.tensor([0.1, 0.0, 0.25, 0.65], dtype=torch.float64)
    grid = (torch.arange(100_000, dtype=torch.float64) + 0.5) / 100_000
    tokens = verify.sample_from(p.expand(100_000, 4), grid)
    frequencies = torch.bincount(tokens, minlength=4).double() / 100_000
    assert torch.allclose(frequencies, p, atol=1e-5)
    assert frequencies[1] == 0


# ------------------------------------------------------ blocks, integrated exactly


def conditional_tables(vocab: int, depth: int, seed: int):
    """Random p(. | prefix) and q(. | prefix) for every prefix of length < depth, with all edge kinds."""
    generator = torch.Generator().manual_seed(seed)
    target, draft = {}, {}
    for length in range(depth):
        for prefix in itertools.product(range(vocab), repeat=length):
            choice = int(torch.randint(6, (1,), generator=generator))
            if choice == 0:
                p, q = disjoint_pair(generator, vocab)
            elif choice == 1:
                p = random_distribution(generator, vocab, "sparse")
                q = p.clone()
            else:
                p = random_distribution(generator, vocab, KINDS[choice - 2])
                q = random_distribution(generator, vocab, KINDS[(choice + 1) % 4])
            if choice == 5:  # point masses for the draft now and then
                q = random_distribution(generator, vocab, "one_hot")
            target[prefix], draft[prefix] = p, q
    return target, draft


def exact_committed_law(target, draft, vocab: int, gamma: int, point_mass: bool, verifier=verify_with_uniforms):
    """P(committed tokens = s) for every outcome s, by exact integration of the verifier over its uniforms."""
    rows, weights = [], []
    for drafts in itertools.product(range(vocab), repeat=gamma):
        q_rows = [draft[drafts[:i]] for i in range(gamma)]
        if point_mass:  # a deterministic proposer: the argmax chain of the draft table
            q_rows = [torch.nn.functional.one_hot(q.argmax(), vocab).double() for q in q_rows]
        draft_weight = math.prod(float(q_rows[i][d]) for i, d in enumerate(drafts))
        if draft_weight == 0:
            continue
        p_rows = [target[drafts[:i]] for i in range(gamma + 1)]
        ratios = [float(p_rows[i][d] / q_rows[i][d]) for i, d in enumerate(drafts)]
        for stop in range(gamma + 1):  # number of accepted tokens
            accept_u, weight = [], draft_weight
            for i in range(gamma):
                a = min(1.0, ratios[i])
                if i < stop:  # accepted: probe [0, a) just below its threshold
                    accept_u.append(a * (1 - 1e-9))
                    weight *= a
                elif i == stop:  # rejected: probe [a, 1) just above its threshold
                    accept_u.append(a + (1 - a) * 1e-9)
                    weight *= 1 - a
                else:
                    accept_u.append(0.5)  # after the first rejection the uniform is irrelevant
            if weight == 0:
                continue
            correction = p_rows[stop] - (q_rows[stop] if stop < gamma else 0)
            correction = correction.clamp(min=0)
            correction = correction / correction.sum()
            edges = torch.cat([torch.zeros(1, dtype=torch.float64), correction.cumsum(0)])
            for token in range(vocab):
                width = float(correction[token])
                if width <= 0:
                    continue
                # near both ends of the token's interval (the middle when it is too narrow to probe twice)
                margin = width * 1e-4 if width > 1e-9 else width / 2
                for u in {float(edges[token]) + margin, float(edges[token + 1]) - margin}:
                    rows.append((drafts, q_rows, p_rows, accept_u, u))
                    weights.append(weight * width / (2 if margin < width / 2 else 1))
    result = verifier(
        torch.tensor([r[0] for r in rows], dtype=torch.int64).reshape(len(rows), gamma),
        None
        if point_mass
        else torch.stack([torch.stack(r[1]) if gamma else torch.zeros(0, vocab, dtype=torch.float64) for r in rows]),
        torch.stack([torch.stack(r[2]) for r in rows]),
        torch.tensor([r[3] for r in rows], dtype=torch.float64).reshape(len(rows), gamma),
        torch.tensor([r[4] for r in rows], dtype=torch.float64),
    )
    law: dict[tuple[int, ...], float] = {}
    for b, weight in enumerate(weights):
        outcome = tuple(result.committed(b))
        law[outcome] = law.get(outcome, 0.0) + weight
    return law


def check_block_law(target, law, vocab: int, gamma: int) -> float:
    """Largest error of: sum_k P(commit = s[:k]) * p(s[k:] | s[:k]) = p(s) for all s of length gamma + 1."""

    def p_seq(prefix, suffix):
        prob = 1.0
        for token in suffix:
            prob *= float(target[tuple(prefix)][token])
            prefix = (*prefix, token)
        return prob

    assert abs(sum(law.values()) - 1) < 1e-12
    worst = 0.0
    for s in itertools.product(range(vocab), repeat=gamma + 1):
        via_engine = sum(law.get(s[:k], 0.0) * p_seq(s[:k], s[k:]) for k in range(1, gamma + 2))
        worst = max(worst, abs(via_engine - p_seq((), s)))
    return worst


@pytest.mark.parametrize("vocab,gamma", [(2, 1), (3, 2), (5, 2), (4, 3), (3, 4), (5, 4)])
@pytest.mark.parametrize("point_mass", [False, True])
def test_block_law_equals_target_sequence_law(vocab, gamma, point_mass):
    target, draft = conditional_tables(vocab, gamma + 1, seed=vocab * 10 + gamma)
    law = exact_committed_law(target, draft, vocab, gamma, point_mass)
    assert all(1 <= len(outcome) <= gamma + 1 for outcome in law)
    assert check_block_law(target, law, vocab, gamma) < 1e-12


def _keeps_rejected_tail(draft_tokens, draft_probs, target_probs, accept_u, sample_u):
    """Mutant: after the replacement token, keeps the later draft tokens of the block."""
    result = verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u, sample_u)
    tokens = result.tokens.clone()
    gamma = draft_tokens.shape[1]
    for b in range(tokens.shape[0]):
        n = int(result.num_accepted[b])
        tokens[b, n + 1 : gamma] = draft_tokens[b, n + 1 :]
    return verify.VerifyResult(torch.where(result.num_accepted + 1 < gamma, gamma - 1, result.num_accepted), tokens)


def _replacement_from_target(draft_tokens, draft_probs, target_probs, accept_u, sample_u):
    """Mutant: on rejection draws the replacement from p instead of the residual."""
    result = verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u, sample_u)
    rows = torch.arange(draft_tokens.shape[0])
    tokens = result.tokens.clone()
    tokens[rows, result.num_accepted] = verify.sample_from(target_probs[rows, result.num_accepted], sample_u)
    return verify.VerifyResult(result.num_accepted, tokens)


def _no_bonus(draft_tokens, draft_probs, target_probs, accept_u, sample_u):
    """Mutant: after a full acceptance draws the extra token from the last residual instead of p_{gamma+1}."""
    gamma = draft_tokens.shape[1]
    shifted = torch.cat([target_probs[:, :gamma], target_probs[:, gamma - 1 : gamma]], dim=1)
    return verify_with_uniforms(draft_tokens, draft_probs, shifted, accept_u, sample_u)


def _shifted_threshold(draft_tokens, draft_probs, target_probs, accept_u, sample_u):
    """Mutant: accepts when u < 0.6 p/q (a wrong threshold that midpoint probes would miss)."""
    return verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u / 0.6, sample_u)


def _residual_only_at_draft(draft_tokens, draft_probs, target_probs, accept_u, sample_u):
    """Mutant: on rejection removes q's mass only at the drafted token, i.e. draws from max(0, p - q(x) 1_x)."""
    only_drafted = torch.zeros_like(draft_probs).scatter(
        -1, draft_tokens.unsqueeze(-1), draft_probs.gather(-1, draft_tokens.unsqueeze(-1))
    )
    result = verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u, sample_u)
    rows = torch.arange(draft_tokens.shape[0])
    gamma = draft_tokens.shape[1]
    stop = result.num_accepted
    padded = torch.cat([only_drafted, torch.zeros_like(target_probs[:, :1])], dim=1)
    correction = (target_probs[rows, stop] - padded[rows, stop]).clamp(min=0)
    tokens = result.tokens.clone()
    tokens[rows, stop] = torch.where(stop < gamma, verify.sample_from(correction, sample_u), tokens[rows, stop])
    return verify.VerifyResult(stop, tokens)


@pytest.mark.parametrize(
    "mutant", [_keeps_rejected_tail, _replacement_from_target, _no_bonus, _shifted_threshold, _residual_only_at_draft]
)
def test_block_law_detects_wrong_verifiers(mutant):
    """Power of the exact block integration: each mutant moves at least 1e-2 of probability mass.

    (Tables whose root position is a point mass hide some mutants; seed 6 has none and each mutant
    moves at least 0.1 there.)
    """
    target, draft = conditional_tables(3, 4, seed=6)
    law = exact_committed_law(target, draft, 3, 3, False, verifier=mutant)
    assert check_block_law(target, law, 3, 3) > 1e-2


# ----------------------------------------------------------------- greedy


def test_greedy_accepts_matching_prefix_then_commits_argmax():
    scores = torch.tensor([[[0.1, 0.9, 0.0], [0.8, 0.1, 0.1], [0.2, 0.2, 0.6], [0.3, 0.3, 0.4]]])  # (1, 4, 3)
    result = verify_greedy(torch.tensor([[1, 0, 1]]), scores)
    assert result.num_accepted.tolist() == [2] and result.committed() == [1, 0, 2]
    result = verify_greedy(torch.tensor([[1, 0, 2]]), scores)
    assert result.num_accepted.tolist() == [3] and result.committed() == [1, 0, 2, 2]
    result = verify_greedy(torch.tensor([[2, 0, 2]]), scores)
    assert result.committed() == [1]


def test_greedy_ties_go_to_the_lowest_token_id():
    scores = torch.tensor([[[0.0, 0.5, 0.5], [0.4, 0.2, 0.4]]])
    assert verify_greedy(torch.tensor([[2]]), scores).committed() == [1]
    assert verify_greedy(torch.tensor([[1]]), scores).committed() == [1, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_greedy_token_takes_the_first_of_tied_maxima_at_any_width(dtype):
    """greedy_token gives the lowest index among tied maxima, also across the chunks a vectorised kernel splits a
    wide row into (a wrong tie-break, e.g. the last maximum, fails), and on a strided view as on its copy."""
    generator = torch.Generator().manual_seed(0)
    for width in (5, 64, 4097, 49152):
        scores = torch.randint(0, 4, (16, 2, width), generator=generator).to(dtype)  # many ties at the maximum
        first = [[int((row == row.max()).nonzero()[0]) for row in rows] for rows in scores]
        assert greedy_token(scores).tolist() == first
        assert greedy_token(scores.transpose(0, 1)).tolist() == [list(column) for column in zip(*first)]
        assert greedy_token(scores[:, :, ::2]).tolist() == greedy_token(scores[:, :, ::2].contiguous()).tolist()


def test_greedy_rows_accept_different_counts():
    scores = torch.eye(3).expand(2, 3, 3).clone()  # argmax of position i is i
    result = verify_greedy(torch.tensor([[0, 1], [0, 2]]), scores)
    assert result.num_accepted.tolist() == [2, 1]
    assert result.tokens.tolist() == [[0, 1, 2], [0, 1, -1]]


# ---------------------------------------------------------- batching and seeds


def test_batched_rows_accept_different_numbers_and_seed_reproduces():
    generator = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(64, 4, 6, generator=generator, dtype=torch.float64), -1)
    q = torch.softmax(torch.randn(64, 3, 6, generator=generator, dtype=torch.float64), -1)
    tokens = torch.multinomial(q.reshape(-1, 6), 1, generator=generator).reshape(64, 3)
    first = verify_stochastic(tokens, q, p, torch.Generator().manual_seed(9))
    second = verify_stochastic(tokens, q, p, torch.Generator().manual_seed(9))
    assert torch.equal(first.tokens, second.tokens)
    assert len(set(first.num_accepted.tolist())) > 1
    for b in range(64):
        n = int(first.num_accepted[b])
        assert first.tokens[b, :n].tolist() == tokens[b, :n].tolist()
        assert (first.tokens[b, n + 1 :] == -1).all()


def test_point_mass_rejection_never_returns_the_rejected_token():
    p = torch.tensor([[[0.5, 0.3, 0.2], [1 / 3, 1 / 3, 1 / 3]]], dtype=torch.float64).expand(3000, 2, 3)
    result = verify_point_mass(torch.zeros((3000, 1), dtype=torch.int64), p, torch.Generator().manual_seed(4))
    rejected = result.num_accepted == 0
    assert 0.45 < rejected.double().mean() < 0.55  # accepted with probability p(x) = 0.5
    assert (result.tokens[rejected, 0] != 0).all()


# ----------------------------------------------------------------- bad inputs


def _block():
    p = torch.full((1, 3, 4), 0.25, dtype=torch.float64)
    q = torch.full((1, 2, 4), 0.25, dtype=torch.float64)
    return torch.tensor([[1, 2]]), q, p


@pytest.mark.parametrize(
    "mutate,message",
    [
        (
            lambda t, q, p: (
                t,
                q,
                p.masked_fill(
                    torch.zeros_like(p, dtype=torch.bool).index_fill(2, torch.tensor([0]), True), float("nan")
                ),
            ),
            "NaN",
        ),
        (lambda t, q, p: (t, q * float("inf"), p), "NaN or infinite"),
        (lambda t, q, p: (t, q, p * torch.tensor([2.0, -1.0, 0.0, 0.0], dtype=torch.float64)), "negative"),
        (lambda t, q, p: (t, q * 0.5, p), "not normalised"),
        (lambda t, q, p: (t, q, p[:, :2]), "shape"),
        (lambda t, q, p: (t, q[..., :3] / q[..., :3].sum(-1, keepdim=True), p), "draft_probs must have shape"),
        (lambda t, q, p: (torch.tensor([[1, 7]]), q, p), "outside the vocabulary"),
        (lambda t, q, p: (t.reshape(-1), q, p), "draft_tokens must have shape"),
    ],
)
def test_bad_inputs_raise_clear_errors(mutate, message):
    tokens, q, p = mutate(*_block())
    with pytest.raises(ValueError, match=message):
        verify_stochastic(tokens, q, p, torch.Generator())


def test_draft_token_with_zero_draft_probability_is_an_error():
    tokens, q, p = _block()
    q = torch.tensor([[[0.5, 0.0, 0.5, 0.0], [0.25] * 4]], dtype=torch.float64)
    with pytest.raises(ValueError, match="draft probability 0"):
        verify_stochastic(tokens, q, p, torch.Generator())


def test_global_rng_is_refused():
    tokens, q, p = _block()
    with pytest.raises(TypeError, match="explicit torch.Generator"):
        verify_stochastic(tokens, q, p, None)


def test_greedy_rejects_nan_scores():
    with pytest.raises(ValueError, match="NaN"):
        verify_greedy(torch.tensor([[0]]), torch.tensor([[[float("nan"), 1.0], [0.0, 1.0]]]))


@pytest.mark.parametrize("dtype,within,beyond", [(torch.float32, 5e-6, 1e-4), (torch.float64, 5e-10, 1e-7)])
def test_a_distribution_off_by_rounding_is_renormalised_and_one_off_by_more_is_refused(dtype, within, beyond):
    """Tolerance by dtype (NORMALIZATION_TOLERANCE): within it the row is divided by its sum in float64, so the
    verifier never works with a q that is not a distribution; beyond it the call is refused."""
    from exactspec.decoding.verify import check_distribution

    q = torch.tensor([[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    q[0, 0] += within
    fixed = check_distribution(q.to(dtype), "draft_probs")
    assert fixed.dtype == torch.float64 and (fixed.sum(-1) - 1).abs().max() < 1e-15
    assert torch.allclose(fixed[0], q[0].to(dtype).double() / q[0].to(dtype).double().sum(), rtol=0, atol=1e-16)
    q[0, 0] += beyond
    with pytest.raises(ValueError, match=rf"not normalised: .*\(the rounding allowed for {str(dtype)[6:]}\)"):
        check_distribution(q.to(dtype), "draft_probs")
