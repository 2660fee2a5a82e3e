"""One generation at a time: :class:`SpeculativeDecoder`, the library's entry point, as a batch of one.

It runs the engine's loop (:mod:`exactspec.decoding.engine`; Leviathan et al. 2023, Algorithm 1) on one slot over the
target model itself (:class:`exactspec.models.runtime.SequenceSlots`), so a generation here and a served request
are the same rounds and the same rules::

    draft  = proposer.propose(context, gamma)              gamma tokens [+ q]
    logits = target.forward([last] + draft.tokens)         gamma + 1 positions, one call
    p      = block_probs(logits, ...)                      same pipeline as q
    result = verify(p, q, draft.tokens)                    accepted prefix + replacement/bonus token
    target.rollback(...)                                   cache = committed history minus the newest token

Random numbers: a fresh ``torch.Generator`` seeded with ``GenerationConfig.seed``; the first token (from the
prompt's prefill) consumes one uniform, then per round the proposer's draws come first, then the verifier's (see
:mod:`exactspec.decoding.verify`). With a fixed gamma a seeded generation is reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from exactspec.decoding.block import check_rule
from exactspec.decoding.engine import BatchEngine, SequenceRequest, verify_block
from exactspec.decoding.policy import AdaptiveGamma
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.stats import GenerationStats
from exactspec.models.base import LanguageModel, check_token_ids
from exactspec.models.runtime import SequenceSlots
from exactspec.proposers import DraftModelProposer, Proposer, SequenceProposer
from exactspec.proposers.base import as_proposer

__all__ = ["GenerationConfig", "Generation", "SpeculativeDecoder", "verify_block"]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    gamma: int = 4  # draft tokens per round; 0 is plain decoding
    stop_token_ids: frozenset[int] = frozenset()  # EOS and other stops; the stop token is kept
    seed: int = 0  # of the generation's own torch.Generator, in [0, 2^64 - 1]
    verify: str = "block"  # sampled drafts: "block" (exactspec.decoding.block) or "token" (token-wise min(1, p/q))
    compare_rules: bool = False  # record both rules' expected accepted length of each sampled round (stats.summary)

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.gamma, int) or self.gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {self.gamma!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2^64 - 1] (torch.Generator's range), got {self.seed!r}")
        check_rule(self.verify)
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), the stop token included
    stop_reason: str  # "stop_token" or "max_new_tokens"
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeDecoder:
    """Exact speculative decoding of ``target`` with proposals from ``draft``.

    ``draft`` is a language model with the target's vocabulary (drafted with the target's sampling settings), a
    :class:`exactspec.proposers.Proposer`, a single-sequence proposer (``reset`` / ``propose(context, gamma,
    generator)``), or ``None`` for plain decoding. ``policy`` (:class:`exactspec.decoding.policy.AdaptiveGamma`) chooses
    gamma per round, for the source each context routes to, and keeps learning across generations; without one,
    every round drafts ``GenerationConfig.gamma``.
    """

    def __init__(
        self,
        target: LanguageModel,
        draft: LanguageModel | Proposer | SequenceProposer | None = None,
        params: SamplingParams = SamplingParams(),
        policy: AdaptiveGamma | None = None,
    ) -> None:
        if draft is target:
            raise ValueError("the draft must be a different object from the target: they cannot share one cache")
        if isinstance(draft, LanguageModel):
            if draft.vocab_size != target.vocab_size:
                raise ValueError(
                    f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}"
                )
            draft = DraftModelProposer(SequenceSlots([draft]))
        elif draft is not None:
            draft = as_proposer(draft)
        self.target, self.params, self.proposer = target, params, draft
        self.engine = BatchEngine(SequenceSlots([target]), draft)
        self.policy = policy

    @property
    def policy(self) -> AdaptiveGamma | None:
        return self._policy

    @policy.setter
    def policy(self, policy: AdaptiveGamma | None) -> None:
        self._policy = policy
        if policy is not None:
            self.engine.policy = policy

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> Generation:
        generation = Generation(tokens=[], stop_reason="max_new_tokens")
        for token in self.stream(prompt_ids, config, generation):
            generation.tokens.append(token)
        return generation

    def stream(
        self,
        prompt_ids: Sequence[int],
        config: GenerationConfig = GenerationConfig(),
        generation: Generation | None = None,
    ) -> Iterator[int]:
        """Yield generated tokens as they are committed. ``generation`` (optional) receives stats and stop reason."""
        generation = generation if generation is not None else Generation(tokens=[], stop_reason="max_new_tokens")
        prompt = check_token_ids(prompt_ids, self.target.vocab_size)
        request = SequenceRequest(
            tuple(prompt),
            self.params,
            config.max_new_tokens,
            config.stop_token_ids,
            config.seed,
            speculation="off" if self.proposer is None else "draft",
            gamma=config.gamma if self.policy is None else "auto",
            verify=config.verify,
            compare_rules=config.compare_rules,
        )
        committed, began = [], time.perf_counter()
        handle = self.engine.submit(request, lambda events: committed.extend(e.token for e in events), lambda _: None)
        handle.stats = generation.stats
        try:
            while handle.finish_reason is None:
                self.engine.step()
                yield from committed
                committed.clear()
        finally:
            generation.stats.wall_seconds = time.perf_counter() - began  # the caller's work between tokens included
            if handle.finish_reason is None:  # the caller stopped reading: free the slot
                handle.cancel()
                self.engine.step()
        if handle.finish_reason == "error":
            raise handle.exception
        generation.stop_reason = "stop_token" if handle.finish_reason == "stop" else "max_new_tokens"
