"""llama.cpp as a runtime: a GGUF file's slots as llama.cpp sequences in one context.

Through llama-cpp-python's bindings of llama.cpp's C API (the optional extra ``exactspec[llamacpp]``), this module
implements the runtime interface (:mod:`exactspec.models.runtime`) on llama.cpp's own kernels and KV cache:

* ``forward(rows, outputs)``: one ``llama_decode`` for every row of the call, each row's tokens at its slot's next
  positions in sequence ``slot``, logits requested for the positions asked for (every fed position by default)
  and read back in the batch's order;
* ``rollback(slot, n)``: ``llama_memory_seq_rm(slot, n, -1)``; the cells past ``n`` are free again (a failed
  decode frees what it wrote past each of its slots' lengths the same way, before it raises);
* ``copy_prefix(source, slot, n)``: the slot's cells dropped, then the source's first ``n`` positions shared with
  it (``llama_memory_seq_cp``: no recomputation, the cells are tagged with both sequences).

The cache is llama.cpp's unified one by default: ``slots * max_len`` cells that every sequence draws from, so a
shared prompt costs its cells once, but every token's attention spans all the cells (masked), which costs more with
each slot. ``split_cache=True`` gives each slot a stream of its own (``kv_unified`` off): a token attends to its
own sequence only, a copied prefix is the source's whole stream cut to ``n`` positions (a stream is copied whole),
rows of consecutive slots share a graph computation and others do not (llama.cpp's ``split_equal``), and features
cannot be captured (llama.cpp reorders the rows of such a batch). For many slots that all decode, as in
``train-draft``'s answers, it pays, more so the more slots (``python -m exactspec.bench.cache_layout`` measures it;
figures in docs/experiments/smollm2-log.md). Numerics are llama.cpp's: weights as the file stores them (no
requantizing), activations in float32, keys and values cached in float16 (llama.cpp's default), and a position's logits
may differ in the last bits with the call's size and the other rows beside it (llama.cpp's matrix kernels pick their
tiling by batch size), so this runtime is not call-size invariant (``invariant`` is False) and refuses to be asked to
be.

``capture_features(layers)`` hands back the raw outputs of target layers (what a feature-level draft reads,
:mod:`exactspec.models.eagle`) through llama.cpp's eval callback: the graph's tensors named ``l_out-{i}`` (layer
``i``'s output, before the final norm, as the torch decoder's) are copied out as llama.cpp computes them, one
chunk per micro-batch, in the batch's order. The callback is asked about every node of the graph (about 940 for
SmolLM2), so the context is made with it only once features are asked for (its cost, about a tenth of a one-token
call on SmolLM2: docs/runtimes.md).

:class:`LlamaCppModel` is one slot of a runtime: the single-sequence model protocol
(:class:`exactspec.models.base.LanguageModel`) that ``generate`` and the library's decoder take, as
:class:`exactspec.models.lean.LeanModel` is for the torch runtime.
"""

from __future__ import annotations

import ctypes
import weakref
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from ..vocab import check_output_rows
from .base import check_rollback_length, check_token_ids
from .llamacpp_tiles import PROBE_TOKENS, extra_buffers_work
from .runtime import OneSlot, check_rows, outputs_per_row

__all__ = ["LlamaCppRuntime", "LlamaCppModel", "llama_cpp_available", "llama_cpp_version", "requantize"]

#: A row longer than this (a prompt) is decoded alone, so that one long prefill does not hold up a batch's rounds.
MAX_BATCHED_ROW = 64

_BACKEND: dict = {}  # the imported module and the no-op log callback (kept alive while llama.cpp may call it)


def llama_cpp_available() -> bool:
    from importlib.util import find_spec

    return find_spec("llama_cpp") is not None


def _llama():
    """llama_cpp, initialised once, its log output silenced (it would mix with streamed text)."""
    if "module" not in _BACKEND:
        try:
            import llama_cpp
        except ImportError:
            raise ValueError(
                "the llamacpp backend needs llama-cpp-python: pip install 'exactspec[llamacpp]' "
                "(it builds llama.cpp for this CPU, about 15 minutes on 2 cores)"
            ) from None
        llama_cpp.llama_backend_init()
        _BACKEND["log"] = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_BACKEND["log"], ctypes.c_void_p(0))
        _BACKEND["module"] = llama_cpp
    return _BACKEND["module"]


def _ggml() -> ctypes.CDLL:
    """ggml's base library as llama-cpp-python ships it, with the four tensor functions the eval callback uses."""
    if "ggml" not in _BACKEND:
        directory = Path(_llama().__file__).parent / "lib"
        found = sorted(directory.glob("*ggml-base*"))
        if not found:
            raise ValueError(f"llama-cpp-python's ggml library is not in {directory}: target features need it")
        lib = ctypes.CDLL(str(found[0]))
        for name, result in (
            ("ggml_get_name", ctypes.c_void_p),
            ("ggml_nrows", ctypes.c_int64),
            ("ggml_nbytes", ctypes.c_size_t),
            ("ggml_nelements", ctypes.c_int64),
        ):
            getattr(lib, name).restype, getattr(lib, name).argtypes = result, [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        _BACKEND["ggml"] = lib
    return _BACKEND["ggml"]


class _FeatureCapture:
    """The outputs of target layers copied out of llama.cpp's graph as it computes them (``cb_eval``).

    llama.cpp asks the callback about each node (``ask`` true: do you want this one?) and, for a wanted node, calls
    it again once the node's data is computed. A callback that returns false on the second call stops the graph, so
    an exception here is kept and raised after the decode instead of being lost inside C."""

    def __init__(self, layers: Sequence[int]) -> None:
        self.layers = tuple(layers)
        self._index = {f"l_out-{layer}".encode(): k for k, layer in enumerate(self.layers)}
        self._chunks: list[list[np.ndarray]] = [[] for _ in self.layers]
        self._name_offset: int | None = None  # of the name inside ggml's tensor struct, read once from ggml_get_name
        self._error: BaseException | None = None
        self.callback = _llama().ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, tensor: int, ask: bool, user_data) -> bool:
        try:
            ggml = _ggml()
            if self._name_offset is None:
                self._name_offset = ggml.ggml_get_name(tensor) - tensor
            k = self._index.get(ctypes.string_at(tensor + self._name_offset))
            if ask:
                return k is not None
            if k is None:
                return True
            rows, size = ggml.ggml_nrows(tensor), ggml.ggml_nbytes(tensor)
            if size != 4 * ggml.ggml_nelements(tensor):
                raise RuntimeError(f"llama.cpp's layer output l_out-{self.layers[k]} is not float32")
            out = np.empty((rows, size // 4 // rows), dtype=np.float32)  # (micro-batch tokens, C)
            ggml.ggml_backend_tensor_get(tensor, out.ctypes.data, 0, size)
            self._chunks[k].append(out)
        except BaseException as error:  # noqa: BLE001 - raised again by take()
            self._error = self._error or error
        return True

    def clear(self) -> None:
        self._chunks, self._error = [[] for _ in self.layers], None

    def take(self, tokens: int) -> torch.Tensor:  # (tokens, len(layers) C)
        """The features of the last decode's ``tokens`` positions, layers concatenated in order; the chunks cleared."""
        chunks, error = self._chunks, self._error
        self.clear()
        if error is not None:
            raise RuntimeError(f"copying the target's features out of llama.cpp failed: {error}") from error
        layers = [np.concatenate(c) if c else np.empty((0, 0), np.float32) for c in chunks]
        if any(layer.shape[0] != tokens for layer in layers):
            raise RuntimeError(
                f"llama.cpp computed {[layer.shape[0] for layer in layers]} rows of layers {self.layers} "
                f"for {tokens} tokens (a graph without these layer names?)"
            )
        return torch.from_numpy(np.concatenate(layers, axis=1))


def llama_cpp_version() -> dict:
    """llama-cpp-python's version and the CPU features its llama.cpp build uses."""
    llama = _llama()
    return {"version": llama.__version__, "system_info": llama.llama_print_system_info().decode().strip()}


def requantize(source: str | Path, out: str | Path, ftype: str, threads: int | None = None) -> Path:
    """A copy of GGUF file ``source`` at ``out`` with its weights requantized by llama.cpp's own quantizer
    (``ftype``: a name of llama.cpp's file types such as Q8_0, Q4_0, Q4_K_M, F16). The model's numbers change with
    the format: for measurement, and for trying formats other than the one a file ships in."""
    llama = _llama()
    code = (
        getattr(llama, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
        if ftype.upper() not in ("F32", "ALL_F32")
        else llama.LLAMA_FTYPE_ALL_F32
    )
    if code is None:
        known = sorted(n.removeprefix("LLAMA_FTYPE_MOSTLY_") for n in dir(llama) if n.startswith("LLAMA_FTYPE_MOSTLY_"))
        raise ValueError(f"unknown llama.cpp file type {ftype!r}; choose one of {', '.join(known)}")
    params = llama.llama_model_quantize_default_params()
    params.ftype, params.allow_requantize, params.nthread = code, True, threads or torch.get_num_threads()
    if llama.llama_model_quantize(str(source).encode(), str(out).encode(), ctypes.byref(params)) != 0:
        Path(out).unlink(missing_ok=True)  # nothing half-written
        raise ValueError(f"llama.cpp could not requantize {source} to {ftype}")
    return Path(out)


class _Weights:
    """A loaded GGUF file (``llama_model``), shared by every context made over it and freed with the last."""

    def __init__(self, path: Path, device: torch.device, extra_buffers: bool | None = None) -> None:
        llama = _llama()
        params = llama.llama_model_default_params()
        params.n_gpu_layers = (
            0 if device.type == "cpu" else 999
        )  # all layers on the accelerator llama.cpp was built for
        if (
            extra_buffers is None and device.type == "cpu"
        ):  # probed where llama.cpp's AMX kernels could crash this process
            extra_buffers = extra_buffers_work(
                path, Path(llama.__file__).parent / "lib", llama.llama_print_system_info().decode()
            )
        if extra_buffers is not None:
            params.use_extra_bufts = extra_buffers
        self.handle = llama.llama_model_load_from_file(str(path).encode(), params)
        if not self.handle:
            raise ValueError(f"llama.cpp could not load {path} (not a GGUF model file of an architecture it knows?)")
        weakref.finalize(self, llama.llama_model_free, self.handle)
        self.path = path
        self.vocab_size = int(llama.llama_vocab_n_tokens(llama.llama_model_get_vocab(self.handle)))
        self.context_length = int(llama.llama_model_n_ctx_train(self.handle))


class LlamaCppRuntime:
    """``slots`` sequences of up to ``max_len`` positions each, decoded by llama.cpp (see the module docstring).
    ``extra_buffers``: the weights in llama.cpp's extra buffers (its repacked layouts and AMX kernels) or not; None
    (the default) takes them unless they crash this process (:mod:`exactspec.models.llamacpp_tiles`)."""

    invariant = False

    def __init__(
        self,
        path: str | Path | _Weights,
        slots: int = 1,
        max_len: int | None = None,
        threads: int | None = None,
        device: str | torch.device = "cpu",
        vocab_size: int | None = None,
        split_cache: bool = False,
        extra_buffers: bool | None = None,
    ) -> None:
        self.device = torch.device(device)
        self.weights = path if isinstance(path, _Weights) else _Weights(Path(path), self.device, extra_buffers)
        if slots < 1:
            raise ValueError(f"a runtime needs at least one slot, got {slots}")
        self.slots = slots
        self.split_cache = split_cache  # a KV stream per slot (the module docstring)
        self.max_len = min(max_len or self.weights.context_length, self.weights.context_length)
        self.max_batched_row = MAX_BATCHED_ROW
        self.threads = threads or torch.get_num_threads()
        self._capture: _FeatureCapture | None = None
        self._every_row = False  # the last layer is captured: llama.cpp must compute it (and logits) at every position
        self._free_context: weakref.finalize | None = None
        self.last_features: list[torch.Tensor] = []  # per row of the last call, (t_i, F), when capture_features asked
        self._lengths = [0] * slots
        self._ctx = None
        self._vocab_size = check_output_rows(self.weights.vocab_size, vocab_size)  # padding rows cut
        self._make_context()  # here, not in the first call, which a user times

    def _make_context(self) -> None:
        """llama.cpp's context for the slots, with the feature capture's callback where features are asked for. A
        context made again (features asked for after the slots were used) takes over each slot's cached positions
        (llama.cpp's per-sequence state, copied)."""
        llama, slots = _llama(), self.slots
        params = llama.llama_context_default_params()
        params.n_ctx = slots * self.max_len
        params.n_batch = params.n_ctx  # one call may feed every slot its whole prompt
        params.n_ubatch = min(512, params.n_ctx)
        params.n_seq_max = slots
        params.kv_unified = not self.split_cache
        params.n_threads = params.n_threads_batch = self.threads
        params.no_perf = True
        if self._capture is not None:
            params.cb_eval = self._capture.callback
        context = llama.llama_init_from_model(self.weights.handle, params)
        if not context:
            raise ValueError(
                f"llama.cpp could not make a context of {slots} x {self.max_len} positions for {self.weights.path}"
            )
        if self._ctx is not None:
            for slot, length in enumerate(self._lengths):
                if length:
                    size = llama.llama_state_seq_get_size(self._ctx, slot)
                    state = (ctypes.c_uint8 * size)()
                    if (
                        llama.llama_state_seq_get_data(self._ctx, state, size, slot) != size
                        or llama.llama_state_seq_set_data(context, state, size, slot) == 0
                    ):
                        llama.llama_free(context)
                        raise RuntimeError(
                            f"llama.cpp could not move slot {slot}'s {length} positions to a new context"
                        )
            self._free_context()  # the context it replaces
        self._ctx, self._free_context = context, weakref.finalize(self, llama.llama_free, context)
        self._memory = llama.llama_get_memory(self._ctx)

    @classmethod
    def like(
        cls,
        model: LlamaCppModel,
        slots: int,
        max_len: int | None = None,
        split_cache: bool = False,
    ) -> LlamaCppRuntime:
        """A runtime of ``slots`` slots over the same loaded file, threads and vocabulary cut as ``model`` (weights
        loaded once)."""
        return cls(
            model.runtime.weights,
            slots,
            max_len or model.max_len,
            model.runtime.threads,
            model.runtime.device,
            model.vocab_size,
            split_cache,
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def lengths(self) -> list[int]:
        return list(self._lengths)

    def set_threads(self, threads: int) -> None:
        self.threads = threads
        _llama().llama_set_n_threads(self._ctx, threads, threads)

    def capture_features(self, layers: Sequence[int]) -> None:
        """Keep the outputs of ``layers`` (concatenated in layer order) for every row of each call, as
        ``last_features`` (see the module docstring). The context is made again with the callback."""
        layers = tuple(layers)
        if layers and self.split_cache:
            raise ValueError(
                "target features are captured only in the unified cache (split_cache=False): llama.cpp "
                "reorders the rows of a split cache's batch"
            )
        if self._capture is not None and self._capture.layers == layers:
            return
        n_layers = int(_llama().llama_model_n_layer(self.weights.handle))
        bad = [i for i in layers if not 0 <= i < n_layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in a {n_layers}-layer target")
        self._capture = _FeatureCapture(layers) if layers else None
        self._every_row = n_layers - 1 in layers
        self._make_context()

    def forward(
        self, rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """``rows``: (slot, tokens to append) per sequence, slots distinct. Returns the logits of each row's last
        ``outputs[i]`` positions (every position without ``outputs``), float32 on the CPU, and advances each slot's
        length by ``t_i``. llama.cpp computes logits only where asked, and the last layer only for those positions;
        while the last layer's output is a captured feature every position is computed, and the logits are cut to
        ``outputs`` afterwards (EAGLE-3's layers end before the last, so its drafts do not pay for this)."""
        llama = _llama()
        slots = [slot for slot, _ in rows]
        ids = [check_token_ids(tokens, self.vocab_size) for _, tokens in rows]
        counts = outputs_per_row(rows, outputs)
        check_rows(slots, [len(t) for t in ids], self._lengths, self.max_len)
        computed = [len(t) for t in ids] if self._every_row else counts  # logits llama.cpp computes per row
        total = sum(len(t) for t in ids)
        # a split cache computes consecutive slots together only when the batch holds them in slot order
        order = sorted(range(len(rows)), key=slots.__getitem__) if self.split_cache else range(len(rows))
        batch = llama.llama_batch_init(total, 0, 1)
        try:
            i = 0
            for slot, tokens, wanted in ((slots[r], ids[r], computed[r]) for r in order):
                start = self._lengths[slot]
                for offset, token in enumerate(tokens):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, start + offset, 1
                    batch.seq_id[i][0], batch.logits[i] = slot, offset >= len(tokens) - wanted
                    i += 1
            batch.n_tokens = total
            if self._capture is not None:
                self._capture.clear()  # nothing left from a decode that failed
            status = llama.llama_decode(self._ctx, batch)
            if status != 0:
                for slot in slots:  # what the failed decode wrote past each slot's length stays in no slot
                    llama.llama_memory_seq_rm(self._memory, slot, self._lengths[slot], -1)
                raise RuntimeError(f"llama_decode failed with status {status} on {total} tokens in {len(rows)} rows")
            logits = torch.empty((0, self.vocab_size))  # (sum(computed), V): copied, llama.cpp reuses its buffer
            if sum(computed):
                found = np.ctypeslib.as_array(
                    llama.llama_get_logits(self._ctx), shape=(sum(computed), self.weights.vocab_size)
                )
                logits = torch.from_numpy(found[:, : self.vocab_size].copy())
            features = self._capture.take(total) if self._capture is not None else None  # (total, F)
        finally:
            llama.llama_batch_free(batch)
        self.last_features = list(features.split([len(t) for t in ids])) if features is not None else []
        for slot, tokens in zip(slots, ids):
            self._lengths[slot] += len(tokens)
        by_row = dict(zip(order, logits.split([computed[r] for r in order])))
        return [by_row[r][len(by_row[r]) - count :] for r, count in enumerate(counts)]

    def rollback(self, slot: int, length: int) -> None:
        check_rollback_length(length, self._lengths[slot])
        if length < self._lengths[slot]:
            _llama().llama_memory_seq_rm(self._memory, slot, length, -1)
            self._lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        check_rollback_length(length, self._lengths[source])
        if slot == source:
            return self.rollback(slot, length)
        llama = _llama()
        llama.llama_memory_seq_rm(self._memory, slot, 0, -1)
        if length and self.split_cache:
            llama.llama_memory_seq_cp(self._memory, source, slot, -1, -1)  # a stream is copied whole
            llama.llama_memory_seq_rm(self._memory, slot, length, -1)
        elif length:
            llama.llama_memory_seq_cp(self._memory, source, slot, 0, length)
        self._lengths[slot] = length


class LlamaCppModel(OneSlot):
    """One sequence on llama.cpp: slot 0 of a :class:`LlamaCppRuntime` of one slot (the single-sequence protocol)."""

    invariant = False
    precision = "llama.cpp: the GGUF file's weights as stored, float32 activations, float16 KV cache"

    def __init__(self, runtime: LlamaCppRuntime) -> None:
        if runtime.slots != 1:
            raise ValueError("LlamaCppModel is one sequence: give it a runtime of one slot")
        self.runtime = runtime
        self.device = runtime.device

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        max_len: int | None = None,
        threads: int | None = None,
        device: str | torch.device = "cpu",
        vocab_size: int | None = None,
    ) -> LlamaCppModel:
        """``path`` on llama.cpp, its logits cut to ``vocab_size`` rows (the tokenizer's real vocabulary)."""
        return cls(LlamaCppRuntime(path, 1, max_len, threads, device, vocab_size))

    @property
    def threads(self) -> int:
        return self.runtime.threads

    def set_threads(self, threads: int) -> None:
        self.runtime.set_threads(threads)

    def __repr__(self) -> str:
        return (
            f"LlamaCppModel({self.runtime.weights.path.name}, {self.runtime.threads} threads, max_len={self.max_len})"
        )


def probe_extra_buffers(model: str) -> None:
    """The child of :func:`exactspec.models.llamacpp_tiles.probe_command`: ``model`` loaded with llama.cpp's extra
    buffers, a batched decode, a torch bfloat16 product of a size that takes oneDNN's AMX kernel where there is one,
    and the decode again (a crash is the verdict)."""
    runtime = LlamaCppRuntime(model, slots=1, max_len=PROBE_TOKENS, threads=1, extra_buffers=True)
    for _ in range(2):
        runtime.rollback(0, 0)
        runtime.forward([(0, [i % runtime.vocab_size for i in range(PROBE_TOKENS)])], [1])
        torch.ones(256, 576, dtype=torch.bfloat16) @ torch.ones(576, 1536, dtype=torch.bfloat16)
