"""The lean Llama decoder against transformers' LlamaForCausalLM, its cache, loader and errors."""

from __future__ import annotations

import json

import pytest
import torch

from exactspec.models.base import LanguageModel
from exactspec.models.lean import LeanModel
from exactspec.models.llama import LlamaDecoder, cache_dtype, hf_state_dict, one_row_head
from exactspec.models.llama_config import LlamaConfig

transformers = pytest.importorskip("transformers")

#: float32 tolerance on logits against transformers (observed ~1e-7 on this tiny model).
ATOL = 1e-4


def _hf_model(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        rope_theta=500.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=tie,
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
        got = a.forward(ids[k : k + 6])
        want = b.prefill(ids[: k + 6])[k:]
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
    cfg = LlamaConfig(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        max_position_embeddings=32,
    )
    dec = LlamaDecoder(cfg)
    dec.init_weights(torch.Generator().manual_seed(0))
    assert dec.lm_head.weight is dec.embed.weight
    model = LeanModel(dec)
    assert model.prefill([1, 2, 3]).shape == (3, 50)
    with pytest.raises(ValueError, match="multiple"):
        LlamaConfig(
            vocab_size=50,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=2,
        )


def test_a_sharded_checkpoint_loads_like_the_single_file(checkpoint, tmp_path):
    """model.safetensors.index.json and its shards (what save_pretrained writes for big models)."""
    path, ids, ref = checkpoint
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("model-*.safetensors"))) > 2
    torch.testing.assert_close(LeanModel.from_pretrained(tmp_path).prefill(ids), ref, atol=ATOL, rtol=0)


def test_bfloat16_on_cpu_caches_its_own_values_in_float32(checkpoint):
    """The KV cache of a bfloat16 model on the CPU is float32 (faster attention) but holds bfloat16 values."""
    path, ids, _ = checkpoint
    model = LeanModel.from_pretrained(path, dtype=torch.bfloat16)
    model.prefill(ids)
    cached = model.runtime.cache.keys[:, :, :, : len(ids)]
    assert model.runtime.cache.keys.dtype == torch.float32 and cached.abs().sum() > 0
    assert torch.equal(cached.to(torch.bfloat16).float(), cached)
    assert cache_dtype(torch.bfloat16, torch.device("cuda")) == torch.bfloat16


def test_one_token_calls_use_a_float16_copy_of_the_same_head(checkpoint):
    """One-token calls of a bfloat16 model on the CPU run the LM head in float16 on exactly the same weights; the
    logits agree with the bfloat16 head's and with float32 to bfloat16 accuracy."""
    path, ids, ref = checkpoint
    model = LeanModel.from_pretrained(path, dtype=torch.bfloat16)
    head = model.runtime.one_token_head
    assert head is not None and head.dtype == torch.float16
    assert torch.equal(head.to(torch.bfloat16), model.decoder.lm_head.weight)
    model.prefill(ids[:-1])
    one = model.forward(ids[-1:])[0]
    block = model.prefill(ids)[-1]
    assert not torch.equal(one, block)  # the float16 path ran (it rounds the logits less than bfloat16)
    torch.testing.assert_close(one, block, atol=0.25, rtol=0.02)
    torch.testing.assert_close(one, ref[-1], atol=0.25, rtol=0.02)
    assert LeanModel.from_pretrained(path, dtype=torch.bfloat16, invariant=True).runtime.one_token_head is None
    assert LeanModel.from_pretrained(path).runtime.one_token_head is None  # float32 model


def test_the_float16_head_is_refused_where_it_would_change_the_model(checkpoint):
    path, _, _ = checkpoint
    decoder = LeanModel.from_pretrained(path, dtype=torch.bfloat16).decoder
    cpu = torch.device("cpu")
    assert one_row_head(decoder, cpu) is not None and one_row_head(decoder, torch.device("cuda")) is None
    with torch.no_grad():
        decoder.lm_head.weight[0, 0] = 1e-30  # a bfloat16 number float16 cannot hold
        assert one_row_head(decoder, cpu) is None
        decoder.lm_head.weight[0, 0] = 0.5
        assert one_row_head(decoder, cpu) is not None
        decoder.norm[0] = 1e4  # a normed hidden state could overflow float16
        assert one_row_head(decoder, cpu) is None
