"""The lean Llama decoder against transformers' LlamaForCausalLM, its cache, loader and errors."""

from __future__ import annotations

import json

import pytest
import torch

from exactspec.models.base import LanguageModel
from exactspec.models.lean import LeanModel, LlamaConfig, LlamaDecoder, hf_state_dict

transformers = pytest.importorskip("transformers")

#: float32 tolerance on logits against transformers (observed ~1e-7 on this tiny model).
ATOL = 1e-4


def _hf_model(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=500.0, rms_norm_eps=1e-5, tie_word_embeddings=tie,
    )
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # HF init is near-zero std; widen it so the test has teeth
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            else:
                p.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def checkpoint(request, tmp_path_factory):
    model = _hf_model(tie=request.param)
    path = tmp_path_factory.mktemp("llama")
    model.save_pretrained(path)
    ids = torch.randint(0, 97, (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids.unsqueeze(0)).logits[0].float()  # (T, V)
    return path, ids.tolist(), ref


def test_is_a_language_model(checkpoint):
    path, _, _ = checkpoint
    model = LeanModel.from_pretrained(path)
    assert isinstance(model, LanguageModel)
    assert model.vocab_size == 97 and model.length == 0


def test_prefill_matches_transformers(checkpoint):
    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path)
    out = model.prefill(ids)
    assert out.dtype == torch.float32 and out.device.type == "cpu" and out.shape == (40, 97)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert model.length == 40


def test_multi_token_forwards_after_rollbacks_match_transformers(checkpoint):
    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path)
    model.prefill(ids[:12])
    model.forward(ids[12:20])  # rejected block: must leave no trace
    model.rollback(15)
    torch.testing.assert_close(model.forward(ids[15:23]), ref[15:23], atol=ATOL, rtol=0)
    model.rollback(3)
    torch.testing.assert_close(model.forward(ids[3:4]), ref[3:4], atol=ATOL, rtol=0)
    torch.testing.assert_close(model.forward(ids[4:40]), ref[4:40], atol=ATOL, rtol=0)
    # token-by-token equals one block
    model.rollback(30)
    rows = torch.cat([model.forward([t]) for t in ids[30:40]])
    torch.testing.assert_close(rows, ref[30:40], atol=ATOL, rtol=0)


def test_rollback_then_forward_equals_fresh_prefill(checkpoint):
    path, ids, _ = checkpoint
    a, b = LeanModel.from_pretrained(path), LeanModel.from_pretrained(path)
    a.prefill(ids[:30])
    for k in (29, 17, 5, 0):
        a.rollback(k)
        assert a.length == k
        got = a.forward(ids[k:k + 6])
        want = b.prefill(ids[:k + 6])[k:]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        a.rollback(k)


def test_training_forward_matches_cached_forward(checkpoint):
    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path)
    with torch.no_grad():
        full = model.decoder.forward_train(torch.tensor([ids, ids[::-1]]))  # (2, T, V)
    torch.testing.assert_close(full[0], ref, atol=ATOL, rtol=0)


def test_bfloat16_load(checkpoint):
    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    out = model.prefill(ids)
    assert out.dtype == torch.float32
    # bf16 compute: loose agreement only, but the same next-token ranking mostly
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() > 0.8


def test_save_roundtrip_through_hf_names(checkpoint, tmp_path):
    from safetensors.torch import save_file

    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path)
    save_file(hf_state_dict(model.decoder), str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(model.cfg.to_hf_dict("float32")))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        out = again(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_error_paths(tmp_path, checkpoint):
    with pytest.raises(FileNotFoundError, match="not found"):
        LeanModel.from_pretrained(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="config.json"):
        LeanModel.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(ValueError, match="model_type"):
        LeanModel.from_pretrained(tmp_path)
    cfg = json.loads((checkpoint[0] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        LeanModel.from_pretrained(tmp_path)

    model = LeanModel.from_pretrained(checkpoint[0], max_len=16)
    model.prefill(list(range(10)))
    with pytest.raises(ValueError, match="too long"):
        model.forward(list(range(7)))
    assert model.length == 10  # a refused call changes nothing
    with pytest.raises(ValueError):
        model.rollback(11)
    with pytest.raises(ValueError):
        model.forward([97])
    with pytest.raises(ValueError):
        model.forward([])


def test_random_init_decoder_runs():
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=True,
                      max_position_embeddings=32)
    dec = LlamaDecoder(cfg)
    dec.init_weights(torch.Generator().manual_seed(0))
    assert dec.lm_head.weight is dec.embed.weight
    model = LeanModel(dec)
    assert model.prefill([1, 2, 3]).shape == (3, 50)
    with pytest.raises(ValueError, match="multiple"):
        LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=2)


def test_a_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path):
    """model.safetensors.index.json and its shards (what save_pretrained writes for big models)."""
    path, ids, ref = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 2
    torch.testing.assert_close(LeanModel.from_pretrained(tmp_path).prefill(ids), ref, atol=ATOL, rtol=0)
