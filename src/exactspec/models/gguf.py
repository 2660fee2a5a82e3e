"""GGUF files (llama.cpp's single-file format): metadata, dequantized tensors, and the Llama model they hold.

Layout (version 2 and 3, little-endian): magic ``GGUF``, version, tensor count,
metadata count; typed key/value metadata; one record per tensor (name, dims with
the fastest-varying first, type, offset); then tensor data aligned to
``general.alignment`` (default 32).

Weight types read: F32, F16, BF16 and the block formats of 32 weights
``Q8_0`` (w = d * q, q int8), ``Q4_0`` (w = d * (q - 8), q in 0..15) and
``Q4_1`` (w = d * q + m, q in 0..15), with ``d`` and ``m`` float16 per block;
the 4-bit blocks hold weights 0..15 in the low nibbles and 16..31 in the high
nibbles, dequantized here in float32, where every one of these values is exact.
Every other type llama.cpp writes (Q5_0, Q5_1, the K-quants Q2_K..Q6_K, the
I-quants, MXFP4 ...) is dequantized by ggml-org's ``gguf`` package
(``gguf.quants.dequantize``, its reference of llama.cpp's own block layouts); a
type neither knows is refused by name.

llama.cpp's converter reorders the rows of each query and key head from
Hugging Face's two halves (rotate_half) to interleaved pairs; :func:`hf_state_dict`
undoes it, so the lean decoder and transformers see the same matrices.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from .llama_config import LlamaConfig, RopeScaling

__all__ = [
    "GGUFFile",
    "GGUFTensor",
    "read_gguf",
    "llama_config",
    "hf_state_dict",
    "dequantize",
    "unpermute_rotary",
    "SUPPORTED_TYPES",
]

_MAGIC = b"GGUF"
# metadata value type -> struct format (8: string and 9: array are read separately)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {
    0: np.uint8,
    1: np.int8,
    2: np.uint16,
    3: np.int16,
    4: np.uint32,
    5: np.int32,
    6: np.float32,
    7: np.bool_,
    10: np.uint64,
    11: np.int64,
    12: np.float64,
}

# ggml tensor type id -> (name, weights per block, bytes per block)
SUPPORTED_TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    8: ("Q8_0", 32, 34),
    30: ("BF16", 1, 2),
}
_OTHER_TYPES = {
    6: "Q5_0",
    7: "Q5_1",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # torch order: slowest-varying first (GGUF's dims reversed)
    type_id: int
    offset: int  # from the start of the file

    @property
    def type_name(self) -> str:
        if self.type_id in SUPPORTED_TYPES:
            return SUPPORTED_TYPES[self.type_id][0]
        return _OTHER_TYPES.get(self.type_id, f"type {self.type_id}")

    @property
    def known(self) -> bool:
        """Whether this reader or the ``gguf`` package can dequantize the tensor's type."""
        return self.type_id in SUPPORTED_TYPES or _gguf_type(self.type_id) is not None

    @property
    def nbytes(self) -> int:
        if self.type_id in SUPPORTED_TYPES:
            _, per_block, block_bytes = SUPPORTED_TYPES[self.type_id]
        else:
            from gguf import GGML_QUANT_SIZES

            per_block, block_bytes = GGML_QUANT_SIZES[_gguf_type(self.type_id)]
        return int(np.prod(self.shape)) // per_block * block_bytes


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor]

    def tensor(self, name: str) -> torch.Tensor:
        """One tensor, dequantized to float32."""
        info = self.tensors[name]
        if not info.known:
            raise ValueError(
                f"{self.path}: tensor {name} is {info.type_name}, which exactspec does not read "
                f"(it reads {', '.join(sorted(n for n, _, _ in SUPPORTED_TYPES.values()))}, and with the "
                "gguf package installed every type it dequantizes: pip install gguf)"
            )
        raw = np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset)
        if raw.size != info.nbytes:
            raise ValueError(
                f"{self.path} is truncated: tensor {name} needs {info.nbytes} bytes at offset {info.offset}"
            )
        if info.type_id not in SUPPORTED_TYPES:
            from gguf import quants

            rows = int(np.prod(info.shape[:-1]))
            return torch.from_numpy(
                quants.dequantize(raw.reshape(rows, -1), _gguf_type(info.type_id)).astype(np.float32)
            ).reshape(info.shape)
        return dequantize(torch.from_numpy(raw), info.type_id, info.shape)

    def q4_blocks(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A ``Q4_0``/``Q4_1`` tensor as it is stored: ``q`` (N, K) in 0..15, ``d`` and ``m`` (N, K / 32) float32,
        with w = d * q + m (Q4_0: m = -8 d)."""
        info = self.tensors[name]
        if info.type_name not in ("Q4_0", "Q4_1"):
            raise ValueError(f"{self.path}: tensor {name} is {info.type_name}, not a 4-bit block format")
        raw = torch.from_numpy(np.fromfile(self.path, dtype=np.uint8, count=info.nbytes, offset=info.offset))
        q, d, m = q4_fields(raw, info.type_name)
        rows, cols = info.shape
        return q.reshape(rows, cols), d.reshape(rows, cols // 32), m.reshape(rows, cols // 32)


def _gguf_type(type_id: int):
    """The ``gguf`` package's quantization type for ``type_id``, where it is installed and knows the type."""
    try:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    except ImportError:
        return None
    try:
        qtype = GGMLQuantizationType(type_id)
    except ValueError:
        return None
    return qtype if qtype in GGML_QUANT_SIZES else None


def dequantize(raw: torch.Tensor, type_id: int, shape: tuple[int, ...]) -> torch.Tensor:
    """``raw`` uint8 bytes of one tensor -> float32 tensor of ``shape`` (equations in the module docstring)."""
    name, per_block, block_bytes = SUPPORTED_TYPES[type_id]
    if name == "F32":
        return raw.view(torch.float32).reshape(shape).clone()
    if name in ("F16", "BF16"):
        return raw.view(torch.float16 if name == "F16" else torch.bfloat16).float().reshape(shape)
    if name == "Q8_0":
        blocks = raw.reshape(-1, block_bytes)  # (n_blocks, 34)
        d = blocks[:, :2].contiguous().view(torch.float16).float()  # (n_blocks, 1)
        q = blocks[:, 2:].contiguous().view(torch.int8).float()  # (n_blocks, 32)
        return (d * q).reshape(shape)
    q, d, m = q4_fields(raw, name)
    return (d * q + m).reshape(shape)  # exact in float32: Q4_0's d * q - 8 d equals d * (q - 8)


def q4_fields(raw: torch.Tensor, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``raw`` bytes of Q4_0/Q4_1 blocks -> q (n_blocks, 32) uint8 in 0..15, d and m (n_blocks, 1) float32."""
    blocks = raw.reshape(-1, 20 if name == "Q4_1" else 18)  # (n_blocks, block_bytes): d [m] and 16 nibble bytes
    d = blocks[:, :2].contiguous().view(torch.float16).float()
    m = blocks[:, 2:4].contiguous().view(torch.float16).float() if name == "Q4_1" else -8 * d
    packed = blocks[:, -16:]  # weights 0..15 in the low nibbles, 16..31 in the high ones
    return torch.cat([packed & 0x0F, packed >> 4], dim=1), d, m


class _Reader:
    def __init__(self, handle: BinaryIO, path: Path) -> None:
        self.handle, self.path = handle, path

    def take(self, n: int) -> bytes:
        data = self.handle.read(n)
        if len(data) != n:
            raise ValueError(f"{self.path} is truncated (its header ends early)")
        return data

    def scalar(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return self.take(self.scalar("<Q")).decode("utf-8", errors="replace")

    def value(self, type_id: int) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id])
        if type_id == 8:
            return self.string()
        if type_id == 9:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype.newbyteorder("<")).tolist()
            return [self.value(item_type) for _ in range(count)]
        raise ValueError(f"{self.path}: unknown metadata value type {type_id} (not a GGUF file, or a newer version)")


def read_gguf(path: str | Path) -> GGUFFile:
    """The metadata and tensor directory of a GGUF file (tensor data is read on demand). Parsed once per file
    version (path, size, modification time) in a process: a tokenizer's 49k strings take 0.4 s to parse, and
    loading a pair reads the target's header for its config, tokenizer and runtime."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    stat = path.stat()
    return _read_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    with path.open("rb") as handle:
        reader = _Reader(handle, path)
        if handle.read(4) != _MAGIC:
            raise ValueError(f"{path} is not a GGUF file (it does not start with 'GGUF')")
        version = reader.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path} is GGUF version {version}; exactspec reads versions 2 and 3")
        n_tensors, n_metadata = reader.scalar("<Q"), reader.scalar("<Q")
        if n_tensors > 1_000_000 or n_metadata > 1_000_000:
            raise ValueError(f"{path} has an implausible header ({n_tensors} tensors, {n_metadata} metadata keys)")
        metadata = {}
        for _ in range(n_metadata):
            key = reader.string()
            metadata[key] = reader.value(reader.scalar("<I"))
        records = []
        for _ in range(n_tensors):
            name, n_dims = reader.string(), reader.scalar("<I")
            dims = [reader.scalar("<Q") for _ in range(n_dims)]
            records.append((name, tuple(reversed(dims)), reader.scalar("<I"), reader.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", 32))
        data_start = -(-handle.tell() // alignment) * alignment
    tensors = {name: GGUFTensor(name, shape, type_id, data_start + offset) for name, shape, type_id, offset in records}
    for info in tensors.values():
        if info.known and info.offset + info.nbytes > size:
            raise ValueError(f"{path} is truncated: tensor {info.name} ends past the end of the file")
    return GGUFFile(path, metadata, tensors)


# ---- the Llama architecture inside a GGUF file ------------------------------------------------

# llama.* metadata keys the lean decoder reads, and those that cannot change a forward pass.
_READ = {
    "block_count",
    "context_length",
    "embedding_length",
    "feed_forward_length",
    "attention.head_count",
    "attention.head_count_kv",
    "attention.layer_norm_rms_epsilon",
    "rope.freq_base",
    "rope.dimension_count",
    "vocab_size",
    "attention.key_length",
    "attention.value_length",
    "rope.scaling.type",
    "rope.scaling.factor",
}
_IGNORED = {"tensor_data_layout"}


def llama_config(gguf: GGUFFile) -> LlamaConfig:
    """The :class:`LlamaConfig` a GGUF file describes; ValueError for what the lean decoder does not implement."""
    meta, where = gguf.metadata, gguf.path
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"{where} holds a {arch!r} model; the lean backend reads Llama GGUF files only")
    unknown = sorted(k for k in meta if k.startswith("llama.") and k[len("llama.") :] not in _READ | _IGNORED)
    if unknown:
        raise ValueError(f"{where}: metadata {', '.join(unknown)} unknown to the lean backend")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise ValueError(f"{where} has no llama.{key}")
        return value

    heads = int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", int(get("embedding_length")) // heads))
    if (
        int(get("attention.value_length", head_dim)) != head_dim
        or int(get("rope.dimension_count", head_dim)) != head_dim
    ):
        raise ValueError(
            f"{where}: value heads or rotary dimensions that differ from the key heads are not implemented"
        )
    scaling_type = get("rope.scaling.type", "none")
    if scaling_type not in ("none", "linear"):
        raise ValueError(f"{where}: rope scaling {scaling_type!r} is not implemented by the lean backend")
    extra = sorted(name for name in gguf.tensors if _hf_name(name) is None)
    if extra:
        raise ValueError(f"{where}: tensor(s) {', '.join(extra[:3])} unknown to the lean backend")
    tokens = meta.get("tokenizer.ggml.tokens")
    return LlamaConfig(
        vocab_size=int(get("vocab_size", len(tokens) if tokens else None)),
        hidden_size=int(get("embedding_length")),
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in gguf.tensors,
        head_dim=head_dim,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        rope_scaling=RopeScaling("linear", float(get("rope.scaling.factor"))) if scaling_type == "linear" else None,
    )


_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _hf_name(name: str) -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    parts = name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[2] in _LAYER_NAMES
        and parts[3] == "weight"
    ):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    return None


def unpermute_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's row order for one projection: per head, interleaved pairs -> two halves (rotate_half)."""
    out_features = weight.shape[0]
    return weight.reshape(heads, out_features // heads // 2, 2, -1).transpose(1, 2).reshape(weight.shape)


def hf_state_dict(gguf: GGUFFile, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """Every weight dequantized to float32 under Hugging Face ``LlamaForCausalLM`` names."""
    state = {}
    for name in gguf.tensors:
        tensor = gguf.tensor(name)
        if name.endswith("attn_q.weight"):
            tensor = unpermute_rotary(tensor, config.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            tensor = unpermute_rotary(tensor, config.num_key_value_heads)
        state[_hf_name(name)] = tensor
    return state


def embedding_and_head(gguf: GGUFFile) -> tuple[torch.Tensor, torch.Tensor]:  # (V, C) float32 x 2
    """The token embedding and the LM head of a Llama GGUF file, dequantized; the head is the embedding when tied."""
    embed = gguf.tensor("token_embd.weight")
    return embed, gguf.tensor("output.weight") if "output.weight" in gguf.tensors else embed
