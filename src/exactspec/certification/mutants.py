"""Known-wrong speculative samplers, kept for the certification's self-check and for tests only.

Each is a :class:`exactspec.decoding.engine.BatchEngine` with one rule of a round replaced by a bug that real
engines have shipped (see the reference texts): the certification must reject every one of them at the sample
size it runs, which shows its power on the pair and settings at hand. ``needs`` says what a mutant's bug lives in:
a draft's distribution q (a draft model's or a trained feature-level draft's, both drafted through the engine's
``_draft_probs``) or its sampled drafts (the residual); prompt lookup has neither, only point masses.
"""

from __future__ import annotations

import torch

from exactspec.decoding.sampling import SamplingParams, block_probs
from exactspec.decoding.engine import BatchEngine
from exactspec.decoding.verify import VerifyResult, sample_from, verify_stochastic

__all__ = ["MUTANTS", "applies"]


class ResidualFromTarget(BatchEngine):
    """On rejection the replacement is drawn from p instead of normalize(max(0, p - q))."""

    needs = "sampled drafts"

    def _verify_rule(self, params, draft_tokens, draft_probs, target_probs, generator):
        if params.greedy or draft_probs is None:
            return super()._verify_rule(params, draft_tokens, draft_probs, target_probs, generator)
        result = verify_stochastic(draft_tokens, draft_probs, target_probs, generator)
        n = int(result.num_accepted[0])
        if n == draft_tokens.shape[1]:
            return result
        tokens = result.tokens.clone()
        tokens[0, n] = sample_from(target_probs[0, n : n + 1], torch.rand((1,), dtype=torch.float64, generator=generator))[0]
        return VerifyResult(result.num_accepted, tokens)


class UnprocessedDraft(BatchEngine):
    """Draft tokens are drawn from the processed q, but the verifier is handed the raw softmax (temperature 1, no
    truncation, no penalties): the draft distribution taken before the processors."""

    needs = "draft distribution"

    def _draft_probs(self, logits, prefix, prompt_length, params, token_ids=None):
        q, _ = super()._draft_probs(logits, prefix, prompt_length, params, token_ids)
        return q, torch.softmax(logits[0].double(), dim=-1)


class PenaltiesOncePerRound(BatchEngine):
    """The target's penalties are computed once per round from the context, not per position from each
    position's own prefix (earlier draft tokens of the block not counted)."""

    needs: str | None = None

    def _target_probs(self, logits, context, block, prompt_length, params):
        return torch.cat([block_probs(logits[j : j + 1], context, [], prompt_length, params) for j in range(logits.shape[0])])


class ArgmaxDraftSampledRatio(BatchEngine):
    """The draft proposes its argmax but the verifier applies min(1, p/q) as if the token had been sampled."""

    needs = "draft distribution"

    def _draft_probs(self, logits, prefix, prompt_length, params, token_ids=None):
        q, _ = super()._draft_probs(logits, prefix, prompt_length, params, token_ids)
        return torch.nn.functional.one_hot(q.argmax(), q.shape[0]).double(), q


class PrecisionMismatch(BatchEngine):
    """Draft tokens are sampled from q computed on bfloat16-rounded logits, the verifier is handed q from the
    full-precision logits: drafts sampled in one precision and checked in another."""

    needs = "draft distribution"

    def _draft_probs(self, logits, prefix, prompt_length, params: SamplingParams, token_ids=None):
        rounded, _ = super()._draft_probs(logits.to(torch.bfloat16).float(), prefix, prompt_length, params, token_ids)
        q, _ = super()._draft_probs(logits, prefix, prompt_length, params, token_ids)
        return rounded, q


def applies(mutant: type[BatchEngine], drafting: str) -> bool:
    """Whether ``drafting`` (``"draft model"``, ``"feature draft"`` or ``"lookup"``) has the rule ``mutant`` breaks
    (see the module docstring)."""
    return mutant.needs is None or drafting != "lookup"


MUTANTS: dict[str, type[BatchEngine]] = {
    "residual_from_p": ResidualFromTarget,
    "unprocessed_q": UnprocessedDraft,
    "penalties_once_per_round": PenaltiesOncePerRound,
    "argmax_draft_sampled_ratio": ArgmaxDraftSampledRatio,
    "precision_mismatch": PrecisionMismatch,
}
