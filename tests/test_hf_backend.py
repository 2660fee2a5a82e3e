"""The Hugging Face backend: rollback on DynamicCache, agreement with the lean backend, clear errors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from conftest import save_tiny_checkpoint

from exactspec.models import LanguageModel
from exactspec.models.hf import HFModel
from exactspec.models.lean import LeanModel


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_checkpoint(tmp_path_factory.mktemp("hf"), vocab_rows=300, layers=2, seed=0)


def test_rollback_then_forward_equals_fresh_prefill(checkpoint):
    model = HFModel.from_pretrained(checkpoint)
    assert isinstance(model, LanguageModel) and model.vocab_size == 300
    tokens = [5, 17, 42, 8, 99, 3, 250, 11]
    model.prefill(tokens[:4])
    model.forward([1, 2, 3])  # rejected drafts
    model.rollback(4)
    after = model.forward(tokens[4:])
    fresh = HFModel.from_pretrained(checkpoint).prefill(tokens)[4:]
    assert model.length == len(tokens)
    assert torch.allclose(after, fresh, atol=1e-5)


def test_agrees_with_the_lean_backend_in_float32(checkpoint):
    hf, lean = HFModel.from_pretrained(checkpoint), LeanModel.from_pretrained(checkpoint)
    tokens = [1, 20, 30, 40, 50, 60]
    assert torch.allclose(hf.prefill(tokens), lean.prefill(tokens), atol=1e-4)
    hf.rollback(2), lean.rollback(2)
    assert torch.allclose(hf.forward([7, 8, 9]), lean.forward([7, 8, 9]), atol=1e-4)


def test_missing_directory_is_a_clear_error_and_no_download(tmp_path):
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        HFModel.from_pretrained(tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="model directory not found"):
        HFModel.from_pretrained("gpt2")  # a hub name is not a local directory: never fetched


def test_a_checkpoint_that_is_not_a_causal_lm_is_refused(tmp_path):
    import transformers

    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, image_size=8, patch_size=4
    )
    transformers.ViTModel(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="'vit' checkpoint, which is not a causal language model"):
        HFModel.from_pretrained(tmp_path)


def test_a_cache_that_cannot_be_rolled_back_is_refused(checkpoint):
    model = HFModel.from_pretrained(checkpoint)

    class SlidingCache(model._cache_class):
        is_croppable = False

    model._cache_class = SlidingCache
    with pytest.raises(ValueError, match="cannot be rolled back"):
        model.prefill([1, 2, 3])
