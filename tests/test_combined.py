"""Prompt lookup combined with a trained feature draft (exactspec.proposers.combined) and one gamma policy per source
(exactspec.decoding.policy.AdaptiveGamma keeps its estimates per source).

Statistical tests as in test_exactness.py (G-test, N = 8000, ALPHA = 1e-3 each, fixed seeds), on the tiny Llama
target and feature draft of test_feature_draft.py. With min_match = 1 over 4 tokens most rounds after the first
few take the lookup source, so both sources and both verification rules are in play in one generation. Power: a
mutant that verifies lookup tokens as if the draft had sampled them from a uniform q is rejected at the same N.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_counts
from test_exactness import ALPHA, SIZES, g_test_p_value
from test_feature_draft import GAMMA, NEW_TOKENS, PROMPT, SLOTS, VOCAB, exact_law, tiny_draft, tiny_target

from exactspec import SamplingParams, SpeculativeDecoder
from exactspec.decoding.engine import BatchEngine, EngineConfig
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma
from exactspec.models.feature_runtime import FeatureDraftRuntime
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.proposers import Draft, DraftRequest, LookupOrDraft
from exactspec.proposers.base import processed_q
from exactspec.proposers.feature_draft import FeatureDraftProposer


class Recorder:
    """A single-sequence proposer that remembers what it was asked."""

    def __init__(self, token: int = 7) -> None:
        self.calls, self.token = 0, token
        self.on_call = lambda: None

    def reset(self, prompt) -> None:
        pass

    def propose(self, context, gamma, generator) -> Draft:
        self.calls += 1
        self.on_call()
        return Draft([self.token] * gamma, None)


def test_routes_to_lookup_only_on_a_long_enough_repeat():
    proposer = LookupOrDraft(Recorder(), min_match=3, max_ngram=4)
    assert proposer.route([1, 2, 3, 4, 1, 2]) == "draft"  # a 2-token repeat is not enough
    assert proposer.route([1, 2, 3, 4, 1, 2, 3]) == "lookup"

    def proposed(context):
        (draft,) = proposer.propose([DraftRequest(0, context, 1, 2, SamplingParams(), torch.Generator())], processed_q)
        return draft.tokens

    assert proposed([1, 2, 3, 4, 1, 2, 3]) == [4, 1]
    assert proposer.draft.proposer.calls == 0
    assert proposed([1, 2, 3, 4, 1, 2]) == [7, 7]
    assert proposer.draft.proposer.calls == 1
    with pytest.raises(ValueError, match="min_match"):
        LookupOrDraft(Recorder(), min_match=0)


def test_engine_asks_and_teaches_the_policy_per_source():
    """The engine asks the policy for the source each context routes to, that source learns from the round, and
    the draft model is never called for a round routed to lookup."""
    seen = {"lookup": 0, "draft": 0}

    class Counting(AdaptiveGamma):
        def choose(self, sources, fixed_rows=0, fixed_tokens=0.0):
            self.asked = list(sources)
            return super().choose(sources, fixed_rows, fixed_tokens)

        def observe_round(self, source, record):
            seen[source] += 1
            super().observe_round(source, record)

    policy = Counting(AdaptiveConfig(max_gamma=2, initial_gamma=2))
    recorder = Recorder(token=3)
    recorder.on_call = lambda: seen.__setitem__(
        "draft_calls_under_lookup", seen.get("draft_calls_under_lookup", 0) + (policy.asked != ["draft"])
    )
    decoder = SpeculativeDecoder(
        LeanModel(tiny_target()),
        LookupOrDraft(recorder, min_match=2, max_ngram=3),
        SamplingParams(temperature=0.0),
        policy=policy,
    )
    decoder.generate([1, 2, 1, 2, 1], max_new_tokens=12, gamma="auto")
    assert seen["lookup"] >= 1 and seen["draft"] >= 1
    assert recorder.calls >= 1 and seen["draft_calls_under_lookup"] == 0


class LookupAsSampled(LookupOrDraft):
    """Bug: lookup tokens are handed to the verifier as if sampled from a uniform q (checked with min(1, p/q))."""

    def propose(self, requests, draft_rule):
        uniform = lambda n: torch.full((n, VOCAB), 1.0 / VOCAB, dtype=torch.float64)  # noqa: E731
        return [
            Draft(d.tokens, uniform(len(d.tokens))) if d.probs is None and d.tokens else d
            for d in super().propose(requests, draft_rule)
        ]


def combined_counts(params: SamplingParams, n: int, proposer_class=LookupOrDraft):
    target = tiny_target()
    feature = FeatureDraftProposer(FeatureDraftRuntime(tiny_draft(target), SLOTS, 32), VOCAB)
    proposer = proposer_class(feature, min_match=1, max_ngram=2)
    routes = {"lookup": 0, "draft": 0}
    route = proposer.route
    proposer.route = lambda context: routes.__setitem__(r := route(context), routes[r] + 1) or r
    engine = BatchEngine(LeanRuntime.like(LeanModel(target), SLOTS, 32), proposer, EngineConfig(gamma=GAMMA))
    # A fixed gamma: the policy would learn from these tiny calls' timings to stop drafting (its per-source choice
    # is test_engine_asks_and_teaches_the_policy_per_source's), and every round should draft from one source or the
    # other.
    counts = engine_counts(engine, PROMPT, n, params, NEW_TOKENS, GAMMA)
    return counts, exact_law(LeanModel(tiny_target()), params), routes


@pytest.mark.parametrize("n", SIZES)
def test_lookup_combined_with_the_feature_draft_follows_the_target_law(n):
    params = SamplingParams(temperature=0.8)
    counts, law, routes = combined_counts(params, n)
    assert routes["lookup"] > n and routes["draft"] > n // 10  # both sources serve many rounds
    assert g_test_p_value(counts, law) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_the_same_test_rejects_lookup_verified_as_sampled(n):
    counts, law, _ = combined_counts(SamplingParams(temperature=0.8), n, LookupAsSampled)
    assert g_test_p_value(counts, law) < ALPHA
