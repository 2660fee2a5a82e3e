"""Statistical exactness of the whole engine, and the power of the test against known bugs.

Set-up: an order-2 MarkovLM target and a *different* order-2 MarkovLM draft
(the target's table plus noise) over 4 tokens, prompt [1, 2], 5 new tokens,
gamma = 3: the first token comes from the prefill, then rounds draft up to 3
tokens (the budget cut makes the last rounds shorter), so rejections, full
acceptances with bonus tokens and the max_new_tokens cut all occur. The law of
the 5 generated tokens (1,024 outcomes) is computed exactly from the target's
conditionals through the pipeline's single-position path. Each configuration
draws N continuations through the real engine (seeds 0..N-1) and applies a
G-test (scipy.stats.power_divergence, log-likelihood) after pooling outcomes
whose expected count is below 5.

False-positive rate: under a correct engine each test rejects with probability
about ALPHA = 1e-3 (the chi-square approximation; 8 such tests, so about 1% that
some test fails after a change to how random numbers are consumed). The seeds
are fixed, so a given code state passes or fails deterministically. Measured
p-values of the correct engine at N = 8000: 0.07, 0.57, 0.56, 0.36, 0.35 for the
five sampling configurations; 0.045 for the adaptive policy started from priors.

Power: every mutant is rejected at the same N. Measured p-values at N = 8000
(seed range 8000..15999; replacement_from_target also over three further
disjoint ranges): replacement_from_target 1.9e-148 (and 5.5e-118, 1.9e-139,
1.3e-115), penalty_once_per_round 9.5e-154, keeps_tokens_after_rejection,
draft_probs_before_processors and argmax_with_sampled_ratio below 1e-300. Since
each is more than 100 orders of magnitude below ALPHA, the power at this N is 1
for practical purposes; ``pytest -m extended`` repeats every mutant over 5 seed ranges.
"""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from conftest import SyntheticClock, engine_outcomes
from scipy import stats

import exactspec.decoding.engine as engine_module
from exactspec import MarkovLM, SamplingParams, SpeculativeDecoder
from exactspec.decoding.engine import BatchEngine, EngineConfig
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma, PolicyPriors
from exactspec.decoding.sampling import block_probs
from exactspec.decoding.verify import VerifyResult, sample_from, verify_with_uniforms
from exactspec.models.runtime import SequenceSlots
from exactspec.proposers import Draft, DraftModelProposer, PromptLookupProposer
from exactspec.proposers.base import ReadsNothing

ALPHA = 1e-3
N = 8_000  # the full sweep, behind the slow marker (.ci/run runs it after the README's test command)
N_QUICK = 2_000  # the README's test command: every mutant is still rejected far below ALPHA (see each module)
#: Each statistical test runs at both sizes: N_QUICK in the default run, N with ``-m slow``.
SIZES = [pytest.param(N_QUICK, id=f"N={N_QUICK}"), pytest.param(N, id=f"N={N}", marks=pytest.mark.slow)]
VOCAB, ORDER, PROMPT, NEW_TOKENS, GAMMA = 4, 2, [1, 2], 5, 3
SLOTS = 64  # sequences drawn at once (sample_counts)

CONFIGS = {
    "T=1": SamplingParams(),
    "T=0.7,top_k=2": SamplingParams(temperature=0.7, top_k=2),
    "top_p=0.8": SamplingParams(top_p=0.8),
    "repetition=1.8,presence=0.5": SamplingParams(repetition_penalty=1.8, presence_penalty=0.5),
    "min_p,bias,banned,frequency": SamplingParams(
        min_p=0.1, logit_bias={0: 1.0}, banned_token_ids=frozenset({3}), frequency_penalty=0.7
    ),
}


def models():
    """A target and a draft that is the target plus noise (acceptance about 0.6 at T=1)."""
    target = MarkovLM.random(VOCAB, ORDER, seed=11, scale=1.5)
    noise = MarkovLM.random(VOCAB, ORDER, seed=12, scale=0.8)
    return target, MarkovLM(target.table + noise.table, ORDER)


def exact_law(target: MarkovLM, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """P(generated tokens = s), position by position from the pipeline's single-row path."""
    law = {}
    for sequence in itertools.product(range(VOCAB), repeat=NEW_TOKENS):
        prob, prefix = 1.0, list(PROMPT)
        for token in sequence:
            logits = target.next_logits(prefix).unsqueeze(0)
            prob *= float(block_probs(logits, prefix, [], len(PROMPT), params)[0, token])
            prefix.append(token)
        if prob > 0:
            law[sequence] = prob
    return law


def slots_of(model: MarkovLM) -> SequenceSlots:
    """SLOTS copies of a Markov model as the slots of one runtime."""
    return SequenceSlots([MarkovLM(model.table, model.order) for _ in range(SLOTS)])


def sample_outcomes(
    target: MarkovLM, draft, params: SamplingParams, n: int, offset: int = 0, policy=None, verify: str = "block"
) -> list[tuple[int, ...]]:
    """The tokens of n generations (seeds offset..offset+n-1, gamma GAMMA or the policy's) through one batch engine
    with SLOTS slots: the loop ``generate`` runs, its sequences drawn together (each from its own generator, so
    each is a solo run's draw: test_a_seeded_generation_is_the_same_alone_and_in_the_batch).
    ``draft``: a MarkovLM, a batched proposer, or None for plain decoding."""
    proposer = DraftModelProposer(slots_of(draft)) if isinstance(draft, MarkovLM) else draft
    engine = BatchEngine(slots_of(target), proposer, EngineConfig(gamma=GAMMA), policy)
    speculation, gamma = ("off", 0) if draft is None else ("draft", GAMMA if policy is None else "auto")
    return engine_outcomes(engine, PROMPT, n, params, NEW_TOKENS, gamma, speculation, offset, verify)


def sample_counts(*args, **kwargs) -> dict[tuple[int, ...], int]:
    return dict(collections.Counter(sample_outcomes(*args, **kwargs)))


def g_test_p_value(counts: dict, law: dict) -> float:
    """G-test of observed counts against the exact law; outcomes outside the law's support give p = 0."""
    n = sum(counts.values())
    if any(outcome not in law for outcome in counts):
        return 0.0
    observed, expected, pooled_obs, pooled_exp = [], [], 0, 0.0
    for outcome, prob in law.items():
        if prob * n >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(prob * n)
        else:
            pooled_obs += counts.get(outcome, 0)
            pooled_exp += prob * n
    if pooled_exp > 0:
        observed.append(pooled_obs)
        expected.append(pooled_exp)
    return float(stats.power_divergence(observed, expected, lambda_="log-likelihood").pvalue)


# ------------------------------------------------------------------- mutants


def replacement_from_target(draft_tokens, draft_probs, target_probs, generator):
    """Bug: on rejection draw the replacement from p instead of normalize(max(0, p - q))."""
    batch, gamma = draft_tokens.shape
    accept_u = torch.rand((batch, gamma), dtype=torch.float64, generator=generator)
    sample_u = torch.rand((batch,), dtype=torch.float64, generator=generator)
    result = verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u, sample_u)
    rows = torch.arange(batch)
    tokens = result.tokens.clone()
    tokens[rows, result.num_accepted] = sample_from(target_probs[rows, result.num_accepted], sample_u)
    return VerifyResult(result.num_accepted, tokens)


def keeps_tokens_after_rejection(draft_tokens, draft_probs, target_probs, generator):
    """Bug: commit every draft token that passes its own test, skipping the rejected ones."""
    batch, gamma = draft_tokens.shape
    accept_u = torch.rand((batch, gamma), dtype=torch.float64, generator=generator)
    sample_u = torch.rand((batch,), dtype=torch.float64, generator=generator)
    result = verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_u, sample_u)
    n = int(result.num_accepted[0])
    if n == gamma:
        return result
    p_of_draft = target_probs[0, torch.arange(gamma), draft_tokens[0]]
    q_of_draft = draft_probs[0, torch.arange(gamma), draft_tokens[0]]
    later = [
        int(t)
        for i, t in enumerate(draft_tokens[0].tolist())
        if i > n and accept_u[0, i] < p_of_draft[i] / q_of_draft[i]
    ]
    committed = result.committed()[: n + 1] + later
    tokens = torch.full((1, len(committed)), -1, dtype=torch.int64)
    tokens[0] = torch.tensor(committed)
    return VerifyResult(torch.tensor([len(committed) - 1]), tokens)


def penalty_once_per_round(logits, prefix, block, prompt_length, params):
    """Bug: every row of the target's block is processed with the round's starting prefix."""
    return torch.cat(
        [block_probs(logits[j : j + 1], prefix, [], prompt_length, params) for j in range(logits.shape[0])]
    )


class WrongDraft(ReadsNothing):
    """A draft over a Markov model's next-token logits, for every slot, whose :meth:`propose_one` gets a bug."""

    def __init__(self, model: MarkovLM, params: SamplingParams) -> None:
        self.model, self.params = model, params

    def route(self, context) -> str:
        return "draft"

    def propose(self, requests, draft_rule) -> list[Draft]:
        return [self.propose_one(r.context, r.prompt_length, r.gamma, r.generator) for r in requests]

    def q(self, prefix: list[int], prompt_length: int) -> torch.Tensor:  # (V,) the exact rule's q
        return block_probs(self.model.next_logits(prefix).unsqueeze(0), prefix, [], prompt_length, self.params)[0]


class DraftProbsBeforeProcessors(WrongDraft):
    """Bug: tokens are sampled from the processed q, but the verifier is handed the raw softmax."""

    def propose_one(self, context, prompt_length, gamma, generator):
        tokens, raw, prefix = [], [], list(context)
        for _ in range(gamma):
            uniform = torch.rand((1,), dtype=torch.float64, generator=generator)
            tokens.append(int(sample_from(self.q(prefix, prompt_length).unsqueeze(0), uniform)[0]))
            raw.append(self.model.next_logits(prefix).double().softmax(-1))
            prefix.append(tokens[-1])
        return Draft(tokens, torch.stack(raw))


class ArgmaxWithSampledRatio(WrongDraft):
    """Bug: the draft proposes its top token but reports q, so the ratio p/q meant for sampled drafts is used."""

    def propose_one(self, context, prompt_length, gamma, generator):
        tokens, rows, prefix = [], [], list(context)
        for _ in range(gamma):
            rows.append(self.q(prefix, prompt_length))
            tokens.append(int(rows[-1].argmax()))
            prefix.append(tokens[-1])
        return Draft(tokens, torch.stack(rows))


# --------------------------------------------------------------------- tests


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_speculative_output_follows_the_target_law(name, verify, n):
    target, draft = models()
    params = CONFIGS[name]
    counts = sample_counts(target, draft, params, n, verify=verify)
    assert g_test_p_value(counts, exact_law(target, params)) > ALPHA


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_seeded_generation_is_the_same_alone_and_in_the_batch(name):
    """The library's one-at-a-time decoder and the batch the statistical tests sample are the same experiment:
    seed s gives the same tokens from ``SpeculativeDecoder.generate`` as from slot k of sample_counts' engine."""
    target, draft = models()
    params = CONFIGS[name]
    decoder = SpeculativeDecoder(target, draft, params)
    seeds = range(SLOTS + 8)  # past one batch: the last seeds join slots that earlier sequences left
    solo = [tuple(decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, gamma=GAMMA, seed=s).tokens) for s in seeds]
    assert sample_outcomes(target, draft, params, len(seeds)) == solo


@pytest.mark.parametrize("n", SIZES)
def test_prompt_lookup_follows_the_target_law(n):
    """Deterministic n-gram proposals through the point-mass rule (4 tokens, prompt [1, 2])."""
    target, _ = models()
    params = CONFIGS["T=1"]
    counts = sample_counts(target, PromptLookupProposer(min_ngram=1, max_ngram=2), params, n)
    assert g_test_p_value(counts, exact_law(target, params)) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_adaptive_gamma_follows_the_target_law(n):
    """Gamma chosen per round from timings and past acceptance: each round is still an exact step."""
    target, draft = models()
    params = CONFIGS["T=1"]
    counts = sample_counts(target, draft, params, n, policy=AdaptiveGamma(AdaptiveConfig(max_gamma=3, initial_gamma=3)))
    assert g_test_p_value(counts, exact_law(target, params)) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_adaptive_gamma_from_priors_follows_the_target_law(n):
    """The cold-start policy: gamma from calibrated costs and an acceptance prior from the first round on."""
    target, draft = models()
    params = CONFIGS["top_p=0.8"]
    # call costs per row of a sequence: the batch's gamma varies as it would for one sequence with 1.0 + 0.05 n ms
    priors = PolicyPriors({SLOTS * n: 1.0 + 0.05 * n for n in range(1, 5)}, 0.1, (0.9, 0.4))
    policy = SyntheticClock(
        AdaptiveGamma(AdaptiveConfig(max_gamma=3, initial_gamma=3), priors), 0.1, lambda rows: 1.0 + 0.05 * rows / SLOTS
    )
    counts = sample_counts(target, draft, params, n, policy=policy)
    assert {2, 3} <= set(policy.chosen)  # gamma really varies with the estimates
    assert g_test_p_value(counts, exact_law(target, params)) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_plain_decoding_follows_the_target_law(n):
    target, _ = models()
    params = CONFIGS["repetition=1.8,presence=0.5"]
    counts = sample_counts(target, None, params, n // 2)
    assert g_test_p_value(counts, exact_law(target, params)) > ALPHA


def _mutant(mutant: str, monkeypatch) -> tuple[MarkovLM, object, SamplingParams, str]:
    """(target, draft, params, verification rule) of a known-wrong engine; the engine's rules are patched where the
    bug lives (the two token-wise verifier bugs with the token-wise rule, the rest with the default block rule)."""
    target, draft = models()
    if mutant == "replacement_from_target":
        monkeypatch.setattr(engine_module, "verify_stochastic", replacement_from_target)
        return target, draft, CONFIGS["T=1"], "token"
    if mutant == "keeps_tokens_after_rejection":
        monkeypatch.setattr(engine_module, "verify_stochastic", keeps_tokens_after_rejection)
        return target, draft, CONFIGS["T=1"], "token"
    if mutant == "penalty_once_per_round":
        monkeypatch.setattr(engine_module, "block_probs", penalty_once_per_round)
        return target, draft, CONFIGS["repetition=1.8,presence=0.5"], "block"
    if mutant == "argmax_with_sampled_ratio":
        params = CONFIGS["T=1"]
        return target, ArgmaxWithSampledRatio(draft, params), params, "block"
    if mutant == "draft_probs_before_processors":
        params = CONFIGS["T=0.7,top_k=2"]
        return target, DraftProbsBeforeProcessors(draft, params), params, "block"
    raise ValueError(mutant)


MUTANTS = [
    "replacement_from_target",
    "keeps_tokens_after_rejection",
    "penalty_once_per_round",
    "draft_probs_before_processors",
    "argmax_with_sampled_ratio",
]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mutant", MUTANTS)
def test_the_same_test_rejects_each_wrong_variant(mutant, monkeypatch, n):
    target, draft, params, verify = _mutant(mutant, monkeypatch)
    assert g_test_p_value(sample_counts(target, draft, params, n, verify=verify), exact_law(target, params)) < ALPHA


@pytest.mark.extended
@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutant_power_over_several_seed_offsets(mutant, monkeypatch):
    """Extended sweep behind its marker: the mutant is rejected from 5 disjoint seed ranges."""
    target, draft, params, verify = _mutant(mutant, monkeypatch)
    law = exact_law(target, params)
    p_values = [
        g_test_p_value(sample_counts(target, draft, params, N, offset=k * N, verify=verify), law) for k in range(1, 6)
    ]
    print(mutant, [f"{p:.1e}" for p in p_values])
    assert max(p_values) < ALPHA
