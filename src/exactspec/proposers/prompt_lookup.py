"""Prompt-lookup drafting: propose what followed the latest earlier occurrence of the last n tokens.

No draft model: the proposal is a deterministic function of the context, so it
is a point mass and is verified with the point-mass rule (accept with
probability ``p(x)``, replace from ``p`` without ``x``). n is tried from
``max_ngram`` down to ``min_ngram``; the most recent match wins.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exactspec.proposers.base import Draft, DraftRequest, DraftRule, ReadsNothing

__all__ = ["PromptLookupProposer", "find_continuation"]


def find_continuation(context: Sequence[int], gamma: int, min_ngram: int, max_ngram: int) -> list[int]:
    """Up to ``gamma`` tokens that followed the most recent earlier match of the longest suffix n-gram."""
    length = len(context)
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = list(context[length - n :])
        # the most recent earlier occurrence: scan start positions right to left, excluding the suffix itself
        for start in range(length - n - 1, -1, -1):
            if context[start] == suffix[0] and list(context[start : start + n]) == suffix:
                return list(context[start + n : start + n + gamma])
    return []


@dataclass
class PromptLookupProposer(ReadsNothing):
    """Drafts by n-gram lookup in prompt + generated text (Saxena 2023, "prompt lookup decoding"), for any number
    of slots: it keeps no state."""

    min_ngram: int = 1
    max_ngram: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {self.min_ngram} and {self.max_ngram}")

    def route(self, context: Sequence[int]) -> str:
        return "lookup"

    def propose(self, requests: Sequence[DraftRequest], draft_rule: DraftRule | None = None) -> list[Draft]:
        return [Draft(find_continuation(r.context, r.gamma, self.min_ngram, self.max_ngram), None) for r in requests]
