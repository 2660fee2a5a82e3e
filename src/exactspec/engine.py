"""The decoding loop: propose, verify in one target call, commit, roll back.

One round (Leviathan et al. 2023, Algorithm 1)::

    draft  = proposer.propose(context, gamma)              gamma tokens [+ q]
    logits = target.forward([last] + draft.tokens)         gamma + 1 positions, one call
    p      = block_probs(logits, ...)                      same pipeline as q
    result = verify(p, q, draft.tokens)                    accepted prefix + recovered/bonus token
    target.rollback(...)                                   cache = committed history minus the newest token

Invariant between rounds: the target's cache holds every committed token but
the newest one, which is fed at the start of the next round. Plain
autoregressive decoding is the same loop with ``gamma = 0`` (no proposer): the
verifier then just samples the bonus token from ``p``.

Random numbers: a fresh ``torch.Generator`` seeded with ``config.seed``; per
round the proposer's draws come first, then the verifier's (see
:mod:`exactspec.verify`). The first token comes from the prompt's prefill and
consumes one uniform.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from exactspec.models.base import LanguageModel, check_token_ids
from exactspec.policy import GammaPolicy, RoutedPolicy
from exactspec.proposers import Draft, DraftModelProposer, Proposer
from exactspec.sampling import SamplingParams, block_probs
from exactspec.stats import GenerationStats, RoundRecord
from exactspec.verify import VerifyResult, verify_greedy, verify_point_mass, verify_stochastic

__all__ = ["GenerationConfig", "Generation", "SpeculativeDecoder", "verify_block"]


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int = 64
    gamma: int = 4  # draft tokens per round; 0 is plain decoding
    stop_token_ids: frozenset[int] = frozenset()  # EOS and other stops; the stop token is kept
    seed: int = 0  # of the generation's own torch.Generator, in [0, 2^64 - 1]

    def __post_init__(self) -> None:
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not isinstance(self.gamma, int) or self.gamma < 0:
            raise ValueError(f"gamma must be an integer >= 0, got {self.gamma!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(f"seed must be an integer in [0, 2^64 - 1] (torch.Generator's range), got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", frozenset(int(t) for t in self.stop_token_ids))


@dataclass
class Generation:
    tokens: list[int]  # generated tokens (prompt excluded), the stop token included
    stop_reason: str  # "stop_token" or "max_new_tokens"
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpeculativeDecoder:
    """Exact speculative decoding of ``target`` with proposals from ``draft``.

    ``draft`` is a language model (wrapped in a :class:`DraftModelProposer` that
    uses the same :class:`SamplingParams` as the target), any :class:`Proposer`,
    or ``None`` for plain decoding. ``policy`` (e.g. :class:`AdaptiveGamma`)
    chooses gamma per round from completed rounds and keeps learning across
    generations; without one, every round drafts ``GenerationConfig.gamma``.
    """

    def __init__(
        self,
        target: LanguageModel,
        draft: LanguageModel | Proposer | None = None,
        params: SamplingParams = SamplingParams(),
        policy: GammaPolicy | None = None,
    ) -> None:
        self.target = target
        self.params = params
        self.policy = policy  # None: GenerationConfig.gamma every round
        if draft is target:
            raise ValueError("the draft must be a different object from the target: they cannot share one cache")
        if isinstance(draft, LanguageModel):
            if draft.vocab_size != target.vocab_size:
                raise ValueError(
                    f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}"
                )
            draft = DraftModelProposer(draft, params)
        self.proposer: Proposer | None = draft
        self._reads_features = getattr(draft, "reads_target_features", False)
        if self._reads_features:
            if not hasattr(target, "capture_features"):
                raise ValueError("this draft reads the target's hidden states, which only the lean backend provides")
            target.capture_features(draft.feature_layers)

    def _share_features(self, rows: int) -> None:
        """Give a feature-reading proposer the target's features of the ``rows`` positions just computed and kept."""
        if self._reads_features:
            self.proposer.observe_target(self.target.last_features[:rows])

    def generate(self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig()) -> Generation:
        generation = Generation(tokens=[], stop_reason="max_new_tokens")
        for token in self.stream(prompt_ids, config, generation):
            generation.tokens.append(token)
        return generation

    def stream(
        self, prompt_ids: Sequence[int], config: GenerationConfig = GenerationConfig(), generation: Generation | None = None
    ) -> Iterator[int]:
        """Yield generated tokens as they are committed. ``generation`` (optional) receives stats and stop reason."""
        generation = generation if generation is not None else Generation(tokens=[], stop_reason="max_new_tokens")
        prompt = check_token_ids(prompt_ids, self.target.vocab_size)
        generator = torch.Generator().manual_seed(config.seed)
        start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.reset(prompt)
        logits = self.target.prefill(prompt)[-1:]  # (1, V)
        self._share_features(len(prompt))
        p = block_probs(logits, prompt, [], len(prompt), self.params).unsqueeze(0)  # (1, 1, V)
        committed = verify_block(self.params, torch.empty((1, 0), dtype=torch.int64), None, p, generator).committed()
        generation.stats.observe(RoundRecord(0, 0, 1, 0.0, time.perf_counter() - start, 0.0))
        context = prompt + committed
        produced = 0
        while True:
            for token in committed:
                produced += 1
                yield token
                if token in config.stop_token_ids:
                    generation.stop_reason = "stop_token"
                    return
                if produced == config.max_new_tokens:
                    return
            gamma = min(self._next_gamma(config, context), config.max_new_tokens - produced - 1)  # never past the budget
            committed = self._round(context, len(prompt), gamma, generator, generation.stats)
            context += committed

    def _next_gamma(self, config: GenerationConfig, context: list[int]) -> int:
        if self.proposer is None:
            return 0
        if self.policy is None:
            return config.gamma
        if isinstance(self.policy, RoutedPolicy):  # one policy per proposal source: the one this context takes
            self.policy.select(self.proposer.route(context))
        return self.policy.next_gamma()

    def _round(
        self, context: list[int], prompt_length: int, gamma: int, generator: torch.Generator, stats: GenerationStats
    ) -> list[int]:
        """One speculative round; returns the committed tokens (1 to gamma + 1)."""
        if self.target.length != len(context) - 1:
            raise RuntimeError(
                "the target's cache was changed outside this generation (another stream on the same models?)"
            )
        t0 = time.perf_counter()
        draft = self.proposer.propose(context, gamma, generator) if gamma > 0 else Draft([], None)
        if len(draft.tokens) > gamma:
            raise ValueError(f"the proposer returned {len(draft.tokens)} tokens for gamma = {gamma}")
        t1 = time.perf_counter()
        logits = self.target.forward([context[-1], *draft.tokens])  # (g + 1, V)
        t2 = time.perf_counter()
        p = block_probs(logits, context, draft.tokens, prompt_length, self.params)
        draft_tokens = torch.tensor([draft.tokens], dtype=torch.int64).reshape(1, -1)  # (1, g)
        draft_probs = None if draft.probs is None else draft.probs.unsqueeze(0)
        result = verify_block(self.params, draft_tokens, draft_probs, p.unsqueeze(0), generator)
        accepted = int(result.num_accepted[0])
        self.target.rollback(len(context) + accepted)  # keeps context and the accepted drafts
        self._share_features(accepted + 1)
        t3 = time.perf_counter()
        record = RoundRecord(len(draft.tokens), accepted, accepted + 1, t1 - t0, t2 - t1, t3 - t2, draft.setup_seconds)
        stats.observe(record)
        if self.policy is not None:
            self.policy.observe(record)
        return result.committed()


def verify_block(
    params: SamplingParams,
    draft_tokens: torch.Tensor,  # (1, g) int64
    draft_probs: torch.Tensor | None,  # (1, g, V) or None for point-mass proposals
    target_probs: torch.Tensor,  # (1, g + 1, V)
    generator: torch.Generator,
) -> VerifyResult:
    """The rule that fits the proposal: greedy, point mass (deterministic drafts) or min(1, p/q) (sampled ones)."""
    if params.greedy:
        return verify_greedy(draft_tokens, target_probs)
    if draft_probs is None:
        return verify_point_mass(draft_tokens, target_probs, generator)
    return verify_stochastic(draft_tokens, draft_probs, target_probs, generator)
