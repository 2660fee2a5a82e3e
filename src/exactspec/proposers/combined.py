"""Prompt lookup where the context repeats itself at length, a trained draft everywhere else.

Each round takes one source, chosen from the committed context alone (never from the round's random numbers):
``lookup`` when the last ``min_match`` or more tokens occurred earlier and something followed them, else
``draft``. A lookup proposal is a point mass (verified with the point-mass rule), a draft's proposal carries its
q (verified with min(1, p/q)), so every round is an exact speculative step whichever source it took.

:meth:`LookupOrDraft.route` names the source a context will take, so that the gamma policy
(:class:`exactspec.decoding.policy.AdaptiveGamma`) keeps estimates per source: the two have very different acceptance
and step costs. A draft that reads the target's features keeps receiving them during lookup rounds,
and catches up on its next proposal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.proposers.base import Draft, DraftRequest, DraftRule, Proposer, SequenceProposer, as_proposer
from exactspec.proposers.prompt_lookup import find_continuation

__all__ = ["LookupOrDraft"]


class LookupOrDraft:
    SOURCES = ("lookup", "draft")

    def __init__(self, draft: Proposer | SequenceProposer, min_match: int = 3, max_ngram: int = 8) -> None:
        if not 1 <= min_match <= max_ngram:
            raise ValueError(f"need 1 <= min_match <= max_ngram, got {min_match} and {max_ngram}")
        self.draft = draft = as_proposer(draft)
        self.min_match = min_match
        self.max_ngram = max_ngram
        self.feature_layers = draft.feature_layers
        self.slots = getattr(draft, "slots", None)

    def route(self, context: Sequence[int]) -> str:
        """``lookup`` if a suffix of at least ``min_match`` tokens has an earlier continuation, else ``draft``."""
        return "lookup" if find_continuation(context, 1, self.min_match, self.max_ngram) else "draft"

    def propose(self, requests: Sequence[DraftRequest], draft_rule: DraftRule) -> list[Draft]:
        drafts = {
            r.slot: Draft(find_continuation(r.context, r.gamma, self.min_match, self.max_ngram), None) for r in requests
        }
        drafting = [r for r in requests if not drafts[r.slot].tokens]
        if drafting:
            drafts.update(zip((r.slot for r in drafting), self.draft.propose(drafting, draft_rule)))
        return [drafts[r.slot] for r in requests]

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self.draft.start(slot, prompt)

    def observe(self, slot: int, features: torch.Tensor) -> None:  # (n, F)
        self.draft.observe(slot, features)

    def reusable(self, donor: int | None, shared: int) -> int:
        return self.draft.reusable(donor, shared)

    def copy_prefix(self, donor: int, slot: int, length: int) -> None:
        self.draft.copy_prefix(donor, slot, length)
