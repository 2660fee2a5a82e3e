"""4-bit weights kept as the GGUF file stores them, multiplied by torch's int4 CPU kernel.

A ``Q4_0``/``Q4_1`` block of 32 weights is w = d * q + m with q in 0..15. torch's
``_weight_int4pack_mm_for_cpu`` computes with w = (q - 8) * scale + zero per group
of 32 along the input dimension, so scale = d and zero = m + 8 d (held in
bfloat16, the activations' dtype). Every call size runs this same kernel, so
single-token and block calls use one set of weights: one model. Measured on
SmolLM2-135M (2 threads): a one-token call about 0.6x the bfloat16 dense one,
a 9-token block about as costly as the dense one (see docs/smollm2.md).

CPU only (the kernel and its packing are CPU-specific) and bfloat16 only (the
kernel's float32 path is slow); other settings are refused with a clear message.
The embeddings and the LM head stay dense.
"""

from __future__ import annotations

import torch
from torch import nn

from .gguf import GGUFFile, unpermute_rotary

__all__ = ["Int4Linear", "use_q4_weights"]

GROUP = 32


class Int4Linear(nn.Module):
    """``y = x W^T`` with W held as 4-bit values and per-group (scale, zero)."""

    def __init__(
        self,
        q: torch.Tensor,  # (N, K) integers in 0..15
        scale: torch.Tensor,  # (N, K / 32)
        zero: torch.Tensor,  # (N, K / 32): w = (q - 8) * scale + zero
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.out_features = q.shape[0]
        self.packed_weights = q.numel()
        self.register_buffer(
            "packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        )
        self.register_buffer(
            "scale_zero", torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous().to(dtype)
        )  # (K/32, N, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., K) -> (..., N)
        flat = x.reshape(-1, x.shape[-1])
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, GROUP, self.scale_zero)
        return y.reshape(*x.shape[:-1], self.out_features)


def _fused(gguf: GGUFFile, parts: list[tuple[str, int | None]]) -> Int4Linear | None:
    """One Int4Linear over the row-concatenation of ``parts`` (name, heads to un-permute), or None if any part is
    not a 4-bit block tensor."""
    if any(gguf.tensors[name].type_name not in ("Q4_0", "Q4_1") for name, _ in parts):
        return None
    blocks = []
    for name, heads in parts:
        q, d, m = gguf.q4_blocks(name)
        blocks.append([unpermute_rotary(t, heads) for t in (q, d, m)] if heads else [q, d, m])
    q, d, m = (torch.cat(column, dim=0) for column in zip(*blocks))
    return Int4Linear(q, d, m + 8 * d)


def use_q4_weights(decoder: nn.Module, gguf: GGUFFile) -> int:
    """Replace each layer's projections by their 4-bit form where the file stores them in Q4_0/Q4_1; returns how
    many were replaced. ``decoder`` is a bfloat16 :class:`exactspec.models.lean.LlamaDecoder` on the CPU."""
    cfg = decoder.cfg
    replaced = 0
    for i, layer in enumerate(decoder.layers):
        b = f"blk.{i}."
        groups = {
            "wqkv": [
                (b + "attn_q.weight", cfg.num_attention_heads),
                (b + "attn_k.weight", cfg.num_key_value_heads),
                (b + "attn_v.weight", None),
            ],
            "wo": [(b + "attn_output.weight", None)],
            "w13": [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)],
            "w2": [(b + "ffn_down.weight", None)],
        }
        for attribute, parts in groups.items():
            linear = _fused(gguf, parts)
            if linear is not None:
                setattr(layer, attribute, linear)
                replaced += 1
    return replaced
