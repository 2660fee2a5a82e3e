"""Known-wrong speculative samplers, kept for the certification's self-check and for tests only.

Each is a :class:`exactspec.decoding.engine.BatchEngine` with one rule of a round replaced by a bug that real
engines have shipped (see the reference texts): the certification must reject every one of them at the sample
size it runs, which shows its power on the pair and settings at hand. ``needs`` says what a mutant's bug lives in:
a draft's distribution q (a draft model's or a trained feature-level draft's, both drafted through the engine's
``_draft_probs``) or its sampled drafts (the residual); prompt lookup has neither, only point masses.
"""

from __future__ import annotations

import torch

from exactspec.decoding.engine import BatchEngine
from exactspec.decoding.sampling import SamplingParams, block_probs
from exactspec.decoding.verify import VerifyResult, sample_from, verify_stochastic

__all__ = ["MUTANTS", "applies", "block_variant"]


class ResidualFromTarget(BatchEngine):
    """On rejection the replacement is drawn from p instead of normalize(max(0, p - q))."""

    needs = "sampled drafts"

    def _verify_rule(self, params, draft_tokens, draft_probs, target_probs, generator, rule):
        if params.greedy or draft_probs is None:
            return super()._verify_rule(params, draft_tokens, draft_probs, target_probs, generator, rule)
        result = verify_stochastic(draft_tokens, draft_probs, target_probs, generator)
        n = int(result.num_accepted[0])
        if n == draft_tokens.shape[1]:
            return result
        tokens = result.tokens.clone()
        tokens[0, n] = sample_from(
            target_probs[0, n : n + 1], torch.rand((1,), dtype=torch.float64, generator=generator)
        )[0]
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
        return torch.cat(
            [block_probs(logits[j : j + 1], context, [], prompt_length, params) for j in range(logits.shape[0])]
        )


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


def block_variant(
    draft_tokens,
    draft_probs,
    target_probs,
    generator,
    *,
    cap: bool = True,
    denominator: bool = True,
    last: bool = True,
    shared_uniform: bool = False,
    weighted_residual: bool = True,
) -> VerifyResult:
    """The block rule of :mod:`exactspec.decoding.block` for one row, written out step by step so that each switch
    turns one step into a misreading seen in other engines (all switches at their defaults: the rule itself, the
    same draws, the same tokens)."""
    p, q, tokens = target_probs[0].double(), draft_probs[0].double(), draft_tokens[0]
    gamma = tokens.shape[0]
    uniforms = torch.rand((1, gamma), dtype=torch.float64, generator=generator)[0]
    sample_uniform = torch.rand((1,), dtype=torch.float64, generator=generator)
    if shared_uniform:
        uniforms = uniforms[:1].expand(gamma)
    weights = [1.0]
    for i in range(gamma):
        weight = weights[-1] * float(p[i, tokens[i]] / q[i, tokens[i]])
        weights.append(min(1.0, weight) if cap else weight)
    passes = []
    for i in range(1, gamma + 1):
        if i == gamma:
            threshold = weights[gamma]
        else:
            residual = float((weights[i] * p[i] - q[i]).clamp(min=0).sum())
            total = residual + 1 - weights[i] if denominator else 1.0
            threshold = residual / total if total > 0 else 1.0
        passes.append(bool(uniforms[i - 1] < threshold))
    if last:
        tau = max([i + 1 for i, passed in enumerate(passes) if passed], default=0)
    else:
        tau = next((i for i, passed in enumerate(passes) if not passed), gamma)
    if tau == gamma:
        correction = p[gamma]
    else:
        correction = ((weights[tau] if weighted_residual else 1.0) * p[tau] - q[tau]).clamp(min=0)
        if correction.sum() <= 0:
            correction = p[tau]
    out = torch.full((1, gamma + 1), -1, dtype=torch.int64)
    out[0, :tau] = tokens[:tau]
    out[0, tau] = sample_from(correction.unsqueeze(0), sample_uniform)[0]
    return VerifyResult(torch.tensor([tau]), out)


class BlockRuleMutant(BatchEngine):
    """The block rule with one step misread (``variant``: a switch of :func:`block_variant`)."""

    needs = "sampled drafts"
    variant: dict = {}

    def _verify_rule(self, params, draft_tokens, draft_probs, target_probs, generator, rule):
        if params.greedy or draft_probs is None or rule != "block":
            return super()._verify_rule(params, draft_tokens, draft_probs, target_probs, generator, rule)
        return block_variant(draft_tokens, draft_probs, target_probs, generator, **self.variant)


def _block_mutant(name: str, doc: str, **variant) -> type[BatchEngine]:
    return type(name, (BlockRuleMutant,), {"variant": variant, "__doc__": doc})


BlockTokenwiseResidual = _block_mutant(
    "BlockTokenwiseResidual",
    "After the block decision the replacement is drawn from "
    "the token-wise residual max(0, p - q), not max(0, w_tau p - q).",
    weighted_residual=False,
)
BlockFirstFailure = _block_mutant(
    "BlockFirstFailure", "The block stops at the first position that fails, not at the last that passes.", last=False
)
BlockSharedUniform = _block_mutant(
    "BlockSharedUniform", "One uniform is compared with every position's threshold.", shared_uniform=True
)
BlockUncappedWeight = _block_mutant("BlockUncappedWeight", "The running weight is not capped at 1.", cap=False)
BlockNoDenominator = _block_mutant(
    "BlockNoDenominator",
    "The threshold is the next position's residual mass, not divided by it plus 1 - w.",
    denominator=False,
)


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
    "block_tokenwise_residual": BlockTokenwiseResidual,
    "block_first_failure": BlockFirstFailure,
    "block_shared_uniform": BlockSharedUniform,
    "block_uncapped_weight": BlockUncappedWeight,
    "block_no_denominator": BlockNoDenominator,
}
