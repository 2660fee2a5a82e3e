"""A compact Llama-family decoder in plain PyTorch, with a static, rollback-able KV cache.

The architecture is the Hugging Face ``LlamaForCausalLM`` one (RMSNorm, rotary
embeddings with ``rotate_half``, SwiGLU MLP, grouped-query attention, tied or
untied embeddings), written after nanoGPT's ``model.py`` and gpt-fast's
``model.py``:

* the KV cache is preallocated once for ``max_len`` positions; ``rollback(k)``
  only moves an integer, nothing is copied or freed (gpt-fast);
* the query/key/value projections and the gate/up projections are fused into
  one matrix each, so a layer costs four matmuls per call; Hugging Face
  checkpoints are split/joined at load and save time;
* every call runs under ``torch.inference_mode`` with no Python work per token:
  a call of ``n`` new tokens is one pass through the layers.

* ``invariant=True`` makes a position's logits the same bits whatever the call
  size (up to ``INVARIANT_ROWS`` tokens): fixed-row matmuls and
  :func:`chunked_attention`; weights come from safetensors or GGUF files
  (:mod:`exactspec.models.gguf`), optionally kept 4-bit
  (:mod:`exactspec.models.quantized`).

``LeanModel`` implements :class:`exactspec.models.base.LanguageModel`. Which
``config.json`` keys are read, checked, ignored or refused, and the rotary
variants, live in :mod:`exactspec.models.llama_config`.
``LlamaDecoder.forward_train`` is the cache-free full-sequence forward used by
``exactspec.training``.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .base import check_rollback_length, check_token_ids, is_gguf, read_json
from .gguf import hf_state_dict as gguf_state_dict, llama_config, read_gguf
from .quantized import use_q4_weights
from .llama_config import LlamaConfig, rope_tables

__all__ = ["INVARIANT_ROWS", "LlamaConfig", "LlamaDecoder", "LeanModel", "hf_state_dict", "load_hf_state_dict"]

# Invariant mode: every call of up to this many tokens (every decoding call: gamma <= 16) runs its matmuls at
# exactly this many rows, so a position's logits are the same bits whatever the call size. Longer calls (a
# prompt's prefill, the same in every mode) run unpadded.
INVARIANT_ROWS = 17
WEIGHT_FORMATS = ("auto", "dense", "q4")


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's rotation: (x1, x2) -> (-x2, x1) on the two halves of the last dim."""
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


ATTENTION_CHUNK = 64  # keys per fixed-shape chunk of the invariant attention


def chunked_attention(
    q: torch.Tensor,  # (1, nh, R, hd): queries at positions pos, pos + 1, ...
    k_cache: torch.Tensor,  # (1, nkv, max_len, hd)
    v_cache: torch.Tensor,  # (1, nkv, max_len, hd)
    pos: int,
    end: int,  # keys [0, end) hold the history and the call's tokens
) -> torch.Tensor:  # (1, nh, R, hd)
    """Causal softmax attention (softmax(q k^T / sqrt(hd)) v) whose result for a query depends only on its position
    and the keys it sees, never on the number of queries or keys in the call.

    Keys are cut into chunks of ``ATTENTION_CHUNK`` absolute positions; scores and weighted values are computed
    per chunk with fixed-shape batched matmuls; a query's masked keys contribute exact zeros; chunks are combined
    by ``cumsum``, a strict left-to-right sum, so trailing all-masked chunks add exact zeros. The row maximum is
    exact in any order. Computed in float32.
    """
    _, nh, rows, hd = q.shape
    nkv, group = k_cache.shape[1], nh // k_cache.shape[1]
    chunks = -(-end // ATTENTION_CHUNK)
    keys = chunks * ATTENTION_CHUNK
    k = k_cache[0, :, :keys].float().reshape(nkv, chunks, ATTENTION_CHUNK, hd)
    v = v_cache[0, :, :keys].float().reshape(nkv, chunks, ATTENTION_CHUNK, hd)
    queries = (q[0].float() / math.sqrt(hd)).reshape(nkv, 1, group * rows, hd)  # query head h reads kv head h // group
    scores = queries @ k.transpose(-1, -2)  # (nkv, chunks, group R, chunk)
    key_pos = torch.arange(keys, device=q.device).reshape(chunks, 1, ATTENTION_CHUNK)
    query_pos = (pos + torch.arange(rows, device=q.device)).repeat(group).reshape(1, group * rows, 1)
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(1, 3), keepdim=True))  # masked keys: exactly 0
    total = weights.sum(-1).cumsum(1)[:, -1]  # (nkv, group R)
    out = (weights @ v).cumsum(1)[:, -1] / total.unsqueeze(-1)  # (nkv, group R, hd)
    return out.reshape(1, nh, rows, hd).to(q.dtype)


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
        b, t, _ = x.shape
        qkv = self.wqkv(self._norm(x, self.attn_norm))  # (B, T, (nh + 2 nkv) hd)
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
            q.to(k_cache.dtype), k_cache[:, :, :end], v_cache[:, :, :end], attn_mask=mask,
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
        out.update({
            p + "self_attn.q_proj.weight": q, p + "self_attn.k_proj.weight": k,
            p + "self_attn.v_proj.weight": v, p + "self_attn.o_proj.weight": layer.wo.weight,
            p + "mlp.gate_proj.weight": gate, p + "mlp.up_proj.weight": up,
            p + "mlp.down_proj.weight": layer.w2.weight,
            p + "input_layernorm.weight": layer.attn_norm,
            p + "post_attention_layernorm.weight": layer.mlp_norm,
        })
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
        raise ValueError(f"a weight does not match the shapes its config describes ({str(error).splitlines()[0]})") from None


def read_config(path: str | Path) -> LlamaConfig:
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory not found: {path}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path} has no config.json")
    try:
        return LlamaConfig.from_dict(read_json(cfg_file))
    except ValueError as error:
        raise ValueError(f"{cfg_file}: {error}") from None


def read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a ``.safetensors`` file; ValueError naming the file when it cannot be read."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except (SafetensorError, OSError, ValueError, RuntimeError) as error:
        raise ValueError(f"cannot read {file}: {error} (a truncated or corrupt download?)") from None


def read_checkpoint_weights(path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    """Every tensor of a checkpoint directory, single-file or sharded, and the file that names them."""
    single, index = path / "model.safetensors", path / "model.safetensors.index.json"
    if single.is_file():
        return read_safetensors(single), single
    if not index.is_file():
        raise FileNotFoundError(f"{path} has no model.safetensors or model.safetensors.index.json (the lean backend reads safetensors; try --backend hf)")
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no weight_map")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if not (path / shard).is_file():
            raise FileNotFoundError(f"{index} lists {shard}, which is not in {path}")
        tensors.update(read_safetensors(path / shard))
    return tensors, index


# ---- the rollback-able single-sequence model --------------------------------------------------

def cache_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The KV cache's dtype. On the CPU a bfloat16 or float16 model keeps its keys and values, already rounded to
    its dtype, in float32: the same values, and torch's CPU attention runs far faster in float32 (torch 2.13, 9
    heads over 200 cached keys: 29 us against 119 us for one query, 73 against 87 for nine)."""
    return torch.float32 if device.type == "cpu" else dtype


def one_row_head(decoder: LlamaDecoder, device: torch.device) -> torch.Tensor | None:  # (V, C) float16
    """A float16 copy of a bfloat16 model's LM head for one-token calls on the CPU, or None.

    torch's CPU float16 matrix-vector kernel is about 3x faster than its bfloat16 one (SmolLM2's 49152 x 576
    head: 1.8 ms against 5.3) and rounds the logits less. Used only when the copy holds exactly the same
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


class LeanModel:
    """A :class:`LanguageModel` over a :class:`LlamaDecoder` with a static KV cache.

    ``max_len`` (default: ``max_position_embeddings``) bounds prompt + generated
    tokens; exceeding it raises ``ValueError``. Logits are returned as float32
    CPU tensors ``(n, V)`` whatever the compute dtype/device.
    """

    def __init__(
        self,
        decoder: LlamaDecoder,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        invariant: bool = False,
    ) -> None:
        cfg = decoder.cfg
        self.invariant = invariant
        self.cfg = cfg
        self.max_len = int(max_len or cfg.max_position_embeddings)
        if dtype is not None:
            decoder = decoder.to(dtype=dtype)
        self.decoder = decoder.to(device).eval()
        self.dtype = decoder.norm.dtype
        self.device = torch.device(device)
        with torch.inference_mode():
            cos, sin = rope_tables(cfg, self.max_len)
            self._cos = cos.to(device=self.device, dtype=self.dtype)  # (max_len, hd)
            self._sin = sin.to(device=self.device, dtype=self.dtype)
            cache_len = -(-self.max_len // ATTENTION_CHUNK) * ATTENTION_CHUNK  # whole chunks for chunked_attention
            shape = (cfg.num_hidden_layers, 1, cfg.num_key_value_heads, cache_len, cfg.head_size)
            kv_dtype = cache_dtype(self.dtype, self.device)
            self._k = torch.zeros(shape, dtype=kv_dtype, device=self.device)  # (L, 1, nkv, cache_len, hd)
            self._v = torch.zeros(shape, dtype=kv_dtype, device=self.device)
            self._head_f16 = None if invariant else one_row_head(self.decoder, self.device)
            # Row i of the causal mask for a block starting at pos is tril[pos + i, :pos + T].
            self._tril = torch.ones(self.max_len, self.max_len, dtype=torch.bool, device=self.device).tril()
        self._pos = 0
        self._layers = list(self.decoder.layers)
        self._feature_layers: frozenset[int] = frozenset()
        self.last_features: torch.Tensor | None = None  # (T, F) of the last call, when capture_features asked

    def capture_features(self, layers: Sequence[int]) -> None:
        """Keep the outputs of ``layers`` (concatenated in layer order) for every position of each call, as
        ``last_features`` ``(T, len(layers) C)``: what a feature-level draft reads (:mod:`exactspec.models.eagle`)."""
        bad = [i for i in layers if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in a {self.cfg.num_hidden_layers}-layer target")
        self._feature_layers = frozenset(layers)

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        weights: str = "auto",
        invariant: bool = False,
    ) -> "LeanModel":
        """Load a local Hugging Face Llama directory (``config.json`` + ``model.safetensors``, or shards listed
        in ``model.safetensors.index.json``) or a Llama ``.gguf`` file (:mod:`exactspec.models.gguf`).

        ``weights``: ``dense`` (every weight dequantized to ``dtype``), ``q4`` (a GGUF file's 4-bit projections
        kept as stored and run by torch's int4 CPU kernel, :mod:`exactspec.models.quantized`; bfloat16 on CPU), or
        ``auto``: ``q4`` where it can run (a GGUF file with 4-bit projections, bfloat16, CPU), else ``dense``.
        ``invariant``: call-size-invariant numerics (:meth:`Block.forward_invariant`).
        """
        path = Path(path)
        gguf_file = read_gguf(path) if is_gguf(path) else None
        if weights not in WEIGHT_FORMATS:  # checked before anything is read
            raise ValueError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        q4_possible = gguf_file is not None and dtype == torch.bfloat16 and torch.device(device).type == "cpu"
        if weights == "auto":
            weights = "q4" if q4_possible and any(t.type_name in ("Q4_0", "Q4_1") for t in gguf_file.tensors.values()) else "dense"
        if weights == "q4" and not q4_possible:
            raise ValueError("--weights q4 needs a .gguf checkpoint, --dtype bfloat16 and the CPU (torch's int4 kernel)")
        if gguf_file is not None:
            cfg = llama_config(gguf_file)
            decoder, tensors, source = LlamaDecoder(cfg), gguf_state_dict(gguf_file, cfg), path
        else:
            cfg = read_config(path)
            decoder, (tensors, source) = LlamaDecoder(cfg), read_checkpoint_weights(path)
        try:
            load_hf_state_dict(decoder, tensors)
        except ValueError as error:
            raise ValueError(f"{source}: {error}") from None
        if weights == "q4" and not use_q4_weights(decoder, gguf_file):
            raise ValueError(f"{path} stores no projection in Q4_0 or Q4_1; use --weights dense")
        return cls(decoder, max_len=max_len, device=device, dtype=dtype, invariant=invariant)

    # -- protocol ---------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    @property
    def length(self) -> int:
        return self._pos

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        self._pos = 0
        return self.forward(token_ids)

    def rollback(self, length: int) -> None:
        check_rollback_length(length, self._pos)
        self._pos = length

    def copy_prefix(self, source: "LeanModel", length: int) -> None:
        """Hold the first ``length`` cached positions of ``source`` (a model over the same decoder), copied: a prompt
        that several sequences share is prefilled once."""
        if source.decoder is not self.decoder:
            raise ValueError("copy_prefix needs a model over the same decoder")
        check_rollback_length(length, source.length)
        with torch.inference_mode():
            self._k[:, :, :, :length] = source._k[:, :, :, :length]  # (L, 1, nkv, len, hd)
            self._v[:, :, :, :length] = source._v[:, :, :, :length]
        self._pos = length

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        ids = check_token_ids(token_ids, self.cfg.vocab_size)
        pos, t = self._pos, len(ids)
        end = pos + t
        if end > self.max_len:
            raise ValueError(
                f"sequence too long: {pos} cached + {t} new tokens exceeds the cache of {self.max_len} positions"
            )
        with torch.inference_mode():
            if self.invariant and t <= INVARIANT_ROWS:
                logits = self._forward_invariant(ids, pos)
            else:
                idx = torch.tensor(ids, dtype=torch.long, device=self.device).unsqueeze(0)  # (1, T)
                x = self.decoder.embed(idx)  # (1, T, C)
                cos, sin = self._cos[pos:end], self._sin[pos:end]  # (T, hd)
                mask = None if t == 1 else self._tril[pos:end, :end]  # (T, pos + T)
                features = []
                for i, layer in enumerate(self._layers):
                    x = layer.forward_cached(x, cos, sin, self._k[i], self._v[i], pos, mask)
                    if i in self._feature_layers:
                        features.append(x[0])
                self.last_features = torch.cat(features, dim=-1) if features else None
                h = self.decoder.final_norm(x)  # (1, T, C)
                if t == 1 and self._head_f16 is not None:
                    logits = F.linear(h.to(torch.float16), self._head_f16)[0]  # (1, V)
                else:
                    logits = self.decoder.lm_head(h)[0]  # (T, V)
        self._pos = end
        return logits.float().cpu()

    def _forward_invariant(self, ids: list[int], pos: int) -> torch.Tensor:  # (t, V)
        t, rows = len(ids), INVARIANT_ROWS
        idx = torch.tensor(ids + [0] * (rows - t), dtype=torch.long, device=self.device).unsqueeze(0)  # (1, R)
        positions = torch.arange(pos, pos + rows, device=self.device).clamp(max=self.max_len - 1)  # padding: any angle
        cos, sin = self._cos[positions], self._sin[positions]  # (R, hd)
        x = self.decoder.embed(idx)  # (1, R, C)
        features = []
        for i, layer in enumerate(self._layers):
            x = layer.forward_invariant(x, cos, sin, self._k[i], self._v[i], pos, t)
            if i in self._feature_layers:
                features.append(x[0, :t])
        self.last_features = torch.cat(features, dim=-1) if features else None
        return self.decoder.logits(x)[0, :t]

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"LeanModel(layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}/"
            f"{c.num_key_value_heads}, vocab={c.vocab_size}, dtype={self.dtype}, max_len={self.max_len})"
        )
