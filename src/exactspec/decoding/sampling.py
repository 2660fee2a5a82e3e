"""The one pipeline that turns logits into the effective next-token distribution.

Speculative sampling preserves the law of the distribution it is given
(Leviathan et al. 2023, section 2.3: sampling settings are applied to the
logits *before* the method). So the target's ``p`` and the draft's ``q`` must be
produced by the same transformation, from exactly the prefix each position
conditions on. The engine calls :func:`block_probs` for both models; nothing
else in the package turns logits into probabilities.

Order of the processors, per position, all in float64 on float64 logits. It is
the order of Hugging Face ``generate`` (``SequenceBiasLogitsProcessor``, then
``RepetitionPenaltyLogitsProcessor``, then the warpers) and of vLLM (bias before
penalties), checked against transformers' own processors in the tests:

1. logit bias: ``l + bias[token]``;
2. repetition penalty ``r``: a logit ``l`` of a token present in the prefix
   (prompt and generated text) becomes ``l / r`` if ``l > 0`` else ``l * r``;
3. presence and frequency penalties: ``l - presence * [c > 0] - frequency * c``
   where ``c`` counts the token among the *generated* tokens (OpenAI convention);
4. allowed / banned token sets: excluded tokens get ``-inf`` (this commutes
   with every step above, which maps ``-inf`` to ``-inf``);
5. temperature ``T``: ``T == 0`` returns the one-hot of the argmax (greedy, ties to
   the lowest id; top-k/p and min-p are irrelevant), otherwise ``l / T``;
6. top-k, then top-p (smallest set of most likely tokens with mass >= top_p; ties
   by lower id), then min-p (drop tokens below ``min_p * max prob``), each on the
   softmax of what the previous step kept;
7. softmax.

Numeric range: penalties and biases are at most ``MAX_MAGNITUDE`` (1e30) in
size and a non-zero temperature at least its inverse, so from finite float32
logits (below 3.5e38) no step can overflow float64: every processed logit is
finite or ``-inf``, and softmax never sees ``inf - inf``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import torch

from exactspec.decoding.verify import greedy_token

__all__ = ["SamplingParams", "block_probs", "full_width", "processor_order", "GREEDY", "MAX_MAGNITUDE"]

#: Largest penalty or bias magnitude (and inverse of the smallest non-zero temperature) accepted.
MAX_MAGNITUDE = 1e30


@dataclass(frozen=True)
class SamplingParams:
    """Sampling settings shared by the target and the draft. Defaults are plain sampling at T=1."""

    temperature: float = 1.0
    top_k: int = 0  # 0: disabled
    top_p: float = 1.0  # 1.0: disabled
    min_p: float = 0.0  # 0.0: disabled
    repetition_penalty: float = 1.0  # 1.0: disabled
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] = field(default_factory=dict)
    allowed_token_ids: frozenset[int] | None = None  # None: every token allowed
    banned_token_ids: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        def finite(name: str, value: float) -> None:
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            finite(name, getattr(self, name))
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {self.temperature}")
        if self.temperature and not 1 / MAX_MAGNITUDE <= self.temperature <= MAX_MAGNITUDE:
            raise ValueError(
                f"temperature must be 0 (greedy) or in [{1 / MAX_MAGNITUDE:g}, "
                f"{MAX_MAGNITUDE:g}], got {self.temperature}"
            )
        for name in ("presence_penalty", "frequency_penalty"):
            _check_magnitude(name, getattr(self, name))
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 1 / MAX_MAGNITUDE <= self.repetition_penalty <= MAX_MAGNITUDE:
            raise ValueError(
                f"repetition_penalty must be in [{1 / MAX_MAGNITUDE:g}, "
                f"{MAX_MAGNITUDE:g}] (1 disables it), got {self.repetition_penalty}"
            )
        for token, bias in dict(self.logit_bias).items():
            _check_token_id(token, "logit_bias")
            finite(f"logit_bias[{token}]", bias)
            _check_magnitude(f"logit_bias[{token}]", bias)
        object.__setattr__(self, "logit_bias", dict(self.logit_bias))
        if self.allowed_token_ids is not None:
            object.__setattr__(self, "allowed_token_ids", _token_set(self.allowed_token_ids, "allowed_token_ids"))
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids is empty: no token could ever be sampled")
        object.__setattr__(self, "banned_token_ids", _token_set(self.banned_token_ids, "banned_token_ids"))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def uses_prefix(self) -> bool:
        """Whether the distribution depends on the prefix (penalties), not only on the logits."""
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def _check_magnitude(name: str, value: float) -> None:
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError(f"{name} must be within +-{MAX_MAGNITUDE:g}, got {value:g}")


def _check_token_id(token: object, name: str) -> None:
    if not isinstance(token, int) or isinstance(token, bool) or token < 0:
        raise ValueError(f"{name} holds {token!r}, which is not a token id (an integer >= 0)")


def _token_set(tokens: Iterable[int], name: str) -> frozenset[int]:
    result = frozenset(tokens)
    for token in result:
        _check_token_id(token, name)
    return result


GREEDY = SamplingParams(temperature=0.0)


def block_probs(
    logits: torch.Tensor,  # (n, V) raw logits of n consecutive positions
    prefix: Sequence[int],  # tokens that row 0 conditions on (prompt + generated so far)
    block: Sequence[int],  # tokens appended after prefix; row j conditions on prefix + block[:j]
    prompt_length: int,  # how many leading tokens of prefix are the prompt
    params: SamplingParams,
    token_ids: torch.Tensor | None = None,  # (V,) ascending: column c's token id; None: column c is token c
) -> torch.Tensor:  # (n, V) float64, each row a distribution
    """Effective distributions of ``n`` consecutive positions, each from its own prefix.

    Prefix-dependent processors (penalties) are evaluated per row, with the
    earlier tokens of the block counted: per token, never once per round.

    With ``token_ids`` the columns are a subset S of the vocabulary (a draft's): the result is, column for
    column, the distribution the full vocabulary gives with logits ``-inf`` outside S (every processor maps
    ``-inf`` to ``-inf``, and ascending ids keep the ties' order), at the cost of S alone (:func:`full_width`).
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must have shape (n, V), got {tuple(logits.shape)}")
    rows, vocab = logits.shape
    if len(block) < rows - 1:
        raise ValueError(f"{rows} rows need at least {rows - 1} block tokens, got {len(block)}")
    scores = logits.to(torch.float64, copy=True)  # owned: bias and penalties write into it
    if params.logit_bias:
        _apply_bias(scores, params.logit_bias, token_ids)
    if params.uses_prefix:
        _apply_penalties(scores, prefix, block[: rows - 1], prompt_length, params, token_ids)
    if params.banned_token_ids or params.allowed_token_ids is not None:
        scores = _apply_masks(scores, params, token_ids)
        if torch.isneginf(scores).all(-1).any():
            raise ValueError("every token is excluded by the allowed/banned sets or the bias: nothing can be sampled")
    if params.greedy:  # a point mass on the argmax
        return scores.new_zeros(scores.shape).scatter_(-1, greedy_token(scores).unsqueeze(-1), 1.0)
    if params.temperature != 1:
        scores = scores / params.temperature
    if params.top_k and params.top_k < vocab:
        kth = scores.topk(params.top_k, dim=-1).values[:, -1:]  # (n, 1)
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1:
        scores = _top_p(scores, params.top_p)
    if params.min_p > 0:
        probs = scores.softmax(-1)
        scores = scores.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, -math.inf)
    return scores.softmax(-1)


def full_width(probs: torch.Tensor, token_ids: torch.Tensor | None, vocab: int) -> torch.Tensor:  # (n, |S|) -> (n, V)
    """Distributions over the columns ``token_ids`` (:func:`block_probs`) as rows over the whole vocabulary, zero
    outside them; unchanged when ``token_ids`` is None."""
    if token_ids is None:
        return probs
    return probs.new_zeros((probs.shape[0], vocab)).index_copy_(1, token_ids.to(probs.device), probs)


def _columns(ids: torch.Tensor, token_ids: torch.Tensor | None, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(column, present)`` ``(k,)`` each: the column of each token id in ``ids``, and whether it has one."""
    if token_ids is None:
        return ids, ids < width
    columns = torch.searchsorted(token_ids, ids).clamp(max=len(token_ids) - 1)
    return columns, token_ids[columns] == ids


def _token_counts(
    prefix: Sequence[int], block: Sequence[int], start: int, column: Mapping[int, int]
) -> torch.Tensor:  # (len(block) + 1, m) float64
    """Row j, column c: how often the token whose column is c occurs in ``(prefix + block[:j])[start:]``
    (``column``: token id -> c in [0, m); tokens without a column are not counted)."""
    width = len(column)

    def columns_of(tokens: Sequence[int]) -> torch.Tensor:  # (len(tokens),); ``width`` for a token without a column
        return torch.tensor([column.get(t, width) for t in tokens], dtype=torch.int64)

    base = torch.bincount(columns_of(prefix[start:]), minlength=width + 1)[:width].to(torch.float64)
    counts = base.unsqueeze(0).repeat(len(block) + 1, 1)
    if block:
        steps = torch.nn.functional.one_hot(columns_of(block), width + 1)[:, :width].to(torch.float64)
        counts[1:] += steps.cumsum(0)
    return counts


def _apply_penalties(
    scores: torch.Tensor,  # (n, V) float64, changed in place
    prefix: Sequence[int],
    block: Sequence[int],  # n - 1 tokens
    prompt_length: int,
    params: SamplingParams,
    token_ids: torch.Tensor | None,  # see block_probs
) -> None:
    """Repetition (CTRL: divide a positive logit, multiply a negative one), presence and frequency penalties
    (OpenAI: subtract ``presence * [count > 0] + frequency * count``), row j counting ``prefix + block[:j]``.

    Only the columns of tokens in the prefix or the block can change, so the work is O(n x m) for the m distinct
    tokens seen, not O(n x V); every other column keeps its value, as the full-width formulas leave it.
    """
    distinct = sorted({*prefix, *block})
    scores_columns, present = _columns(torch.tensor(distinct, dtype=torch.int64), token_ids, scores.shape[-1])
    seen_ids = [token for token, has_column in zip(distinct, present.tolist()) if has_column]
    if not seen_ids:
        return
    column = {token: c for c, token in enumerate(seen_ids)}
    columns = scores_columns[present].to(scores.device)  # (m,)
    values = scores[:, columns]  # (n, m)
    if params.repetition_penalty != 1:
        seen = _token_counts(prefix, block, 0, column).to(scores.device) > 0
        penalised = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
        values = torch.where(seen, penalised, values)
    if params.presence_penalty or params.frequency_penalty:
        generated = _token_counts(prefix, block, prompt_length, column).to(scores.device)
        present = (generated > 0).to(torch.float64)  # float64: a bool tensor times 0.2 would round in float32
        values = values - params.presence_penalty * present - params.frequency_penalty * generated
    scores[:, columns] = values


def _apply_bias(
    scores: torch.Tensor, logit_bias: Mapping[int, float], token_ids: torch.Tensor | None
) -> None:  # (n, V) float64, in place
    vocab = scores.shape[-1]
    ids = torch.tensor(list(logit_bias), dtype=torch.int64)
    if token_ids is None and ids.max() >= vocab:
        raise ValueError(f"logit_bias names token {int(ids.max())}, outside the vocabulary of size {vocab}")
    columns, present = _columns(ids, token_ids, vocab)  # a biased token outside a subset stays at -inf
    bias = torch.tensor(list(logit_bias.values()), dtype=torch.float64)
    scores[:, columns[present].to(scores.device)] += bias[present].to(scores.device)


def _apply_masks(
    scores: torch.Tensor, params: SamplingParams, token_ids: torch.Tensor | None
) -> torch.Tensor:  # (n, V) float64
    column_ids = torch.arange(scores.shape[-1]) if token_ids is None else token_ids.cpu()
    excluded = torch.isin(column_ids, torch.tensor(sorted(params.banned_token_ids), dtype=torch.int64))
    if params.allowed_token_ids is not None:
        excluded |= ~torch.isin(column_ids, torch.tensor(sorted(params.allowed_token_ids), dtype=torch.int64))
    return scores.masked_fill(excluded.to(scores.device), -math.inf)


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:  # (n, V) tempered logits
    probs = scores.softmax(-1)
    # Stable sort on descending probability: ties keep ascending token id order.
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices
    sorted_probs = probs.gather(-1, order)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs  # mass of strictly more likely tokens
    drop_sorted = mass_before >= top_p  # keeps the smallest prefix reaching top_p (at least one token)
    drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
    return scores.masked_fill(drop, -math.inf)


def processor_order(params: SamplingParams) -> list[list]:
    """The effective processors, in the order they run, with their settings (defaults that do nothing left out)."""
    steps = [
        ["logit_bias", params.logit_bias],
        ["repetition_penalty", params.repetition_penalty],
        ["presence_penalty", params.presence_penalty],
        ["frequency_penalty", params.frequency_penalty],
        ["banned_token_ids", sorted(params.banned_token_ids) if params.banned_token_ids else None],
        ["allowed_token_ids", sorted(params.allowed_token_ids) if params.allowed_token_ids is not None else None],
    ]
    if params.greedy:
        steps.append(["argmax", True])
    else:
        steps += [
            ["temperature", params.temperature],
            ["top_k", params.top_k],
            ["top_p", params.top_p],
            ["min_p", params.min_p],
        ]
    neutral = {"repetition_penalty": 1.0, "temperature": 1.0, "top_p": 1.0}
    return [[name, value] for name, value in steps if value not in (None, 0, 0.0, {}) and neutral.get(name) != value]
