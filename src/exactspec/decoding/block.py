"""Block verification: the optimal exact rule for one drafted chain (Sun et al. 2025, "Block Verification
Accelerates Speculative Decoding", arXiv 2403.10444, Algorithm 2).

Token-wise verification (:mod:`exactspec.decoding.verify`) decides position by position and stops at the first
rejection. The block rule decides on the drafted block ``x_1 .. x_g`` jointly. With ``p_i`` and ``q_i`` the
target's and the draft's distributions at position ``i`` (after ``x_1 .. x_{i-1}``):

    w_0 = 1,   w_i = min(1, w_{i-1} * p_i(x_i) / q_i(x_i))                      capped running weight   (B1)
    r_i = sum_x max(0, w_i * p_{i+1}(x) - q_{i+1}(x))                           next position's residual (B2)
    h_i = r_i / (r_i + 1 - w_i)   for 1 <= i < g,    h_g = w_g,    h_0 = 1       threshold                (B3)
    tau = the LAST i in 0..g with  u_i < h_i  (u_1 .. u_g independent uniforms)                           (B4)
    commit x_1 .. x_tau, then a token from  normalize(max(0, w_tau * p_{tau+1} - q_{tau+1}))  if tau < g,
                                       from  p_{g+1}                                         if tau = g   (B5)

The output follows the target's law for any draft distributions q (point masses included), and the expected
accepted length is at least token-wise's, draft by draft. For g = 1 the two rules coincide; for g >= 2 they
differ (a later position can accept a block whose earlier token token-wise would reject).

Where ``r_i + 1 - w_i = 0`` (``w_i = 1`` and ``p_{i+1} <= q_{i+1}``, so ``p_{i+1} = q_{i+1}``), ``h_i = 1``: the
running weight then stays 1 and a later position passes surely, so no block ends on an empty residual; one left
empty by rounding falls back to ``p_{tau+1}``, as the token-wise rule does.

Given the drafted tokens, ``P(tau >= i) = 1 - prod_{j = i..g} (1 - h_j)`` (B6), so a round's expected accepted
length under either rule, and for every shorter gamma, follows from its p and q alone
(:func:`expected_accepted`).

Randomness: the same consumption as token-wise verification, ``torch.rand((B, g))`` (the ``u_i``), then
``torch.rand((B,))`` for the replacement or bonus draw, float64 (draw order version 2 names the rule that reads
them).
"""

from __future__ import annotations

import torch

from exactspec.decoding.verify import VerifyResult, check_block, checked_block, draw_uniforms, sample_from

__all__ = [
    "RULES",
    "check_rule",
    "block_thresholds",
    "verify_block_rule",
    "verify_block_with_uniforms",
    "expected_accepted",
    "tokenwise_expected_accepted",
    "block_expected_accepted",
]

RULES = ("block", "token")


def check_rule(rule: str, name: str = "verify") -> str:
    """``rule`` if it names a verification rule, else ValueError naming ``name`` and the choices."""
    if rule not in RULES:
        raise ValueError(f"{name} must be one of {', '.join(RULES)}, got {rule!r}")
    return rule


def _weights(p: torch.Tensor, q: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Running weights w_0 .. w_g (B1), ``(B, g + 1)``."""
    index = tokens.unsqueeze(-1)
    ratios = (p[:, : tokens.shape[1]].gather(-1, index) / q.gather(-1, index)).squeeze(-1)  # (B, g)
    weights = torch.ones((tokens.shape[0], tokens.shape[1] + 1), dtype=torch.float64)
    for i in range(tokens.shape[1]):
        weights[:, i + 1] = torch.clamp(weights[:, i] * ratios[:, i], max=1.0)
    return weights


def _threshold_at(p: torch.Tensor, q: torch.Tensor, weights: torch.Tensor, i: int, rows: torch.Tensor) -> torch.Tensor:
    """h_i (B3) of ``rows`` (indices into the batch), ``(len(rows),)``: w_g at the last position, else from the next
    position's residual mass r_i (B2)."""
    every_row = len(rows) == q.shape[0]
    w = weights[:, i] if every_row else weights[rows, i]
    if i == q.shape[1]:
        return w
    p_next, q_next = (
        (p[:, i], q[:, i]) if every_row else (p[rows, i], q[rows, i])
    )  # p[:, i] is p_{i+1}: views when we can
    residual = torch.mul(p_next, w.unsqueeze(-1)).sub_(q_next).clamp_(min=0).sum(-1)
    denominator = residual + 1 - w
    return torch.where(denominator > 0, residual / denominator.clamp(min=torch.finfo(torch.float64).tiny), 1.0)


def _thresholds(p: torch.Tensor, q: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """h_0 .. h_g (B3), ``(B, g + 1)``, with h_0 = 1."""
    rows = torch.arange(q.shape[0])
    return torch.stack(
        [torch.ones(q.shape[0], dtype=torch.float64)]
        + [_threshold_at(p, q, weights, i, rows) for i in range(1, q.shape[1] + 1)],
        -1,
    )


def block_thresholds(
    draft_tokens: torch.Tensor,  # (B, g) int64
    draft_probs: torch.Tensor | None,  # (B, g, V), None for point masses
    target_probs: torch.Tensor,  # (B, g + 1, V)
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, h)``: the running weights (B1) and thresholds (B3), each ``(B, g + 1)`` float64, index 0 the empty
    block."""
    p, q, tokens = checked_block(draft_tokens, draft_probs, target_probs)
    weights = _weights(p, q, tokens)
    return weights, _thresholds(p, q, weights)


def verify_block_with_uniforms(
    draft_tokens: torch.Tensor,  # (B, g) int64
    draft_probs: torch.Tensor | None,  # (B, g, V), None for point masses
    target_probs: torch.Tensor,  # (B, g + 1, V)
    accept_uniforms: torch.Tensor,  # (B, g) float64 in [0, 1): u_1 .. u_g
    sample_uniforms: torch.Tensor,  # (B,) float64 in [0, 1)
) -> VerifyResult:
    """The block rule (B1-B5) as a pure function of its uniforms."""
    p, q, tokens = checked_block(draft_tokens, draft_probs, target_probs)
    batch, gamma = tokens.shape
    weights = _weights(p, q, tokens)
    # (B4) from the last position down: a row's h_i is computed only while no later position has passed it.
    tau = torch.zeros(batch, dtype=torch.int64)
    open_rows = torch.arange(batch)
    for i in range(gamma, 0, -1):
        passed = accept_uniforms[open_rows, i - 1] < _threshold_at(p, q, weights, i, open_rows)
        tau[open_rows[passed]] = i
        open_rows = open_rows[~passed]
        if not len(open_rows):
            break
    positions = torch.arange(gamma + 1)
    rows = torch.arange(batch)
    p_next = p[rows, tau]  # (B, V): p_{tau+1}, the bonus distribution when tau = g
    correction = p_next
    if gamma:
        ended = (tau < gamma).to(torch.float64).unsqueeze(-1)  # (B, 1): a replacement, not a bonus
        q_next = q[rows, tau.clamp(max=gamma - 1)].mul_(ended)
        correction = (
            torch.mul(p_next, weights[rows, tau].unsqueeze(-1)).sub_(q_next).clamp_(min=0)
        )  # (B5); p_{g+1} when tau = g
        no_mass = correction.sum(-1, keepdim=True) <= 0  # rounding only (see the module docstring)
        if no_mass.any():
            correction = torch.where(no_mass, p_next, correction)
    final = sample_from(correction, sample_uniforms)
    out = torch.full((batch, gamma + 1), -1, dtype=torch.int64)
    out[:, :gamma] = torch.where(positions[None, :gamma] < tau.unsqueeze(-1), tokens, -1)
    out[rows, tau] = final
    return VerifyResult(num_accepted=tau, tokens=out)


def verify_block_rule(
    draft_tokens: torch.Tensor,  # (B, g) int64, drawn from draft_probs (or proposed deterministically)
    draft_probs: torch.Tensor | None,  # (B, g, V); None for point masses
    target_probs: torch.Tensor,  # (B, g + 1, V)
    generator: torch.Generator,
) -> VerifyResult:
    """Block verification of one block per row: (B, g) uniforms, then (B,) for the committed draw."""
    batch, gamma, _ = check_block(draft_tokens, target_probs)
    accept_uniforms, sample_uniforms = draw_uniforms(batch, gamma, generator)
    return verify_block_with_uniforms(draft_tokens, draft_probs, target_probs, accept_uniforms, sample_uniforms)


# ------------------------------------------------------------ expected accepted length, draft by draft


def tokenwise_expected_accepted(draft_tokens, draft_probs, target_probs) -> torch.Tensor:
    """``E[accepted | drafted tokens]`` of the token-wise rule for every gamma' = 1..g: ``(B, g)``,
    ``sum_{i <= g'} prod_{j <= i} min(1, p_j(x_j) / q_j(x_j))``."""
    p, q, tokens = checked_block(draft_tokens, draft_probs, target_probs)
    ratios = (p[:, : tokens.shape[1]].gather(-1, tokens.unsqueeze(-1)) / q.gather(-1, tokens.unsqueeze(-1))).squeeze(-1)
    return ratios.clamp(max=1.0).cumprod(-1).cumsum(-1)


def block_expected_accepted(draft_tokens, draft_probs, target_probs) -> torch.Tensor:
    """``E[tau | drafted tokens]`` of the block rule for every gamma' = 1..g (the block cut after g' tokens):
    ``(B, g)``, ``sum_{i=1..g'} P(tau >= i)`` with (B6) and the cut block's thresholds (``h_{g'} = w_{g'}``)."""
    p, q, tokens = checked_block(draft_tokens, draft_probs, target_probs)
    weights = _weights(p, q, tokens)
    h = _thresholds(p, q, weights)
    out = []
    for cut in range(1, tokens.shape[1] + 1):
        h_cut = torch.cat([h[:, 1:cut], weights[:, cut : cut + 1]], -1)  # (B, cut): h_1 .. h_cut
        survive = (1 - h_cut).flip(-1).cumprod(-1).flip(-1)  # prod_{j >= i} (1 - h_j)
        out.append((1 - survive).sum(-1))
    return torch.stack(out, -1)


def expected_accepted(rule: str, draft_tokens, draft_probs, target_probs) -> torch.Tensor:
    """Expected accepted length ``(B, g)`` under ``rule`` ("block" or "token") for every gamma' = 1..g."""
    check_rule(rule, "rule")
    return (block_expected_accepted if rule == "block" else tokenwise_expected_accepted)(
        draft_tokens, draft_probs, target_probs
    )
