"""How far the sequences of a running batch speculate: one gamma per step for the ``auto`` sequences.

Speculation trades target work for fewer calls. Alone, a target call is bound by reading the weights, so
verifying gamma + 1 tokens costs little more than one; in a batch of B sequences every call already carries B
rows, and each drafted token adds a row to a call that now grows with its rows. So the gain shrinks as the batch
grows, and published servers switch speculation off above a batch size (vLLM, SGLang). Here the policy decides per
step from the cost model (Leviathan et al. 2023, Thm 3.8, summed over the batch):

    tokens(g) = sum_s (1 - alpha_s^(g+1)) / (1 - alpha_s)                   expected commits of the auto sequences
    time(g)   = g * draft_step(B_draft) + target_call(rows_fixed + B_auto (g + 1))
    gamma     = argmax_g (tokens(g) + tokens_fixed) / time(g)

with ``alpha`` per proposal source (running means of per-position acceptance, as in
:class:`exactspec.policy.AdaptiveGamma`) and the call costs as straight lines in the rows of the call (target)
and in the drafting sequences (one draft step), fitted to calibration calls and to every step since.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from exactspec.costmodel import expected_tokens_per_round
from exactspec.policy import RunningMean
from exactspec.stats import RoundRecord

__all__ = ["BatchPolicy", "CostLine"]


@dataclass
class CostLine:
    """Seconds as a straight line in a size, least squares over the latest observations (slope kept >= 0)."""

    points: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))
    unknown: float = 1.0  # the cost assumed before any observation (flat: the first steps explore)

    def observe(self, size: float, seconds: float) -> None:
        self.points.append((float(size), float(seconds)))

    def __call__(self, size: float) -> float:
        if not self.points:
            return self.unknown
        n = len(self.points)
        mean_x = sum(x for x, _ in self.points) / n
        mean_y = sum(y for _, y in self.points) / n
        spread = sum((x - mean_x) ** 2 for x, _ in self.points)
        slope = max(0.0, sum((x - mean_x) * (y - mean_y) for x, y in self.points) / spread) if spread else 0.0
        return max(1e-6, mean_y + slope * (size - mean_x))


@dataclass
class BatchPolicy:
    max_gamma: int = 8
    prior_acceptance: dict = field(default_factory=lambda: {"draft": 0.6, "lookup": 0.4})
    smoothing: float = 0.05
    target: CostLine = field(default_factory=CostLine)  # seconds of a target call, by rows
    draft: CostLine = field(default_factory=lambda: CostLine(unknown=0.0))  # seconds of a draft step, by drafting sequences
    acceptance: dict = field(init=False)

    def __post_init__(self) -> None:
        self.acceptance = {source: RunningMean(alpha, self.smoothing, 1) for source, alpha in self.prior_acceptance.items()}

    def observe_round(self, source: str, record: RoundRecord) -> None:
        """Learn a source's acceptance from one sequence's round (a plain round, drafting nothing, teaches nothing)."""
        mean = self.acceptance.setdefault(source, RunningMean(0.5, self.smoothing, 1))
        for position in range(min(record.drafted, record.accepted + 1)):  # positions that were reached
            mean.update(float(record.accepted > position))

    def observe_target(self, rows: int, seconds: float) -> None:
        self.target.observe(rows, seconds)

    def observe_draft(self, sequences: int, seconds_per_step: float) -> None:
        self.draft.observe(sequences, seconds_per_step)

    def expected_tokens(self, source: str, gamma: int) -> float:
        alpha = self.acceptance[source].value if source in self.acceptance else 0.5
        return expected_tokens_per_round(alpha, gamma)

    def rates(self, sources: list[str], fixed_rows: int = 0, fixed_tokens: float = 0.0) -> list[float]:
        """Expected committed tokens per second of the step for gamma = 0..max_gamma, given the auto sequences'
        proposal sources and the rows and expected commits of the sequences whose gamma is fixed."""
        drafting = sum(source == "draft" for source in sources)
        out = []
        for gamma in range(self.max_gamma + 1):
            tokens = fixed_tokens + sum(self.expected_tokens(source, gamma) for source in sources)
            seconds = (gamma * self.draft(drafting) if drafting else 0.0) + self.target(fixed_rows + len(sources) * (gamma + 1))
            out.append(tokens / seconds)
        return out

    def choose(self, sources: list[str], fixed_rows: int = 0, fixed_tokens: float = 0.0) -> int:
        rates = self.rates(sources, fixed_rows, fixed_tokens)
        return max(range(len(rates)), key=lambda g: (rates[g], -g))
