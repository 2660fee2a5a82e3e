"""The library's entry point: Speculator loads a pair and generates as `exactspec generate` does (cold start, policy
cache, shipped draft or prompt lookup, one-line checks), and its output is the decoder's."""

from __future__ import annotations

import pytest

from exactspec import SpeculativeDecoder
from exactspec.decoding.sampling import GREEDY, SamplingParams
from exactspec.loading import LOOKUP, PairSpec, default_pair_dirs
from exactspec.speculator import Speculator
from exactspec.tuning.priors import PolicyCache

PROMPT = "def parse_args(argv):\n"


@pytest.fixture(scope="module")
def speculator(tmp_path_factory):
    return Speculator.load(policy_cache=PolicyCache(tmp_path_factory.mktemp("cache")))


def test_greedy_auto_equals_plain_decoding_and_fixed_gamma(speculator):
    auto = speculator.generate(PROMPT, max_new_tokens=40, sampling=GREEDY, stop_at_eos=False)
    plain = speculator.generate(PROMPT, max_new_tokens=40, sampling=GREEDY, gamma=0, stop_at_eos=False)
    fixed = speculator.generate(PROMPT, max_new_tokens=40, sampling=GREEDY, gamma=3, stop_at_eos=False)
    assert len(auto.tokens) == 40 and auto.tokens == plain.tokens == fixed.tokens
    assert auto.stats.drafted > 0 and plain.stats.drafted == 0
    assert auto.policy is not None and plain.policy is None and fixed.policy is None  # only auto starts a policy


def test_auto_starts_from_the_shipped_prior_then_the_cache_and_keeps_its_policy(speculator):
    params = SamplingParams(temperature=0.7)
    first = speculator.generate(PROMPT, max_new_tokens=24, sampling=params, seed=1)
    second = speculator.generate(PROMPT, max_new_tokens=24, sampling=params, seed=2)
    assert (
        first.policy["prior_source"] == "shipped token-wise"
    )  # the cache was empty; the draft ships token-wise figures
    assert second.policy is first.policy  # one cold start per sampling setting: the policy keeps learning
    fresh = Speculator(speculator.spec, speculator.pair, speculator.policy_cache)
    assert fresh.generate(PROMPT, max_new_tokens=8, sampling=params, seed=3).policy["prior_source"] == "cache"


def test_a_seeded_fixed_gamma_run_is_the_decoders_run(speculator):
    params = SamplingParams(temperature=1.0, top_p=0.9)
    completion = speculator.generate(PROMPT, max_new_tokens=24, sampling=params, gamma=2, seed=5, stop_at_eos=False)
    decoder = SpeculativeDecoder(speculator.pair.target, speculator.pair.proposer(), params)
    direct = decoder.generate(speculator.encode(PROMPT), max_new_tokens=24, gamma=2, seed=5)
    assert completion.tokens == direct.tokens
    other = speculator.generate(PROMPT, max_new_tokens=24, sampling=params, gamma=2, seed=6, stop_at_eos=False)
    assert other.tokens != completion.tokens  # the seed matters, so the equality above is not vacuous


def test_a_stream_read_part_way_keeps_what_it_committed(speculator):
    stream = speculator.stream(PROMPT, max_new_tokens=30, sampling=GREEDY, gamma=2, stop_at_eos=False)
    head = [next(stream) for _ in range(5)]
    stream.close()
    assert head == speculator.generate(PROMPT, max_new_tokens=5, sampling=GREEDY, gamma=2, stop_at_eos=False).tokens


def test_bad_input_is_a_clear_error(speculator):
    with pytest.raises(ValueError, match="exceeds the target model's"):
        speculator.generate(PROMPT, max_new_tokens=10**6)
    with pytest.raises(ValueError, match="gamma must be an integer >= 0, 'auto'"):
        speculator.generate(PROMPT, gamma=-1)
    with pytest.raises(ValueError, match="a draft needs its target"):
        PairSpec(draft="some/draft")
    with pytest.raises(ValueError, match="unknown dtype"):
        PairSpec(dtype="float8")


def test_which_pair_a_spec_names():
    target, draft = default_pair_dirs()
    assert PairSpec().dirs() == (target, draft)
    assert PairSpec(speculate=False).dirs() == (target, None)
    lookup = PairSpec(str(target), LOOKUP)
    assert lookup.lookup and lookup.dirs() == (target, None)
    assert PairSpec(str(target)).lookup  # a target without a shipped draft drafts by prompt lookup
    assert not PairSpec(str(target), str(draft)).lookup
    assert Speculator(lookup, lookup.load()).proposal == "prompt lookup"
