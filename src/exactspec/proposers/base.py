"""The proposer interface: where draft tokens come from, for a batch of slots.

A proposer suggests up to ``gamma`` tokens to follow each request's context. It returns the distribution each
token was drawn from (``probs``) when the proposal is stochastic, or ``None`` when it is deterministic (a point
mass: n-gram lookup, a draft model's argmax). The engine picks the matching verification rule, so a deterministic
proposal is never checked with the ratio meant for sampled ones.

The engine (:mod:`exactspec.decoding.engine`) drives every proposer through :class:`Proposer`, one call per round for
all the sequences that draft in it; nothing in the loop knows a proposer's type. A proposer that draws from a model's
distribution builds q with the engine's ``draft_rule`` (:data:`DraftRule`, by default :func:`processed_q`: the same
pipeline as the target's p), so that the certification's known-wrong variants can replace that one rule.
:class:`OneSequence` adapts a proposer written for a single sequence (``reset`` / ``propose(context, gamma,
generator)``: :class:`SequenceProposer`) to the interface.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from exactspec.decoding.sampling import SamplingParams, block_probs

__all__ = [
    "Draft",
    "DraftRequest",
    "DraftRule",
    "OneSequence",
    "Proposer",
    "SequenceProposer",
    "as_proposer",
    "common_prefix",
    "processed_q",
]


@dataclass(frozen=True)
class Draft:
    """Tokens proposed for one round and, for stochastic proposals, their distributions."""

    tokens: list[int]  # gamma token ids
    probs: torch.Tensor | None  # (gamma, V) float64 rows the tokens were drawn from; None: point masses
    setup_seconds: float = 0.0  # one-off work inside this proposal (a catch-up on a prompt), not a per-token cost

    def __post_init__(self) -> None:
        if self.probs is not None and self.probs.shape[0] != len(self.tokens):
            raise ValueError(f"{len(self.tokens)} draft tokens but {self.probs.shape[0]} distributions")


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's share of a round's proposal call."""

    slot: int
    context: list[int]  # prompt + committed tokens
    prompt_length: int
    gamma: int  # >= 1: propose at most this many tokens
    params: SamplingParams  # the sequence's sampling settings: q is built with them
    generator: torch.Generator  # the sequence's own: a sampled draft token takes one float64 uniform from it


#: ``(logits (1, W), prefix, prompt_length, params, token_ids) -> (q to draw from, q reported to the verifier)``,
#: both ``(W,)``; ``token_ids`` names the columns of a reduced vocabulary (None: column c is token c).
DraftRule = Callable[
    [torch.Tensor, list, int, SamplingParams, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]
]


def processed_q(
    logits: torch.Tensor,
    prefix: list[int],
    prompt_length: int,
    params: SamplingParams,
    token_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact rule: q from the same pipeline as the target's p (:func:`exactspec.decoding.sampling.block_probs`), the
    same distribution drawn from and reported."""
    q = block_probs(logits, prefix, [], prompt_length, params, token_ids=token_ids)[0]
    return q, q


class Proposer(Protocol):
    """What the engine drafts with, for every slot of a batch."""

    feature_layers: tuple[int, ...]  # target layers whose outputs it reads through observe(); () for none

    def route(self, context: Sequence[int]) -> str:
        """The source that would propose after ``context`` (``"draft"`` or ``"lookup"``): the gamma policy keeps
        one acceptance estimate per source. A function of the context alone, never of random numbers."""
        ...

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        """A new sequence in ``slot``: forget what the slot held."""
        ...

    def propose(self, requests: Sequence[DraftRequest], draft_rule: DraftRule) -> list[Draft]:
        """One draft per request, in order, each at most ``gamma`` tokens."""
        ...

    def observe(self, slot: int, features: torch.Tensor) -> None:  # (n, F)
        """The target's features of the next ``n`` positions of the slot's sequence (only with feature_layers)."""
        ...

    def reusable(self, donor: int | None, shared: int) -> int:
        """Of ``shared`` leading positions a new sequence has in common with slot ``donor``'s target cache (None: a
        donor this proposer does not serve), how many may be copied so that this proposer can go on from them."""
        ...

    def copy_prefix(self, donor: int, slot: int, length: int) -> None:
        """``slot`` starts from the first ``length`` positions of ``donor`` (a shared prompt, copied once)."""
        ...


class SequenceProposer(Protocol):
    """A proposer for one sequence at a time (:class:`OneSequence` runs it in the engine)."""

    def reset(self, prompt: Sequence[int]) -> None: ...

    def propose(self, context: Sequence[int], gamma: int, generator: torch.Generator) -> Draft: ...


class ReadsNothing:
    """Defaults of :class:`Proposer` for a proposer that keeps no per-slot state and reads no target features."""

    feature_layers: tuple[int, ...] = ()

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        pass

    def observe(self, slot: int, features: torch.Tensor) -> None:
        pass

    def reusable(self, donor: int | None, shared: int) -> int:
        return shared

    def copy_prefix(self, donor: int, slot: int, length: int) -> None:
        pass


class OneSequence(ReadsNothing):
    """A :class:`SequenceProposer` as a :class:`Proposer` of one slot: its own q, its own draws."""

    slots = 1

    def __init__(self, proposer: SequenceProposer, source: str = "draft") -> None:
        self.proposer, self.source = proposer, source

    def route(self, context: Sequence[int]) -> str:
        return self.source

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self.proposer.reset(list(prompt))

    def propose(self, requests: Sequence[DraftRequest], draft_rule: DraftRule) -> list[Draft]:
        return [self.proposer.propose(r.context, r.gamma, r.generator) for r in requests]


def as_proposer(proposer: Proposer | SequenceProposer) -> Proposer:
    """A :class:`Proposer` as it is; a single-sequence one in :class:`OneSequence`."""
    return proposer if hasattr(proposer, "start") else OneSequence(proposer)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
