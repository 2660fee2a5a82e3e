"""The lean torch runtime: a :class:`LlamaDecoder` over one :class:`KVCache` of several sequences.

:class:`LeanRuntime` implements :class:`exactspec.models.runtime.Runtime` for ``slots`` sequences of up to
``max_len`` positions. One :meth:`LeanRuntime.forward` feeds each of several slots its own tokens (1 for a plain
step, gamma + 1 for a speculative block, a whole prompt for a prefill), under ``torch.inference_mode`` and with
no Python work per token:

* one row runs against its slot of the cache unpadded (the head only on the positions whose logits are asked
  for; one position of a bfloat16 model on the CPU through a float16 copy of the head,
  :func:`exactspec.models.llama.one_row_head`);
* several rows are right-padded to the longest and run as one batch: every row reads its own positions' rotary
  angles and attends to its own slot only, through a mask that stops at each query's position
  (:func:`exactspec.models.attention.grouped_attention`). Padding rows compute garbage that is never returned;
  their keys land past the row's length, where no query looks before a real token overwrites them;
* ``invariant=True``: every row runs alone, and a call of up to ``INVARIANT_ROWS`` tokens runs its matmuls at
  exactly that many rows with fixed-shape attention chunks (:meth:`exactspec.models.llama.Block.forward_invariant`);
  a longer one (a prompt) runs as consecutive calls of that size, so a position's logits and cache entries are the
  same bits whatever the calls that computed them and whatever else the batch holds (a prefix copied from another
  sequence's cache included).

Numerics outside the invariant mode: a sequence's logits are computed by the same operations whatever the call,
but matrix kernels given more rows may round the low-order bits differently; speculative output still follows
the law of the logits each call returns.

:class:`LeanModel` is one sequence (a :class:`exactspec.models.base.LanguageModel`): slot 0 of a runtime of one
slot. It loads Hugging Face directories and GGUF files (:meth:`LeanModel.from_pretrained`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from ..vocab import check_output_rows
from .attention import causal_mask, grouped_attention, ragged_causal_mask
from .base import check_token_ids, is_gguf, read_json
from .gguf import hf_state_dict as gguf_state_dict
from .gguf import llama_config, read_gguf
from .kv_cache import MAX_BLOCK, KVCache, slot_rows
from .llama import INVARIANT_ROWS, LlamaDecoder, cache_dtype, load_hf_state_dict, one_row_head
from .llama_config import LlamaConfig, rope_tables
from .quantized import use_q4_weights
from .runtime import OneSlot, outputs_per_row

__all__ = ["LeanModel", "LeanRuntime", "WEIGHT_FORMATS"]

WEIGHT_FORMATS = ("auto", "dense", "q4")


class LeanRuntime:
    """``slots`` sequences of one decoder in one KV cache (the :class:`~exactspec.models.runtime.Runtime` protocol).

    Logits come back float32 on the CPU, ``(t_i, V)`` per row, cut to ``vocab_size`` (the tokenizer's, when the
    embedding has padding rows)."""

    def __init__(
        self,
        decoder: LlamaDecoder,
        slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        vocab_size: int | None = None,
        invariant: bool = False,
    ) -> None:
        cfg = decoder.cfg
        self.decoder, self.cfg, self.invariant = decoder, cfg, invariant
        self.vocab_size = check_output_rows(cfg.vocab_size, vocab_size)
        self.device, self.dtype = torch.device(device), decoder.norm.dtype
        self.cache = KVCache(
            cfg.num_hidden_layers,
            slots,
            cfg.num_key_value_heads,
            cfg.head_size,
            max_len,
            cache_dtype(self.dtype, self.device),
            self.device,
        )
        self.slots, self.max_len, self.max_batched_row = slots, max_len, MAX_BLOCK
        cos, sin = rope_tables(cfg, max_len + MAX_BLOCK)
        self._cos = cos.to(self.device, self.dtype)  # (max_len + MAX_BLOCK, hd)
        self._sin = sin.to(self.device, self.dtype)
        self.one_token_head = None if invariant else one_row_head(decoder, self.device)  # (V, C) float16, or None
        self._layers = list(decoder.layers)  # iterating a ModuleList costs more per call
        self.feature_layers: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] = []  # per row of the last call, (t_i, F), when capture_features asked

    @classmethod
    def like(cls, model: LeanModel, slots: int, max_len: int | None = None) -> LeanRuntime:
        """A runtime over ``model``'s decoder (weights shared, not copied), in ``model``'s numerics mode and
        vocabulary."""
        return cls(
            model.decoder,
            slots,
            min(max_len or model.max_len, model.max_len),
            model.device,
            model.vocab_size,
            model.invariant,
        )

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def capture_features(self, layers: Sequence[int]) -> None:
        """Keep the outputs of ``layers`` (concatenated in layer order) for every row of each call, as
        ``last_features``: what a feature-level draft reads (:mod:`exactspec.models.eagle`)."""
        bad = [i for i in layers if not 0 <= i < self.cfg.num_hidden_layers]
        if bad:
            raise ValueError(f"feature layers {bad} do not exist in a {self.cfg.num_hidden_layers}-layer target")
        self.feature_layers = tuple(layers)

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        self.cache.copy_prefix(source, slot, length)

    def forward(
        self, rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        """``rows``: (slot, tokens to append) per sequence, slots distinct. Returns the logits of each row's last
        ``outputs[i]`` positions ``(outputs_i, V)`` (every position without ``outputs``) and advances each slot's
        length by ``t_i``. The head runs only on those positions, except in the invariant mode, where it runs on
        the call's fixed rows and the logits are cut afterwards."""
        slots = [slot for slot, _ in rows]
        ids = [check_token_ids(tokens, self.vocab_size) for _, tokens in rows]
        counts = outputs_per_row(rows, outputs)
        self.cache.check_rows(slots, [len(t) for t in ids])
        with torch.inference_mode():
            if len(rows) == 1 or self.invariant:
                outputs = [self._forward_one(slot, tokens, count) for slot, tokens, count in zip(slots, ids, counts)]
            else:
                outputs = self._forward_ragged(slots, ids, counts)
        self.last_features = [features for _, features in outputs] if self.feature_layers else []
        if self.vocab_size < self.cfg.vocab_size:  # padding rows of the embedding
            outputs = [(logits[:, : self.vocab_size], features) for logits, features in outputs]
        return [logits.float().cpu() for logits, _ in outputs]

    def _forward_one(
        self, slot: int, ids: list[int], count: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # (count, V), (t, F)
        """One sequence's call against its slot, unpadded (or at INVARIANT_ROWS rows in the invariant mode); the
        logits of its last ``count`` positions."""
        if self.invariant and len(ids) > INVARIANT_ROWS:
            return self._forward_pieces(slot, ids, count)
        pos, t = self.cache.lengths[slot], len(ids)
        fixed = self.invariant and t <= INVARIANT_ROWS
        rows = INVARIANT_ROWS if fixed else t
        idx = torch.tensor(ids + [0] * (rows - t), dtype=torch.long, device=self.device).unsqueeze(0)  # (1, R)
        cos, sin = self._cos[pos : pos + rows], self._sin[pos : pos + rows]  # (R, hd); padding rows: any angle
        x = self.decoder.embed(idx)  # (1, R, C)
        mask = None if fixed or t == 1 else causal_mask(pos, t, self.device)
        features = []
        for i, layer in enumerate(self._layers):
            keys, values = self.cache.slot(i, slot)  # (1, nkv, capacity, hd) x 2
            if fixed:
                x = layer.forward_invariant(x, cos, sin, keys, values, pos, t)
            else:
                x = layer.forward_cached(x, cos, sin, keys, values, pos, mask)
            if i in self.feature_layers:
                features.append(x[0, :t])
        if self.invariant:  # the head runs at the call's fixed row count too
            logits = self.decoder.logits(x)[0, t - count : t]  # (count, V)
        elif count == 1 and self.one_token_head is not None:
            logits = F.linear(self.decoder.final_norm(x[:, t - 1 : t]).to(torch.float16), self.one_token_head)[
                0
            ]  # (1, V)
        else:
            logits = self.decoder.logits(x[:, t - count : t])[0]  # (count, V)
        self.cache.lengths[slot] = pos + t
        return logits, torch.cat(features, dim=-1) if features else None

    def _forward_pieces(
        self, slot: int, ids: list[int], count: int
    ) -> tuple[torch.Tensor, torch.Tensor | None]:  # (count, V), (t, F)
        """A call longer than INVARIANT_ROWS in the invariant mode (a prompt) as consecutive calls of at most that
        many tokens: every position then gets the bits any other split gives it, so a prefix copied from another
        sequence's cache holds the bits this prompt's own prefill would."""
        logits, features = [], []
        for start in range(0, len(ids), INVARIANT_ROWS):
            piece = ids[start : start + INVARIANT_ROWS]
            after = len(ids) - start - len(piece)  # positions of the call after this piece
            piece_logits, piece_features = self._forward_one(slot, piece, min(len(piece), max(0, count - after)))
            logits.append(piece_logits)
            features.append(piece_features)
        return torch.cat(logits), None if features[0] is None else torch.cat(features)

    def _forward_ragged(
        self, slots: list[int], ids: list[list[int]], counts: list[int]
    ) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Several sequences' rows right-padded into one batch; the logits of each row's last ``counts[i]``
        positions ``(counts_i, V)``, and its features."""
        width = max(len(t) for t in ids)
        if width > MAX_BLOCK:
            raise ValueError(f"a batched call feeds at most {MAX_BLOCK} tokens per row; prefill long prompts alone")
        order = sorted(range(len(slots)), key=slots.__getitem__)  # by slot: consecutive slots read the cache as a view
        slots, ids, counts = [slots[i] for i in order], [ids[i] for i in order], [counts[i] for i in order]
        device = self.device
        batch = torch.tensor([t + [0] * (width - len(t)) for t in ids], device=device)  # (B, T)
        start = torch.tensor([self.cache.lengths[s] for s in slots], device=device)  # (B,)
        positions = start[:, None] + torch.arange(width, device=device)  # (B, T)
        end = int(positions.max()) + 1
        index, rows = torch.tensor(slots, device=device), slot_rows(slots, device)
        mask = ragged_causal_mask(positions, end)
        cos, sin = self._cos[positions], self._sin[positions]  # (B, T, hd)
        x = self.decoder.embed(batch)  # (B, T, C)
        features = []
        for i, layer in enumerate(self._layers):
            q, k, v = layer.qkv(x, cos, sin)  # (B, nh, T, hd), (B, nkv, T, hd) x 2
            self.cache.write(i, index, positions, k, v)
            keys, values = self.cache.read(i, rows, end)  # (B, nkv, end, hd)
            x = layer.finish(x, grouped_attention(q.to(keys.dtype), keys, values, mask).to(x.dtype))
            if i in self.feature_layers:
                features.append(x)
        wanted = [(b, i) for b, (t, count) in enumerate(zip(ids, counts)) for i in range(len(t) - count, len(t))]
        rows_at, positions_at = (
            (torch.tensor(v, dtype=torch.long, device=device) for v in zip(*wanted)) if wanted else (None, None)
        )
        logits = (
            self.decoder.logits(x[rows_at, positions_at]) if wanted else x.new_empty((0, self.cfg.vocab_size))
        )  # (sum(counts), V)
        feature = torch.cat(features, dim=-1) if features else None  # (B, T, F)
        for slot, tokens in zip(slots, ids):
            self.cache.lengths[slot] += len(tokens)
        by_slot = [
            (part, None if feature is None else feature[b, : len(t)])
            for b, (t, part) in enumerate(zip(ids, logits.split(counts)))
        ]
        return [by_slot[b] for b in torch.argsort(torch.tensor(order)).tolist()]  # back to the call's row order


class LeanModel(OneSlot):
    """One sequence of a :class:`LlamaDecoder` (a :class:`~exactspec.models.base.LanguageModel`): slot 0 of a
    :class:`LeanRuntime` of one slot.

    ``max_len`` (default: ``max_position_embeddings``) bounds prompt + generated tokens; exceeding it raises
    ``ValueError``. Logits are float32 CPU tensors ``(n, V)`` whatever the compute dtype and device, cut to
    ``vocab_size`` rows (the tokenizer's real vocabulary; None: every row of the head).
    """

    def __init__(
        self,
        decoder: LlamaDecoder,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: torch.dtype | None = None,
        invariant: bool = False,
        vocab_size: int | None = None,
    ) -> None:
        if dtype is not None:
            decoder = decoder.to(dtype=dtype)
        self.runtime = LeanRuntime(
            decoder.to(device).eval(),
            1,
            int(max_len or decoder.cfg.max_position_embeddings),
            device,
            vocab_size,
            invariant,
        )
        self.decoder, self.cfg, self.dtype, self.device = decoder, decoder.cfg, self.runtime.dtype, self.runtime.device
        self.invariant = invariant

    @classmethod
    def from_pretrained(
        cls,
        path: str | Path,
        dtype: torch.dtype = torch.float32,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        weights: str = "auto",
        invariant: bool = False,
        vocab_size: int | None = None,
    ) -> LeanModel:
        """Load a local Hugging Face Llama directory (``config.json`` + ``model.safetensors``, or shards listed
        in ``model.safetensors.index.json``) or a Llama ``.gguf`` file (:mod:`exactspec.models.gguf`).

        ``weights``: ``dense`` (every weight dequantized to ``dtype``), ``q4`` (a GGUF file's 4-bit projections
        kept as stored and run by torch's int4 CPU kernel, :mod:`exactspec.models.quantized`; bfloat16 on CPU), or
        ``auto``: ``q4`` where it can run (a GGUF file with 4-bit projections, bfloat16, CPU), else ``dense``.
        ``invariant``: call-size-invariant numerics (:meth:`Block.forward_invariant`). ``vocab_size``: the rows
        the logits keep (the tokenizer's real vocabulary).
        """
        path = Path(path)
        gguf_file = read_gguf(path) if is_gguf(path) else None
        if weights not in WEIGHT_FORMATS:  # checked before anything is read
            raise ValueError(f"unknown weights format {weights!r}; choose one of {', '.join(WEIGHT_FORMATS)}")
        q4_possible = gguf_file is not None and dtype == torch.bfloat16 and torch.device(device).type == "cpu"
        if weights == "auto":
            weights = (
                "q4"
                if q4_possible and any(t.type_name in ("Q4_0", "Q4_1") for t in gguf_file.tensors.values())
                else "dense"
            )
        if weights == "q4" and not q4_possible:
            raise ValueError(
                "--weights q4 needs a .gguf checkpoint, --dtype bfloat16 and the CPU (torch's int4 kernel)"
            )
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
        return cls(decoder, max_len=max_len, device=device, dtype=dtype, invariant=invariant, vocab_size=vocab_size)

    # -- protocol ---------------------------------------------------------------------------
    def copy_prefix(self, source: LeanModel, length: int) -> None:
        """Hold the first ``length`` cached positions of ``source`` (a model over the same decoder), copied: a prompt
        that several sequences share is prefilled once."""
        if source.decoder is not self.decoder:
            raise ValueError("copy_prefix needs a model over the same decoder")
        self.runtime.cache.copy_prefix(0, 0, length, source.runtime.cache)

    def __repr__(self) -> str:
        c = self.cfg
        return (
            f"LeanModel(layers={c.num_hidden_layers}, hidden={c.hidden_size}, heads={c.num_attention_heads}/"
            f"{c.num_key_value_heads}, vocab={c.vocab_size}, dtype={self.dtype}, max_len={self.max_len})"
        )


# ---- checkpoint files ---------------------------------------------------------------------------


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
        raise FileNotFoundError(
            f"{path} has no model.safetensors or model.safetensors.index.json "
            "(the lean backend reads safetensors; try --backend hf)"
        )
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
