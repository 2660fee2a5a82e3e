"""A Llama decoder as an ONNX graph for ONNX Runtime's CPU provider, built from a :class:`LlamaConfig` and weights.

One graph call feeds one sequence ``T`` new tokens against its KV cache (:mod:`exactspec.models.onnx_runtime` owns
the cache and binds it). Per layer, with ONNX Runtime's ``com.microsoft`` contrib ops:

* ``SimplifiedLayerNormalization`` / ``SkipSimplifiedLayerNormalization``: RMSNorm, the residual add fused into
  the next norm (its ``input_skip_bias_sum`` output is the residual stream);
* one fused q|k|v projection, one o projection, one fused gate|up projection, one down projection
  (:func:`projection`: ``MatMulNBits`` for 4- and 8-bit blocks, ``MatMul`` for dense weights);
* ``GroupQueryAttention`` on the packed q|k|v with its own rotary embedding (``do_rotary``, rotate-half layout)
  from cos/sin tables the caller computes with :func:`exactspec.models.llama_config.rope_tables` (so every rotary
  scaling the lean decoder implements holds here), and ``past_key``/``present_key`` bound to one buffer
  (past_present_share_buffer): the op appends the call's keys in place and reads ``seqlens_k + 1`` positions;
* SwiGLU as ``Split``, ``Sigmoid``, ``Mul``.

The head runs only on the positions the ``last`` input selects (a ``Gather`` before the final norm).

Weights keep the checkpoint's values (:class:`Projection`): a GGUF ``Q4_0`` block (w = d (q - 8)) is exactly
``MatMulNBits`` bits 4, block 32, default zero point 8, scale d. A ``Q4_1`` block (w = d q + m) is
d (q - 8) + (m + 8 d): the same symmetric ``MatMulNBits`` plus an offset term, the per-32-block sums of the input
``(M, K/32)`` times a dense ``(K/32, N)`` matrix of m + 8 d. ``Q8_0`` (w = d q) is ``MatMulNBits`` bits 8 with
codes q + 128 and the default zero point 128; its embedding is a ``Gather`` of the same codes, dequantized. A
symmetric re-quantization of Q4_1 blocks (other weights than the file's) exists only as the named weights mode
``int4-requantized``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper, numpy_helper

from .gguf import GGUFFile, q4_fields, unpermute_rotary
from .llama_config import LlamaConfig

__all__ = [
    "unsupported",
    "Graph",
    "GraphOptions",
    "LlamaWeights",
    "Projection",
    "WEIGHT_MODES",
    "build_model",
    "float32_array",
    "gguf_weights",
    "group_query_attention",
    "matmul",
    "pack_int4",
    "quantize_int8",
    "projection_model",
    "q4_blocks",
    "q4_projection",
    "requantize_symmetric",
    "state_dict_weights",
]

BLOCK = 32
OPSET = 21
MS = "com.microsoft"
WEIGHT_MODES = ("auto", "dense", "int4-requantized")


def unsupported(cfg: LlamaConfig) -> str | None:
    """Why ONNX Runtime cannot run a decoder of this shape, or None: its GroupQueryAttention takes head sizes that
    are multiples of 16."""
    if cfg.head_size % 16:
        return f"a head size of {cfg.head_size} (ONNX Runtime's GroupQueryAttention takes multiples of 16)"
    return None


@dataclass(frozen=True)
class GraphOptions:
    """What a built graph computes besides the logits, and how its 4-bit matmuls round.

    ``accuracy_level``: ``MatMulNBits``'s; 0 keeps the activations float32, 4 quantizes them to int8 per block
    (another model than the file's, faster). ``feature_layers``: layers whose outputs are extra graph outputs."""

    accuracy_level: int = 0
    feature_layers: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class Projection:
    """One weight matrix W ``(N, K)`` of y = x W^T, in the form the graph multiplies it.

    ``dense``: float32 W. ``bits`` 4 or 8: ``codes`` ``(N, K)`` uint8 and ``scale`` ``(N, K/32)`` float32 with
    w = scale (code - 2^(bits-1)) + ``offset`` (``(N, K/32)``, None for zero)."""

    dense: np.ndarray | None = None
    bits: int = 0
    codes: np.ndarray | None = None
    scale: np.ndarray | None = None
    offset: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return self.dense.shape if self.dense is not None else self.codes.shape

    def dequantized(self) -> np.ndarray:  # (N, K) float32
        if self.dense is not None:
            return self.dense
        n, k = self.codes.shape
        zero = 2 ** (self.bits - 1)
        w = (self.codes.astype(np.float32) - zero).reshape(n, k // BLOCK, BLOCK) * self.scale[:, :, None]
        if self.offset is not None:
            w = w + self.offset[:, :, None]
        return w.reshape(n, k)


def fuse(parts: list[Projection]) -> Projection:
    """The row-concatenation of projections of one input (q|k|v, gate|up), in one form."""
    if len(parts) == 1:
        return parts[0]
    if any(p.dense is not None for p in parts) or len({p.bits for p in parts}) != 1:
        return Projection(dense=np.concatenate([p.dequantized() for p in parts]))
    offsets = None
    if any(p.offset is not None for p in parts):
        offsets = np.concatenate([p.offset if p.offset is not None else np.zeros_like(p.scale) for p in parts])
    return Projection(
        bits=parts[0].bits,
        codes=np.concatenate([p.codes for p in parts]),
        scale=np.concatenate([p.scale for p in parts]),
        offset=offsets,
    )


@dataclass(frozen=True, eq=False)
class LlamaWeights:
    """A decoder's weights in the fused layout of :class:`exactspec.models.llama.Block` (q|k|v and gate|up rows,
    Hugging Face rotate-half order), norms float32 ``(C,)``."""

    embed: Projection  # (V, C)
    head: Projection  # (V, C), the embedding's object when tied
    norm: np.ndarray
    attn_norms: list[np.ndarray] = field(default_factory=list)
    mlp_norms: list[np.ndarray] = field(default_factory=list)
    wqkv: list[Projection] = field(default_factory=list)
    wo: list[Projection] = field(default_factory=list)
    w13: list[Projection] = field(default_factory=list)
    w2: list[Projection] = field(default_factory=list)


# ---- weights from checkpoints --------------------------------------------------------------------


def float32_array(t: torch.Tensor) -> np.ndarray:
    """A tensor's values as a contiguous float32 numpy array (what the graph's initializers hold)."""
    return t.detach().to(torch.float32).contiguous().numpy()


def state_dict_weights(cfg: LlamaConfig, sd: dict[str, torch.Tensor]) -> LlamaWeights:
    """Dense float32 weights from Hugging Face ``LlamaForCausalLM`` names."""

    def get(name: str) -> np.ndarray:
        if name not in sd:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        return float32_array(sd[name])

    embed = Projection(dense=get("model.embed_tokens.weight"))
    head = embed if cfg.tie_word_embeddings else Projection(dense=get("lm_head.weight"))
    w = LlamaWeights(embed, head, get("model.norm.weight"))
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w.attn_norms.append(get(p + "input_layernorm.weight"))
        w.mlp_norms.append(get(p + "post_attention_layernorm.weight"))
        w.wqkv.append(fuse([Projection(dense=get(p + f"self_attn.{n}_proj.weight")) for n in "qkv"]))
        w.wo.append(Projection(dense=get(p + "self_attn.o_proj.weight")))
        w.w13.append(fuse([Projection(dense=get(p + f"mlp.{n}_proj.weight")) for n in ("gate", "up")]))
        w.w2.append(Projection(dense=get(p + "mlp.down_proj.weight")))
    return w


def pack_int4(codes: np.ndarray) -> np.ndarray:  # (N, K) uint8 in 0..15 -> (N, K/32, 16) uint8
    """MatMulNBits' 4-bit layout: element 2j of a block in the low nibble of byte j, 2j + 1 in the high one."""
    n, k = codes.shape
    pairs = codes.reshape(n, k // BLOCK, BLOCK // 2, 2).astype(np.uint8)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def requantize_symmetric(w: np.ndarray) -> Projection:  # w (N, K) float32
    """Symmetric int4 blocks of 32 as llama.cpp's ``quantize_row_q4_0``: d = (signed max-magnitude weight) / -8,
    q = clamp(round(w / d) + 8, 0, 15). Other weights than ``w``: used only by the ``int4-requantized`` mode."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    at = np.abs(blocks).argmax(-1)[..., None]
    d = (np.take_along_axis(blocks, at, -1) / -8.0).astype(np.float16).astype(np.float32)  # (N, K/32, 1)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.floor(blocks * inv + 8.5), 0, 15).astype(np.uint8)
    return Projection(bits=4, codes=q.reshape(n, k), scale=d[..., 0])


def quantize_int8(w: np.ndarray) -> Projection:  # w (N, K) float32
    """Symmetric int8 blocks of 32: d = max |w| / 127, q = round(w / d) (codes q + 128). For weights that only move
    speed (a draft's), never for a target's."""
    n, k = w.shape
    blocks = w.reshape(n, k // BLOCK, BLOCK)
    d = np.abs(blocks).max(-1, keepdims=True) / 127.0  # (N, K/32, 1)
    inv = np.divide(1.0, d, out=np.zeros_like(d), where=d != 0)
    q = np.clip(np.rint(blocks * inv), -127, 127).astype(np.int16) + 128
    return Projection(bits=8, codes=q.astype(np.uint8).reshape(n, k), scale=d[..., 0].astype(np.float32))


def q4_blocks(raw: torch.Tensor, kind: str, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The bytes of a ``(rows, cols)`` Q4_0/Q4_1 tensor as stored -> q ``(rows, cols)``, d and m ``(rows, cols/32)``
    (what :meth:`GGUFFile.q4_blocks` reads from a file)."""
    q, d, m = q4_fields(raw, kind)
    return q.reshape(rows, cols), d.reshape(rows, cols // BLOCK), m.reshape(rows, cols // BLOCK)


def q4_projection(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kind: str, mode: str = "auto") -> Projection:
    """Q4_0/Q4_1 blocks (q ``(N, K)`` in 0..15, d and m ``(N, K/32)``, w = d q + m) as symmetric int4 with scale
    d plus, for Q4_1, the offset m + 8 d (w = d (q - 8) + (m + 8 d)); ``int4-requantized``: Q4_1 blocks re-quantized
    to symmetric int4 (:func:`requantize_symmetric`)."""
    if kind == "Q4_1" and mode == "int4-requantized":
        return requantize_symmetric(float32_array(d.repeat_interleave(BLOCK, 1) * q + m.repeat_interleave(BLOCK, 1)))
    offset = None if kind == "Q4_0" else float32_array(m + 8 * d)  # Q4_0: m = -8 d, the offset is exactly 0
    return Projection(bits=4, codes=q.to(torch.uint8).numpy(), scale=float32_array(d), offset=offset)


def _gguf_projection(gguf: GGUFFile, name: str, heads: int | None, mode: str) -> Projection:
    """One GGUF weight in the form ``mode`` asks: blocks kept where the graph multiplies them exactly."""
    info = gguf.tensors[name]
    kind = info.type_name
    if mode != "dense" and kind in ("Q4_0", "Q4_1"):
        q, d, m = gguf.q4_blocks(name)
        if heads:
            q, d, m = (unpermute_rotary(t, heads) for t in (q, d, m))
        return q4_projection(q, d, m, kind, mode)
    if mode != "dense" and kind == "Q8_0":
        raw = torch.from_numpy(np.fromfile(gguf.path, dtype=np.uint8, count=info.nbytes, offset=info.offset))
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()
        codes = (blocks[:, 2:].contiguous().view(torch.int8).to(torch.int16) + 128).to(torch.uint8)
        rows, cols = info.shape
        scale, codes = d.reshape(rows, cols // BLOCK), codes.reshape(rows, cols)
        if heads:
            codes, scale = unpermute_rotary(codes, heads), unpermute_rotary(scale, heads)
        return Projection(bits=8, codes=codes.numpy(), scale=float32_array(scale))
    weight = gguf.tensor(name)
    return Projection(dense=float32_array(unpermute_rotary(weight, heads) if heads else weight))


def gguf_weights(gguf: GGUFFile, cfg: LlamaConfig, mode: str = "auto") -> LlamaWeights:
    """A Llama GGUF file's weights: ``auto`` keeps Q4_0, Q4_1 and Q8_0 blocks (the file's values), ``dense``
    dequantizes every weight to float32, ``int4-requantized`` turns Q4_1 blocks into symmetric int4 ones."""
    if mode not in WEIGHT_MODES:
        raise ValueError(f"unknown weights mode {mode!r}; choose one of {', '.join(WEIGHT_MODES)}")

    def vector(name: str) -> np.ndarray:
        return float32_array(gguf.tensor(name))

    embed = _gguf_projection(gguf, "token_embd.weight", None, mode)
    head = embed if cfg.tie_word_embeddings else _gguf_projection(gguf, "output.weight", None, mode)
    w = LlamaWeights(embed, head, vector("output_norm.weight"))
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    for i in range(cfg.num_hidden_layers):
        b = f"blk.{i}."
        w.attn_norms.append(vector(b + "attn_norm.weight"))
        w.mlp_norms.append(vector(b + "ffn_norm.weight"))
        w.wqkv.append(
            fuse(
                [
                    _gguf_projection(gguf, b + "attn_q.weight", nh, mode),
                    _gguf_projection(gguf, b + "attn_k.weight", nkv, mode),
                    _gguf_projection(gguf, b + "attn_v.weight", None, mode),
                ]
            )
        )
        w.wo.append(_gguf_projection(gguf, b + "attn_output.weight", None, mode))
        w.w13.append(fuse([_gguf_projection(gguf, b + f"ffn_{n}.weight", None, mode) for n in ("gate", "up")]))
        w.w2.append(_gguf_projection(gguf, b + "ffn_down.weight", None, mode))
    return w


# ---- the graph ----------------------------------------------------------------------------------


class Graph:
    """Nodes and initializers under unique names."""

    def __init__(self) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self._count = 0

    def name(self, stem: str) -> str:
        self._count += 1
        return f"{stem}_{self._count}"

    def const(self, stem: str, value: np.ndarray) -> str:
        name = self.name(stem)
        self.initializers.append(numpy_helper.from_array(np.ascontiguousarray(value), name))
        return name

    def op(self, op_type: str, inputs: list[str], outputs: int | list[str] = 1, domain: str = "", **attrs) -> list[str]:
        names = outputs if isinstance(outputs, list) else [self.name(op_type.lower()) for _ in range(outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=self.name(op_type), domain=domain, **attrs))
        return names

    def one(self, op_type: str, inputs: list[str], domain: str = "", **attrs) -> str:
        return self.op(op_type, inputs, 1, domain, **attrs)[0]


@dataclass(frozen=True)
class _Bound:
    """A projection's initializers in the graph."""

    weight: Projection
    names: dict


def _bind(g: Graph, p: Projection, stem: str) -> _Bound:
    if p.dense is not None:
        return _Bound(p, {"dense": g.const(stem, p.dense.T)})  # (K, N)
    n, k = p.shape
    codes = pack_int4(p.codes) if p.bits == 4 else p.codes.reshape(n, k // BLOCK, BLOCK)
    names = {"codes": g.const(stem + "_q", codes), "scale": g.const(stem + "_d", p.scale)}
    if p.offset is not None:
        names["offset"] = g.const(stem + "_m", p.offset.T)  # (K/32, N)
    return _Bound(p, names)


def projection(g: Graph, x: str, bound: _Bound, options: GraphOptions, sums: dict[str, str]) -> str:
    """x ``(1, T, K)`` -> x W^T ``(1, T, N)``. A Q4_1 offset adds (block sums of x) @ (m + 8 d); ``sums`` caches an
    input's block sums so projections of one input share them."""
    p, names = bound.weight, bound.names
    if p.dense is not None:
        return g.one("MatMul", [x, names["dense"]])
    n, k = p.shape
    y = g.one(
        "MatMulNBits",
        [x, names["codes"], names["scale"]],
        MS,
        K=k,
        N=n,
        bits=p.bits,
        block_size=BLOCK,
        accuracy_level=options.accuracy_level,
    )
    if "offset" not in names:
        return y
    if x not in sums:
        shape = g.const("blocks", np.array([0, 0, k // BLOCK, BLOCK], dtype=np.int64))
        sums[x] = g.one(
            "ReduceSum", [g.one("Reshape", [x, shape]), g.const("axes", np.array([-1], np.int64))], keepdims=0
        )  # (1, T, K/32)
    return g.one("Add", [y, g.one("MatMul", [sums[x], names["offset"]])])


def matmul(g: Graph, x: str, weight: Projection, stem: str, options: GraphOptions = GraphOptions()) -> str:
    """x ``(1, T, K)`` -> x W^T ``(1, T, N)`` for one weight used once."""
    return projection(g, x, _bind(g, weight, stem), options, {})


def _embedding(g: Graph, ids: str, bound: _Bound, cfg: LlamaConfig) -> str:  # ids (1, T) -> (1, T, C)
    p, names = bound.weight, bound.names
    if p.dense is not None:  # the (K, N) transpose is the head's; the embedding needs rows
        table = g.const("embed", p.dense)
        return g.one("Gather", [table, ids])
    if p.bits != 8 or "offset" in names:
        return g.one("Gather", [g.const("embed", p.dequantized()), ids])
    codes = g.one("Cast", [g.one("Gather", [names["codes"], ids])], to=TensorProto.FLOAT)  # (1, T, C/32, 32)
    scale = g.one("Gather", [g.const("embed_d", p.scale[:, :, None]), ids])  # (1, T, C/32, 1)
    centred = g.one("Sub", [codes, g.const("zero", np.array(128, np.float32))])
    shape = g.const("shape", np.array([0, 0, cfg.hidden_size], dtype=np.int64))
    return g.one("Reshape", [g.one("Mul", [centred, scale]), shape])  # d q: exact in float32


def group_query_attention(g: Graph, qkv: str, past: list[str], present: list[str], cfg: LlamaConfig) -> str:
    """Attention over the packed q|k|v ``(1, T, (nh + 2 nkv) hd)`` with its rotary embedding (rotate-half, from the
    graph's ``cos_cache``/``sin_cache``), appending the call's keys and values to the ``past`` buffers in place (bound
    as ``present`` too) and reading ``seqlens_k + 1`` positions of them: ``(1, T, nh hd)``."""
    return g.op(
        "GroupQueryAttention",
        [qkv, "", "", *past, "seqlens_k", "total_sequence_length", "cos_cache", "sin_cache"],
        [g.name("attention"), *present],
        MS,
        num_heads=cfg.num_attention_heads,
        kv_num_heads=cfg.num_key_value_heads,
        do_rotary=1,
        rotary_interleaved=0,
    )[0]


def build_model(cfg: LlamaConfig, weights: LlamaWeights, options: GraphOptions = GraphOptions()) -> onnx.ModelProto:
    """The decoder graph. Inputs: ``input_ids`` (1, T) int64, ``last`` (k,) int64 (positions whose logits are
    returned), ``seqlens_k`` (1,) int32 (cached + T - 1), ``total_sequence_length`` () int32, ``cos_cache`` and
    ``sin_cache`` (capacity, hd/2), ``past_key_i``/``past_value_i`` (1, nkv, capacity, hd). Outputs: ``logits``
    (1, k, V), ``present_key_i``/``present_value_i`` (the past buffers, when bound to them), ``feature_i`` (1, T, C)."""
    bad = [i for i in options.feature_layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"feature layers {bad} do not exist in a {cfg.num_hidden_layers}-layer decoder")
    g, hd, nkv, eps = Graph(), cfg.head_size, cfg.num_key_value_heads, cfg.rms_norm_eps
    float_in = TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"]),
        helper.make_tensor_value_info("last", TensorProto.INT64, ["k"]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos_cache", float_in, ["capacity", hd // 2]),
        helper.make_tensor_value_info("sin_cache", float_in, ["capacity", hd // 2]),
    ]
    outputs = [helper.make_tensor_value_info("logits", float_in, [1, "k", cfg.vocab_size])]
    head = _bind(g, _head_form(weights.head, options), "head")
    shared = weights.embed is weights.head and head.weight is weights.head and weights.head.dense is None
    embed = head if shared else _bind(g, weights.embed, "embed")
    h = _embedding(g, "input_ids", embed, cfg)
    first_norm = g.const("attn_norm", weights.attn_norms[0])
    normed = g.one("SimplifiedLayerNormalization", [h, first_norm], axis=-1, epsilon=eps)
    for i in range(cfg.num_hidden_layers):
        sums: dict[str, str] = {}
        cache = [f"past_key_{i}", f"past_value_{i}"]
        inputs += [helper.make_tensor_value_info(n, float_in, [1, nkv, "capacity", hd]) for n in cache]
        outputs += [
            helper.make_tensor_value_info(n.replace("past", "present"), float_in, [1, nkv, "capacity", hd])
            for n in cache
        ]
        qkv = projection(g, normed, _bind(g, weights.wqkv[i], f"wqkv{i}"), options, sums)
        attention = group_query_attention(g, qkv, cache, [f"present_key_{i}", f"present_value_{i}"], cfg)
        o = projection(g, attention, _bind(g, weights.wo[i], f"wo{i}"), options, sums)
        normed, _, _, h = g.op(
            "SkipSimplifiedLayerNormalization",
            [h, o, g.const("mlp_norm", weights.mlp_norms[i])],
            [g.name("mlp_in"), "", "", g.name("resid")],
            MS,
            epsilon=eps,
        )
        gate, up = _gate_up(g, projection(g, normed, _bind(g, weights.w13[i], f"w13{i}"), options, sums), cfg)
        act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
        down = projection(g, act, _bind(g, weights.w2[i], f"w2{i}"), options, sums)
        if i + 1 < cfg.num_hidden_layers:
            normed, _, _, h = g.op(
                "SkipSimplifiedLayerNormalization",
                [h, down, g.const("attn_norm", weights.attn_norms[i + 1])],
                [g.name("attn_in"), "", "", g.name("resid")],
                MS,
                epsilon=eps,
            )
        else:
            h = g.one("Add", [h, down])
        if i in options.feature_layers:
            g.op("Identity", [h], [f"feature_{i}"])
            outputs.append(helper.make_tensor_value_info(f"feature_{i}", float_in, [1, "T", cfg.hidden_size]))
    picked = g.one("Gather", [h, "last"], axis=1)  # (1, k, C)
    final = g.one("SimplifiedLayerNormalization", [picked, g.const("norm", weights.norm)], axis=-1, epsilon=eps)
    g.op("Identity", [projection(g, final, head, options, {})], ["logits"])
    graph = helper.make_graph(g.nodes, "exactspec_llama", inputs, outputs, g.initializers)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="exactspec"
    )


def _head_form(head: Projection, options: GraphOptions) -> Projection:
    """The head as the graph multiplies it: ONNX Runtime's CPU ``MatMulNBits`` has a fast 8-bit kernel only with
    int8 activations (``accuracy_level`` 4); with float32 activations a Q8_0 head runs dense, its values exact."""
    if head.bits == 8 and options.accuracy_level != 4:
        return Projection(dense=head.dequantized())
    return head


def _gate_up(g: Graph, fused: str, cfg: LlamaConfig) -> tuple[str, str]:  # (1, T, 2 I) -> (1, T, I) x 2
    split = g.const("split", np.array([cfg.intermediate_size] * 2, np.int64))
    gate, up = g.op("Split", [fused, split], 2, axis=-1)
    return gate, up


def projection_model(weight: Projection, options: GraphOptions = GraphOptions()) -> onnx.ModelProto:
    """A graph of one projection, ``x`` (1, T, K) -> ``y`` (1, T, N), as the decoder graph multiplies it."""
    g = Graph()
    n, k = weight.shape
    y = projection(g, "x", _bind(g, weight, "w"), options, {})
    g.op("Identity", [y], ["y"])
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, "T", k])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, "T", n])
    graph = helper.make_graph(g.nodes, "projection", [x_info], [y_info], g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)])
