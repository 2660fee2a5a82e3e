"""LeanRuntime (exactspec.models.lean): ragged rows in one call give each sequence the logits it gets alone,
roll back on their own, and never see another row's keys or their own padding."""

from __future__ import annotations

import pytest
import torch

from exactspec.models.attention import ragged_causal_mask
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.models.llama import LlamaDecoder
from exactspec.models.llama_config import LlamaConfig


def small_model() -> LeanModel:
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    decoder = LlamaDecoder(cfg)
    decoder.init_weights(torch.Generator().manual_seed(0), std=0.3)
    return LeanModel(decoder.eval())


def alone(model: LeanModel, history: list[int], new: list[int]) -> torch.Tensor:
    model.prefill(history)
    return model.forward(new)


def test_ragged_rows_equal_each_sequence_alone():
    model = small_model()
    batched = LeanRuntime.like(model, slots=4, max_len=96)
    prompts = [[1, 2, 3, 4, 5, 6, 7], [8], [9, 10, 11], [12, 13]]
    out = batched.forward(list(enumerate(prompts)))
    for slot, prompt in enumerate(prompts):
        assert torch.allclose(out[slot], model.prefill(prompt), atol=1e-5)
    # continuation: slots out of order and not contiguous, one token for one, a block for the other
    out = batched.forward([(3, [20, 21, 22, 23]), (1, [24])])
    assert torch.allclose(out[0], alone(model, prompts[3], [20, 21, 22, 23]), atol=1e-5)
    assert torch.allclose(out[1], alone(model, prompts[1], [24]), atol=1e-5)
    assert batched.lengths == [7, 2, 3, 6]
    # every slot, out of order: the call reads them as consecutive slots
    histories = [prompts[0], prompts[1] + [24], prompts[2], prompts[3] + [20, 21, 22, 23]]
    rows = [(2, [30]), (0, [31, 32]), (3, [33]), (1, [34])]
    for (slot, new), got in zip(rows, batched.forward(rows)):
        assert torch.allclose(got, alone(model, histories[slot], new), atol=1e-5)


def test_rollback_is_per_sequence_and_stale_keys_are_never_read():
    model = small_model()
    batched = LeanRuntime.like(model, slots=2, max_len=96)
    batched.forward([(0, [1, 2, 3]), (1, [4, 5, 6, 7, 8, 9])])
    batched.forward([(0, [30, 31, 32, 33, 34]), (1, [40])])  # slot 0 drafts 5 tokens, slot 1 one
    batched.rollback(0, 4)  # keeps [1, 2, 3, 30]: 31..34 are stale keys past the length
    out = batched.forward([(0, [44]), (1, [41, 42, 43])])  # slot 0 is the short row now: padding after it
    assert torch.allclose(out[0], alone(model, [1, 2, 3, 30], [44]), atol=1e-5)
    assert torch.allclose(out[1], alone(model, [4, 5, 6, 7, 8, 9, 40], [41, 42, 43]), atol=1e-5)
    with pytest.raises(ValueError, match="rollback|length"):
        batched.rollback(1, 99)


def test_a_mask_that_ignores_each_rows_position_is_caught(monkeypatch):
    """Power of the test above: letting every query see keys up to the batch's last position reads stale keys."""
    import exactspec.models.lean as module

    monkeypatch.setattr(
        module,
        "ragged_causal_mask",
        lambda positions, end: torch.ones(positions.shape[0], 1, positions.shape[1], end, dtype=torch.bool),
    )
    with pytest.raises(AssertionError):
        test_rollback_is_per_sequence_and_stale_keys_are_never_read()


def test_mask_rows_stop_at_their_own_position():
    mask = ragged_causal_mask(torch.tensor([[3, 4], [0, 1]]), 5)
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0, 0].tolist() == [True, True, True, True, False]
    assert mask[1, 0, 1].tolist() == [True, True, False, False, False]


def test_bad_calls_are_refused():
    batched = LeanRuntime.like(small_model(), slots=2, max_len=8)
    with pytest.raises(ValueError, match="distinct slots"):
        batched.forward([(0, [1]), (0, [2])])
    with pytest.raises(ValueError, match="exceeds 8 positions"):
        batched.forward([(1, list(range(9)))])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        batched.forward([(1, [50])])


def test_invariant_mode_gives_each_row_the_bits_it_gets_alone():
    decoder = small_model().decoder.to(torch.bfloat16)
    solo = LeanModel(decoder, invariant=True)
    batched = LeanRuntime.like(solo, slots=3, max_len=96)
    prompts = [[1, 2, 3, 4, 5], [6, 7], [8, 9, 10]]
    batched.forward(list(enumerate(prompts)))
    out = batched.forward([(0, [11, 12, 13]), (2, [14])])
    batched.rollback(0, 6)
    again = batched.forward([(0, [15, 16]), (1, [17, 18, 19, 20])])
    for got, history, new in (
        (out[0], prompts[0], [11, 12, 13]),
        (out[1], prompts[2], [14]),
        (again[0], prompts[0] + [11], [15, 16]),
        (again[1], prompts[1], [17, 18, 19, 20]),
    ):
        assert torch.equal(got, alone(solo, history, new))


@pytest.mark.parametrize("invariant", [False, True], ids=["batched", "invariant"])
def test_a_copied_prefix_continues_as_its_source_does(invariant):
    model = small_model()
    if invariant:
        model = LeanModel(model.decoder, invariant=True)
    batched = LeanRuntime.like(model, slots=3, max_len=96)
    batched.forward([(0, [1, 2, 3, 4, 5, 6]), (2, [9, 9])])
    batched.copy_prefix(0, 1, 4)  # slot 1 gets [1, 2, 3, 4] and none of 5, 6
    out = batched.forward([(1, [7, 8]), (2, [10])])
    expected = alone(model, [1, 2, 3, 4], [7, 8])
    assert torch.equal(out[0], expected) if invariant else torch.allclose(out[0], expected, atol=1e-5)
    assert batched.lengths == [6, 6, 3]
    with pytest.raises(ValueError, match="copy 4 positions of slot 2: it holds 3"):
        batched.copy_prefix(2, 0, 4)  # slot 2 holds 3 positions


@pytest.mark.parametrize("mode", ["one row", "ragged", "invariant", "bfloat16 one position"])
def test_outputs_return_the_logits_of_each_rows_last_positions(mode):
    """``forward(rows, outputs)`` gives the last outputs[i] positions' logits of a full call: not the first ones,
    not another row's; the invariant mode keeps the bits of a full call (its head runs at the fixed row count)."""
    model = small_model()
    if mode == "invariant":
        model = LeanModel(model.decoder.to(torch.bfloat16), invariant=True)
    elif mode == "bfloat16 one position":  # the float16 copy of the head: the same numbers within rounding
        model = LeanModel(model.decoder.to(torch.bfloat16))
    rows = [(0, [1, 2, 3, 4, 5])] if mode != "ragged" else [(1, [1, 2, 3, 4, 5]), (0, [6, 7]), (2, [8, 9, 10])]
    counts = [1] if mode != "ragged" else [2, 0, 3]
    full, part = (LeanRuntime.like(model, slots=3, max_len=32) for _ in range(2))
    expected = full.forward(rows)
    got = part.forward(rows, counts)
    assert [g.shape[0] for g in got] == counts and part.lengths == full.lengths
    for g, e, k in zip(got, expected, counts):
        tail = e[len(e) - k :]
        if mode == "invariant":
            assert torch.equal(g, tail)
        else:
            tolerance = 0.05 if model.dtype == torch.bfloat16 else 1e-5
            assert torch.allclose(g, tail, atol=tolerance) and (
                k == 0 or not torch.allclose(g, e[:k], atol=tolerance) or k == len(e)
            )
    with pytest.raises(ValueError, match="outputs must give each of the"):
        part.forward([(0, [1, 2])], [3])


def test_a_call_that_fails_part_way_leaves_its_slot_as_it_was():
    """A layer raising after the first one wrote its keys: the slot keeps its length, and the next call on it gives a
    fresh call's logits (what the failed call wrote past the length is never read)."""
    model = small_model()
    runtime = LeanRuntime.like(model, slots=2, max_len=64)
    fresh = runtime.forward([(0, [1, 2, 3, 4, 5])])[0]
    layer = runtime._layers[1]
    layer.forward_cached = lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("forced"))
    with pytest.raises(RuntimeError, match="forced"):
        runtime.forward([(1, [7, 8, 9, 10])])
    del layer.forward_cached
    assert runtime.lengths == [5, 0]
    assert torch.equal(runtime.forward([(1, [1, 2, 3, 4, 5])])[0], fresh)
