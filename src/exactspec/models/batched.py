"""Several sequences in one KV cache, each with its own length: the lean backend for continuous batching.

:class:`BatchedLean` holds ``slots`` sequences of up to ``max_len`` positions for one :class:`LlamaDecoder`. One
:meth:`BatchedLean.forward` feeds each of several sequences its own tokens (1 for a plain step, gamma + 1 for a
speculative block, a whole prompt for a prefill): the rows are right-padded to the longest, every row reads its
own positions' rotary angles and attends to its own cache only, through a causal mask that stops at each query's
position. Padding rows compute garbage that is never returned; their keys land in the row's own slot past its
length, where no query of that sequence looks before a real token overwrites them. Each sequence rolls back on
its own (:meth:`BatchedLean.rollback`).

Numerics: a sequence's logits in a batch are computed by the same operations as alone, but the matrix kernels
see more rows, so low-order bits may differ from a solo call (as between block sizes in
:class:`exactspec.models.lean.LeanModel`'s default mode). Speculative output still follows the law of the
logits each call returns.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from .base import check_rollback_length, check_token_ids
from .lean import LeanModel, LlamaDecoder, cache_dtype
from .llama_config import rope_tables

__all__ = ["BatchedLean", "MAX_BLOCK", "ragged_causal_mask"]

MAX_BLOCK = 64  # spare positions per slot, so that padding rows of a full sequence still have somewhere to go


def ragged_causal_mask(positions: torch.Tensor, end: int) -> torch.Tensor:  # (B, T) -> (B, 1, T, end) bool
    """Query (b, i) at position ``positions[b, i]`` sees its own sequence's keys at positions up to its own."""
    return (torch.arange(end, device=positions.device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(hd)) v`` over the keys ``mask`` lets each query see, query head h reading key/value head
    ``h // (nh / nkv)`` (grouped-query attention), as two batched matmuls. For the few queries per row of a decoding
    call this is 1.4-1.7x faster on CPU than the fused kernel (B = 32, T = 3, 63-300 keys, float32 and bfloat16).

    q ``(B, nh, T, hd)``; keys, values ``(B, nkv, L, hd)``; mask ``(B, 1, T, L)`` bool. Returns ``(B, nh, T, hd)``."""
    batch, heads, width, head_dim = q.shape
    groups = heads // keys.shape[1]
    grouped = q.reshape(batch, keys.shape[1], groups * width, head_dim)  # row g * T + t: head h = kv * groups + g
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * head_dim**-0.5  # (B, nkv, g T, L)
    scores = scores.float().masked_fill(~mask.repeat(1, 1, groups, 1), -math.inf)
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).reshape(batch, heads, width, head_dim)


def slot_rows(slots: list[int], device: torch.device | str) -> slice | torch.Tensor:
    """The index that picks the slots' rows of a slot cache: a slice (indexing gives a view) when the slots are
    consecutive, as calls run in slot order for this; else an index tensor (indexing copies)."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)


class BatchedLean:
    def __init__(self, decoder: LlamaDecoder, slots: int, max_len: int, device: torch.device | str = "cpu",
                 vocab_size: int | None = None, invariant: bool = False) -> None:
        if slots < 1 or max_len < 1:
            raise ValueError(f"need slots >= 1 and max_len >= 1, got {slots} and {max_len}")
        cfg = decoder.cfg
        self.decoder, self.cfg = decoder, cfg
        self.vocab_size = vocab_size or cfg.vocab_size  # logits beyond it (padding rows of the embedding) are cut
        self.device = torch.device(device)
        self.dtype = decoder.norm.dtype
        self.slots, self.max_len = slots, max_len
        cos, sin = rope_tables(cfg, max_len + MAX_BLOCK)
        self._cos = cos.to(self.device, self.dtype)  # (max_len + MAX_BLOCK, hd)
        self._sin = sin.to(self.device, self.dtype)
        # Head-major: a run of slots' keys is a strided (B, nkv, len, hd) view that attention reads without a copy.
        shape = (cfg.num_hidden_layers, 0 if invariant else slots, cfg.num_key_value_heads, max_len + MAX_BLOCK, cfg.head_size)
        kv_dtype = cache_dtype(self.dtype, self.device)
        self._k = torch.zeros(shape, dtype=kv_dtype, device=self.device)  # (L, S, nkv, len, hd)
        self._v = torch.zeros(shape, dtype=kv_dtype, device=self.device)
        self.lengths = [0] * slots
        self.feature_layers: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] = []  # per row of the last call, (t_i, F), when capture_features asked
        self.invariant = invariant
        # Invariant numerics: each row runs alone through LeanModel's fixed-shape path, on its own cache, so its
        # logits are the bits it gets alone whatever the batch; the batch shares the schedule, not the matmuls.
        self._solo = [LeanModel(decoder, max_len, device, invariant=True) for _ in range(slots)] if invariant else None

    @classmethod
    def like(cls, model: LeanModel, slots: int, max_len: int | None = None, vocab_size: int | None = None) -> "BatchedLean":
        """A batched cache over ``model``'s decoder (weights shared, not copied), in ``model``'s numerics mode."""
        return cls(model.decoder, slots, min(max_len or model.max_len, model.max_len), model.device, vocab_size, model.invariant)

    def capture_features(self, layers: Sequence[int]) -> None:
        """Keep the outputs of ``layers`` for every row of each call (``last_features``): what a feature-level
        draft reads (:mod:`exactspec.models.eagle`)."""
        self.feature_layers = tuple(layers)
        for model in self._solo or []:
            model.capture_features(layers)

    def rollback(self, slot: int, length: int) -> None:
        check_rollback_length(length, self.lengths[slot])
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Give ``slot`` the first ``length`` cached positions of ``source`` (the same values, copied): a prompt that
        several sequences share is prefilled once."""
        check_rollback_length(length, self.lengths[source])
        if self._solo is not None:
            self._solo[slot].copy_prefix(self._solo[source], length)
        else:
            with torch.inference_mode():
                self._k[:, slot, :, :length] = self._k[:, source, :, :length]  # (L, S, nkv, len, hd)
                self._v[:, slot, :, :length] = self._v[:, source, :, :length]
        self.lengths[slot] = length

    def forward(self, rows: Sequence[tuple[int, Sequence[int]]]) -> list[torch.Tensor]:
        """``rows``: (slot, tokens to append) per sequence, slots distinct. Returns each row's logits ``(t_i, V)``
        (float32, CPU) and advances each slot's length by ``t_i``."""
        slots = [slot for slot, _ in rows]
        if len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise ValueError(f"rows need distinct slots in [0, {self.slots}), got {slots}")
        ids = [check_token_ids(tokens, self.vocab_size) for _, tokens in rows]
        lengths = [len(t) for t in ids]
        for slot, t in zip(slots, lengths):
            if self.lengths[slot] + t > self.max_len:
                raise ValueError(f"sequence too long: {self.lengths[slot]} cached + {t} new tokens exceeds {self.max_len} positions")
        width = max(lengths)
        if width > MAX_BLOCK and len(rows) > 1:
            raise ValueError(f"a batched call feeds at most {MAX_BLOCK} tokens per row; prefill long prompts alone")
        if self._solo is not None:
            out = [self._forward_alone(slot, tokens) for slot, tokens in zip(slots, ids)]
            self.last_features = [self._solo[slot].last_features for slot in slots] if self.feature_layers else []
            return out
        order = sorted(range(len(rows)), key=slots.__getitem__)  # by slot: consecutive slots read the cache as a view
        with torch.inference_mode():
            logits, features = self._forward([slots[i] for i in order], [ids[i] for i in order], width)
        place = torch.argsort(torch.tensor(order)).tolist()  # row i of the call is row place[i] of the outputs
        self.last_features = [features[place[i], :t] for i, t in enumerate(lengths)] if features is not None else []
        for slot, t in zip(slots, lengths):
            self.lengths[slot] += t
        return [logits[place[i], :t, : self.vocab_size].float().cpu() for i, t in enumerate(lengths)]

    def _forward_alone(self, slot: int, tokens: list[int]) -> torch.Tensor:  # (t, V)
        model = self._solo[slot]
        model.rollback(self.lengths[slot])  # never above the model's own length: slots only roll back
        logits = model.forward(tokens)
        self.lengths[slot] = model.length
        return logits[:, : self.vocab_size]

    def _forward(self, slots: list[int], ids: list[list[int]], width: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits ``(B, T, V)`` and the captured layers' outputs ``(B, T, F)`` (None when none are asked for)."""
        device = self.device
        batch = torch.tensor([t + [0] * (width - len(t)) for t in ids], device=device)  # (B, T)
        start = torch.tensor([self.lengths[s] for s in slots], device=device)  # (B,)
        positions = start[:, None] + torch.arange(width, device=device)  # (B, T)
        end = int(positions.max()) + 1
        index, rows = torch.tensor(slots, device=device), slot_rows(slots, device)
        mask = ragged_causal_mask(positions, end)
        cos, sin = self._cos[positions], self._sin[positions]  # (B, T, hd)
        x = self.decoder.embed(batch)  # (B, T, C)
        features = []
        for i, layer in enumerate(self.decoder.layers):
            q, k, v = layer.qkv(x, cos, sin)  # (B, nh, T, hd), (B, nkv, T, hd) x 2
            self._k[i][index[:, None], :, positions] = k.transpose(1, 2).to(self._k.dtype)  # indexed as (B, T, nkv, hd)
            self._v[i][index[:, None], :, positions] = v.transpose(1, 2).to(self._v.dtype)
            keys, values = self._k[i, rows, :, :end], self._v[i, rows, :, :end]  # (B, nkv, end, hd)
            y = grouped_attention(q.to(keys.dtype), keys, values, mask)  # (B, nh, T, hd)
            x = layer.finish(x, y.to(x.dtype))
            if i in self.feature_layers:
                features.append(x)
        logits = self.decoder.lm_head(self.decoder.final_norm(x))  # (B, T, V)
        return logits, torch.cat(features, dim=-1) if features else None
