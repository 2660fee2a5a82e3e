"""The feature-level draft (exactspec.models.eagle, exactspec.proposers.feature_draft): training mirrors decoding,
the engine hands it the target's features, and speculative output with it follows the target's law.

Statistical tests: as in test_exactness.py (G-test, N = 8000, ALPHA = 1e-3 each, fixed seeds), on a tiny random
Llama target over 4 tokens whose draft's vocabulary subset leaves one token out (q = 0 there), so the
reduced-vocabulary head is part of what is tested. Power: a mutant replacement rule and a mutant proposer that
samples from the processed q but reports the raw one are rejected at the same N.
"""

from __future__ import annotations

import pytest
import torch
from conftest import engine_counts, sequence_law
from test_exactness import ALPHA, SIZES, g_test_p_value, replacement_from_target

import exactspec.decoding.engine as engine_module
from exactspec import SamplingParams, SpeculativeDecoder
from exactspec.decoding.engine import BatchEngine, EngineConfig
from exactspec.decoding.sampling import block_probs
from exactspec.models.eagle import FeatureDraft, FeatureDraftConfig, ttt_mask
from exactspec.models.feature_runtime import FeatureDraftRuntime
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.models.llama import LlamaDecoder
from exactspec.models.llama_config import LlamaConfig
from exactspec.proposers.feature_draft import FeatureDraftProposer

VOCAB, PROMPT, NEW_TOKENS, GAMMA = 4, [1, 2], 5, 3
SUBSET = [0, 1, 3]  # token 2 is never drafted


def tiny_target(seed: int = 3, hidden_size: int = 16) -> LlamaDecoder:
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    decoder = LlamaDecoder(cfg)
    decoder.init_weights(torch.Generator().manual_seed(seed), std=0.6)
    return decoder.eval()


def tiny_draft(target: LlamaDecoder, subset=SUBSET, seed: int = 1, layout: str = "exactspec") -> FeatureDraft:
    torch.manual_seed(seed)
    draft = FeatureDraft(FeatureDraftConfig.for_target(target.cfg, len(subset), layout))
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.4)
            elif p.dim() == 1 and layout == "eagle3":  # its two input norms apart from 1 and each other: a swap shows
                p.uniform_(0.5, 1.5)
        draft.vocab_ids.copy_(torch.tensor(subset))
    return draft.attach(target).eval()


def test_layers_are_spread_over_the_target():
    target = LlamaConfig(
        vocab_size=10,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=30,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    cfg = FeatureDraftConfig.for_target(target, 8)
    assert cfg.feature_layers == (6, 14, 29)
    eagle3 = FeatureDraftConfig.for_target(target, 8, "eagle3")  # EAGLE-3's inputs of layers 2, 15 and 27
    assert eagle3.feature_layers == (1, 14, 26) and eagle3.layout == "eagle3"
    with pytest.raises(ValueError, match="layout is one of"):
        FeatureDraftConfig.for_target(target, 8, "eagle2")


def test_ttt_mask_is_the_decoding_cache():
    """Step 3 at slot 5 sees the true slots 0..3 and its own chain: step 2's slot 4 and step 3's slot 5."""
    mask = ttt_mask(8, 3)
    assert mask.shape == (8, 24)
    assert mask[5].nonzero().flatten().tolist() == [0, 1, 2, 3, 8 + 4, 16 + 5]
    assert ttt_mask(4, 1).equal(torch.ones(4, 4, dtype=torch.bool).tril())


@pytest.mark.parametrize("layout", ["exactspec", "eagle3"])
def test_training_forward_equals_decoding_with_the_drafts_own_features(layout):
    """forward_train's step k at slot j is what decoding computes when the target's features end at slot j - k + 1
    and the draft chains its own outputs for k - 1 slots; and the LeanModel's captured features equal the training
    forward's. In both layouts."""
    target = tiny_target()
    draft = tiny_draft(target, layout=layout)
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, features = target.forward_train(tokens, draft.cfg.feature_layers)  # (1, 12, F)
        outputs = draft.forward_train(features[:, :-1], tokens[:, 1:], steps=3)  # slot j pairs f_j with x_{j+1}
    lean = LeanModel(target)
    lean.capture_features(draft.cfg.feature_layers)
    lean.prefill(tokens[0].tolist())
    torch.testing.assert_close(lean.last_features, features[0], atol=1e-5, rtol=0)
    runtime = FeatureDraftRuntime(draft, 1, max_len=16)
    for k, j in [(1, 4), (2, 5), (3, 7), (3, 10)]:
        runtime.rollback(0, 0)
        last_true = j - k + 1
        g, _ = runtime.forward(
            [(0, runtime.project(features[0, : last_true + 1]), tokens[0, 1 : last_true + 2].tolist())]
        )
        for slot in range(last_true + 1, j + 1):
            g, _ = runtime.forward([(0, g, [int(tokens[0, slot + 1])])])
        torch.testing.assert_close(g[0], outputs[k - 1][0, j], atol=1e-5, rtol=1e-5)  # float32 rounding only


@pytest.mark.parametrize("layout", ["exactspec", "eagle3"])
def test_a_widened_draft_computes_what_it_was_computed_from_and_trains(layout):
    """FeatureDraft.widened grows the MLP without changing the draft's outputs (the new units' down-projection is
    zero, their gate and up rows are not), and a training step then moves the new units; it refuses to shrink."""
    target = tiny_target()
    draft = tiny_draft(target, layout=layout)
    wide = draft.widened(3 * draft.cfg.intermediate_size, torch.Generator().manual_seed(0))
    assert wide.cfg.intermediate_size == 96 and wide.block.w2.weight.shape == (16, 96)
    assert wide.block.w13.weight[32:64].abs().min() > 0  # the new gate rows: drawn, not zero
    tokens = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        _, features = target.forward_train(tokens, draft.cfg.feature_layers)
        before = draft.forward_train(features[:, :-1], tokens[:, 1:], steps=2)
    after = wide.forward_train(features[:, :-1], tokens[:, 1:], steps=2)
    for old, new in zip(before, after):
        torch.testing.assert_close(new, old, atol=1e-6, rtol=0)
    torch.stack([wide.logits(g).logsumexp(-1).sum() for g in after]).sum().backward()
    assert wide.block.w2.weight.grad[:, 32:].abs().max() > 0  # the new units' columns learn from the first step
    with pytest.raises(ValueError, match="does not shrink"):
        draft.widened(16)


def test_a_target_without_features_is_refused():
    from exactspec import MarkovLM

    draft = tiny_draft(tiny_target())
    with pytest.raises(ValueError, match="hidden states"):
        SpeculativeDecoder(MarkovLM.random(VOCAB, 2, seed=0), FeatureDraftProposer.solo(draft, VOCAB, 16))


def test_greedy_equals_plain_greedy_and_drafts_come_from_the_subset():
    target = tiny_target()
    params = SamplingParams(temperature=0)
    proposer = FeatureDraftProposer.solo(tiny_draft(target), VOCAB, 32)
    drafted = []
    propose = proposer.propose
    proposer.propose = lambda *a: drafted.extend(propose(*a)) or drafted[-len(a[0]) :]
    config = dict(max_new_tokens=20, gamma=3, seed=0)
    speculative = SpeculativeDecoder(LeanModel(target), proposer, params).generate(PROMPT, **config)
    plain = SpeculativeDecoder(LeanModel(tiny_target()), None, params).generate(PROMPT, **config)
    assert speculative.tokens == plain.tokens
    assert speculative.stats.summary()["accepted"] > 0
    assert drafted and all(t in SUBSET for d in drafted for t in d.tokens)


# ---------------------------------------------------------------- statistical exactness


def exact_law(model: LeanModel, params: SamplingParams) -> dict[tuple[int, ...], float]:
    """The law of NEW_TOKENS tokens after PROMPT from the model's logits of each prefix computed alone."""
    return sequence_law(
        lambda prefix: block_probs(model.prefill(prefix)[-1:], prefix, [], len(PROMPT), params)[0], PROMPT, NEW_TOKENS
    )


class RawProbsReported(FeatureDraftProposer):
    """Bug: tokens are sampled from the processed q, the verifier is handed the unprocessed softmax over S."""

    def propose(self, requests, draft_rule):
        def raw_reported(logits, *args):  # logits (1, |S|)
            return draft_rule(logits, *args)[0], logits[0].double().softmax(-1)

        return super().propose(requests, raw_reported)


#: Sequences drawn at once by the statistical tests (one batch engine, seeds 0..n-1; see conftest.engine_counts).
SLOTS = 48


def counts_and_law(
    params: SamplingParams,
    n: int,
    proposer_class=FeatureDraftProposer,
    verify: str = "block",
    layout: str = "exactspec",
):
    """The feature draft batched over SLOTS slots beside the target's LeanRuntime, as serve runs it."""
    target = tiny_target()
    proposer = proposer_class(FeatureDraftRuntime(tiny_draft(target, layout=layout), SLOTS, 32), VOCAB)
    engine = BatchEngine(LeanRuntime.like(LeanModel(target), SLOTS, 32), proposer, EngineConfig(gamma=GAMMA))
    counts = engine_counts(engine, PROMPT, n, params, NEW_TOKENS, GAMMA, verify=verify)
    return counts, exact_law(LeanModel(tiny_target()), params), engine


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("verify", ["block", "token"])
@pytest.mark.parametrize(
    "params", [SamplingParams(), SamplingParams(temperature=0.7, top_k=3)], ids=["T=1", "T=0.7,top_k=3"]
)
def test_speculative_output_with_the_feature_draft_follows_the_target_law(params, verify, n):
    counts, law, decoder = counts_and_law(params, n, verify=verify)
    assert g_test_p_value(counts, law) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_the_eagle3_layout_drafts_under_the_same_law(n):
    counts, law, _ = counts_and_law(SamplingParams(), n, layout="eagle3")
    assert g_test_p_value(counts, law) > ALPHA


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mutant", ["replacement_from_target", "raw_probs_reported"])
def test_the_same_test_rejects_wrong_variants_with_the_feature_draft(mutant, monkeypatch, n):
    if mutant == "replacement_from_target":
        monkeypatch.setattr(engine_module, "verify_stochastic", replacement_from_target)
        counts, law, _ = counts_and_law(SamplingParams(), n, verify="token")
    else:
        counts, law, _ = counts_and_law(SamplingParams(temperature=0.7, top_k=3), n, RawProbsReported)
    assert g_test_p_value(counts, law) < ALPHA
