"""Draft tokens from a feature-level draft (:mod:`exactspec.models.eagle`) that reads the target's hidden states.

The engine hands the proposer the target's features of every position its calls computed and kept
(:meth:`FeatureDraftProposer.observe`: the prompt's prefill, then the fed token and the accepted drafts of each
round), so drafting never makes a target call of its own. At a proposal for a context of n tokens the features of
positions 0..n-2 are known; the slot's draft cache is rolled back to the slots built from them (dropping last
round's predicted slots), the missing ones are fed in the round's first draft call, and each further step feeds
the draft's own output as the next feature and its last token.

q of each step is the draft's distribution over its vocabulary subset S with the same sampling pipeline as the
target's p (:func:`exactspec.decoding.sampling.block_probs` on S's columns, equal to the full vocabulary's with logits
-inf outside S), so a sampled token is checked with min(1, p/q) and a greedy one as a point mass, as for any
proposer. Drafting is :class:`exactspec.proposers.draft_model.ModelDraft`'s loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.models.eagle import FeatureDraft
from exactspec.models.feature_runtime import FeatureDraftRuntime
from exactspec.proposers.base import DraftRequest
from exactspec.proposers.draft_model import ModelDraft

__all__ = ["FeatureDraftProposer"]


class FeatureDraftProposer(ModelDraft):
    def __init__(self, draft: FeatureDraftRuntime, vocab_size: int) -> None:
        self.draft, self.vocab_size, self.slots = draft, vocab_size, draft.slots
        self.feature_layers = tuple(draft.draft.cfg.feature_layers)
        ids = draft.draft.vocab_ids.cpu()
        self.token_ids = ids[ids < vocab_size]  # S within the target's real vocabulary, ascending
        self._new = [[] for _ in range(self.slots)]  # per slot: target features not fed to the draft yet, in order
        self._known = [0] * self.slots  # positions whose target features the slot was handed
        self._built = [0] * self.slots  # draft slots built from target features
        self._output: list[torch.Tensor | None] = [None] * self.slots  # (1, C) the draft's output at its last slot

    @classmethod
    def solo(
        cls,
        draft: FeatureDraft,
        vocab_size: int,
        max_len: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        invariant: bool = True,
    ) -> FeatureDraftProposer:
        """A proposer of one slot; ``invariant``: in the invariant numerics (a row's bits never depend on its call's
        size, at the price of every call running at 17 rows: about twice the draft step on a CPU)."""
        return cls(FeatureDraftRuntime(draft, 1, max_len, device, dtype, invariant), vocab_size)

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self._new[slot], self._known[slot], self._built[slot] = [], 0, 0

    def observe(self, slot: int, features: torch.Tensor) -> None:  # (n, F)
        self._new[slot].append(features)
        self._known[slot] += features.shape[0]

    def reusable(self, donor: int | None, shared: int) -> int:
        """Slot j of the draft reads token j + 1: one position fewer than the target shares, and no more than the
        donor's draft built."""
        return 0 if donor is None else max(0, min(shared - 1, self._built[donor]))

    def copy_prefix(self, donor: int, slot: int, length: int) -> None:
        if length:
            self.draft.copy_prefix(donor, slot, length)
            self._built[slot] = self._known[slot] = length

    def _step(
        self, step: int, live: list[DraftRequest], tokens: dict[int, list[int]]
    ) -> tuple[list[torch.Tensor], bool]:
        if step == 0:
            rows = []
            for r in live:
                n = len(r.context)
                if self._known[r.slot] != n - 1:
                    raise RuntimeError(
                        f"the target's features cover {self._known[r.slot]} positions, the context needs {n - 1}"
                    )
                self.draft.rollback(r.slot, self._built[r.slot])
                rows.append(
                    (r.slot, self.draft.project(torch.cat(self._new[r.slot])), r.context[self._built[r.slot] + 1 :])
                )
                self._new[r.slot], self._built[r.slot] = [], n - 1
        else:
            rows = [(r.slot, self._output[r.slot], tokens[r.slot][-1:]) for r in live]
        outputs, subset_logits = self.draft.forward(rows)
        for r, output in zip(live, outputs):
            self._output[r.slot] = output.unsqueeze(0)
        logits = subset_logits[:, : len(self.token_ids)].cpu().unsqueeze(1)  # (B, 1, |S|)
        return list(logits), max(len(t) for _, _, t in rows) > 2
