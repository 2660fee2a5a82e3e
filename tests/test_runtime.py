"""The runtime interface over single-sequence models (exactspec.models.runtime.SequenceSlots)."""

from __future__ import annotations

import pytest
import torch
from test_feature_draft import tiny_target

from exactspec import MarkovLM
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.models.runtime import Runtime, SequenceSlots, as_runtime


def markov(seed: int = 0) -> MarkovLM:
    return MarkovLM.random(5, 2, seed=seed)


def test_each_slot_runs_its_own_model_and_returns_what_the_model_alone_returns():
    runtime = SequenceSlots([markov(), markov()])
    out = runtime.forward([(1, [1, 2, 3]), (0, [4])])
    assert torch.equal(out[0], markov().prefill([1, 2, 3])) and torch.equal(out[1], markov().prefill([4]))
    assert runtime.lengths == [1, 3]
    nxt = runtime.forward([(1, [0, 2])])[0]
    alone = markov()
    alone.prefill([1, 2, 3])
    assert torch.equal(nxt, alone.forward([0, 2])) and runtime.lengths == [1, 5]


def test_rollback_and_copy_prefix_give_the_logits_of_the_kept_history():
    runtime = SequenceSlots([markov(), markov()])
    runtime.forward([(0, [1, 2, 3, 4])])
    runtime.rollback(0, 2)
    runtime.copy_prefix(0, 1, 2)
    assert runtime.lengths == [2, 2]
    expected = markov().prefill([1, 2, 0])[-1]
    assert torch.equal(runtime.forward([(0, [0])])[0][-1], expected)
    assert torch.equal(runtime.forward([(1, [0])])[0][-1], expected)
    with pytest.raises(ValueError):
        runtime.rollback(0, 9)


def test_a_cache_changed_outside_is_refused_while_a_slot_holds_a_sequence():
    model = markov()
    runtime = SequenceSlots([model])
    runtime.forward([(0, [1, 2])])
    model.prefill([3, 3, 3])  # someone else used the model
    with pytest.raises(RuntimeError, match="changed outside this engine"):
        runtime.forward([(0, [1])])
    runtime.rollback(0, 0)  # an empty slot starts with a prefill: what the model held does not matter
    assert torch.equal(runtime.forward([(0, [1, 2])])[0], markov().prefill([1, 2]))


def test_bad_slots_and_models_are_clear_errors():
    with pytest.raises(ValueError, match="distinct model"):
        SequenceSlots([])
    model = markov()
    with pytest.raises(ValueError, match="distinct model"):
        SequenceSlots([model, model])
    with pytest.raises(ValueError, match="one vocabulary"):
        SequenceSlots([markov(), MarkovLM.random(6, 2)])
    with pytest.raises(ValueError, match="distinct slots"):
        SequenceSlots([markov()]).forward([(1, [0])])
    with pytest.raises(ValueError, match="hidden states"):
        SequenceSlots([markov()]).capture_features((0,))


def test_features_come_from_each_slots_model():
    decoder = tiny_target(3)
    runtime = SequenceSlots([LeanModel(decoder), LeanModel(decoder)])
    runtime.capture_features((0,))
    runtime.forward([(0, [1, 2]), (1, [3])])
    alone = LeanModel(decoder)
    alone.capture_features((0,))
    alone.prefill([1, 2])
    assert [f.shape[0] for f in runtime.last_features] == [2, 1]
    assert torch.equal(runtime.last_features[0], alone.last_features)


def test_as_runtime_keeps_a_runtime_and_wraps_a_model():
    batched = LeanRuntime.like(LeanModel(tiny_target(3)), 2, 16)
    assert as_runtime(batched) is batched and isinstance(batched, Runtime)
    wrapped = as_runtime(markov())
    assert isinstance(wrapped, SequenceSlots) and wrapped.slots == 1


def test_outputs_cut_each_rows_logits_to_its_last_positions():
    runtime = SequenceSlots([markov(), markov()])
    out = runtime.forward([(0, [1, 2, 3]), (1, [4, 0])], [1, 0])
    full = markov().prefill([1, 2, 3])
    assert torch.equal(out[0], full[-1:]) and not torch.equal(out[0], full[:1]) and out[1].shape == (0, 5)
    assert runtime.lengths == [3, 2]
    with pytest.raises(ValueError, match="between 0 and its length"):
        runtime.forward([(0, [1])], [2])
