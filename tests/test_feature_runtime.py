"""The feature-level draft's runtime (exactspec.models.feature_runtime): ragged rows, rollbacks, copied prefixes and
the invariant mode, each row against what the same draft gives it alone."""

from __future__ import annotations

import pytest
import torch
from test_feature_draft import tiny_draft, tiny_target

from exactspec.models.feature_runtime import FeatureDraftRuntime


def inputs(n: int, seed: int) -> tuple[torch.Tensor, list[int]]:  # (n, C) inputs and n tokens
    g = torch.Generator().manual_seed(seed)
    return torch.randn((n, 16), generator=g), torch.randint(0, 4, (n,), generator=g).tolist()


def alone(runtime: FeatureDraftRuntime, u: torch.Tensor, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A one-row call on slot 0: the last slot's output g ``(C,)`` and its logits ``(|S|,)``."""
    g, logits = runtime.forward([(0, u, tokens)])
    return g[0], logits[0]


@pytest.mark.parametrize("layout", ["exactspec", "eagle3"])
def test_ragged_rows_with_rollbacks_equal_each_sequence_alone(layout):
    """Three sequences fed ragged rows (a prompt's worth, a block, single steps), with per-slot rollbacks between
    calls, give each row what a one-slot runtime gives for the same history (float32, 1e-5), in both layouts."""
    draft = tiny_draft(tiny_target(), layout=layout)
    batched = FeatureDraftRuntime(draft, 3, 32)
    solo = [FeatureDraftRuntime(draft, 1, 32) for _ in range(3)]
    schedule = [  # per call: (slot, roll back to, slots fed)
        [(0, 0, 5), (1, 0, 1), (2, 0, 3)],
        [(2, 2, 4), (0, 5, 1), (1, 1, 2)],  # slot 2 drops its last slot: stale keys must not be read
        [(2, 6, 1), (0, 3, 2)],  # out of slot order, with a gap
    ]
    for call, rows in enumerate(schedule):
        fed = []
        for slot, back, n in rows:
            batched.rollback(slot, back)
            solo[slot].rollback(0, back)
            fed.append((slot, *inputs(n, 10 * call + slot)))
        outputs, logits = batched.forward(fed)
        for i, (slot, u, tokens) in enumerate(fed):
            g, row_logits = alone(solo[slot], u, tokens)
            assert torch.allclose(outputs[i], g, atol=1e-5) and torch.allclose(logits[i], row_logits, atol=1e-5)
            assert batched.lengths[slot] == solo[slot].lengths[0]


def test_invariant_mode_gives_each_row_the_solo_bits():
    """Each slot's rows get what an invariant one-slot runtime gives them, and that does not depend on how the rows are
    split into calls (it pads every call to fixed rows, so CPUs whose kernels depend on the row count agree)."""
    draft = tiny_draft(tiny_target())
    batched, solo = FeatureDraftRuntime(draft, 2, 32, invariant=True), FeatureDraftRuntime(draft, 1, 32, invariant=True)
    (u, tokens), (u2, tokens2) = inputs(4, 0), inputs(2, 1)
    _, logits = batched.forward([(1, u2, tokens2), (0, u, tokens)])
    whole = alone(solo, u, tokens)[1]
    assert torch.equal(logits[1], whole)
    split = FeatureDraftRuntime(draft, 1, 32, invariant=True)
    alone(split, u[:1], tokens[:1])
    assert torch.equal(alone(split, u[1:], tokens[1:])[1], whole)


@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "invariant"])
def test_a_copied_prefix_continues_as_its_source_does(invariant):
    """Slot 1 given slot 0's first 3 slots and fed 2 more gives what a one-slot runtime fed those 5 gives."""
    draft = tiny_draft(tiny_target())
    batched, solo = (
        FeatureDraftRuntime(draft, 3, 32, invariant=invariant),
        FeatureDraftRuntime(draft, 1, 32, invariant=invariant),
    )
    (u, tokens), (u2, tokens2) = inputs(5, 0), inputs(2, 1)
    batched.forward([(0, u, tokens), (2, u2, tokens2)])
    batched.copy_prefix(0, 1, 3)
    _, logits = batched.forward([(1, u2, tokens2), (2, u2[:1], tokens2[:1])])
    alone(solo, u[:3], tokens[:3])
    expected = alone(solo, u2, tokens2)[1]
    assert torch.equal(logits[0], expected) if invariant else torch.allclose(logits[0], expected, atol=1e-5)
    assert batched.lengths == [5, 5, 3]
    with pytest.raises(ValueError, match="copy 4 positions of slot 2: it holds 3"):
        batched.copy_prefix(2, 0, 4)


def test_bad_calls_are_refused():
    batched = FeatureDraftRuntime(tiny_draft(tiny_target()), 2, 8)
    u, tokens = inputs(3, 0)
    with pytest.raises(ValueError, match="distinct slots"):
        batched.forward([(0, u, tokens), (0, u, tokens)])
    with pytest.raises(ValueError, match="3 inputs for 2 tokens"):
        batched.forward([(0, u, tokens[:2])])
    batched.forward([(0, u, tokens)])
    with pytest.raises(ValueError, match="roll back to length 4: the state holds 3"):
        batched.rollback(0, 4)
    with pytest.raises(ValueError, match="3 cached . 6 new tokens exceeds 8 positions"):
        batched.forward([(0, *inputs(6, 1))])
