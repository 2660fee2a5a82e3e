"""Block verification (exactspec.decoding.block): its law, its gain over token-wise verification, and the power of
the statistical tests against the five ways the rule has been misread.

Exact laws. For a MarkovLM pair, :func:`generation_law` computes the law of the engine's whole output (the first
token from the prompt, then rounds of gamma = min(GAMMA, budget - 1) drafted tokens, a stop token ending it) by
enumerating every draft of every round and integrating the rule over its uniforms in closed form:
P(tau = i) = h_i prod_{j > i} (1 - h_j) for the block rule (the last position that passes), with the library's own
weights and thresholds (block_thresholds). Each misreading (the switches of certification.mutants.block_variant)
has its own closed form, so its exact total-variation distance from the target's law is known before sampling.

Statistical tests: G-tests at ALPHA = 1e-3 (test_exactness) of outcomes drawn through the batch engine. A mutant's
sample size is set from its exact law: the smallest N at which the G-test rejects it with probability POWER (the
noncentral chi-square approximation, noncentrality N * chi2-divergence of the mutant's law from the target's).
Measured on each mutant's pair (BLOCK_MUTANTS): exact TV and sample size 0.085 / 2,979 (token-wise residual),
0.49 / 200 (first failure), 0.35 / 200 (one shared uniform), 0.16 / 426 (uncapped weight), 0.19 / 200 (no
denominator); the correct engine is sampled at the same size on the same pair and must pass.
"""

from __future__ import annotations

import collections
import itertools
import math

import pytest
import torch
from conftest import engine_outcomes
from scipy import stats
from test_exactness import ALPHA, CONFIGS, SIZES, g_test_p_value

from exactspec.certification.mutants import MUTANTS, block_variant
from exactspec.decoding.block import (
    block_expected_accepted,
    block_thresholds,
    tokenwise_expected_accepted,
    verify_block_with_uniforms,
)
from exactspec.decoding.engine import BatchEngine, EngineConfig
from exactspec.decoding.sampling import SamplingParams, block_probs
from exactspec.decoding.verify import verify_with_uniforms
from exactspec.models.markov import MarkovLM
from exactspec.models.runtime import SequenceSlots
from exactspec.proposers import DraftModelProposer

PROMPT, NEW_TOKENS, GAMMA, SLOTS = (1, 0), 5, 3, 64
POWER = 0.99
MIN_SAMPLES = 200  # the chi-square approximations behind samples_for_power need expected counts to lean on
#: Each misreading (a switch of block_variant) and the pair it is tested on: (vocabulary, order, target scale,
#: noise scale, seed), chosen by searching small order-1 pairs for the one on which it is cheapest to catch
#: (its exact law known): the token-wise residual's distance is about 1e-3 on many random pairs.
BLOCK_MUTANTS = {
    "block_tokenwise_residual": (dict(weighted_residual=False), (3, 1, 3.0, 4.0, 4)),
    "block_first_failure": (dict(last=False), (2, 1, 3.0, 1.0, 4)),
    "block_shared_uniform": (dict(shared_uniform=True), (2, 1, 2.0, 4.0, 3)),
    "block_uncapped_weight": (dict(cap=False), (2, 1, 1.0, 2.0, 8)),
    "block_no_denominator": (dict(denominator=False), (2, 1, 3.0, 4.0, 4)),
}


def models(vocab: int = 4, order: int = 2, scale: float = 1.5, noise: float = 0.8, seed: int = 11):
    """A target and a draft that is the target plus noise (at the defaults test_exactness's pair)."""
    target = MarkovLM.random(vocab, order, seed=seed, scale=scale)
    noise_table = MarkovLM.random(
        vocab, order, seed=seed + 1 if (vocab, order) == (4, 2) else seed + 100, scale=noise
    ).table
    return target, MarkovLM(target.table + noise_table, order)


# --------------------------------------------------------------------------- exact laws


def round_law(
    p_rows: list[torch.Tensor],
    q_rows: list[torch.Tensor],
    tokens: tuple[int, ...],
    *,
    cap=True,
    denominator=True,
    last=True,
    shared_uniform=False,
    weighted_residual=True,
) -> list[tuple[int, float, torch.Tensor]]:
    """[(tau, P(tau), law of the committed draw)] for one draft under the rule with the given switches;
    ``p_rows``: g + 1 target distributions, ``q_rows``: g draft distributions (float64, (V,) each)."""
    gamma = len(tokens)
    if gamma == 0:  # a plain round (the budget's last token)
        return [(0, 1.0, p_rows[0])]
    if cap and denominator:  # the library's own weights and thresholds
        w, h = block_thresholds(torch.tensor([tokens]), torch.stack(q_rows)[None], torch.stack(p_rows)[None])
        weights, thresholds = w[0].tolist(), h[0].tolist()
    else:
        weights = [1.0]
        for i in range(gamma):
            weight = weights[-1] * float(p_rows[i][tokens[i]] / q_rows[i][tokens[i]])
            weights.append(min(1.0, weight) if cap else weight)
        thresholds = [1.0]
        for i in range(1, gamma + 1):
            if i == gamma:
                thresholds.append(weights[gamma])
                continue
            residual = float((weights[i] * p_rows[i] - q_rows[i]).clamp(min=0).sum())
            total = residual + 1 - weights[i] if denominator else 1.0
            thresholds.append(residual / total if total > 0 else 1.0)
    h = [min(1.0, max(0.0, x)) for x in thresholds]  # P(u < h) for u ~ U[0, 1)
    if shared_uniform:
        at_least = [1.0] + [max(h[i:]) for i in range(1, gamma + 1)] + [0.0]
        tau_probs = [at_least[i] - at_least[i + 1] for i in range(gamma + 1)]
    elif last:
        tau_probs = [h[i] * math.prod(1 - x for x in h[i + 1 :]) for i in range(gamma + 1)]
    else:
        tau_probs = [math.prod(h[1 : i + 1]) * (1 - (h[i + 1] if i < gamma else 0.0)) for i in range(gamma + 1)]
    out = []
    for tau, prob in enumerate(tau_probs):
        if prob <= 0:
            continue
        if tau == gamma:
            draw = p_rows[gamma]
        else:
            draw = ((weights[tau] if weighted_residual else 1.0) * p_rows[tau] - q_rows[tau]).clamp(min=0)
            draw = draw if draw.sum() > 0 else p_rows[tau]
        out.append((tau, prob, draw / draw.sum()))
    return out


def generation_law(target: MarkovLM, draft: MarkovLM, params: SamplingParams, stops=frozenset(), **variant) -> dict:
    """P(output = s) of the engine at fixed gamma GAMMA, NEW_TOKENS tokens, by enumerating rounds (see the module)."""
    cache: dict = {}

    def probs(model: MarkovLM, prefix: tuple[int, ...]) -> torch.Tensor:
        key = (id(model), prefix)
        if key not in cache:
            cache[key] = block_probs(
                model.next_logits(list(prefix)).unsqueeze(0), list(prefix), [], len(PROMPT), params
            )[0]
        return cache[key]

    law: dict = collections.defaultdict(float)

    def commit(prefix, generated, committed, prob):
        for token in committed:
            prefix, generated = prefix + (token,), generated + (token,)
            if token in stops or len(generated) == NEW_TOKENS:
                law[generated] += prob
                return
        step(prefix, generated, prob)

    def step(prefix, generated, prob):
        gamma = min(GAMMA, NEW_TOKENS - len(generated) - 1)
        for tokens in itertools.product(range(target.vocab_size), repeat=gamma):
            q_rows = [probs(draft, prefix + tokens[:i]) for i in range(gamma)]
            drafted = math.prod(float(q[t]) for q, t in zip(q_rows, tokens))
            if drafted == 0:
                continue
            p_rows = [probs(target, prefix + tokens[:i]) for i in range(gamma + 1)]
            for tau, tau_prob, draw in round_law(p_rows, q_rows, tokens, **variant):
                for y in torch.nonzero(draw > 0).flatten().tolist():
                    commit(prefix, generated, tokens[:tau] + (y,), prob * drafted * tau_prob * float(draw[y]))

    first = probs(target, PROMPT)
    for y in torch.nonzero(first > 0).flatten().tolist():
        commit(PROMPT, (), (y,), float(first[y]))
    return dict(law)


def target_law(target: MarkovLM, params: SamplingParams, stops=frozenset()) -> dict:
    return generation_law(target, target, params, stops)  # a draft equal to the target: every round accepts


def total_variation(law: dict, other: dict) -> float:
    return 0.5 * sum(abs(law.get(s, 0.0) - other.get(s, 0.0)) for s in set(law) | set(other))


def samples_for_power(law: dict, wrong: dict, alpha: float = ALPHA, power: float = POWER) -> int:
    """The smallest N at which the G-test against ``law`` rejects samples of ``wrong`` with probability ``power``
    (noncentral chi-square, noncentrality N * sum (wrong - law)^2 / law over the outcomes law gives mass)."""
    divergence = sum((wrong.get(s, 0.0) - p) ** 2 / p for s, p in law.items())
    df = len(law) - 1
    critical = stats.chi2.ppf(1 - alpha, df)
    low, high = 1, 10**7
    while low < high:
        n = (low + high) // 2
        if stats.ncx2.sf(critical, df, n * divergence) >= power:
            high = n
        else:
            low = n + 1
    return low


# --------------------------------------------------------------------------- the rule's mathematics


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_block_rule_keeps_the_target_law_exactly_with_every_processor(name):
    target, draft = models()
    params = CONFIGS[name]
    law, truth = generation_law(target, draft, params), target_law(target, params)
    assert set(law) == set(truth)
    assert max(abs(law[s] - truth[s]) for s in truth) < 1e-12


def test_the_block_rule_keeps_the_target_law_with_stop_tokens():
    target, draft = models()
    law, truth = generation_law(target, draft, CONFIGS["T=1"], stops={0}), target_law(target, CONFIGS["T=1"], stops={0})
    assert any(len(s) < NEW_TOKENS for s in truth)  # the stop ends some generations early
    assert max(abs(law.get(s, 0.0) - truth[s]) for s in truth) < 1e-12


def random_rows(generator, vocab: int, gamma: int, sharp: float = 2.0):
    """One drafted block: target rows (1, g + 1, V), draft rows (1, g, V) and tokens drawn from the draft."""
    p = torch.softmax(torch.randn((1, gamma + 1, vocab), generator=generator, dtype=torch.float64) * sharp, -1)
    q = torch.softmax(torch.randn((1, gamma, vocab), generator=generator, dtype=torch.float64) * sharp, -1)
    tokens = torch.multinomial(q[0], 1, generator=generator).T
    return tokens, q, p


def test_one_drafted_token_is_the_token_wise_rule_and_two_are_not():
    """gamma = 1: the same uniforms give the same tokens under both rules. gamma = 2: some draws differ (a later
    position can carry a block that token-wise verification rejects at its first token)."""
    generator = torch.Generator().manual_seed(3)
    for _ in range(50):
        tokens, q, p = random_rows(generator, 5, 1)
        u, s = (
            torch.rand((1, 1), dtype=torch.float64, generator=generator),
            torch.rand((1,), dtype=torch.float64, generator=generator),
        )
        assert torch.equal(
            verify_block_with_uniforms(tokens, q, p, u, s).tokens, verify_with_uniforms(tokens, q, p, u, s).tokens
        )
    differ = 0
    for _ in range(200):
        tokens, q, p = random_rows(generator, 5, 2)
        u, s = (
            torch.rand((1, 2), dtype=torch.float64, generator=generator),
            torch.rand((1,), dtype=torch.float64, generator=generator),
        )
        block, token = verify_block_with_uniforms(tokens, q, p, u, s), verify_with_uniforms(tokens, q, p, u, s)
        differ += int(block.num_accepted[0]) > int(token.num_accepted[0])
    assert differ > 0


@pytest.mark.parametrize("gamma", [2, 3, 4])
def test_the_block_rule_accepts_more_in_expectation(gamma):
    """E[accepted] over drafts (exact: the draft's own law on a small tree): block >= token-wise, strictly here;
    equal at gamma' = 1, and equal for point-mass drafts, where token-wise already accepts each prefix with the
    target's probability of it."""
    generator = torch.Generator().manual_seed(gamma)
    vocab = 3
    rows: dict = {}

    def row(kind, prefix):
        if (kind, prefix) not in rows:
            rows[kind, prefix] = torch.softmax(torch.randn(vocab, generator=generator, dtype=torch.float64) * 2, -1)
        return rows[kind, prefix]

    block = token = 0.0
    for tokens in itertools.product(range(vocab), repeat=gamma):
        q = torch.stack([row("q", tokens[:i]) for i in range(gamma)])[None]
        p = torch.stack([row("p", tokens[:i]) for i in range(gamma + 1)])[None]
        weight = math.prod(float(q[0, i, t]) for i, t in enumerate(tokens))
        block = block + weight * block_expected_accepted(torch.tensor([tokens]), q, p)[0]
        token = token + weight * tokenwise_expected_accepted(torch.tensor([tokens]), q, p)[0]
        point = torch.tensor([tokens])
        assert torch.allclose(
            block_expected_accepted(point, None, p), tokenwise_expected_accepted(point, None, p), atol=1e-12
        )
    assert abs(float(block[0] - token[0])) < 1e-12
    assert (block[1:] > token[1:] + 1e-3).all(), (block, token)


def test_the_expected_accepted_length_is_the_mean_of_the_rule_s_draws():
    """(B6) against 200,000 draws of the block rule on one drafted block: the mean accepted length of every cut
    block within 5 standard errors of block_expected_accepted (false-alarm rate below 1e-6 per cut)."""
    generator = torch.Generator().manual_seed(7)
    tokens, q, p = random_rows(generator, 6, 4, sharp=1.0)
    expected = block_expected_accepted(tokens, q, p)[0]
    n = 200_000
    for cut in range(1, 5):
        u = torch.rand((n, cut), dtype=torch.float64, generator=generator)
        s = torch.rand((n,), dtype=torch.float64, generator=generator)
        tau = verify_block_with_uniforms(
            tokens[:, :cut].expand(n, cut), q[:, :cut].expand(n, cut, 6), p[:, : cut + 1].expand(n, cut + 1, 6), u, s
        ).num_accepted.double()
        assert abs(float(tau.mean()) - float(expected[cut - 1])) < 5 * float(tau.std()) / math.sqrt(n)


def test_the_mutant_harness_at_its_defaults_is_the_rule():
    """certification.mutants.block_variant with no switch turned draws the same tokens as the library's rule."""
    generator = torch.Generator().manual_seed(5)
    for seed in range(30):
        tokens, q, p = random_rows(generator, 5, 3)
        assert torch.equal(
            block_variant(tokens, q, p, torch.Generator().manual_seed(seed)).tokens,
            verify_block_with_uniforms(tokens, q, p, *draws(seed, 3)).tokens,
        )


def draws(seed: int, gamma: int):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand((1, gamma), dtype=torch.float64, generator=generator), torch.rand(
        (1,), dtype=torch.float64, generator=generator
    )


# --------------------------------------------------------------------------- through the engine


def engine_sample(
    target: MarkovLM, draft: MarkovLM, params: SamplingParams, n: int, engine_class=BatchEngine, stops=frozenset()
) -> dict:
    slots = lambda model: SequenceSlots([MarkovLM(model.table, model.order) for _ in range(SLOTS)])  # noqa: E731
    engine = engine_class(slots(target), DraftModelProposer(slots(draft)), EngineConfig(gamma=GAMMA))
    return dict(collections.Counter(engine_outcomes(engine, PROMPT, n, params, NEW_TOKENS, GAMMA, stops=stops)))


@pytest.mark.parametrize("n", SIZES)
def test_the_engine_s_block_rule_follows_the_target_law_with_a_stop_token(n):
    target, draft = models()
    params = CONFIGS["top_p=0.8"]
    counts = engine_sample(target, draft, params, n, stops=frozenset({0}))
    assert g_test_p_value(counts, target_law(target, params, stops={0})) > ALPHA


@pytest.mark.parametrize("mutant", list(BLOCK_MUTANTS))
def test_the_same_test_rejects_each_misreading_at_the_size_its_law_calls_for(mutant):
    """Each mutant engine (certification.mutants) on its pair, sampled at samples_for_power of its exact law (at
    least MIN_SAMPLES): rejected. The correct engine on the same pair at the same size: not rejected."""
    variant, pair = BLOCK_MUTANTS[mutant]
    target, draft = models(*pair)
    params = CONFIGS["T=1"]
    law, wrong = target_law(target, params), generation_law(target, draft, params, **variant)
    assert total_variation(law, wrong) > 0.01
    n = max(MIN_SAMPLES, samples_for_power(law, wrong))
    assert n <= 4000, n  # the pair is chosen so that every mutant is cheap to catch
    assert g_test_p_value(engine_sample(target, draft, params, n, MUTANTS[mutant]), law) < ALPHA
    assert g_test_p_value(engine_sample(target, draft, params, n), law) > ALPHA
