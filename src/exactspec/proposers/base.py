"""The proposer interface.

A proposer suggests ``gamma`` tokens to follow ``context``. It returns the
distribution each token was drawn from (``probs``) when the proposal is
stochastic, or ``None`` when it is deterministic (a point mass: n-gram lookup,
a draft model's argmax). The engine picks the matching verification rule, so a
deterministic proposal is never checked with the ratio meant for sampled ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for one round and, for stochastic proposals, their distributions."""

    tokens: list[int]  # gamma token ids
    probs: torch.Tensor | None  # (gamma, V) float64 rows the tokens were drawn from; None: point masses
    setup_seconds: float = 0.0  # one-off work inside this proposal (a lazy prefill), not a per-token cost

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} draft tokens but {self.probs.shape[0]} distributions")


class Proposer(Protocol):
    def reset(self, prompt: Sequence[int]) -> None:
        """Forget all state: a new sequence starts with ``prompt``."""
        ...

    def propose(self, context: Sequence[int], gamma: int, generator: torch.Generator) -> Draft:
        """Propose up to ``gamma`` tokens to follow ``context`` (prompt + committed tokens)."""
        ...
