"""The certification's statistics (exactspec.certification.pit): the PIT of tokens drawn from p is uniform and
that of tokens drawn from a distribution 0.05 away in total variation is not; the goodness of fit rejects a
shifted law; Holm keeps the family-wise rate. Fixed seeds; each assertion's false-positive rate is below 1e-3."""

from __future__ import annotations

import numpy as np
import torch

from exactspec.certification.pit import (
    TestResult,
    binned_uniform,
    holm,
    keyed_pit_values,
    ks_critical_value,
    ks_uniform,
    p_order_masses,
    pit_values,
    ratio_pit_values,
    recency_pit_values,
    token_goodness_of_fit,
)


def draws(probs: torch.Tensor, n: int, seed: int) -> torch.Tensor:  # probs (n, V) -> (n,)
    return torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(seed))[:, 0]


def laws(n: int, vocab: int = 50, seed: int = 0) -> torch.Tensor:
    return torch.softmax(
        2 * torch.randn((n, vocab), generator=torch.Generator().manual_seed(seed), dtype=torch.float64), -1
    )


def test_pit_is_uniform_under_the_law_and_not_under_a_shifted_one():
    n = 20_000
    p = laws(n)
    shifted = torch.softmax(p.log() / 1.3, -1)  # the law at temperature 1.3 instead of 1 (the unprocessed-q bug)
    assert 0.02 < float(0.5 * (shifted - p).abs().sum(-1).mean()) < 0.15  # the per-token TV it is off by
    uniforms = torch.rand((n,), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    good = ks_uniform("good", pit_values(p, draws(p, n, 2), uniforms).numpy())
    bad = ks_uniform("bad", pit_values(p, draws(shifted, n, 2), uniforms).numpy())
    assert good.p_value > 1e-3 and bad.p_value < 1e-6
    assert bad.statistic > ks_critical_value(n, 1e-3) > good.statistic


def test_goodness_of_fit_rejects_a_shifted_law_and_passes_the_true_one():
    p = laws(1)[0]
    wrong = torch.roll(p, 1)

    def counts(law):
        return {
            int(t): int(c) for t, c in zip(*np.unique(draws(law.expand(3000, -1), 3000, 5).numpy(), return_counts=True))
        }

    assert token_goodness_of_fit("true", [(counts(p), p)]).p_value > 1e-3
    assert token_goodness_of_fit("wrong", [(counts(wrong), p)]).p_value < 1e-6
    impossible = torch.zeros_like(p)
    impossible[0] = 1.0
    assert token_goodness_of_fit("impossible", [({1: 3}, impossible)]).p_value == 0.0


def test_holm_adjusts_step_down():
    results = holm([TestResult("a", 1, 0, 0.01), TestResult("b", 1, 0, 0.04), TestResult("c", 1, 0, 0.03)], alpha=0.05)
    assert [round(r.adjusted_p, 6) for r in results] == [0.03, 0.06, 0.06]
    assert [r.rejected for r in results] == [True, False, False]


def test_keyed_pit_is_uniform_under_the_law_in_any_fixed_order_and_sees_a_flattened_law_in_p_order():
    n = 20_000
    p = laws(n, seed=3)
    flattened = torch.softmax(p.log() / 1.1, -1)
    uniforms = torch.rand((n,), dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    shuffled = torch.rand(
        (n, p.shape[1]), generator=torch.Generator().manual_seed(5)
    )  # any order fixed before the draw
    for keys in (p, shuffled, (p > 0.05).double()):  # the last has ties, randomized together
        assert ks_uniform("good", keyed_pit_values(p, keys, draws(p, n, 6), uniforms).numpy()).p_value > 1e-3
    by_p = ks_uniform("by p", keyed_pit_values(p, p, draws(flattened, n, 6), uniforms).numpy())
    by_id = ks_uniform("by id", pit_values(p, draws(flattened, n, 6), uniforms).numpy())
    assert by_p.p_value < 1e-6 and by_p.statistic > 2 * by_id.statistic


def test_the_fast_orders_equal_the_keyed_definition_ties_included():
    """certify's orders by p, recency and q / p skip most of the vocabulary; each must give keyed_pit_values' value
    under its key. Rows with tied p (groups of equal mass, zeros) and tokens seen in the prefix, in the row's own
    earlier tokens, or never; recorded draft tokens with q = 0 and tokens nobody recorded."""
    n, vocab, generator = 60, 300, torch.Generator().manual_seed(11)
    probs = laws(n, vocab, seed=12)
    probs[:, :40] = probs[:, :40].mean(-1, keepdim=True)  # a block of tied tokens
    probs[:, 280:] = 0.0
    probs = probs / probs.sum(-1, keepdim=True)
    tokens = draws(probs, n, 13)
    tokens[::7] = torch.arange(0, 36, 4)  # some tokens from the tied block
    uniforms = torch.rand((n,), dtype=torch.float64, generator=generator)
    prefix = torch.randint(0, 60, (30,), generator=generator).tolist()  # overlaps the tokens' ids
    below, tied = p_order_masses(probs, tokens)
    torch.testing.assert_close(
        below + uniforms * tied, keyed_pit_values(probs, probs, tokens, uniforms), rtol=0, atol=1e-12
    )
    # recency: unseen tokens by p (keys in [0, 1]), then seen ones by last position (keys >= 2)
    last = torch.full((vocab,), -1.0, dtype=torch.float64)
    recency_keys = torch.empty_like(probs)
    for i, token in enumerate(prefix + tokens.tolist()):
        if i >= len(prefix):
            recency_keys[i - len(prefix)] = torch.where(last >= 0, 2 + last, probs[i - len(prefix)])
        last[token] = i
    assert 0 < int((recency_keys.gather(1, tokens[:, None]) >= 2).sum()) < n  # both cases occur
    torch.testing.assert_close(
        recency_pit_values(probs, tokens, uniforms, prefix, (below, tied), probs.sum(-1)),
        keyed_pit_values(probs, recency_keys, tokens, uniforms),
        rtol=0,
        atol=1e-12,
    )
    # q / p: 8 recorded tokens per row (the first of them with q = 0), every other token at q = 0
    q_ids = torch.stack(
        [(lambda perm: perm[perm != token][:8])(torch.randperm(vocab, generator=generator)) for token in tokens]
    )
    q_ids[::3, 1] = tokens[::3]  # the drawn token recorded, with q > 0, in a third of the rows
    q_ids[1::6, 0] = tokens[1::6]  # and with q = 0 in others
    q_values = torch.rand((n, 8), dtype=torch.float64, generator=generator) / 8
    q_values[:, 0] = 0.0
    ratio_keys = torch.zeros_like(probs).scatter_(1, q_ids, q_values) / probs.clamp_min(1e-300)
    fast = ratio_pit_values(probs.gather(1, q_ids), probs.sum(-1), tokens, uniforms, q_ids, q_values)
    torch.testing.assert_close(fast, keyed_pit_values(probs, ratio_keys, tokens, uniforms), rtol=0, atol=1e-12)


def test_tail_bins_see_an_excess_near_one_that_the_ks_distance_misses():
    rng = np.random.default_rng(7)
    values = rng.random(5000)
    assert binned_uniform("uniform", values).p_value > 1e-3
    values[:100] = 0.9995 + 0.0005 * rng.random(100)  # 2% of the mass moved into the top 0.05%
    assert binned_uniform("excess", values).p_value < 1e-6
    assert ks_uniform("excess", values).p_value > 1e-3
