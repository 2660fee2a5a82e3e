"""MarkovLM: the table model behind the exactness tests, and the rollback contract of the protocol."""

from __future__ import annotations

import pytest
import torch

from exactspec.models import LanguageModel, MarkovLM


def test_implements_the_protocol_and_looks_up_the_right_row():
    model = MarkovLM.random(3, order=2, seed=0)
    assert isinstance(model, LanguageModel)
    logits = model.prefill([2, 1, 0])
    assert logits.shape == (3, 3)
    # row index of context (t1, t2) is t1 * V + t2; before the start counts as token 0
    assert torch.equal(logits[0], model.table[0 * 3 + 2])
    assert torch.equal(logits[1], model.table[2 * 3 + 1])
    assert torch.equal(logits[2], model.table[1 * 3 + 0])


def test_rollback_then_forward_equals_fresh_prefill():
    model = MarkovLM.random(4, order=3, seed=1)
    tokens = [1, 2, 3, 0, 1, 2, 2]
    model.prefill(tokens[:3])
    model.forward([3, 3, 3, 3])  # tokens that will be rolled back
    model.rollback(3)
    after_rollback = model.forward(tokens[3:])
    fresh = MarkovLM(model.table, 3).prefill(tokens)[3:]
    assert model.length == len(tokens)
    assert torch.equal(after_rollback, fresh)


def test_random_tables_are_reproducible_from_the_seed():
    assert torch.equal(MarkovLM.random(5, 2, seed=3).table, MarkovLM.random(5, 2, seed=3).table)
    assert not torch.equal(MarkovLM.random(5, 2, seed=3).table, MarkovLM.random(5, 2, seed=4).table)


@pytest.mark.parametrize(
    "call,message",
    [
        (lambda m: m.prefill([]), "at least one token"),
        (lambda m: m.prefill([0, 9]), "outside the vocabulary"),
        (lambda m: m.rollback(5), "cannot roll back to length 5"),
        (lambda m: m.rollback(-1), "cannot roll back"),
    ],
)
def test_bad_calls_raise_clear_errors(call, message):
    model = MarkovLM.random(3, 1, seed=0)
    model.prefill([1, 2])
    with pytest.raises(ValueError, match=message):
        call(model)


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="shape"):
        MarkovLM(torch.zeros(4, 3), order=1)
    with pytest.raises(ValueError, match="NaN"):
        MarkovLM(torch.full((3, 3), float("nan")), order=1)
