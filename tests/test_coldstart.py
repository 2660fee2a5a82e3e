"""The adaptive policy's cold start as library code: what `generate --gamma auto` runs, callable without the CLI."""

from __future__ import annotations

import pytest
import torch

from exactspec import SpeculativeDecoder
from exactspec.decoding.policy import AdaptiveGamma
from exactspec.decoding.sampling import GREEDY
from exactspec.loading import default_pair_dirs, load_pair
from exactspec.proposers import DraftModelProposer, LookupOrDraft
from exactspec.tuning.coldstart import ColdStart, cold_start
from exactspec.tuning.priors import PolicyCache, shipped_prior


@pytest.fixture(scope="module")
def pair():
    torch.set_num_threads(1)
    return load_pair(*default_pair_dirs())


def test_the_policy_starts_from_calibrated_costs_and_the_shipped_prior_then_the_cache(pair, tmp_path):
    target_dir, draft_dir = default_pair_dirs()
    prompt = pair.tokenizer.encode_prompt("def parse_args(argv):\n")
    cache = PolicyCache(tmp_path)
    decoder = SpeculativeDecoder(pair.target, pair.proposer(), GREEDY)
    default_policy = decoder.policy
    started = cold_start(decoder, prompt, GREEDY, target_dir, draft_dir, cache)
    assert isinstance(started, ColdStart) and isinstance(decoder.policy, AdaptiveGamma)
    assert decoder.policy is not default_policy
    priors = decoder.policy.priors
    assert (
        sorted(priors.target_ms) == list(range(1, 10)) and priors.draft_step_ms[1] > 0
    )  # every call size gamma <= 8 uses
    assert priors.source == "shipped" and priors.acceptance["draft"] == shipped_prior(draft_dir, target_dir, "greedy")
    assert (
        started.record["prior_source"] == "shipped" and started.record["calibration"]["target_ms"] == priors.target_ms
    )

    generation = decoder.generate(prompt, max_new_tokens=96, gamma="auto")
    started.remember(generation.stats)  # the next run of the pair starts from this one
    again = SpeculativeDecoder(pair.target, pair.proposer(), GREEDY)
    assert cold_start(again, prompt, GREEDY, target_dir, draft_dir, cache).record["prior_source"] == "cache"
    assert (
        cold_start(again, prompt, GREEDY, target_dir, draft_dir, None).record["prior_source"] == "shipped"
    )  # no cache


def test_a_draft_combined_with_lookup_gets_estimates_per_source_and_is_not_cached(pair, tmp_path):
    target_dir, draft_dir = default_pair_dirs()
    decoder = SpeculativeDecoder(pair.target, LookupOrDraft(DraftModelProposer(pair.draft)), GREEDY)
    prompt = pair.tokenizer.encode_prompt("import os\n")
    cache = PolicyCache(tmp_path)
    started = cold_start(decoder, prompt, GREEDY, target_dir, draft_dir, cache)
    assert (
        decoder.policy.sources["lookup"].step_ms(1) == 0.0 < decoder.policy.sources["draft"].step_ms(1)
    )  # lookup: next to nothing
    started.remember(decoder.generate(prompt, max_new_tokens=16, gamma="auto").stats)
    assert list(cache.entries()) == []  # its rounds mix two sources' acceptance


def test_plain_decoding_has_no_cold_start(pair):
    with pytest.raises(ValueError, match="needs a decoder with a proposer"):
        cold_start(SpeculativeDecoder(pair.target, None, GREEDY), [1, 2, 3], GREEDY, *default_pair_dirs())
