"""Acceptance priors: the draft's shipped figures, the per-pair cache, and their use by `generate --gamma auto`."""

from __future__ import annotations

import json
import shutil

import pytest

from exactspec.cli import main
from exactspec.decoding.sampling import GREEDY, SamplingParams
from exactspec.loading import default_pair_dirs
from exactspec.tuning.priors import PRIOR_FILE, PolicyCache, acceptance_prior, fingerprint, shipped_prior


@pytest.fixture
def pair_copy(tmp_path):
    target, draft = (shutil.copytree(d, tmp_path / d.name) for d in default_pair_dirs())
    return target, draft


def test_the_fingerprint_follows_the_weights_and_config(pair_copy):
    target, draft = pair_copy
    before = fingerprint(target, draft)
    assert fingerprint(target, draft) == before and fingerprint(draft, target) != before
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit in the last tensor
    weights.write_bytes(bytes(data))
    assert fingerprint(target, draft) != before


def test_the_shipped_prior_applies_only_to_the_pair_it_was_measured_with(pair_copy):
    target, draft = pair_copy
    greedy, sampled = shipped_prior(draft, target, "greedy"), shipped_prior(draft, target, "sampled")
    assert greedy and sampled and len(greedy) == 8 and greedy != sampled and all(0 < a <= 1 for a in greedy + sampled)
    weights = draft / "model.safetensors"
    original = weights.read_bytes()
    weights.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))  # the draft retrained in place
    assert shipped_prior(draft, target, "greedy") is None
    weights.write_bytes(original)
    config = json.loads((target / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))  # another target
    assert shipped_prior(draft, target, "greedy") is None
    (draft / PRIOR_FILE).write_text("{damaged")
    assert shipped_prior(draft, target, "greedy") is None  # ignored, never fatal


def test_the_cache_adds_counts_caps_them_and_serves_well_observed_positions(tmp_path):
    cache = PolicyCache(tmp_path / "policy")
    assert cache.load("pair", "greedy") is None
    cache.save("pair", "greedy", reached=[10, 6, 2], accepted=[9, 3, 1])
    assert cache.load("pair", "greedy") == (0.9,)  # position 1 has 6 < MIN_COUNT observations
    cache.save("pair", "greedy", reached=[10, 6], accepted=[5, 3])
    assert cache.load("pair", "greedy") == pytest.approx((14 / 20, 6 / 12))
    assert cache.load("pair", "sampled") is None and cache.load("other", "greedy") is None
    cache.save("pair", "greedy", reached=[1000], accepted=[0])  # a long run: old counts fade, capped at MAX_COUNT
    rate = cache.load("pair", "greedy")[0]
    assert (
        rate == pytest.approx(14 / 1020, rel=1e-3)
        and json.loads(cache.entries()[0].read_text())["greedy"]["reached"][0] == PolicyCache.MAX_COUNT
    )
    cache.entries()[0].write_text('{"greedy": {"reached": [5], "accepted": [9]}}')  # damaged: accepted > reached
    assert cache.load("pair", "greedy") is None
    assert cache.clear() == 1 and cache.entries() == []


def test_the_cache_comes_before_the_shipped_prior(pair_copy, tmp_path):
    target, draft = pair_copy
    cache = PolicyCache(tmp_path / "cache")
    rates, source = acceptance_prior(target, draft, GREEDY, cache)
    assert source == "shipped" and rates == shipped_prior(draft, target, "greedy")
    cache.save(fingerprint(target, draft), "greedy", [20, 20], [19, 10])
    assert acceptance_prior(target, draft, GREEDY, cache) == ((0.95, 0.5), "cache")
    assert acceptance_prior(target, draft, SamplingParams(), cache)[1] == "shipped"  # another mode
    # the block rule keeps its own entries; a token-wise prior stands in until it has one
    assert acceptance_prior(target, draft, SamplingParams(), cache, "block") == (
        shipped_prior(draft, target, "sampled"),
        "shipped token-wise",
    )
    cache.save(fingerprint(target, draft), "sampled-block", [20, 20], [18, 12])
    assert acceptance_prior(target, draft, SamplingParams(), cache, "block") == ((0.9, 0.6), "cache")
    assert acceptance_prior(target, draft, SamplingParams(), cache)[1] == "shipped"
    (draft / PRIOR_FILE).unlink()
    assert acceptance_prior(target, draft, SamplingParams(), None) == ((), "none")


def test_generate_auto_calibrates_records_its_priors_and_remembers_the_pair(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    args = ["generate", "def parse_args(", "--max-new-tokens", "40", "--ignore-eos", "--temperature", "0", "--json"]
    assert main([*args, "--no-policy-cache"]) == 0
    first = json.loads(capsys.readouterr().out)["policy"]
    assert first["prior_source"] == "shipped" and sorted(map(int, first["calibration"]["target_ms"])) == list(
        range(1, 10)
    )
    assert first["calibration"]["draft_step_ms"] > 0 and not PolicyCache().entries()  # --no-policy-cache wrote nothing
    assert main(args) == 0 and json.loads(capsys.readouterr().out)["policy"]["prior_source"] == "shipped"
    assert main(args) == 0
    second = json.loads(capsys.readouterr().out)["policy"]
    assert second["prior_source"] == "cache" and len(PolicyCache().entries()) == 1
    assert main(["cache", "--clear"]) == 0 and "removed 1" in capsys.readouterr().out and not PolicyCache().entries()
    assert main([*args, "--gamma", "4"]) == 0 and json.loads(capsys.readouterr().out)["policy"] is None  # fixed gamma
