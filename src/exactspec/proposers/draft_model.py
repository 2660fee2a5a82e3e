"""Draft tokens from a smaller language model.

The draft's distribution ``q`` of each position is built by the same pipeline
as the target's ``p`` (:func:`exactspec.sampling.block_probs`), from the prefix
that position conditions on: the context plus the draft tokens drawn so far.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from exactspec.models.base import LanguageModel
from exactspec.proposers.base import Draft
from exactspec.sampling import SamplingParams, block_probs
from exactspec.verify import greedy_token, sample_from


class DraftModelProposer:
    """Samples ``gamma`` tokens autoregressively from ``model``.

    The model's cache always holds a prefix of the tokens this proposer fed it
    (``self._fed``); at each call the cache is rolled back to the longest prefix
    that the new context shares with it and the missing tokens are fed in one
    call. After a fully accepted round that is how the draft catches up on its
    last token. Random numbers: one float64 uniform per sampled draft token,
    from the engine's generator, in order; none in greedy mode.
    """

    def __init__(self, model: LanguageModel, params: SamplingParams) -> None:
        self.model = model
        self.params = params
        self.prompt_length = 0  # set by reset(); penalties count generated tokens after it
        self._fed: list[int] = []  # the tokens in the model's cache
        self._committed = 0  # a prefix of _fed known to be committed (contexts only grow)
        self._caught_up_from = 0  # cache length before the last catch-up

    def reset(self, prompt: Sequence[int]) -> None:
        """Start a sequence. The prompt is prefilled lazily, at the first proposal, so a generation
        that never speculates (the adaptive policy chose plain decoding) never pays for it."""
        self.prompt_length = len(prompt)
        self._fed, self._committed = [], 0

    def _catch_up(self, context: Sequence[int]) -> torch.Tensor:  # (V,) logits after context
        limit = min(len(self._fed), len(context) - 1)  # feed at least the last context token
        keep = min(self._committed, limit)
        if self._fed[:keep] != list(context[:keep]):  # not a continuation (no reset between sequences)
            keep = 0
        while keep < limit and self._fed[keep] == context[keep]:
            keep += 1
        missing = list(context[keep:])
        self._caught_up_from = keep
        if keep == 0:
            logits = self.model.prefill(missing)
        else:
            self.model.rollback(keep)
            logits = self.model.forward(missing)
        self._fed = list(context)
        self._committed = len(context)
        return logits[-1]

    def propose(self, context: Sequence[int], gamma: int, generator: torch.Generator) -> Draft:
        if gamma <= 0:
            return Draft([], None)
        prefix = list(context)
        start = time.perf_counter()
        logits = self._catch_up(prefix)
        # feeding more than the usual 1-2 tokens (a prefill, or catching up after plain rounds) is setup
        setup = time.perf_counter() - start if len(prefix) - self._caught_up_from > 2 else 0.0
        tokens: list[int] = []
        rows: list[torch.Tensor] = []
        for step in range(gamma):
            q = block_probs(logits.unsqueeze(0), prefix, [], self.prompt_length, self.params)[0]  # (V,)
            if self.params.greedy:
                token = int(greedy_token(q))
            else:
                uniform = torch.rand((1,), dtype=torch.float64, generator=generator)
                token = int(sample_from(q.unsqueeze(0), uniform)[0])
            tokens.append(token)
            rows.append(q)
            prefix.append(token)
            if step < gamma - 1:
                logits = self.model.forward([token])[-1]
                self._fed.append(token)
        return Draft(tokens, None if self.params.greedy else torch.stack(rows), setup)
