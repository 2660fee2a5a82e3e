"""Draft tokens from a smaller language model, for a batch of slots.

:class:`ModelDraft` is the drafting loop every model-based proposer shares: one batched draft call per draft
position for all the sequences that draft in the round; each token drawn (greedy: argmax) from q of the engine's
``draft_rule`` over the draft's columns, built by the same pipeline as the target's p from the prefix that
position conditions on (the context plus the draft tokens drawn so far). A sequence whose settings leave the
draft nothing to propose stops drafting there. Random numbers: one float64 uniform per sampled draft token, from
the sequence's generator, in order; none in greedy mode.

:class:`DraftModelProposer` runs it over a draft model (any :class:`exactspec.models.runtime.Runtime`, or a
single-sequence model as one slot). Each slot's cache holds a prefix of the tokens it was fed; at a round's first
step it is rolled back to the longest prefix the context shares with them and the missing tokens are fed (after
a fully accepted round, the last drafted token and the bonus token).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from exactspec.decoding.sampling import full_width
from exactspec.decoding.verify import greedy_token, sample_from
from exactspec.models.runtime import as_runtime
from exactspec.proposers.base import Draft, DraftRequest, DraftRule, ReadsNothing, common_prefix

__all__ = ["DraftModelProposer", "ModelDraft"]


class ModelDraft(ReadsNothing):
    """The drafting loop of a model-based proposer. A subclass gives :meth:`_step`, and ``token_ids`` when its
    logits cover a subset S of the vocabulary (column c is token ``token_ids[c]``), and ``vocab_size``."""

    token_ids: torch.Tensor | None = None
    vocab_size: int

    def route(self, context: Sequence[int]) -> str:
        return "draft"

    def _step(
        self, step: int, live: list[DraftRequest], tokens: dict[int, list[int]]
    ) -> tuple[list[torch.Tensor], bool]:
        """Logits ``(1, W)`` per live request after its context and its draft tokens so far, and whether the call
        was setup (feeding more than 2 tokens to a row: a prompt, a catch-up after plain rounds)."""
        raise NotImplementedError

    def propose(self, requests: Sequence[DraftRequest], draft_rule: DraftRule) -> list[Draft]:
        prefixes = {r.slot: list(r.context) for r in requests}
        tokens = {r.slot: [] for r in requests}
        rows = {r.slot: [] for r in requests}
        setup = 0.0
        live = list(requests)
        for step in range(max(r.gamma for r in requests)):
            began = time.perf_counter()
            logits, is_setup = self._step(step, live, tokens)
            if is_setup:
                setup += time.perf_counter() - began
            for r, row in zip(live, logits):
                try:
                    q, reported = draft_rule(row, prefixes[r.slot], r.prompt_length, r.params, self.token_ids)
                except ValueError:  # every token the draft has is excluded (allowed/banned sets, bias)
                    continue
                if r.params.greedy:
                    column = greedy_token(q)
                else:
                    column = sample_from(q.unsqueeze(0), torch.rand((1,), dtype=torch.float64, generator=r.generator))[
                        0
                    ]
                token = int(column) if self.token_ids is None else int(self.token_ids[column])
                tokens[r.slot].append(token)
                rows[r.slot].append(reported)
                prefixes[r.slot].append(token)
            live = [r for r in live if len(tokens[r.slot]) == step + 1 < r.gamma]
            if not live:
                break
        drafts = []
        for r in requests:
            probs = (
                None
                if r.params.greedy or not rows[r.slot]
                else full_width(torch.stack(rows[r.slot]), self.token_ids, self.vocab_size)
            )
            drafts.append(Draft(tokens[r.slot], probs, setup))
        return drafts


class DraftModelProposer(ModelDraft):
    """Samples draft tokens autoregressively from a draft model with the target's vocabulary."""

    def __init__(self, model) -> None:
        self.model = as_runtime(model)
        self.slots, self.vocab_size = self.model.slots, self.model.vocab_size
        self._fed: list[list[int]] = [[] for _ in range(self.slots)]  # the tokens in each slot's cache

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self._fed[slot] = []  # fed lazily at the first proposal: a sequence that never drafts never pays for it

    def _step(
        self, step: int, live: list[DraftRequest], tokens: dict[int, list[int]]
    ) -> tuple[list[torch.Tensor], bool]:
        if step == 0:
            feeds = [(r.slot, self._catch_up(r.slot, r.context)) for r in live]
        else:
            feeds = [(r.slot, tokens[r.slot][-1:]) for r in live]
            for r in live:
                self._fed[r.slot].append(tokens[r.slot][-1])
        is_setup = max(len(feed) for _, feed in feeds) > 2
        if len(feeds) > 1:  # a row longer than a batched call allows (a prompt) is fed alone first
            longest = self.model.max_batched_row
            for slot, feed in feeds:
                if len(feed) > longest:
                    self.model.forward([(slot, feed[:-1])], [0])
            feeds = [(slot, feed[-1:] if len(feed) > longest else feed) for slot, feed in feeds]
        return self.model.forward(feeds, [1] * len(feeds)), is_setup

    def _catch_up(self, slot: int, context: list[int]) -> list[int]:
        """Roll the slot back to what it shares with the context; the tokens it still has to read (at least the
        newest one, whose logits give the first draft position)."""
        keep = common_prefix(self._fed[slot], context[:-1])
        self.model.rollback(slot, keep)
        self._fed[slot] = list(context)
        return context[keep:]
