"""One generation at a time: :class:`SpeculativeDecoder`, the library's entry point, as a batch of one.

It runs the engine's loop (:mod:`exactspec.decoding.engine`; Leviathan et al. 2023, Algorithm 1) on one slot over the
target model itself (:class:`exactspec.models.runtime.SequenceSlots`), so a generation here and a served request
are the same rounds and the same rules::

    draft  = proposer.propose(context, gamma)              gamma tokens [+ q]
    logits = target.forward([last] + draft.tokens)         gamma + 1 positions, one call
    p      = block_probs(logits, ...)                      same pipeline as q
    result = verify(p, q, draft.tokens)                    accepted prefix + replacement/bonus token
    target.rollback(...)                                   cache = committed history minus the newest token

A call's keywords are the fields of the one request type, :class:`exactspec.decoding.engine.SequenceRequest`, which
validates them; the result is a :class:`Generation`, filled as the tokens stream.

Random numbers: a fresh ``torch.Generator`` seeded with the request's seed; the first token (from the prompt's
prefill) consumes one uniform, then per round the proposer's draws come first, then the verifier's (see
:mod:`exactspec.decoding.verify`). With a fixed gamma a seeded generation is reproducible.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from exactspec.decoding.engine import BatchEngine, SequenceRequest, verify_block
from exactspec.decoding.policy import AdaptiveGamma
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.stats import GenerationStats
from exactspec.models.base import LanguageModel
from exactspec.models.runtime import SequenceSlots
from exactspec.proposers import DraftModelProposer, Proposer, SequenceProposer
from exactspec.proposers.base import as_proposer

__all__ = ["Generation", "SpeculativeDecoder", "TokenStream", "verify_block"]


@dataclass
class Generation:
    """One generation's result, filled as its tokens are committed."""

    prompt_ids: list[int]
    seed: int
    tokens: list[int] = field(default_factory=list)  # generated tokens (prompt excluded), the stop token included
    finish_reason: str | None = None  # the engine's: "stop" (a stop token), "length", "cancelled", "error"
    stats: GenerationStats = field(default_factory=GenerationStats)
    policy: dict | None = None  # the gamma policy's cold start, where one ran (exactspec.speculator)


class TokenStream(Iterator[int]):
    """The generated tokens as they are committed, and the :class:`Generation` they fill (complete once the
    stream is exhausted; closing the stream early keeps what was committed)."""

    def __init__(self, tokens: Iterator[int], generation: Generation) -> None:
        self._tokens, self.generation = tokens, generation

    def __next__(self) -> int:
        return next(self._tokens)

    def close(self) -> None:
        self._tokens.close()


class SpeculativeDecoder:
    """Exact speculative decoding of ``target`` with proposals from ``draft``.

    ``draft`` is a language model with the target's vocabulary (drafted with the target's sampling settings), a
    :class:`exactspec.proposers.Proposer`, a single-sequence proposer (``reset`` / ``propose(context, gamma,
    generator)``), or ``None`` for plain decoding. ``policy`` (:class:`exactspec.decoding.policy.AdaptiveGamma`) is
    the gamma policy of requests with ``gamma="auto"``; it keeps learning across generations.
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
        self.engine = BatchEngine(SequenceSlots([target]), draft, policy=policy)

    @property
    def policy(self) -> AdaptiveGamma:
        return self.engine.policy

    @policy.setter
    def policy(self, policy: AdaptiveGamma) -> None:
        self.engine.policy = policy

    def generate(self, prompt_ids: Sequence[int], **request: object) -> Generation:
        """The whole generation; ``request``: the keywords of :meth:`stream`."""
        stream = self.stream(prompt_ids, **request)
        for _ in stream:
            pass
        return stream.generation

    def stream(
        self,
        prompt_ids: Sequence[int],
        *,
        max_new_tokens: int = 64,
        gamma: int | str = 4,
        stop_token_ids: Sequence[int] = (),
        seed: int = 0,
        verify: str = "block",
        compare_rules: bool = False,
    ) -> TokenStream:
        """Stream one generation with this decoder's sampling settings. ``gamma``: draft tokens per round (0 is plain
        decoding) or "auto" (the policy's); the stop token is kept; the other keywords are
        :class:`exactspec.decoding.engine.SequenceRequest`'s."""
        request = SequenceRequest(
            prompt=tuple(prompt_ids),
            params=self.params,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            seed=seed,
            speculation="off" if self.proposer is None else "draft",
            gamma=gamma,
            verify=verify,
            compare_rules=compare_rules,
        )
        generation = Generation(list(request.prompt), seed)
        return TokenStream(self._run(request, generation), generation)

    def _run(self, request: SequenceRequest, generation: Generation) -> Iterator[int]:
        committed, began = [], time.perf_counter()
        handle = self.engine.submit(
            request, lambda events: committed.extend(e.token for e in events), lambda _: None, generation.stats
        )
        try:
            while handle.finish_reason is None:
                self.engine.step()
                generation.tokens += committed
                yield from committed
                committed.clear()
        finally:
            generation.stats.wall_seconds = time.perf_counter() - began  # the caller's work between tokens included
            if handle.finish_reason is None:  # the caller stopped reading: free the slot
                handle.cancel()
                self.engine.step()
            generation.finish_reason = handle.finish_reason
        if handle.finish_reason == "error":
            raise handle.exception
