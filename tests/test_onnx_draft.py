"""The feature-level draft on ONNX Runtime (exactspec.models.onnx_draft): the same numbers as the torch draft in
float32, int8 blocks within their rounding, the runtime's slot operations, and the output law through the engine
beside the ONNX target (G-test as in test_exactness.py, false-positive rate ALPHA = 1e-3, with its power case)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_feature_draft import SUBSET, tiny_draft, tiny_target

from exactspec.models.feature_runtime import FeatureDraftRuntime
from exactspec.models.onnx_draft import OnnxFeatureDraftRuntime, build_draft_model
from exactspec.models.onnx_graph import quantize_int8

TOKENS = [1, 3, 2, 0, 1, 1, 2, 3, 0, 2]


def drafts(layout: str, weights: str = "float32", slots: int = 2):
    draft = tiny_draft(tiny_target(hidden_size=32), layout=layout)
    return FeatureDraftRuntime(draft, slots, 32), OnnxFeatureDraftRuntime(draft, slots, 32, weights=weights)


def calls(runtime) -> list[torch.Tensor]:
    """A prompt's catch-up, two one-token steps, a rollback and a two-slot call: every output, in order."""
    torch.manual_seed(5)
    features = torch.randn(len(TOKENS), runtime.draft.fc.in_features)
    u = runtime.project(features)
    out = []
    g, logits = runtime.forward([(0, u[:6], TOKENS[:6])])
    out += [g, logits]
    for token in (2, 3):
        g, logits = runtime.forward([(0, g, [token])])
        out += [g, logits]
    runtime.rollback(0, 6)
    out += list(runtime.forward([(0, u[6:9], TOKENS[6:9]), (1, u[:2], TOKENS[:2])]))
    return out


@pytest.mark.parametrize("layout", ["exactspec", "eagle3"])
def test_the_float32_graph_computes_the_torch_drafts_numbers(layout):
    reference, ours = drafts(layout)
    for a, b in zip(calls(reference), calls(ours), strict=True):
        assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
    assert ours.lengths == reference.lengths == [9, 2]


def test_int8_blocks_round_each_weight_to_half_a_step():
    w = np.random.default_rng(0).normal(size=(64, 96)).astype(np.float32)
    w[3, :32] = 0.0  # a block of zeros: scale 0, codes exact
    q = quantize_int8(w)
    step = np.repeat(q.scale, 32, axis=1)  # (N, K)
    assert q.bits == 8 and q.codes.dtype == np.uint8
    assert np.all(np.abs(q.dequantized() - w) <= step / 2 + 1e-7)
    assert np.all(q.dequantized()[3, :32] == 0.0)


def test_int8_weights_keep_the_drafts_outputs_near_float32():
    """Weights rounded to 1/254 of a block's range move the draft's logits by a small part of their spread (the
    draft's numbers only move speed: the verifier checks the q it reports)."""
    _, exact = drafts("eagle3")
    _, int8 = drafts("eagle3", "int8")
    for a, b in zip(calls(exact), calls(int8), strict=True):
        assert (a - b).abs().max().item() < 0.05 * a.abs().max().item()
    assert any(a.ne(b).any() for a, b in zip(calls(exact), calls(int8)))  # it did quantize


def test_a_copied_prefix_continues_as_its_source():
    _, ours = drafts("eagle3")
    u = ours.project(torch.randn(len(TOKENS), ours.draft.fc.in_features))
    ours.forward([(0, u[:5], TOKENS[:5])])
    ours.copy_prefix(0, 1, 4)
    assert ours.lengths == [5, 4]
    ours.rollback(0, 4)
    a = ours.forward([(0, u[4:7], TOKENS[4:7])])
    b = ours.forward([(1, u[4:7], TOKENS[4:7])])
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_bad_calls_are_refused():
    _, ours = drafts("eagle3")
    u = ours.project(torch.randn(3, ours.draft.fc.in_features))
    with pytest.raises(ValueError, match="2 inputs for 3 tokens"):
        ours.forward([(0, u[:2], [1, 2, 3])])
    with pytest.raises(ValueError, match="distinct slots"):
        ours.forward([(0, u[:1], [1]), (0, u[1:2], [2])])
    with pytest.raises(ValueError, match="exceed"):
        ours.forward([(0, u[:1].repeat(33, 1), [1] * 33)])
    with pytest.raises(ValueError, match="cannot roll back"):
        ours.rollback(0, 1)
    with pytest.raises(ValueError, match="unknown draft weights"):
        build_draft_model(ours.draft, "float8")
    assert ours.draft.vocab_ids.tolist() == list(SUBSET)


@pytest.mark.parametrize("mutant", [False, True])
def test_speculation_with_the_onnx_draft_follows_the_target_law(mutant):
    """The int8-weight ONNX draft over the ONNX target, block verification, T=0.8: the output law is the target
    runtime's own; the draft's unprocessed softmax handed to the verifier is rejected by the same test."""
    from test_exactness import ALPHA, g_test_p_value
    from test_feature_draft import RawProbsReported
    from test_onnx_runtime import onnx_counts_and_law

    from exactspec.decoding.sampling import SamplingParams

    counts, law = onnx_counts_and_law(
        SamplingParams(temperature=0.8),
        2_000,
        RawProbsReported if mutant else None,
        lambda draft, slots: OnnxFeatureDraftRuntime(draft, slots, 32, weights="int8"),
    )
    assert (g_test_p_value(counts, law) < ALPHA) == mutant
