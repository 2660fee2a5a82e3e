"""ONNX Runtime behind the :class:`~exactspec.models.runtime.Runtime` protocol: a Llama graph
(:mod:`exactspec.models.onnx_graph`) run by ONNX Runtime's CPU provider over a KV cache that exactspec owns.

The cache is two preallocated float32 numpy buffers ``(L, slots, 1, nkv, max_len, hd)``. Each slot has one
``IOBinding`` per session in which layer i's ``past_key_i`` and ``present_key_i`` are the same ``OrtValue`` over that
slot's view (``OrtValue.ortvalue_from_numpy`` wraps the numpy memory, no copy), so ``GroupQueryAttention`` writes the
call's keys and values in place at positions ``[length, length + T)`` and a call never copies the cache. A slot's
length is a Python integer: ``rollback`` sets it (stale positions are never read: the op attends to
``seqlens_k + 1`` positions), ``copy_prefix`` copies the first n positions of one slot's buffers into another's.

Rows of a ``forward`` call run one after another, one session run per row. The head runs only on the positions
whose logits are asked for (the graph's ``last`` input). ``capture_features`` switches to a second session whose
graph also returns the named layers' outputs, built on first use; calls without features never pay for them.

Numerics: float32 activations (``MatMulNBits`` ``accuracy_level`` 0, unless the caller asks for 4). ONNX Runtime's
4-bit kernels take another path for one row than for several, so a position's logits may differ in the last bits
between a one-token call and a block: ``invariant`` is False.

:meth:`OnnxRuntime.from_checkpoint` loads a GGUF file or a Hugging Face Llama directory and keeps the built
``.onnx`` under exactspec's cache directory (``onnx/``), keyed by a hash of the checkpoint file(s) and the build
options, so a second load only opens a session.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..cache_files import CacheDirectory, default_cache_dir
from ..vocab import check_output_rows
from .base import check_rollback_length, check_token_ids, is_gguf
from .gguf import llama_config, read_gguf
from .llama_config import LlamaConfig, rope_tables
from .onnx_graph import (
    WEIGHT_MODES,
    GraphOptions,
    LlamaWeights,
    build_model,
    gguf_weights,
    state_dict_weights,
    unsupported,
)
from .runtime import OneSlot, check_rows, outputs_per_row

__all__ = ["GraphCache", "OnnxModel", "OnnxRuntime", "SessionSettings", "checkpoint_unsupported", "onnx_cache_dir"]

WARM_UP_TOKENS = 4  # the throwaway call a new session makes at load (OnnxRuntime._warmed)
GRAPH_VERSION = "exactspec-onnx-1"  # part of every cache key: bump when build_model changes its output


@dataclass(frozen=True)
class SessionSettings:
    """How ONNX Runtime runs a graph: ``threads`` intra-op threads (inter-op 1, sequential execution, every graph
    optimization); ``spin``: whether idle pool threads spin between ops (ONNX Runtime's default)."""

    threads: int = 2
    spin: bool = False  # spinning pool threads starve torch's (the verifier's) on a machine with few cores

    def session_options(self) -> ort.SessionOptions:
        options = ort.SessionOptions()
        options.intra_op_num_threads = self.threads
        options.inter_op_num_threads = 1
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.add_session_config_entry("session.intra_op.allow_spinning", "1" if self.spin else "0")
        options.log_severity_level = 3
        return options


GraphSource = Callable[[GraphOptions], "str | bytes"]  # a model file's path, or its serialized bytes


def onnx_cache_dir() -> Path:
    """Where built graphs are kept: ``onnx/`` in exactspec's cache directory."""
    return default_cache_dir() / "onnx"


class GraphCache(CacheDirectory):
    """The graphs built from checkpoints, one ``.onnx`` file per checkpoint and build options (``exactspec cache``)."""

    pattern = "*.onnx"

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else onnx_cache_dir()


class _Session:
    """One inference session and, per slot, an IOBinding whose cache inputs and outputs are the slot's buffers."""

    def __init__(self, model: str | bytes, settings: SessionSettings, runtime: OnnxRuntime) -> None:
        self.session = ort.InferenceSession(model, settings.session_options(), providers=["CPUExecutionProvider"])
        self.outputs = [o.name for o in self.session.get_outputs()]
        self.features = [name for name in self.outputs if name.startswith("feature_")]
        self.bindings = [self._binding(runtime, slot) for slot in range(runtime.slots)]

    def _binding(self, runtime: OnnxRuntime, slot: int) -> ort.IOBinding:
        binding = self.session.io_binding()
        binding.bind_output("logits", "cpu")  # get_outputs() lists outputs in binding order: logits, features, cache
        for name in self.features:
            binding.bind_output(name, "cpu")
        binding.bind_ortvalue_input("cos_cache", runtime.rope[0])
        binding.bind_ortvalue_input("sin_cache", runtime.rope[1])
        for layer in range(runtime.cfg.num_hidden_layers):
            for kind, buffers in (("key", runtime.keys), ("value", runtime.values)):
                value = ort.OrtValue.ortvalue_from_numpy(buffers[layer, slot])  # (1, nkv, max_len, hd), shared
                binding.bind_ortvalue_input(f"past_{kind}_{layer}", value)
                binding.bind_ortvalue_output(f"present_{kind}_{layer}", value)
        return binding


class OnnxRuntime:
    """``slots`` sequences of a Llama decoder run by ONNX Runtime (the Runtime protocol; module docstring)."""

    def __init__(
        self,
        cfg: LlamaConfig,
        source: GraphSource,
        slots: int = 1,
        max_len: int | None = None,
        settings: SessionSettings = SessionSettings(),
        vocab_size: int | None = None,
        options: GraphOptions = GraphOptions(),
    ) -> None:
        max_len = int(max_len or cfg.max_position_embeddings)
        if unsupported(cfg):
            raise ValueError(f"ONNX Runtime cannot run this model: {unsupported(cfg)}")
        if slots < 1 or max_len < 1:
            raise ValueError(f"need slots >= 1 and max_len >= 1, got {slots} and {max_len}")
        self.cfg, self.slots, self.max_len, self.settings = cfg, slots, max_len, settings
        self._vocab_size = check_output_rows(cfg.vocab_size, vocab_size)
        self.invariant, self.device = False, torch.device("cpu")
        self.max_batched_row = max_len  # rows run one after another, each as long as it is
        self.lengths = [0] * slots
        self.feature_layers: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] = []
        shape = (cfg.num_hidden_layers, slots, 1, cfg.num_key_value_heads, max_len, cfg.head_size)
        self.keys = np.zeros(shape, dtype=np.float32)  # (L, S, 1, nkv, max_len, hd)
        self.values = np.zeros(shape, dtype=np.float32)
        half = cfg.head_size // 2
        self._rope = [np.ascontiguousarray(t[:, :half].numpy()) for t in rope_tables(cfg, max_len)]  # (max_len, hd/2)
        self.rope = [ort.OrtValue.ortvalue_from_numpy(t) for t in self._rope]
        self.graph_source, self.graph_options = source, options
        self._sessions: dict[tuple[int, ...], _Session] = {}
        self._session = self._session_for(())

    # -- loading ------------------------------------------------------------------------------------------
    @classmethod
    def from_weights(
        cls,
        cfg: LlamaConfig,
        weights: LlamaWeights,
        slots: int = 1,
        max_len: int | None = None,
        threads: int = 2,
        options: GraphOptions = GraphOptions(),
        **kwargs,
    ) -> OnnxRuntime:
        """A runtime over in-memory weights; graphs are built in memory (not cached on disk)."""

        def source(graph_options: GraphOptions) -> bytes:
            return build_model(cfg, weights, graph_options).SerializeToString()

        return cls(cfg, source, slots, max_len, SessionSettings(threads, **kwargs), options=options)

    @classmethod
    def from_checkpoint(
        cls,
        path: str | Path,
        slots: int = 1,
        max_len: int | None = None,
        threads: int = 2,
        weights: str = "auto",
        accuracy_level: int = 0,
        spin: bool = False,
        cache_dir: Path | None = None,
        vocab_size: int | None = None,
    ) -> OnnxRuntime:
        """A GGUF file or a Hugging Face Llama directory. ``weights``: ``auto`` (the checkpoint's own values: 4- and
        8-bit blocks as stored, the rest float32), ``dense`` (every weight dequantized to float32) or
        ``int4-requantized`` (a GGUF's Q4_1 blocks re-quantized to symmetric int4: other weights than the
        file's). The graph is built once and kept in ``cache_dir`` (default :func:`onnx_cache_dir`); the logits are
        cut to ``vocab_size`` rows (the tokenizer's real vocabulary)."""
        if weights not in WEIGHT_MODES:
            raise ValueError(f"unknown weights mode {weights!r}; choose one of {', '.join(WEIGHT_MODES)}")
        path = Path(path)
        files, cfg, load = _checkpoint(path, weights)
        directory = Path(cache_dir or onnx_cache_dir())
        digest = _files_digest(tuple(files))
        options = GraphOptions(accuracy_level=accuracy_level)

        def source(graph_options: GraphOptions) -> str:
            key = hashlib.sha256(repr((GRAPH_VERSION, digest, weights, asdict(graph_options))).encode()).hexdigest()
            target = directory / f"{key[:32]}.onnx"
            if not target.is_file():
                _save_atomically(build_model(cfg, load(), graph_options), target)
            return str(target)

        return cls(cfg, source, slots, max_len, SessionSettings(threads, spin), vocab_size, options)

    @classmethod
    def like(cls, model: OnnxModel, slots: int, max_len: int | None = None) -> OnnxRuntime:
        """A runtime of ``slots`` slots over ``model``'s graphs (built once), threads and vocabulary cut."""
        runtime = model.runtime
        return cls(
            runtime.cfg,
            runtime.graph_source,
            slots,
            min(max_len or runtime.max_len, runtime.max_len),
            runtime.settings,
            runtime.vocab_size,
            runtime.graph_options,
        )

    def _session_for(self, layers: tuple[int, ...]) -> _Session:
        if layers not in self._sessions:
            options = GraphOptions(self.graph_options.accuracy_level, layers)
            self._sessions[layers] = self._warmed(_Session(self.graph_source(options), self.settings, self))
        return self._sessions[layers]

    def _warmed(self, session: _Session) -> _Session:
        """``session`` after one throwaway call of a few tokens in slot 0, so that ONNX Runtime's first-run work (its
        kernels' one-time preparation, up to a second on SmolLM2) is paid at load, not in the first call a user
        times. The slot's length is kept: the positions written are past it, where no call reads before a real token
        overwrites them."""
        length, previous = self.lengths[0], getattr(self, "_session", None)
        if length + WARM_UP_TOKENS <= self.max_len:
            self._session = session
            self._run(0, [0] * WARM_UP_TOKENS, 1)
            self.lengths[0], self._session = length, previous
        return session

    # -- protocol -----------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def capture_features(self, layers: Sequence[int]) -> None:
        """Return the outputs of ``layers`` (concatenated in layer order, ``(t_i, F)``) for every row of each
        call as ``last_features``, through a second session whose graph has them as outputs."""
        bad = [i for i in layers if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in a {self.cfg.num_hidden_layers}-layer target")
        self.feature_layers = tuple(sorted(set(int(i) for i in layers)))
        self._session = self._session_for(self.feature_layers)

    def rollback(self, slot: int, length: int) -> None:
        check_rollback_length(length, self.lengths[slot])
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Give ``slot`` the first ``length`` positions of ``source``, copied."""
        if not 0 <= length <= self.lengths[source]:
            raise ValueError(f"cannot copy {length} positions of slot {source}: it holds {self.lengths[source]}")
        if slot != source:
            self.keys[:, slot, :, :, :length] = self.keys[:, source, :, :, :length]
            self.values[:, slot, :, :, :length] = self.values[:, source, :, :, :length]
        self.lengths[slot] = length

    def forward(
        self, rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """``rows``: (slot, tokens to append), slots distinct. The logits of each row's last ``outputs[i]``
        positions ``(outputs_i, V)`` float32 (every position without ``outputs``); each slot advances by ``t_i``."""
        slots = [slot for slot, _ in rows]
        ids = [check_token_ids(tokens, self.vocab_size) for _, tokens in rows]
        counts = outputs_per_row(rows, outputs)
        check_rows(slots, [len(t) for t in ids], self.lengths, self.max_len)
        results, features = [], []
        for slot, tokens, count in zip(slots, ids, counts):
            logits, feature = self._run(slot, tokens, count)
            results.append(logits)
            features.append(feature)
        self.last_features = features if self.feature_layers else []
        return results

    def _run(self, slot: int, tokens: list[int], count: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One session run of one row: logits ``(count, V)`` and features ``(t, F)`` or None."""
        session, t, pos = self._session, len(tokens), self.lengths[slot]
        binding = session.bindings[slot]
        binding.bind_cpu_input("input_ids", np.asarray([tokens], dtype=np.int64))
        binding.bind_cpu_input("last", np.arange(t - max(count, 1), t, dtype=np.int64))
        binding.bind_cpu_input("seqlens_k", np.asarray([pos + t - 1], dtype=np.int32))
        binding.bind_cpu_input("total_sequence_length", np.asarray(pos + t, dtype=np.int32))
        for name in ("logits", *session.features):  # a fresh output each run: its shape follows the call
            binding.bind_output(name, "cpu")
        session.session.run_with_iobinding(binding)
        self.lengths[slot] = pos + t
        values = binding.get_outputs()
        logits = torch.from_numpy(values[0].numpy()[0, :, : self.vocab_size])[max(count, 1) - count :]
        if not session.features:
            return logits, None
        picked = [torch.from_numpy(value.numpy()[0]) for value in values[1 : 1 + len(session.features)]]
        return logits, torch.cat(picked, dim=-1)


class OnnxModel(OneSlot):
    """One sequence on ONNX Runtime: slot 0 of an :class:`OnnxRuntime` of one slot (the single-sequence protocol)."""

    invariant = False
    precision = "onnxruntime: the checkpoint's weights as stored, float32 activations, float32 KV cache"

    def __init__(self, runtime: OnnxRuntime, checkpoint: Path | None = None) -> None:
        if runtime.slots != 1:
            raise ValueError("OnnxModel is one sequence: give it a runtime of one slot")
        self.runtime, self.device, self.checkpoint = runtime, runtime.device, checkpoint

    @classmethod
    def from_checkpoint(cls, path: str | Path, **options) -> OnnxModel:
        """``path`` (a GGUF file or a Llama directory) on ONNX Runtime: :meth:`OnnxRuntime.from_checkpoint`."""
        return cls(OnnxRuntime.from_checkpoint(path, slots=1, **options), Path(path))

    @property
    def threads(self) -> int:
        return self.runtime.settings.threads

    def __repr__(self) -> str:
        return f"OnnxModel({self.runtime.cfg.num_hidden_layers} layers, {self.threads} threads, max_len={self.max_len})"


# ---- checkpoints ------------------------------------------------------------------------------------------


def checkpoint_unsupported(path: str | Path) -> str | None:
    """Why exactspec's graph cannot run this checkpoint on ONNX Runtime (not a Llama GGUF file or a directory whose
    config names LlamaForCausalLM, or a shape its kernels do not take), or None. Reads the config only."""
    path = Path(path)
    try:
        if is_gguf(path):
            gguf = read_gguf(path)
            architecture = gguf.metadata.get("general.architecture")
            if architecture != "llama":
                return f"a {architecture} GGUF file (the graph builder reads Llama files)"
            return unsupported(llama_config(gguf))
        architectures = json.loads((path / "config.json").read_text()).get("architectures", [])
        if "LlamaForCausalLM" not in architectures:
            return f"config.json names {', '.join(architectures) or 'no architecture'}, not LlamaForCausalLM"
        from .lean import read_config

        return unsupported(read_config(path))
    except (OSError, ValueError, AttributeError) as error:
        return f"{type(error).__name__}: {error}"


def _checkpoint(path: Path, mode: str) -> tuple[list[Path], LlamaConfig, Callable[[], LlamaWeights]]:
    """The files that define a checkpoint, its config, and a loader of its weights (called only to build)."""
    if is_gguf(path):
        gguf = read_gguf(path)
        cfg = llama_config(gguf)
        return [path], cfg, lambda: gguf_weights(gguf, cfg, mode)
    from .lean import read_checkpoint_weights, read_config

    cfg = read_config(path)
    if mode == "int4-requantized":
        raise ValueError("int4-requantized re-quantizes a GGUF file's Q4_1 blocks; a safetensors directory is dense")
    files = [path / "config.json", *sorted(path.glob("*.safetensors")), *sorted(path.glob("*.safetensors.index.json"))]
    return files, cfg, lambda: state_dict_weights(cfg, read_checkpoint_weights(path)[0])


def _files_digest(files: tuple[Path, ...]) -> str:
    stats = tuple((str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _digest(stats)


@functools.lru_cache(maxsize=16)
def _digest(stats: tuple[tuple[str, int, int], ...]) -> str:
    """sha256 of the files' contents (once per file version in a process)."""
    digest = hashlib.sha256()
    for name, _, _ in stats:
        with open(name, "rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 24), b""):
                digest.update(chunk)
    return digest.hexdigest()


def _save_atomically(model: onnx.ModelProto, target: Path) -> None:
    """Readers see no file or the whole one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    handle, name = tempfile.mkstemp(dir=target.parent, suffix=".tmp")
    os.close(handle)
    try:
        onnx.save_model(model, name)
        os.replace(name, target)
    finally:
        if os.path.exists(name):
            os.unlink(name)
