"""Several sequences' feature-level drafts (:mod:`.eagle`) in one slot cache: the draft side of continuous batching.

:class:`BatchedFeatureDraft` is to :class:`exactspec.models.eagle.FeatureDraftRunner` what
:class:`exactspec.models.batched.BatchedLean` is to a lean model: one call feeds each of several sequences its own
slots (the target's new features at a round's first draft step, the draft's own output after that), right-padded,
each row with its own rotary positions and a causal mask that stops at its own length, so padding and another
sequence's keys are never read. Each slot rolls back on its own.

Numerics: as in :mod:`.batched`, a row's result matches its solo computation up to the low-order bits of batched
matrix kernels. With ``invariant=True`` every row runs alone through its own :class:`FeatureDraftRunner`, so it gets
the solo bits whatever the batch (the target's invariant mode keeps its promise with a feature-level draft).
"""

from __future__ import annotations

from typing import Sequence

import torch

from .batched import MAX_BLOCK, grouped_attention, ragged_causal_mask, slot_rows
from .eagle import FeatureDraft, FeatureDraftRunner
from .lean import cache_dtype

__all__ = ["BatchedFeatureDraft"]


class BatchedFeatureDraft:
    def __init__(self, draft: FeatureDraft, slots: int, max_len: int, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, invariant: bool = False) -> None:
        self.draft = draft.to(device=device, dtype=dtype).eval()
        self.device, self.dtype = torch.device(device), dtype
        self.slots, self.max_len = slots, max_len
        cfg = draft.cfg.layer_config()
        shape = (0 if invariant else slots, cfg.num_key_value_heads, max_len + MAX_BLOCK, cfg.head_size)  # head-major, as BatchedLean
        self._k = torch.zeros(shape, dtype=cache_dtype(dtype, self.device), device=self.device)  # (S, nkv, len, hd)
        self._v = torch.zeros_like(self._k)
        self._cos = draft.rope_cos[: max_len + MAX_BLOCK].to(self.device, dtype)
        self._sin = draft.rope_sin[: max_len + MAX_BLOCK].to(self.device, dtype)
        self.lengths = [0] * slots
        self._solo = [FeatureDraftRunner(draft, max_len, device, dtype, invariant=True) for _ in range(slots)] if invariant else None

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll draft slot {slot} back to {length} (it holds {self.lengths[slot]})")
        self.lengths[slot] = length

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Give ``slot`` the first ``length`` slots of ``source`` (copied): a prompt sequences share is drafted once."""
        if not 0 <= length <= self.lengths[source]:
            raise ValueError(f"cannot copy {length} slots of draft slot {source} (it holds {self.lengths[source]})")
        if self._solo is not None:
            self._solo[slot].copy_prefix(self._solo[source], length)
        else:
            with torch.inference_mode():
                self._k[slot, :, :length] = self._k[source, :, :length]  # (S, nkv, len, hd)
                self._v[slot, :, :length] = self._v[source, :, :length]
        self.lengths[slot] = length

    def project(self, features: torch.Tensor) -> torch.Tensor:  # (n, F) the target's features -> (n, C) inputs
        if self._solo is not None:
            return self._solo[0].project(features)  # at the fixed row count: the same bits whatever the call
        with torch.inference_mode():
            return self.draft.fc(features.to(device=self.device, dtype=self.dtype))

    def forward(self, rows: Sequence[tuple[int, torch.Tensor, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows``: (slot, inputs u ``(n_i, C)``, the tokens x_{j+1} of those slots), slots distinct. Appends the
        slots and returns each row's last output g ``(B, C)`` and its logits over S ``(B, |S|)`` float32."""
        rows = list(rows)
        slots = [slot for slot, _, _ in rows]
        if len(set(slots)) != len(slots) or not all(0 <= s < self.slots for s in slots):
            raise ValueError(f"rows need distinct slots in [0, {self.slots}), got {slots}")
        for slot, u, tokens in rows:
            if u.shape[0] != len(tokens) or not tokens:
                raise ValueError(f"slot {slot}: {u.shape[0]} inputs for {len(tokens)} tokens")
            if self.lengths[slot] + len(tokens) > self.max_len:
                raise ValueError(f"draft slot {slot} is full ({self.lengths[slot]} + {len(tokens)} > {self.max_len})")
        if self._solo is not None:
            outputs = [self._alone(slot, u, tokens) for slot, u, tokens in rows]
            return torch.stack([g for g, _ in outputs]), torch.stack([logits for _, logits in outputs])
        if len(rows) > 1:  # a row too long for the padding room (a new prompt) feeds all but its last slot alone
            for i, (slot, u, tokens) in enumerate(rows):
                if len(tokens) > MAX_BLOCK:
                    self.forward([(slot, u[:-1], tokens[:-1])])
                    rows[i] = (slot, u[-1:], tokens[-1:])
        order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # by slot: consecutive slots read the cache as a view
        with torch.inference_mode():
            g = self._forward([rows[i][0] for i in order], [rows[i][1] for i in order], [list(rows[i][2]) for i in order])
            g = g[torch.argsort(torch.tensor(order, device=self.device))]  # back to the rows' order
            return g, self.draft.logits(g).float()

    def _alone(self, slot: int, u: torch.Tensor, tokens: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        runner = self._solo[slot]
        runner.rollback(self.lengths[slot])  # never above the runner's own length: slots only roll back
        g, logits = runner.step(u, list(tokens))
        self.lengths[slot] = runner.length
        return g, logits

    def _forward(self, slots: list[int], inputs: list[torch.Tensor], tokens: list[list[int]]) -> torch.Tensor:  # (B, C)
        lengths = [len(t) for t in tokens]
        width, device = max(lengths), self.device
        u = torch.zeros((len(slots), width, inputs[0].shape[-1]), dtype=self.dtype, device=device)  # (B, T, C)
        for b, row in enumerate(inputs):
            u[b, : row.shape[0]] = row.to(device=device, dtype=self.dtype)
        ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens], device=device)  # (B, T)
        positions = torch.tensor([self.lengths[s] for s in slots], device=device)[:, None] + torch.arange(width, device=device)
        end = int(positions.max()) + 1
        index = torch.tensor(slots, device=device)
        block = self.draft.block
        x = self.draft.inputs(u, ids)  # (B, T, C)
        q, k, v = block.qkv(x, self._cos[positions], self._sin[positions])  # (B, nh, T, hd), (B, nkv, T, hd) x 2
        self._k[index[:, None], :, positions] = k.transpose(1, 2).to(self._k.dtype)  # indexed as (B, T, nkv, hd)
        self._v[index[:, None], :, positions] = v.transpose(1, 2).to(self._v.dtype)
        rows = slot_rows(slots, device)
        keys, values = self._k[rows, :, :end], self._v[rows, :, :end]  # (B, nkv, end, hd)
        y = grouped_attention(q.to(keys.dtype), keys, values, ragged_causal_mask(positions, end))  # (B, nh, T, hd)
        g = block.finish(x, y.to(x.dtype))  # (B, T, C)
        for slot, t in zip(slots, lengths):
            self.lengths[slot] += t
        return g[torch.arange(len(slots), device=device), torch.tensor(lengths, device=device) - 1]
