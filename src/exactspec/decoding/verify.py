"""Verification of drafted tokens: the mathematics of exact speculative sampling.

Vocabulary (as in vLLM's rejection sampler):

* draft tokens: the ``gamma`` tokens a proposer suggests for one round;
* accepted tokens: the longest prefix of draft tokens that passes verification;
* recovered token: the token drawn at the first rejected position, from the
  residual ``normalize(max(0, p - q))``;
* bonus token: drawn from the target's distribution after the last draft token
  when every draft token was accepted.

A round therefore commits ``num_accepted + 1`` tokens, between 1 and ``gamma + 1``.

The rules (Leviathan et al. 2023, "Fast Inference from Transformers via
Speculative Decoding", Algorithm 1 and Appendix A.1; Chen et al. 2023):

    accept x ~ q   with probability  min(1, p(x) / q(x))            (eq. 1)
    on rejection   draw from          max(0, p - q) / sum max(0, p - q)   (eq. 2)

so the output law is ``min(p, q) + (1 - sum min(p, q)) * residual = p``.
A deterministic proposal (n-gram lookup, a draft's argmax) is the point mass
``q = one_hot(x)``: it is accepted with probability ``p(x)`` and on rejection the
token is drawn from ``p`` with ``x`` removed and renormalised. Greedy
verification (temperature 0) keeps the draft prefix that equals the target
argmax and commits the argmax at the first mismatch; ties go to the lowest id.

Randomness: every random number comes from the caller's ``torch.Generator``
and is drawn in float64 (float32 uniforms can be exactly 0). One call of
:func:`verify_stochastic` or :func:`verify_point_mass` consumes exactly, in this
order: ``torch.rand((B, gamma))`` acceptance uniforms, then ``torch.rand((B,))``
uniforms for the recovered or bonus draw (inverse-CDF sampling), whatever the
outcome. A seed therefore reproduces a run.

Probability tensors may be float32 or float64; the arithmetic is float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = [
    "VerifyResult",
    "verify_stochastic",
    "verify_point_mass",
    "verify_greedy",
    "verify_with_uniforms",
    "greedy_token",
    "sample_from",
    "acceptance_probabilities",
    "accepted_mass",
    "rejection_probability",
    "residual_distribution",
    "output_law",
    "naive_output_law",
    "independent_match_rate",
    "check_distribution",
    "check_block",
    "checked_block",
    "draw_uniforms",
]

#: The largest ``|sum(p) - 1|`` of a row that counts as rounding, by the dtype the distribution arrives in: about
#: ten times what a softmax over 50,000 entries is off in that precision (float32: ~1e-6). A row within it is
#: renormalised in float64; a row beyond it is refused.
NORMALIZATION_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of verifying one block per batch row.

    ``num_accepted[b]`` draft tokens were accepted in row ``b``; the committed
    tokens of that row are ``tokens[b, : num_accepted[b] + 1]`` (the accepted
    draft tokens followed by the recovered or bonus token). Later entries are -1.
    """

    num_accepted: torch.Tensor  # (B,) int64 in [0, gamma]
    tokens: torch.Tensor  # (B, gamma + 1) int64, -1 after the committed tokens

    def committed(self, row: int = 0) -> list[int]:
        """The committed tokens of one batch row as a list."""
        return self.tokens[row, : int(self.num_accepted[row]) + 1].tolist()


# ---------------------------------------------------------------- input checks


def check_distribution(probs: torch.Tensor, name: str) -> torch.Tensor:
    """Return ``probs`` as float64 distributions: each row divided by its sum where rounding left it off 1.

    Raises ValueError for NaN, inf, negative entries or rows that do not sum to 1 within
    :data:`NORMALIZATION_TOLERANCE` of their dtype.
    """
    if not isinstance(probs, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(probs).__name__}")
    if not probs.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {probs.dtype}")
    if probs.shape[-1] == 0:
        raise ValueError(f"{name} has an empty vocabulary dimension")
    dtype = str(probs.dtype).removeprefix("torch.")
    tolerance = NORMALIZATION_TOLERANCE.get(probs.dtype, NORMALIZATION_TOLERANCE[torch.float16])
    probs = probs.to(torch.float64)
    # One pass for the minimum (NaN propagates through it) and one for the row sums (an inf makes one inf or NaN);
    # the slower element-wise checks below only run to name what is wrong.
    sums = probs.sum(-1)
    if probs.numel() == 0:
        return probs
    off = (sums - 1).abs().max()
    if bool(probs.min() >= 0) and bool(off <= tolerance):
        return probs / sums.unsqueeze(-1) if off > 1e-12 else probs
    if not torch.isfinite(probs).all():
        raise ValueError(f"{name} contains NaN or infinite values")
    if (probs < 0).any():
        raise ValueError(f"{name} contains negative probabilities")
    raise ValueError(
        f"{name} is not normalised: a row sums to {float(sums.flatten()[(sums - 1).abs().flatten().argmax()]):.9g}, "
        f"more than {tolerance:g} off 1 (the rounding allowed for {dtype})"
    )


def check_block(draft_tokens: torch.Tensor, target_probs: torch.Tensor) -> tuple[int, int, int]:
    if draft_tokens.dim() != 2:
        raise ValueError(f"draft_tokens must have shape (B, gamma), got {tuple(draft_tokens.shape)}")
    if draft_tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"draft_tokens must be an integer tensor, got {draft_tokens.dtype}")
    batch, gamma = draft_tokens.shape
    if target_probs.dim() != 3 or target_probs.shape[:2] != (batch, gamma + 1):
        raise ValueError(
            f"target_probs must have shape (B, gamma + 1, V) = ({batch}, {gamma + 1}, V), "
            f"got {tuple(target_probs.shape)}"
        )
    vocab = target_probs.shape[-1]
    if gamma and (draft_tokens.min() < 0 or draft_tokens.max() >= vocab):
        raise ValueError(f"a draft token id is outside the vocabulary [0, {vocab})")
    return batch, gamma, vocab


# ------------------------------------------------------- single-position laws


def acceptance_probabilities(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``min(1, p(x) / q(x))`` for every token x (eq. 1); 0 where ``q(x) = 0`` (never proposed).

    Shapes: ``(..., V)`` for both, result ``(..., V)`` float64.
    """
    p, q = target_probs.to(torch.float64), draft_probs.to(torch.float64)
    ratio = torch.where(q > 0, p / torch.where(q > 0, q, 1.0), 0.0)
    return ratio.clamp(max=1.0)


def accepted_mass(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``q(x) * min(1, p(x)/q(x)) = min(p(x), q(x))``: mass that reaches the output by acceptance."""
    return torch.minimum(target_probs.to(torch.float64), draft_probs.to(torch.float64))


def rejection_probability(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``1 - sum min(p, q) = sum max(0, p - q)``, computed as the latter (no cancellation). Shape ``(...)``."""
    p, q = target_probs.to(torch.float64), draft_probs.to(torch.float64)
    return (p - q).clamp(min=0).sum(-1)


def residual_distribution(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``max(0, p - q) / sum max(0, p - q)`` (eq. 2), shape ``(..., V)`` float64.

    Where the residual mass is zero (``p == q``: rejection never happens) the row
    is returned as all zeros; it is never divided by zero.
    """
    p, q = target_probs.to(torch.float64), draft_probs.to(torch.float64)
    residual = (p - q).clamp(min=0)
    mass = residual.sum(-1, keepdim=True)
    return torch.where(mass > 0, residual / torch.where(mass > 0, mass, 1.0), 0.0)


def output_law(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """Exact law of the token one verification step emits: ``min(p,q) + P(reject) * residual``.

    Equals ``p`` for any pair of distributions (Leviathan et al. 2023, Theorem 3.5).
    """
    rejection = rejection_probability(target_probs, draft_probs).unsqueeze(-1)
    return accepted_mass(target_probs, draft_probs) + rejection * residual_distribution(target_probs, draft_probs)


def naive_output_law(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """The WRONG law obtained by drawing the replacement from ``p`` instead of the residual."""
    rejection = rejection_probability(target_probs, draft_probs).unsqueeze(-1)
    return accepted_mass(target_probs, draft_probs) + rejection * target_probs.to(torch.float64)


def independent_match_rate(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """``sum p(x) q(x)``: how often two independent draws agree (the needless 'match' criterion)."""
    return (target_probs.to(torch.float64) * draft_probs.to(torch.float64)).sum(-1)


# ------------------------------------------------------------------- sampling


def sample_from(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw: the smallest x with ``cdf(x) > u * total``.

    ``probs``: ``(B, V)`` non-negative, need not be normalised (rows must have
    positive mass); ``uniforms``: ``(B,)`` float64 in [0, 1). Returns ``(B,)`` int64.
    Tokens of zero probability are never returned.
    """
    probs = probs.to(torch.float64)
    cdf = probs.cumsum(-1)  # (B, V)
    threshold = uniforms.to(torch.float64) * cdf[:, -1]  # (B,)
    tokens = torch.searchsorted(cdf, threshold.unsqueeze(-1), right=True).squeeze(-1)
    if (tokens >= probs.shape[-1]).any():
        # u * total rounded up to total (chance ~2^-53): take the last token with positive mass.
        last_positive = probs.shape[-1] - 1 - (probs > 0).flip(-1).to(torch.uint8).argmax(-1)
        tokens = torch.minimum(tokens, last_positive)
    return tokens


def greedy_token(probs_or_logits: torch.Tensor) -> torch.Tensor:
    """Argmax over the last dimension with ties broken towards the LOWEST token id. ``(..., V) -> (...)``.

    torch's and NumPy's argmax both return the first maximal index (documented; tests/test_verify.py checks ties
    at every position and width) in one pass, and both take a NaN for the maximum. On the CPU, float32 and float64
    go through NumPy's, which is vectorised and several times faster on a 49k-token row; it runs once per committed
    token in greedy decoding."""
    if probs_or_logits.device.type == "cpu" and probs_or_logits.dtype in (torch.float32, torch.float64):
        return torch.as_tensor(probs_or_logits.detach().numpy().argmax(-1))
    return probs_or_logits.argmax(-1)


# ------------------------------------------------------------------ verifiers


def verify_stochastic(
    draft_tokens: torch.Tensor,  # (B, gamma) int64, drawn from draft_probs
    draft_probs: torch.Tensor,  # (B, gamma, V) the distributions the draft tokens were drawn from
    target_probs: torch.Tensor,  # (B, gamma + 1, V) effective target distributions, incl. the bonus position
    generator: torch.Generator,
) -> VerifyResult:
    """Speculative sampling of one block per row (Leviathan et al. 2023, Algorithm 1).

    Position ``i`` is accepted with probability ``min(1, p_i(x_i)/q_i(x_i))``
    (eq. 1); the first rejection at ``n`` commits a token from
    ``normalize(max(0, p_n - q_n))`` (eq. 2) and discards the rest of the block;
    if all ``gamma`` are accepted the bonus token is drawn from ``p_{gamma+1}``.
    Raises ValueError when a proposed token has ``q(x) = 0``, which correct
    drafting cannot produce.
    """
    batch, gamma, _ = check_block(draft_tokens, target_probs)
    if draft_probs.shape != target_probs[:, :gamma].shape:
        raise ValueError(
            f"draft_probs must have shape (B, gamma, V) = {tuple(target_probs[:, :gamma].shape)}, "
            f"got {tuple(draft_probs.shape)}"
        )
    accept_uniforms, sample_uniforms = draw_uniforms(batch, gamma, generator)
    return verify_with_uniforms(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)


def verify_point_mass(
    draft_tokens: torch.Tensor,  # (B, gamma) int64, proposed deterministically
    target_probs: torch.Tensor,  # (B, gamma + 1, V)
    generator: torch.Generator,
) -> VerifyResult:
    """Verification of deterministic proposals: ``q = one_hot(x)``.

    Eq. 1 becomes "accept with probability ``p(x)``" and eq. 2 becomes "draw from
    ``p`` with ``x`` removed, renormalised". Same random-number consumption as
    :func:`verify_stochastic`.
    """
    batch, gamma, _ = check_block(draft_tokens, target_probs)
    accept_uniforms, sample_uniforms = draw_uniforms(batch, gamma, generator)
    return verify_with_uniforms(draft_tokens, None, target_probs, accept_uniforms, sample_uniforms)


def draw_uniforms(batch: int, gamma: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented consumption: (B, gamma) acceptance uniforms, then (B,) sampling uniforms, float64."""
    if not isinstance(generator, torch.Generator):
        raise TypeError("an explicit torch.Generator is required: exactspec never uses the global RNG")
    accept_uniforms = torch.rand((batch, gamma), dtype=torch.float64, generator=generator)
    sample_uniforms = torch.rand((batch,), dtype=torch.float64, generator=generator)
    return accept_uniforms, sample_uniforms


def verify_with_uniforms(
    draft_tokens: torch.Tensor,  # (B, gamma) int64
    draft_probs: torch.Tensor | None,  # (B, gamma, V), or None for point-mass proposals
    target_probs: torch.Tensor,  # (B, gamma + 1, V)
    accept_uniforms: torch.Tensor,  # (B, gamma) float64 in [0, 1)
    sample_uniforms: torch.Tensor,  # (B,) float64 in [0, 1)
) -> VerifyResult:
    """The verifier as a pure function of its uniforms (what the exact-law tests integrate over).

    Draft token ``i`` is accepted iff ``u_i < p_i(x_i) / q_i(x_i)``, which has
    probability ``min(1, p/q)`` for ``u_i ~ U[0, 1)``; the recovered or bonus
    token is the inverse-CDF draw of ``sample_uniforms`` from
    ``max(0, p_n - q_n)`` (with ``q = 0`` at the bonus position).
    """
    p, q, tokens = checked_block(draft_tokens, draft_probs, target_probs)
    batch, gamma = tokens.shape
    q_of_draft = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, gamma)
    p_of_draft = p[:, :gamma].gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, gamma)
    accepted = accept_uniforms < p_of_draft / q_of_draft  # (B, gamma)
    num_accepted = accepted.long().cumprod(-1).sum(-1)  # (B,) length of the accepted prefix
    rows = torch.arange(batch)
    p_at_stop = _rows_at(p, num_accepted)  # (B, V): p_n, or the bonus distribution when n == gamma
    correction = p_at_stop
    if gamma:  # q_n at a rejection; q = 0 at the bonus position
        rejected = (num_accepted < gamma).to(torch.float64).unsqueeze(-1)  # (B, 1)
        correction = (
            _rows_at(q, num_accepted.clamp(max=gamma - 1)).mul_(-rejected).add_(p_at_stop).clamp_(min=0)
        )  # in place: one (B, V) buffer
    # A rejection with zero residual mass can only come from rounding (p, q equal up to 1e-16):
    # fall back to p there rather than dividing by zero.
    no_mass = correction.sum(-1, keepdim=True) <= 0  # (B, 1)
    if no_mass.any():
        correction = torch.where(no_mass, p_at_stop, correction)
    final = sample_from(correction, sample_uniforms)  # (B,)
    out = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    positions = torch.arange(gamma + 1).unsqueeze(0)  # (1, gamma + 1)
    out[:, :gamma] = torch.where(positions[:, :gamma] < num_accepted.unsqueeze(-1), tokens, -1)
    out[rows, num_accepted] = final
    return VerifyResult(num_accepted=num_accepted, tokens=out)


def checked_block(
    draft_tokens: torch.Tensor,  # (B, gamma) int64
    draft_probs: torch.Tensor | None,  # (B, gamma, V), or None for point-mass proposals
    target_probs: torch.Tensor,  # (B, gamma + 1, V)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(p, q, tokens)`` of a block, checked, in float64: q of a point-mass proposal is its one-hot rows. Raises
    ValueError when a proposed token has ``q(x) = 0``, which correct drafting cannot produce."""
    batch, gamma, vocab = check_block(draft_tokens, target_probs)
    p = check_distribution(target_probs, "target_probs")
    tokens = draft_tokens.long()
    if draft_probs is None:
        q = torch.zeros((batch, gamma, vocab), dtype=torch.float64).scatter_(-1, tokens.unsqueeze(-1), 1.0)
    else:
        if draft_probs.shape != target_probs[:, :gamma].shape:
            raise ValueError(
                f"draft_probs must have shape (B, gamma, V) = {tuple(target_probs[:, :gamma].shape)}, "
                f"got {tuple(draft_probs.shape)}"
            )
        q = check_distribution(draft_probs, "draft_probs")
    q_of_draft = q.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)  # (B, gamma)
    if (q_of_draft <= 0).any():
        row, pos = (q_of_draft <= 0).nonzero()[0].tolist()
        raise ValueError(
            f"draft token {int(tokens[row, pos])} at position {pos} of row {row} has draft probability 0: "
            "it cannot have been sampled from draft_probs"
        )
    return p, q, tokens


def _rows_at(probs: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:  # probs (B, n, V), positions (B,)
    """Row ``positions[b]`` of each batch element ``b``: ``(B, V)`` (an index_select, cheaper than fancy indexing)."""
    batch, n, vocab = probs.shape
    return probs.reshape(batch * n, vocab).index_select(0, torch.arange(batch) * n + positions)


def verify_greedy(
    draft_tokens: torch.Tensor,  # (B, gamma) int64
    target_scores: torch.Tensor,  # (B, gamma + 1, V) target logits or probabilities (any monotone score)
) -> VerifyResult:
    """Greedy verification: keep the longest draft prefix equal to the target argmax, then
    commit the target argmax at the first mismatch (or after the last draft token).

    Ties are broken towards the lowest token id (:func:`greedy_token`). Consumes no randomness.
    """
    batch, gamma, _ = check_block(draft_tokens, target_scores)
    argmax = greedy_token(target_scores)  # (B, gamma + 1)
    best = target_scores.gather(-1, argmax.unsqueeze(-1))  # NaN where a row holds one (argmax takes NaN as the maximum)
    if torch.isnan(best).any() or torch.isneginf(best).any():
        raise ValueError("target_scores contains NaN or a row with no finite value")
    matches = draft_tokens.long() == argmax[:, :gamma]
    num_accepted = matches.long().cumprod(-1).sum(-1)
    out = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    positions = torch.arange(gamma + 1).unsqueeze(0)
    keep = positions <= num_accepted.unsqueeze(-1)
    out[keep] = argmax[keep]  # accepted draft tokens equal the argmax, so one gather serves both
    return VerifyResult(num_accepted=num_accepted, tokens=out)
