"""One generation at a time: :class:`SpeculativeDecoder`, the library's entry point, as a batch of one.

It runs the engine's loop (:mod:`exactspec.engine`; Leviathan et al. 2023, Algorithm 1) on one slot over the
target model itself (:class:`exactspec.models.runtime.SequenceSlots`), so a generation here and a served request
are the same rounds and the same rules::

    draft  = proposer.propose(context, gamma)              gamma tokens [+ q]
    logits = target.forward([last] + draft.tokens)         gamma + 1 positions, one call
    p      = block_probs(logits, ...)                      same pipeline as q
    result = verify(p, q, draft.tokens)                    accepted prefix + replacement/bonus token
    target.rollback(...)                                   cache = committed history minus the newest token

Random numbers: a fresh ``torch.Generator`` seeded with ``GenerationConfig.seed``; the first token (from the
prompt's prefill) consumes one uniform, then per round the proposer's draws come first, then the verifier's (see
:mod:`exactspec.verify`). With a fixed gamma a seeded generation is reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Sequence

from exactspec.engine import BatchEngine, SequenceRequest, verify_block
from exactspec.models.base import LanguageModel, check_token_ids
from exactspec.models.runtime import SequenceSlots
from exactspec.policy import GammaPolicy, RoutedPolicy
from exactspec.proposers import DraftModelProposer, Proposer, SequenceProposer
from exactspec.proposers.base import as_proposer
from exactspec.sampling import SamplingParams
from exactspec.stats import GenerationStats, RoundRecord

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

    ``draft`` is a language model with the target's vocabulary (drafted with the target's sampling settings), a
    :class:`exactspec.proposers.Proposer`, a single-sequence proposer (``reset`` / ``propose(context, gamma,
    generator)``), or ``None`` for plain decoding. ``policy`` (e.g. :class:`exactspec.policy.AdaptiveGamma`)
    chooses gamma per round from completed rounds and keeps learning across generations; without one, every round
    drafts ``GenerationConfig.gamma``.
    """

    def __init__(
        self,
        target: LanguageModel,
        draft: "LanguageModel | Proposer | SequenceProposer | None" = None,
        params: SamplingParams = SamplingParams(),
        policy: GammaPolicy | None = None,
    ) -> None:
        if draft is target:
            raise ValueError("the draft must be a different object from the target: they cannot share one cache")
        if isinstance(draft, LanguageModel):
            if draft.vocab_size != target.vocab_size:
                raise ValueError(f"draft vocabulary size {draft.vocab_size} differs from the target's {target.vocab_size}")
            draft = DraftModelProposer(SequenceSlots([draft]))
        elif draft is not None:
            draft = as_proposer(draft)
        self.target, self.params, self.proposer = target, params, draft
        self.engine = BatchEngine(SequenceSlots([target]), draft, policy=_OneSequencePolicy(policy))

    @property
    def policy(self) -> GammaPolicy | None:
        return self.engine.policy.policy

    @policy.setter
    def policy(self, policy: GammaPolicy | None) -> None:
        self.engine.policy = _OneSequencePolicy(policy)

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
        request = SequenceRequest(tuple(prompt), self.params, config.max_new_tokens, config.stop_token_ids, config.seed,
                                  speculation="off" if self.proposer is None else "draft",
                                  gamma=config.gamma if self.policy is None else "auto")
        committed = []
        handle = self.engine.submit(request, lambda events: committed.extend(e.token for e in events), lambda _: None)
        handle.stats = generation.stats
        try:
            while handle.finish_reason is None:
                self.engine.step()
                yield from committed
                committed.clear()
        finally:
            if handle.finish_reason is None:  # the caller stopped reading: free the slot
                handle.cancel()
                self.engine.step()
        if handle.finish_reason == "error":
            raise handle.exception
        generation.stop_reason = "stop_token" if handle.finish_reason == "stop" else "max_new_tokens"


class _OneSequencePolicy:
    """A :class:`GammaPolicy` (None: gamma fixed by the request) in the engine's batch-policy interface, for a batch
    of one sequence: a :class:`RoutedPolicy` selects the source the context routes to, then chooses or learns."""

    def __init__(self, policy: GammaPolicy | None) -> None:
        self.policy = policy

    def _selected(self, source: str) -> GammaPolicy:
        if isinstance(self.policy, RoutedPolicy):
            self.policy.select(source)
        return self.policy

    def choose(self, sources: list[str], fixed_rows: int = 0, fixed_tokens: float = 0.0) -> int:
        (source,) = sources
        return self._selected(source).next_gamma()

    def expected_tokens(self, source: str, gamma: int) -> float:  # asked only for neighbours, which one sequence has none of
        raise AssertionError("a batch of one sequence has no neighbours")

    def observe_round(self, source: str, record: RoundRecord) -> None:
        if self.policy is not None and source != "off":
            self._selected(source).observe(record)

    def observe_target(self, rows: int, seconds: float) -> None:
        pass  # the policy learns call costs from the round records

    def observe_draft(self, sequences: int, seconds_per_step: float) -> None:
        pass
