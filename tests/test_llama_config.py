"""config.json keys on the lean backend: every key is read, checked, ignored or refused; rotary variants match
transformers."""

from __future__ import annotations

import json

import pytest
import torch

from exactspec.models.lean import LeanModel
from exactspec.models.llama_config import FIXED_VALUES, IGNORED_KEYS, READ_KEYS, LlamaConfig

transformers = pytest.importorskip("transformers")

ATOL = 1e-4  # float32 logits against transformers, as in test_lean.py
BASE = dict(
    vocab_size=61,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 500.0},
    "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    # original_max_position_embeddings 16: wavelengths of this head size fall on both sides of 16/1 and 16/4
    "llama3": {
        "rope_type": "llama3",
        "rope_theta": 500.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def save_model(path, rope: dict, **extra):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**BASE, rope_parameters=rope, **extra)).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0.0, 0.3) if parameter.dim() == 2 else parameter.uniform_(0.5, 1.5)
    model.save_pretrained(path)
    return model


IDS = torch.randint(0, 61, (48,), generator=torch.Generator().manual_seed(3))


def hf_logits(model) -> torch.Tensor:  # (48, V)
    with torch.no_grad():
        return model(IDS.unsqueeze(0)).logits[0].float()


@pytest.mark.parametrize("rope", ["linear", "llama3"])
def test_rope_scaling_matches_transformers_and_matters(tmp_path, rope):
    reference = hf_logits(save_model(tmp_path / rope, ROPES[rope]))
    ours = LeanModel.from_pretrained(tmp_path / rope).prefill(IDS.tolist())
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
    plain = hf_logits(save_model(tmp_path / "default", ROPES["default"]))  # same weights, default rope
    assert (plain - reference).abs().max() > 0.1  # a decoder that ignored the scaling would fail above


def test_rope_settings_of_transformers_4_are_read_too():
    legacy = {
        **BASE,
        "model_type": "llama",
        "rope_theta": 500.0,
        "rope_scaling": {**ROPES["llama3"], "rope_theta": None},
    }
    del legacy["rope_scaling"]["rope_theta"]
    config = LlamaConfig.from_dict(legacy)
    assert (
        config.rope_theta == 500.0 and config.rope_scaling.rope_type == "llama3" and config.rope_scaling.factor == 8.0
    )
    assert (
        LlamaConfig.from_dict({**legacy, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope_scaling.factor == 2.0
    )


def test_every_key_transformers_writes_is_classified():
    written = transformers.LlamaConfig(**BASE).to_dict()
    assert set(written) <= READ_KEYS | IGNORED_KEYS | set(FIXED_VALUES), (
        set(written) - READ_KEYS - IGNORED_KEYS - set(FIXED_VALUES)
    )
    assert not (READ_KEYS & IGNORED_KEYS) and not (set(FIXED_VALUES) & (READ_KEYS | IGNORED_KEYS))
    LlamaConfig.from_dict(written)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic' is not implemented"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "attention_factor": 1.2}},
            "rope setting(s) attention_factor",
        ),
        ({"rope_scaling": {"type": "longrope", "factor": 4.0}}, "rope type 'longrope' is not implemented"),
        ({"hidden_act": "gelu"}, "hidden_act = 'gelu' is not implemented by the lean backend"),
        ({"attention_bias": True}, "attention_bias = True is not implemented"),
        ({"mlp_bias": True}, "mlp_bias = True is not implemented"),
        ({"sliding_window": 4096}, "config key(s) 'sliding_window' unknown to the lean backend; use --backend hf"),
        ({"quantization_config": {"quant_method": "gptq"}}, "'quantization_config' unknown"),
        ({"model_type": "mistral"}, "expected a Llama checkpoint"),
    ],
)
def test_settings_the_decoder_does_not_implement_are_refused(change, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        LlamaConfig.from_dict({**BASE, "model_type": "llama", **change})


@pytest.mark.parametrize(
    "key,value",
    [
        ("initializer_range", 0.5),
        ("attention_dropout", 0.3),
        ("use_cache", False),
        ("pad_token_id", 7),
        ("pretraining_tp", 2),
        ("torch_dtype", "float16"),
        ("temperature", 0.2),
        ("architectures", ["Other"]),
    ],
)
def test_ignored_keys_do_not_change_transformers_logits_either(tmp_path, key, value):
    """What the lean backend ignores, transformers' own forward pass ignores too (same weights, eval mode)."""
    model = save_model(tmp_path / "base", ROPES["default"])
    reference = hf_logits(model)
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    (tmp_path / "base" / "config.json").write_text(json.dumps({**config, key: value}))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(reloaded), reference, atol=1e-6, rtol=0)
    ours = LeanModel.from_pretrained(tmp_path / "base").prefill(IDS.tolist())
    torch.testing.assert_close(ours, reference, atol=ATOL, rtol=0)
