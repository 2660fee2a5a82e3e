"""A Llama-family decoder in plain PyTorch: the layers, and Hugging Face's parameter names.

The architecture is the Hugging Face ``LlamaForCausalLM`` one (RMSNorm, rotary embeddings with ``rotate_half``,
SwiGLU MLP, grouped-query attention, tied or untied embeddings), written after nanoGPT's and gpt-fast's
``model.py``. The query/key/value projections and the gate/up projections are fused into one matrix each, so a
layer costs four matmuls per call; Hugging Face checkpoints are split and joined at load and save time
(:func:`hf_state_dict`, :func:`load_hf_state_dict`).

:class:`Block` runs against a cache slot it is handed (:meth:`Block.forward_cached`, and
:meth:`Block.forward_invariant` for the call-size-invariant numerics); the cache and the calls that feed it are the
runtime's (:mod:`exactspec.models.lean`). ``LlamaDecoder.forward_train`` is the cache-free full-sequence forward
used by ``exactspec.training``. Which ``config.json`` keys are read and the rotary variants live in
:mod:`exactspec.models.llama_config`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from .attention import chunked_attention
from .llama_config import LlamaConfig, rope_tables

__all__ = [
    "INVARIANT_ROWS",
    "Block",
    "LlamaDecoder",
    "cache_dtype",
    "hf_state_dict",
    "load_hf_state_dict",
    "one_row_head",
]

# Invariant mode: every call of up to this many tokens (every decoding call: gamma <= 16) runs its matmuls at
# exactly this many rows, so a position's logits are the same bits whatever the call size. Longer calls (a
# prompt's prefill) run as consecutive calls of this size.
INVARIANT_ROWS = 17


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotation: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class Block(nn.Module):
    """One pre-norm decoder layer: x + attn(norm(x)); x + mlp(norm(x))."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        c, hd = cfg.hidden_size, cfg.head_size
        self.n_head, self.n_kv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, hd
        self.eps = cfg.rms_norm_eps
        self.attn_norm = nn.Parameter(torch.ones(c))
        self.wqkv = nn.Linear(c, (self.n_head + 2 * self.n_kv) * hd, bias=False)  # q | k | v
        self.wo = nn.Linear(self.n_head * hd, c, bias=False)
        self.mlp_norm = nn.Parameter(torch.ones(c))
        self.w13 = nn.Linear(c, 2 * cfg.intermediate_size, bias=False)  # gate | up
        self.w2 = nn.Linear(cfg.intermediate_size, c, bias=False)

    def _norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # HF LlamaRMSNorm: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        return self._project(self._norm(x, self.attn_norm), cos, sin)

    def _project(self, normed: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # (B, T, in) -> q, k, v
        b, t, _ = normed.shape
        qkv = self.wqkv(normed)  # (B, T, (nh + 2 nkv) hd)
        qk, v = qkv.split([(self.n_head + self.n_kv) * self.hd, self.n_kv * self.hd], dim=-1)
        qk = qk.view(b, t, self.n_head + self.n_kv, self.hd)  # queries and keys rotate together: fewer small ops
        qk = qk * cos.unsqueeze(-2) + rotate_half(qk) * sin.unsqueeze(-2)  # cos (T, hd) or (B, T, hd)
        q, k = qk.transpose(1, 2).split([self.n_head, self.n_kv], dim=1)  # (B, nh, T, hd), (B, nkv, T, hd)
        v = v.view(b, t, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        return q, k, v

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        x = x + self.wo(y.transpose(1, 2).reshape(b, t, self.n_head * self.hd))  # (B, T, C)
        gate, up = self.w13(self._norm(x, self.mlp_norm)).chunk(2, dim=-1)  # (B, T, I) each
        return x + self.w2(F.silu(gate) * up)  # (B, T, C)

    def forward_train(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_head)
        return self.finish(x, y)

    def forward_cached(
        self,
        x: torch.Tensor,  # (1, T, C)
        cos: torch.Tensor,  # (T, hd)
        sin: torch.Tensor,  # (T, hd)
        k_cache: torch.Tensor,  # (1, nkv, max_len, hd), in cache_dtype(x.dtype, device)
        v_cache: torch.Tensor,  # (1, nkv, max_len, hd)
        pos: int,
        mask: torch.Tensor | None,  # (T, pos + T) bool, True = attend; None when T == 1
    ) -> torch.Tensor:
        q, k, v = self.qkv(x, cos, sin)
        end = pos + x.shape[1]
        k_cache[:, :, pos:end] = k
        v_cache[:, :, pos:end] = v
        y = F.scaled_dot_product_attention(
            q.to(k_cache.dtype),
            k_cache[:, :, :end],
            v_cache[:, :, :end],
            attn_mask=mask,
            enable_gqa=self.n_kv != self.n_head,
        )  # (1, nh, T, hd)
        return self.finish(x, y.to(x.dtype))

    def forward_invariant(
        self,
        x: torch.Tensor,  # (1, R, C): the call's t tokens, then padding rows
        cos: torch.Tensor,  # (R, hd)
        sin: torch.Tensor,  # (R, hd)
        k_cache: torch.Tensor,  # (1, nkv, max_len, hd)
        v_cache: torch.Tensor,  # (1, nkv, max_len, hd)
        pos: int,
        t: int,
    ) -> torch.Tensor:
        """As :meth:`forward_cached`, with every matmul at the fixed row count R and attention in fixed-shape key
        chunks (:func:`chunked_attention`), so that a position's result never depends on how many tokens its call
        carries. Padding rows never reach the cache or another row."""
        q, k, v = self.qkv(x, cos, sin)
        k_cache[:, :, pos : pos + t] = k[:, :, :t]
        v_cache[:, :, pos : pos + t] = v[:, :, :t]
        y = chunked_attention(q, k_cache, v_cache, pos, pos + t)
        return self.finish(x, y)


class LlamaDecoder(nn.Module):
    """Embeddings, ``num_hidden_layers`` blocks, final norm and LM head."""

    def __init__(self, cfg: LlamaConfig, rope_len: int | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        cos, sin = rope_tables(cfg, rope_len or cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # (L, hd) float32
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_weights(self, generator: torch.Generator | None = None, std: float = 0.02) -> None:
        """GPT-2 style init: normal(0, std); residual output projections scaled by 1/sqrt(2 L)."""
        resid_std = std / math.sqrt(2 * max(1, self.cfg.num_hidden_layers))
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0)
                elif name.endswith("wo.weight") or name.endswith("w2.weight"):
                    p.normal_(0.0, resid_std, generator=generator)
                else:
                    p.normal_(0.0, std, generator=generator)

    def final_norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return self.norm * xf.to(x.dtype)

    def logits(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) last hidden states -> (..., V)
        return self.lm_head(self.final_norm(x))

    def forward_train(self, idx: torch.Tensor, feature_layers: Sequence[int] = ()):
        """Full causal forward without a cache. ``idx`` ``(B, T)`` -> logits ``(B, T, V)``; with ``feature_layers``,
        (logits, the outputs of those layers concatenated ``(B, T, len(feature_layers) C)``)."""
        t = idx.shape[1]
        if t > self.rope_cos.shape[0]:
            raise ValueError(f"sequence of {t} tokens exceeds the rope table ({self.rope_cos.shape[0]})")
        x = self.embed(idx)  # (B, T, C)
        cos = self.rope_cos[:t].to(x.dtype)
        sin = self.rope_sin[:t].to(x.dtype)
        features = []
        for i, layer in enumerate(self.layers):
            x = layer.forward_train(x, cos, sin)
            if i in feature_layers:
                features.append(x)
        logits = self.logits(x)  # (B, T, V)
        return (logits, torch.cat(features, dim=-1)) if feature_layers else logits

    forward = forward_train


# ---- Hugging Face parameter names <-> fused layout --------------------------------------------


def hf_state_dict(model: LlamaDecoder) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face ``LlamaForCausalLM`` names (q/k/v, gate/up split)."""
    cfg = model.cfg
    hd, nh, nkv = cfg.head_size, cfg.num_attention_heads, cfg.num_key_value_heads
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed.weight}
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        q, k, v = layer.wqkv.weight.split([nh * hd, nkv * hd, nkv * hd], dim=0)
        gate, up = layer.w13.weight.chunk(2, dim=0)
        out.update(
            {
                p + "self_attn.q_proj.weight": q,
                p + "self_attn.k_proj.weight": k,
                p + "self_attn.v_proj.weight": v,
                p + "self_attn.o_proj.weight": layer.wo.weight,
                p + "mlp.gate_proj.weight": gate,
                p + "mlp.up_proj.weight": up,
                p + "mlp.down_proj.weight": layer.w2.weight,
                p + "input_layernorm.weight": layer.attn_norm,
                p + "post_attention_layernorm.weight": layer.mlp_norm,
            }
        )
    out["model.norm.weight"] = model.norm
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    return {k: v.detach().contiguous() for k, v in out.items()}


def load_hf_state_dict(model: LlamaDecoder, sd: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named weights into the fused layout; clear error on a missing tensor."""
    cfg = model.cfg

    def get(name: str) -> torch.Tensor:
        if name not in sd:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return sd[name]

    with torch.no_grad(), _named_shape_errors():
        model.embed.weight.copy_(get("model.embed_tokens.weight"))
        for i, layer in enumerate(model.layers):
            p = f"model.layers.{i}."
            layer.wqkv.weight.copy_(torch.cat([get(p + f"self_attn.{n}_proj.weight") for n in "qkv"], dim=0))
            layer.wo.weight.copy_(get(p + "self_attn.o_proj.weight"))
            layer.w13.weight.copy_(torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")], 0))
            layer.w2.weight.copy_(get(p + "mlp.down_proj.weight"))
            layer.attn_norm.copy_(get(p + "input_layernorm.weight"))
            layer.mlp_norm.copy_(get(p + "post_attention_layernorm.weight"))
        model.norm.copy_(get("model.norm.weight"))
        if not cfg.tie_word_embeddings:
            model.lm_head.weight.copy_(get("lm_head.weight"))


@contextmanager
def _named_shape_errors():
    """A weight whose shape does not match config.json is a ValueError, not a RuntimeError from ``copy_``."""
    try:
        yield
    except RuntimeError as error:
        raise ValueError(
            f"a weight does not match the shapes its config describes ({str(error).splitlines()[0]})"
        ) from None


def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype. On the CPU a bfloat16 or float16 model keeps its keys and values, already rounded to
    its dtype, in float32: the same values, and torch's CPU attention runs far faster in float32 (torch 2.13, 9
    heads over 200 cached keys: 29 us against 119 us for one query, 73 against 87 for nine)."""
    return torch.float32 if device.type == "cpu" else dtype


def one_row_head(decoder: LlamaDecoder, device: torch.device) -> torch.Tensor | None:  # (V, C) float16
    """A float16 copy of a bfloat16 model's LM head for one-token calls on the CPU, or None.

    torch's CPU float16 matrix-vector kernel is faster than its bfloat16 one (about 3x on SmolLM2's head) and rounds
    the logits less. Used only when the copy holds exactly the same
    weights (every bfloat16 weight is a float16 number) and the normed hidden state cannot overflow float16
    (|h| <= sqrt(C) max|norm weight|), so the model is the same one in every call.
    """
    weight = decoder.lm_head.weight.detach()
    if device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    copy = weight.to(torch.float16)
    bound = math.sqrt(decoder.cfg.hidden_size) * decoder.norm.detach().abs().max().item()
    if bound >= torch.finfo(torch.float16).max / 2 or not torch.equal(copy.to(torch.bfloat16), weight):
        return None
    return copy
