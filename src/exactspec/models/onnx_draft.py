"""A feature-level draft (:mod:`exactspec.models.eagle`) run by ONNX Runtime: the draft of a target that runs there.

:class:`OnnxFeatureDraftRuntime` is :class:`exactspec.models.feature_runtime.FeatureDraftRuntime`'s protocol
(``project``, ``forward``, ``rollback``, ``copy_prefix``, ``lengths``) with the draft's layer and head in one graph
call per row, so a draft step is one session run instead of some forty dispatched torch operations. The graph
(:func:`build_draft_model`) takes the layer's two inputs, u (the fused target features, or the draft's own last
output) and e (the next token's embedding row, gathered in torch: the target's table is not copied into the graph),
and returns the last position's output g and its logits over the vocabulary subset S:

    eagle3:     y = u + W_o attn(W_qkv [norm_e(e) ; norm_u(u)])
    exactspec:  h = W_in [u ; e],  y = h + W_o attn(W_qkv norm(h))
    both:       g = y + W_2 (silu(W_1 norm(y)) * W_3 norm(y)),   logits = head_S norm_out(g)

Attention is ``GroupQueryAttention`` over a per-slot float32 cache bound in place, as in
:mod:`exactspec.models.onnx_runtime`. Numerics: float32 throughout. What the draft computes only moves speed: the
verifier checks the draft's tokens against the q it reports, whatever computed it.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import TensorProto, helper

from .eagle import FeatureDraft
from .kv_cache import MAX_BLOCK
from .llama_config import rope_tables
from .onnx_graph import (
    BLOCK,
    MS,
    OPSET,
    Graph,
    GraphOptions,
    Projection,
    float32_array,
    group_query_attention,
    matmul,
    quantize_int8,
    requantize_symmetric,
)
from .onnx_runtime import SessionSettings

__all__ = ["DRAFT_WEIGHTS", "OnnxFeatureDraftRuntime", "build_draft_model"]

# How the graph stores the draft's matrices: float32 as trained, or symmetric blocks of 32 multiplied with int8
# activations (MatMulNBits, accuracy level 4): a draft step reads its weights once, so their bytes set its cost.
DRAFT_WEIGHTS = ("float32", "int8", "int4")


def build_draft_model(draft: FeatureDraft, weights: str = "int8") -> onnx.ModelProto:
    """The draft's layer and head, its matrices in the form ``weights`` names (:data:`DRAFT_WEIGHTS`).

    Inputs: ``u`` and ``e`` (1, T, C), ``last`` (1,) int64 (T - 1), ``seqlens_k`` (1,) int32,
    ``total_sequence_length`` () int32, ``cos_cache``/``sin_cache`` (capacity, hd/2), ``past_key``/``past_value``
    (1, nkv, capacity, hd). Outputs: ``g`` (1, 1, C), ``logits`` (1, 1, |S|), ``present_key``/``present_value``."""
    cfg, block = draft.cfg, draft.block
    layer = cfg.layer_config()
    c, hd, nkv, eps = cfg.target_hidden_size, layer.head_size, layer.num_key_value_heads, layer.rms_norm_eps
    g, f = Graph(), TensorProto.FLOAT
    inputs = [
        helper.make_tensor_value_info("u", f, [1, "T", c]),
        helper.make_tensor_value_info("e", f, [1, "T", c]),
        helper.make_tensor_value_info("last", TensorProto.INT64, [1]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, []),
        helper.make_tensor_value_info("cos_cache", f, ["capacity", hd // 2]),
        helper.make_tensor_value_info("sin_cache", f, ["capacity", hd // 2]),
        helper.make_tensor_value_info("past_key", f, [1, nkv, "capacity", hd]),
        helper.make_tensor_value_info("past_value", f, [1, nkv, "capacity", hd]),
    ]
    outputs = [
        helper.make_tensor_value_info("g", f, [1, 1, c]),
        helper.make_tensor_value_info("logits", f, [1, 1, cfg.vocab_subset_size]),
        helper.make_tensor_value_info("present_key", f, [1, nkv, "capacity", hd]),
        helper.make_tensor_value_info("present_value", f, [1, nkv, "capacity", hd]),
    ]

    if weights not in DRAFT_WEIGHTS:
        raise ValueError(f"unknown draft weights {weights!r}; choose one of {', '.join(DRAFT_WEIGHTS)}")
    quantize = {"float32": lambda w: Projection(dense=w), "int8": quantize_int8, "int4": requantize_symmetric}[weights]
    options = GraphOptions(accuracy_level=0 if weights == "float32" else 4)

    def product(x: str, linear: torch.nn.Linear | torch.Tensor, stem: str) -> str:
        weight = float32_array(linear.weight if isinstance(linear, torch.nn.Linear) else linear)  # (N, K)
        blocks = weight.shape[1] % BLOCK == 0  # MatMulNBits takes whole blocks of 32 inputs; else float32
        return matmul(g, x, quantize(weight) if blocks else Projection(dense=weight), stem, options)

    def norm(x: str, weight: torch.Tensor) -> str:
        return g.one("SimplifiedLayerNormalization", [x, g.const("norm", float32_array(weight))], axis=-1, epsilon=eps)

    if cfg.layout == "eagle3":
        attention_in = g.one("Concat", [norm("e", block.attn_norm), norm("u", block.hidden_norm)], axis=-1)
        residual = "u"
    else:
        residual = product(g.one("Concat", ["u", "e"], axis=-1), draft.w_in, "w_in")
        attention_in = norm(residual, block.attn_norm)
    qkv = product(attention_in, block.wqkv, "wqkv")
    attention = group_query_attention(g, qkv, ["past_key", "past_value"], ["present_key", "present_value"], layer)
    mlp_in, _, _, y = g.op(
        "SkipSimplifiedLayerNormalization",
        [residual, product(attention, block.wo, "wo"), g.const("mlp_norm", float32_array(block.mlp_norm))],
        [g.name("mlp_in"), "", "", g.name("y")],
        MS,
        epsilon=eps,
    )
    gate, up = g.op("Split", [product(mlp_in, block.w13, "w13")], 2, axis=-1, num_outputs=2)
    act = g.one("Mul", [g.one("Mul", [gate, g.one("Sigmoid", [gate])]), up])
    out = g.one("Add", [y, product(act, block.w2, "w2")])
    g.op("Gather", [out, "last"], ["g"], axis=1)
    g.op("Identity", [product(norm("g", draft.norm), draft.head, "head")], ["logits"])
    graph = helper.make_graph(g.nodes, "exactspec_feature_draft", inputs, outputs, g.initializers)
    return helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)], producer_name="exactspec"
    )


class OnnxFeatureDraftRuntime:
    """``slots`` sequences of a feature-level draft on ONNX Runtime (module docstring); rows run one after
    another, one session run each."""

    def __init__(
        self,
        draft: FeatureDraft,
        slots: int,
        max_len: int,
        settings: SessionSettings = SessionSettings(),
        weights: str = "int8",
    ) -> None:
        if draft.embed is None or draft.head is None:
            raise ValueError("the feature draft has no target weights attached (FeatureDraft.attach_weights)")
        self.draft = draft.eval()
        self.slots, self.max_len, self.max_batched_row = slots, max_len, MAX_BLOCK
        layer = draft.cfg.layer_config()
        shape = (slots, 1, layer.num_key_value_heads, max_len, layer.head_size)
        self._keys, self._values = np.zeros(shape, np.float32), np.zeros(shape, np.float32)
        half = layer.head_size // 2
        self._rope = [np.ascontiguousarray(t[:, :half].numpy()) for t in rope_tables(layer, max_len)]
        self.session = ort.InferenceSession(
            build_draft_model(self.draft, weights).SerializeToString(),
            settings.session_options(),
            providers=["CPUExecutionProvider"],
        )
        self._bindings = [self._binding(slot) for slot in range(slots)]
        self.lengths = [0] * slots

    def _binding(self, slot: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        binding.bind_output("g", "cpu")  # get_outputs() lists outputs in binding order: g, logits, cache
        binding.bind_output("logits", "cpu")
        for name, array in (("cos_cache", self._rope[0]), ("sin_cache", self._rope[1])):
            binding.bind_ortvalue_input(name, ort.OrtValue.ortvalue_from_numpy(array))
        for kind, buffers in (("key", self._keys), ("value", self._values)):
            value = ort.OrtValue.ortvalue_from_numpy(buffers[slot])  # (1, nkv, max_len, hd), written in place
            binding.bind_ortvalue_input(f"past_{kind}", value)
            binding.bind_ortvalue_output(f"present_{kind}", value)
        return binding

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"slot {slot}: cannot roll back to {length} (holds {self.lengths[slot]})")
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        if length > self.lengths[source]:
            raise ValueError(f"slot {source} holds {self.lengths[source]} positions, not {length}")
        self._keys[slot, :, :, :length] = self._keys[source, :, :, :length]
        self._values[slot, :, :, :length] = self._values[source, :, :, :length]
        self.lengths[slot] = length

    def project(self, features: torch.Tensor) -> torch.Tensor:  # (n, F) the target's features -> (n, C) inputs u
        with torch.inference_mode():
            return self.draft.fc(features.to(self.draft.fc.weight.dtype)).float()

    def forward(self, rows: Sequence[tuple[int, torch.Tensor, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows``: (slot, inputs u ``(n_i, C)``, the tokens x_{j+1} of those slots), slots distinct. Appends the
        slots and returns each row's last output g ``(B, C)`` and its logits over S ``(B, |S|)`` float32."""
        if len({slot for slot, _, _ in rows}) != len(rows):
            raise ValueError("the rows of one call need distinct slots")
        outputs, logits = [], []
        for slot, u, tokens in rows:
            n, pos = len(tokens), self.lengths[slot]
            if u.shape[0] != n or not tokens:
                raise ValueError(f"slot {slot}: {u.shape[0]} inputs for {n} tokens")
            if pos + n > self.max_len:
                raise ValueError(f"slot {slot}: {pos} + {n} positions exceed the draft's {self.max_len}")
            binding = self._bindings[slot]
            e = self.draft.embed[torch.as_tensor(tokens)].float()
            binding.bind_cpu_input("u", np.ascontiguousarray(float32_array(u)[None]))
            binding.bind_cpu_input("e", np.ascontiguousarray(e.numpy()[None]))
            binding.bind_cpu_input("last", np.asarray([n - 1], dtype=np.int64))
            binding.bind_cpu_input("seqlens_k", np.asarray([pos + n - 1], dtype=np.int32))
            binding.bind_cpu_input("total_sequence_length", np.asarray(pos + n, dtype=np.int32))
            binding.bind_output("g", "cpu")  # a fresh output each run
            binding.bind_output("logits", "cpu")
            self.session.run_with_iobinding(binding)
            self.lengths[slot] = pos + n
            g, row_logits = (torch.from_numpy(v.numpy()) for v in binding.get_outputs()[:2])
            outputs.append(g[0, 0])
            logits.append(row_logits[0, 0])
        return torch.stack(outputs), torch.stack(logits)
