"""Decoding with a feature-level draft (:mod:`.eagle`): several sequences' draft slots in one :class:`KVCache`.

:class:`FeatureDraftRuntime` is to a :class:`exactspec.models.eagle.FeatureDraft` what
:class:`exactspec.models.lean.LeanRuntime` is to a target: one call feeds each of several sequences its own slots
(the target's new features at a round's first draft step, the draft's own output after that). One row runs
against its slot unpadded; several rows are right-padded, each with its own rotary positions and a mask that stops
at its own length, so padding and another sequence's keys are never read. Each slot rolls back on its own.

Numerics: as in the lean runtime, a batched row matches its solo computation up to the low-order bits of matrix
kernels given more rows. With ``invariant=True`` every row runs alone at ``INVARIANT_ROWS`` rows with fixed-shape
attention (a longer one as consecutive calls of that size), so it gets the same bits whatever the call and the
batch (the target's invariant mode keeps its promise with a feature-level draft).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .attention import causal_mask, grouped_attention, ragged_causal_mask
from .eagle import FeatureDraft
from .kv_cache import MAX_BLOCK, KVCache, slot_rows
from .llama import INVARIANT_ROWS, cache_dtype
from .llama_config import rope_tables

__all__ = ["FeatureDraftRuntime"]


def padded_rows(x: torch.Tensor, rows: int) -> torch.Tensor:  # (n, C) -> (rows, C), zero rows appended
    return x if x.shape[0] == rows else torch.cat([x, x.new_zeros(rows - x.shape[0], x.shape[1])])


class FeatureDraftRuntime:
    def __init__(
        self,
        draft: FeatureDraft,
        slots: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        invariant: bool = False,
    ) -> None:
        self.draft = draft.to(device=device, dtype=dtype).eval()
        self.device, self.dtype, self.invariant = torch.device(device), dtype, invariant
        self.slots, self.max_len, self.max_batched_row = slots, max_len, MAX_BLOCK
        cfg = draft.cfg.layer_config()
        self.cache = KVCache(
            1, slots, cfg.num_key_value_heads, cfg.head_size, max_len, cache_dtype(dtype, self.device), self.device
        )
        cos, sin = rope_tables(cfg, max_len + MAX_BLOCK)
        self._cos, self._sin = cos.to(self.device, dtype), sin.to(self.device, dtype)  # (max_len + MAX_BLOCK, hd)

    @property
    def lengths(self) -> list[int]:
        return self.cache.lengths

    def rollback(self, slot: int, length: int) -> None:
        self.cache.rollback(slot, length)

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        """Give ``slot`` the first ``length`` slots of ``source`` (copied): a prompt sequences share is drafted once."""
        self.cache.copy_prefix(source, slot, length)

    def _rows(self, n: int) -> int:
        """The row count a call of ``n`` slots runs at: fixed in invariant mode (so a slot's bits never depend on
        its call's size), else ``n``."""
        return INVARIANT_ROWS if self.invariant and n <= INVARIANT_ROWS else n

    def project(self, features: torch.Tensor) -> torch.Tensor:  # (n, F) the target's features -> (n, C) inputs u
        n = features.shape[0]
        if self.invariant and n > INVARIANT_ROWS:  # in pieces of the fixed row count, as _forward_one feeds them
            return torch.cat([self.project(features[i : i + INVARIANT_ROWS]) for i in range(0, n, INVARIANT_ROWS)])
        with torch.inference_mode():
            return self.draft.fc(padded_rows(features.to(device=self.device, dtype=self.dtype), self._rows(n)))[:n]

    def forward(self, rows: Sequence[tuple[int, torch.Tensor, Sequence[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows``: (slot, inputs u ``(n_i, C)``, the tokens x_{j+1} of those slots), slots distinct. Appends the
        slots and returns each row's last output g ``(B, C)`` and its logits over S ``(B, |S|)`` float32."""
        rows = [(slot, u, list(tokens)) for slot, u, tokens in rows]
        for slot, u, tokens in rows:
            if u.shape[0] != len(tokens) or not tokens:
                raise ValueError(f"slot {slot}: {u.shape[0]} inputs for {len(tokens)} tokens")
        self.cache.check_rows([slot for slot, _, _ in rows], [len(tokens) for _, _, tokens in rows])
        with torch.inference_mode():
            if len(rows) == 1 or self.invariant:  # the head runs per row too: its bits do not depend on the batch
                g = [self._forward_one(slot, u, tokens) for slot, u, tokens in rows]
                return torch.stack(g), torch.stack([self.draft.logits(row) for row in g]).float()
            g = self._forward_ragged(rows)
            return g, self.draft.logits(g).float()

    def _forward_one(self, slot: int, u: torch.Tensor, tokens: list[int]) -> torch.Tensor:  # (C,) the last slot's g
        if self.invariant and len(tokens) > INVARIANT_ROWS:  # a prompt's catch-up: consecutive fixed-size calls, so
            for start in range(0, len(tokens), INVARIANT_ROWS):  # its slots' bits never depend on how it was split
                g = self._forward_one(slot, u[start : start + INVARIANT_ROWS], tokens[start : start + INVARIANT_ROWS])
            return g
        pos, n = self.cache.lengths[slot], len(tokens)
        rows = self._rows(n)
        ids = torch.tensor(tokens + [0] * (rows - n), dtype=torch.long, device=self.device).unsqueeze(0)  # (1, R)
        x = self.draft.inputs(
            padded_rows(u.to(device=self.device, dtype=self.dtype), rows).unsqueeze(0), ids
        )  # (1, R, C)
        cos, sin = self._cos[pos : pos + rows], self._sin[pos : pos + rows]  # (R, hd); padding rows: any angle
        keys, values = self.cache.slot(0, slot)  # (1, nkv, capacity, hd) x 2
        if self.invariant and rows == INVARIANT_ROWS:
            g = self.draft.block.forward_invariant(x, cos, sin, keys, values, pos, n)
        else:
            mask = None if n == 1 else causal_mask(pos, n, self.device)
            g = self.draft.block.forward_cached(x, cos, sin, keys, values, pos, mask)
        self.cache.lengths[slot] = pos + n
        return g[0, n - 1]

    def _forward_ragged(self, rows: list[tuple[int, torch.Tensor, list[int]]]) -> torch.Tensor:  # (B, C)
        for i, (slot, u, tokens) in enumerate(rows):  # a row too long for the padding room (a new prompt) feeds
            if len(tokens) > MAX_BLOCK:  # all but its last slot alone
                self._forward_one(slot, u[:-1], tokens[:-1])
                rows[i] = (slot, u[-1:], tokens[-1:])
        order = sorted(
            range(len(rows)), key=lambda i: rows[i][0]
        )  # by slot: consecutive slots read the cache as a view
        slots, inputs, tokens = [rows[i][0] for i in order], [rows[i][1] for i in order], [rows[i][2] for i in order]
        lengths = [len(t) for t in tokens]
        width, device = max(lengths), self.device
        u = torch.zeros((len(slots), width, inputs[0].shape[-1]), dtype=self.dtype, device=device)  # (B, T, C)
        for b, row in enumerate(inputs):
            u[b, : row.shape[0]] = row.to(device=device, dtype=self.dtype)
        ids = torch.tensor([t + [0] * (width - len(t)) for t in tokens], device=device)  # (B, T)
        positions = torch.tensor([self.cache.lengths[s] for s in slots], device=device)[:, None] + torch.arange(
            width, device=device
        )
        end = int(positions.max()) + 1
        block = self.draft.block
        x = self.draft.inputs(u, ids)  # (B, T, C)
        q, k, v = block.qkv(x, self._cos[positions], self._sin[positions])  # (B, nh, T, hd), (B, nkv, T, hd) x 2
        self.cache.write(0, torch.tensor(slots, device=device), positions, k, v)
        keys, values = self.cache.read(0, slot_rows(slots, device), end)  # (B, nkv, end, hd)
        g = block.finish(
            x, grouped_attention(q.to(keys.dtype), keys, values, ragged_causal_mask(positions, end)).to(x.dtype)
        )
        for slot, t in zip(slots, lengths):
            self.cache.lengths[slot] += t
        last = g[torch.arange(len(slots), device=device), torch.tensor(lengths, device=device) - 1]  # (B, C)
        return last[torch.argsort(torch.tensor(order, device=device))]  # back to the rows' order
