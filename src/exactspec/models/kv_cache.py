"""The KV cache of a torch runtime: keys and values of ``slots`` sequences per layer, the batch a dimension.

One :class:`KVCache` holds, for every layer, a ``(slots, kv_heads, capacity, head_size)`` block of keys and one of
values, and each slot's length. Rolling a slot back moves an integer (nothing is copied or freed, as gpt-fast's
``KVCache``); positions past a slot's length are stale and never read, because every query's mask stops at its own
position. ``capacity`` is ``max_len`` plus ``MAX_BLOCK`` spare positions (padding rows of a full slot land there)
rounded up to whole ``ATTENTION_CHUNK`` chunks (the invariant attention reads whole chunks).

The lean target (:mod:`exactspec.models.lean`, one layer per decoder layer) and the feature-level draft
(:mod:`exactspec.models.feature_runtime`, one layer) keep their keys and values here and nowhere else.
"""

from __future__ import annotations

import torch

from .base import check_rollback_length
from .runtime import check_rows

__all__ = ["ATTENTION_CHUNK", "KVCache", "MAX_BLOCK"]

MAX_BLOCK = 64  # spare positions per slot, so that padding rows of a full sequence still have somewhere to go
ATTENTION_CHUNK = 64  # keys per fixed-shape chunk of the invariant attention


class KVCache:
    def __init__(
        self,
        layers: int,
        slots: int,
        kv_heads: int,
        head_size: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if slots < 1 or max_len < 1:
            raise ValueError(f"need slots >= 1 and max_len >= 1, got {slots} and {max_len}")
        self.slots, self.max_len = slots, max_len
        capacity = -(-(max_len + MAX_BLOCK) // ATTENTION_CHUNK) * ATTENTION_CHUNK
        shape = (layers, slots, kv_heads, capacity, head_size)  # head-major: a run of slots is a strided view
        self.keys = torch.zeros(shape, dtype=dtype, device=device)  # (L, S, nkv, capacity, hd)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.lengths = [0] * slots
        self._views = [
            [(self.keys[layer, slot : slot + 1], self.values[layer, slot : slot + 1]) for layer in range(layers)]
            for slot in range(slots)
        ]  # made once: views stay valid, the tensors are never reallocated

    def check_rows(self, slots: list[int], added: list[int]) -> None:
        """Distinct slots that exist, each with room for the positions a call adds to it."""
        check_rows(slots, added, self.lengths, self.max_len)

    def rollback(self, slot: int, length: int) -> None:
        check_rollback_length(length, self.lengths[slot])
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int, source_cache: KVCache | None = None) -> None:
        """Give ``slot`` the first ``length`` positions of ``source`` (in ``source_cache``, by default this one),
        copied: a prompt that several sequences share is computed once."""
        origin = source_cache or self
        if not 0 <= length <= origin.lengths[source]:
            raise ValueError(f"cannot copy {length} positions of slot {source}: it holds {origin.lengths[source]}")
        with torch.inference_mode():
            self.keys[:, slot, :, :length] = origin.keys[:, source, :, :length]
            self.values[:, slot, :, :length] = origin.values[:, source, :, :length]
        self.lengths[slot] = length

    def slot(self, layer: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:  # (1, nkv, capacity, hd) x 2
        """One slot's keys and values of one layer, as views that a single-sequence call writes into."""
        return self._views[slot][layer]

    def write(
        self, layer: int, slots: torch.Tensor, positions: torch.Tensor, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Store row b's keys and values ``(B, nkv, T, hd)`` at its ``positions[b]`` ``(B, T)`` of slot ``slots[b]``."""
        index = slots[:, None]
        self.keys[layer][index, :, positions] = keys.transpose(1, 2).to(self.keys.dtype)  # indexed as (B, T, nkv, hd)
        self.values[layer][index, :, positions] = values.transpose(1, 2).to(self.values.dtype)

    def read(self, layer: int, rows: slice | torch.Tensor, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``end`` positions of the slots ``rows`` picks (:func:`slot_rows`): ``(B, nkv, end, hd)`` x 2."""
        return self.keys[layer, rows, :, :end], self.values[layer, rows, :, :end]


def slot_rows(slots: list[int], device: torch.device | str) -> slice | torch.Tensor:
    """The index that picks the slots' rows of a cache: a slice (indexing gives a view) when the slots are
    consecutive, as calls run in slot order for this; else an index tensor (indexing copies)."""
    if slots == list(range(slots[0], slots[0] + len(slots))):
        return slice(slots[0], slots[0] + len(slots))
    return torch.tensor(slots, device=device)
