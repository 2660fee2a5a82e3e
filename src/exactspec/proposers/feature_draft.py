"""Draft tokens from a feature-level draft (:mod:`exactspec.models.eagle`) that reads the target's hidden states.

The engine hands the proposer the target's features of every position its calls computed and kept
(:meth:`FeatureDraftProposer.observe_target`: the prompt's prefill, then the fed token and the accepted drafts of
each round), so drafting never makes a target call of its own. At a proposal for a context of n tokens the
features of positions 0..n-2 are known; the draft's cache is rolled back to the slots built from them, the
missing ones are fed in one call, and each further draft step feeds the draft's own output as the next feature.

q of each step is the draft's distribution over its vocabulary subset S with the same sampling pipeline as the
target's p (:func:`exactspec.sampling.block_probs` on S's columns, equal to the full vocabulary's with logits
-inf outside S), so a sampled token is checked with min(1, p/q) and a greedy one as a point mass, as for any
proposer.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from exactspec.models.eagle import FeatureDraftRunner
from exactspec.proposers.base import Draft
from exactspec.sampling import SamplingParams, block_probs, full_width
from exactspec.verify import greedy_token, sample_from

__all__ = ["FeatureDraftProposer"]


class FeatureDraftProposer:
    reads_target_features = True

    def __init__(self, runner: FeatureDraftRunner, vocab_size: int, params: SamplingParams) -> None:
        self.runner = runner
        self.params = params
        self.vocab_size = vocab_size
        self.feature_layers = runner.draft.cfg.feature_layers
        ids = runner.draft.vocab_ids.cpu()
        self._ids = ids[ids < vocab_size]  # S within the target's real vocabulary
        self.prompt_length = 0
        self._pending: list[torch.Tensor] = []  # target features not yet fed to the draft, in position order
        self._known = 0  # target positions whose features were observed
        self._true_slots = 0  # draft slots built from target features
        self._last_u: torch.Tensor | None = None  # (1, C) the input of the last of them

    def reset(self, prompt: Sequence[int]) -> None:
        self.prompt_length = len(prompt)
        self._pending, self._known, self._true_slots = [], 0, 0
        self.runner.rollback(0)

    def observe_target(self, features: torch.Tensor) -> None:  # (n, F): the target's next n positions
        self._pending.append(features)
        self._known += features.shape[0]

    def propose(self, context: Sequence[int], gamma: int, generator: torch.Generator) -> Draft:
        if gamma <= 0:
            return Draft([], None)
        n = len(context)
        if self._known != n - 1:
            raise RuntimeError(f"the target's features cover {self._known} positions, the context needs {n - 1}")
        start = time.perf_counter()
        if self._pending:  # the target's new positions, after the slots already built from its features
            first, u = self._true_slots, self.runner.project(torch.cat(self._pending))
        else:  # the same context again (calibration): rebuild its last slot
            first, u = n - 2, self._last_u
        fed = n - 1 - first
        self.runner.rollback(first)  # also drops last round's predicted slots
        g, logits = self.runner.step(u, list(context[first + 1 : n]))
        self._pending, self._true_slots, self._last_u = [], n - 1, u[-1:]
        setup = time.perf_counter() - start if fed > 2 else 0.0  # a prompt's worth of slots is setup, not a step
        prefix, tokens, rows = list(context), [], []
        for step in range(gamma):
            q = self._probs(logits, prefix)
            if q is None:  # the sampling settings exclude all of S: propose what we have
                break
            if self.params.greedy:
                column = greedy_token(q)
            else:
                column = sample_from(q.unsqueeze(0), torch.rand((1,), dtype=torch.float64, generator=generator))[0]
            token = int(self._ids[column])
            tokens.append(token)
            rows.append(q)
            prefix.append(token)
            if step < gamma - 1:
                g, logits = self.runner.step(g.unsqueeze(0), [token])
        probs = None if self.params.greedy or not rows else full_width(torch.stack(rows), self._ids, self.vocab_size)
        return Draft(tokens, probs, setup)

    def _probs(self, subset_logits: torch.Tensor, prefix: list[int]) -> torch.Tensor | None:  # (|S|,) -> (|S|,) or None
        try:
            return block_probs(subset_logits[: len(self._ids)].cpu().unsqueeze(0), prefix, [], self.prompt_length, self.params, token_ids=self._ids)[0]
        except ValueError:
            return None
