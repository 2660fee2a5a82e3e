"""The shipped default pair: loads offline, speculative greedy equals plain greedy on real prompts,
both backends agree, and a seeded stochastic run is reproducible."""

from __future__ import annotations

import pytest
import torch

from exactspec import GREEDY, SamplingParams, SpeculativeDecoder
from exactspec.bench.workloads import workload_prompts
from exactspec.loading import default_pair_dirs, load_pair


@pytest.fixture(scope="module")
def pair():
    return load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode_prompt(text)[-200:] for text in workload_prompts("heldout", 3, lines=12)]


def test_the_pair_ships_with_the_package_and_shares_a_vocabulary(pair):
    target_dir, draft_dir = default_pair_dirs()
    for directory in (target_dir, draft_dir):
        assert (directory / "config.json").is_file() and (directory / "model.safetensors").is_file()
        assert (directory / "tokenizer.json").is_file()
    assert pair.target.vocab_size == pair.draft.vocab_size == len(pair.tokenizer.vocabulary())
    assert (target_dir.parent / "MODEL_CARD.md").is_file()


def test_speculative_greedy_equals_plain_greedy_on_held_out_code(pair, prompts):
    config = dict(max_new_tokens=48, gamma=5)
    accepted = 0
    for prompt in prompts:
        plain = SpeculativeDecoder(pair.target, None, GREEDY).generate(prompt, **config)
        speculative = SpeculativeDecoder(pair.target, pair.draft, GREEDY).generate(prompt, **config)
        assert speculative.tokens == plain.tokens
        accepted += speculative.stats.accepted
    assert accepted > 0


def test_the_trained_draft_is_a_useful_draft(pair, prompts):
    """Acceptance far above what an unrelated model would get (a property of the shipped weights)."""
    stats = SpeculativeDecoder(pair.target, pair.draft, GREEDY).generate(prompts[0], max_new_tokens=64, gamma=4).stats
    assert stats.acceptance_rate > 0.4


def test_lean_and_hf_backends_agree(pair, prompts):
    pytest.importorskip("transformers")
    hf = load_pair(default_pair_dirs()[0], None, backend="hf", dtype=torch.float32).target
    prompt = prompts[1][-64:]
    assert torch.allclose(pair.target.prefill(prompt), hf.prefill(prompt), atol=2e-3)
    config = dict(max_new_tokens=24, gamma=3)
    lean_tokens = SpeculativeDecoder(pair.target, pair.draft, GREEDY).generate(prompt, **config).tokens
    hf_tokens = SpeculativeDecoder(hf, pair.draft, GREEDY).generate(prompt, **config).tokens
    assert lean_tokens == hf_tokens


def test_static_cache_rollback_equals_fresh_prefill(pair, prompts):
    prompt = prompts[2][-40:]
    model = pair.target
    model.prefill(prompt[:20])
    model.forward([5, 6, 7, 8])
    model.rollback(20)
    after = model.forward(prompt[20:])
    fresh = model.prefill(prompt)[20:]
    assert torch.allclose(after, fresh, atol=1e-4)


def test_a_seeded_stochastic_run_is_reproducible(pair, prompts):
    decoder = SpeculativeDecoder(pair.target, pair.draft, SamplingParams(temperature=0.8, top_p=0.95))
    runs = [decoder.generate(prompts[0], max_new_tokens=32, gamma=4, seed=s).tokens for s in (1, 1, 2)]
    assert runs[0] == runs[1] != runs[2]
