"""Choosing gamma every round from what the rounds so far have shown.

The policy keeps running estimates (exponential moving averages) of

* ``accept[i]``: the probability that draft position ``i`` is accepted given that
  positions ``< i`` were (estimated only from rounds that drafted position i);
* ``draft_ms``: the time of one draft step;
* ``target_ms[n]``: the time of one target call on ``n`` tokens;

and picks the gamma that maximises expected committed tokens per millisecond,

    E[tokens](g) = 1 + sum_{k=1..g} prod_{i<=k} accept[i]
    rate(g)      = E[tokens](g) / (g * draft_ms + target_ms[g + 1])

which is the cost model of Leviathan et al. (2023, Thm 3.8) with acceptance that
may vary with position and a measured verify cost. Each average weighs the
newest observation by ``max(smoothing, 1 / count)``, so early estimates settle
fast and later ones track slow drift. Gamma changes only when another value promises a
rate ``switch_margin`` higher, so noise on a flat curve does not make it wander. When ``g = 0`` (plain decoding) wins,
the policy still probes with a short draft, after ``probe_every`` plain rounds
(``informed_probe_every`` when an acceptance prior said so from the start),
doubling the wait after each probe that did not pay (up to ``max_probe_every``),
so a useless draft costs well under 1% once it has been recognised.

Cold start. Without priors the first rounds guess (``initial_gamma``,
``prior_acceptance``) and learn; with :class:`PolicyPriors` the very first round
already takes the cost model's optimum: call costs measured at load
(:mod:`exactspec.calibration`: the target at every call size the policy may use,
one draft step) and acceptance by draft position from the draft's shipped
held-out figures or the last run of the same pair (:mod:`exactspec.priors`).
A prior counts as ``weight`` observations, after which completed rounds take
over at the usual rate, so a wrong prior costs a few rounds, not a generation.

The choice depends only on completed rounds and priors, never on the current round's
random numbers, so every round is still an exact speculative step. Because
timings differ between runs, a stochastic run with the adaptive policy is
exact but not bit-reproducible from its seed; fix gamma for that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

from exactspec.costmodel import expected_tokens_by_gamma
from exactspec.stats import RoundRecord

__all__ = ["AdaptiveConfig", "AdaptiveGamma", "GammaPolicy", "PolicyPriors", "RoutedPolicy", "RunningMean"]


class GammaPolicy(Protocol):
    def next_gamma(self) -> int:
        """Draft tokens for the next round (0: a plain decoding step)."""
        ...

    def observe(self, record: RoundRecord) -> None:
        """Learn from a completed round."""
        ...


#: Observations of a draft position before its own acceptance estimate is trusted.
MIN_OBSERVATIONS = 8


@dataclass(frozen=True)
class AdaptiveConfig:
    max_gamma: int = 8
    initial_gamma: int = 4
    probe_every: int = 8  # plain rounds before the first probe
    informed_probe_every: int = 64  # ...when an acceptance prior already says plain decoding wins from the start
    max_probe_every: int = 256
    probe_gamma: int = 2
    smoothing: float = 0.05  # weight of the newest observation in each moving average
    prior_acceptance: float = 0.7
    switch_margin: float = 0.03  # change gamma only for an expected rate this much higher

    def __post_init__(self) -> None:
        if not 1 <= self.initial_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= initial_gamma <= max_gamma, got {self.initial_gamma} and {self.max_gamma}")
        if not 1 <= self.probe_gamma <= self.max_gamma:
            raise ValueError(f"need 1 <= probe_gamma <= max_gamma, got {self.probe_gamma}")
        if not 1 <= self.probe_every <= self.max_probe_every or self.informed_probe_every < 1:
            raise ValueError(f"need 1 <= probe_every <= max_probe_every and informed_probe_every >= 1, got {self}")
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if not 0 <= self.prior_acceptance <= 1:
            raise ValueError(f"prior_acceptance must be in [0, 1], got {self.prior_acceptance}")
        if self.switch_margin < 0:
            raise ValueError(f"switch_margin must be >= 0, got {self.switch_margin}")


@dataclass(frozen=True)
class PolicyPriors:
    """What is known before the first round (see the module docstring). Empty fields: learn from scratch."""

    target_ms: Mapping[int, float] = field(default_factory=dict)  # call size in tokens -> ms of one target call
    draft_step_ms: float | None = None  # one draft step, ms
    acceptance: tuple[float, ...] = ()  # entry i: P(draft position i accepted | reached); the last repeats
    cost_weight: int = 4  # observations a calibrated cost counts as
    acceptance_weight: int = 4  # observations an acceptance prior counts as (trusted from the first round)
    source: str = "none"  # where the acceptance prior came from, for the run record

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_ms", {int(n): float(ms) for n, ms in dict(self.target_ms).items()})
        object.__setattr__(self, "acceptance", tuple(float(a) for a in self.acceptance))
        if any(n < 1 or not ms > 0 for n, ms in self.target_ms.items()):
            raise ValueError(f"target_ms must map call sizes >= 1 to positive times, got {self.target_ms}")
        if self.draft_step_ms is not None and not self.draft_step_ms >= 0:
            raise ValueError(f"draft_step_ms must be >= 0, got {self.draft_step_ms}")
        if any(not 0 <= a <= 1 for a in self.acceptance):
            raise ValueError(f"acceptance rates must be in [0, 1], got {self.acceptance}")
        if self.cost_weight < 1 or self.acceptance_weight < 1:
            raise ValueError("cost_weight and acceptance_weight must be >= 1")

    def acceptance_at(self, position: int) -> float:
        """The prior rate of a draft position; positions past the list repeat its last entry."""
        return self.acceptance[min(position, len(self.acceptance) - 1)]


@dataclass
class RunningMean:
    """Average that weighs the newest value by ``max(smoothing, 1 / count)``."""

    value: float
    smoothing: float
    count: int = 0

    def update(self, new: float) -> None:
        self.count += 1
        self.value += max(self.smoothing, 1 / self.count) * (new - self.value)


@dataclass
class AdaptiveGamma:
    """Picks gamma per round by the cost model on running estimates (see the module docstring)."""

    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    priors: PolicyPriors = field(default_factory=PolicyPriors)
    accept: list[RunningMean] = field(init=False)
    draft_ms: RunningMean | None = field(init=False, default=None)
    target_ms: dict[int, RunningMean] = field(init=False, default_factory=dict)
    plain_rounds: int = field(init=False, default=0)
    probe_wait: int = field(init=False)
    current: int = field(init=False, default=-1)  # the gamma chosen last (-1: none yet)

    def __post_init__(self) -> None:
        priors, smoothing = self.priors, self.config.smoothing
        if priors.acceptance:  # trusted from the first round (see expected_tokens), weighing acceptance_weight observations
            self.accept = [RunningMean(priors.acceptance_at(i), smoothing, priors.acceptance_weight) for i in range(self.config.max_gamma)]
        else:  # the generic prior counts as one observation per position
            self.accept = [RunningMean(self.config.prior_acceptance, smoothing, 1) for _ in range(self.config.max_gamma)]
        if priors.draft_step_ms is not None:
            self.draft_ms = RunningMean(priors.draft_step_ms, smoothing, priors.cost_weight)
        self.target_ms = {n: RunningMean(ms, smoothing, priors.cost_weight) for n, ms in priors.target_ms.items()}
        self.probe_wait = self.config.probe_every

    def _update(self, mean: RunningMean | None, new: float) -> RunningMean:
        mean = mean or RunningMean(new, self.config.smoothing)
        mean.update(new)
        return mean

    def observe(self, record: RoundRecord) -> None:
        """Update the estimates from one completed round."""
        if record.drafted == 0:
            self.plain_rounds += 1
        else:
            was_probe, self.plain_rounds = self.plain_rounds > 0, 0
            per_step = (record.draft_seconds - record.draft_setup_seconds) / record.drafted
            self.draft_ms = self._update(self.draft_ms, 1000 * per_step)
            for i in range(min(record.drafted, record.accepted + 1)):  # positions that were reached
                self.accept[i].update(float(record.accepted > i))
            if was_probe:
                self.probe_wait = min(2 * self.probe_wait, self.config.max_probe_every)
        calls = record.drafted + 1
        self.target_ms[calls] = self._update(self.target_ms.get(calls), 1000 * record.target_seconds)

    def target_cost_line(self) -> tuple[float, float, float]:
        """``(n_bar, t_bar, slope)``: target call cost on n tokens is ``t_bar + slope * (n - n_bar)``.

        A count-weighted straight line over the call sizes seen rather than a table, so that one
        slow call at a rarely used size cannot put that size off limits forever; the slope is kept
        >= 0 (a single size seen gives a flat line, which explores).
        """
        points = [(n, mean.value, mean.count) for n, mean in self.target_ms.items()]
        weight = sum(w for _, _, w in points)
        n_bar = sum(w * n for n, _, w in points) / weight
        t_bar = sum(w * t for _, t, w in points) / weight
        spread = sum(w * (n - n_bar) ** 2 for n, _, w in points)
        slope = sum(w * (n - n_bar) * (t - t_bar) for n, t, w in points) / spread if spread else 0.0
        return n_bar, t_bar, max(slope, 0.0)

    def expected_tokens(self) -> list[float]:
        """Entry g: ``1 + sum_{k<=g} prod_{i<=k} accept[i]`` (:func:`exactspec.costmodel.expected_tokens_by_gamma`).

        Without an acceptance prior, position 0 is its running mean from the first round (a useless draft is
        dropped after a round or two), and a later position reached fewer than ``MIN_OBSERVATIONS`` times
        borrows the rate of the last position that was (so longer drafts get tried). With one, a position not
        reached yet takes its prior scaled by how the evidence moved the last reached position (estimate over
        prior), so a draft that disappoints early loses its whole optimistic prior, not just the first position's.
        """
        rates, rate, level = [], self.config.prior_acceptance, 1.0
        for i, mean in enumerate(self.accept):
            if not self.priors.acceptance:
                if mean.count > MIN_OBSERVATIONS or i == 0:  # position 0: the generic prior is one observation
                    rate = mean.value
            else:
                start = self.priors.acceptance_at(i)
                if mean.count > self.priors.acceptance_weight:  # reached in this run: its blend of prior and data
                    rate = mean.value
                    level = mean.value / start if start > 0 else 1.0
                else:
                    rate = min(1.0, start * level)
            rates.append(rate)
        return expected_tokens_by_gamma(rates)

    def next_gamma(self) -> int:
        if self.draft_ms is None or not self.target_ms:
            return self.config.initial_gamma
        n_bar, t_bar, slope = self.target_cost_line()
        tokens = self.expected_tokens()
        rates = [tokens[g] / (g * self.draft_ms.value + t_bar + slope * (g + 1 - n_bar)) for g in range(self.config.max_gamma + 1)]
        best = max(range(len(rates)), key=lambda g: (rates[g], -g))
        if 0 <= self.current < len(rates) and rates[best] < rates[self.current] * (1 + self.config.switch_margin):
            best = self.current  # hysteresis: noisy estimates of a flat curve should not make gamma wander
        if self.current < 0 and best == 0 and self.priors.acceptance:  # the prior, not a guess, says plain: probe rarely
            self.probe_wait = self.config.informed_probe_every
        self.current = best
        if best > 0:
            self.probe_wait = self.config.probe_every
        elif self.plain_rounds >= self.probe_wait:
            return self.config.probe_gamma
        return best


@dataclass
class RoutedPolicy:
    """One policy per proposal source (:class:`exactspec.proposers.LookupOrDraft`): before each round the engine
    selects the source the context routes to, and that source's policy chooses gamma and learns from the round."""

    policies: dict[str, GammaPolicy]
    selected: str = ""

    def __post_init__(self) -> None:
        if not self.policies:
            raise ValueError("RoutedPolicy needs at least one source's policy")
        self.selected = self.selected or next(iter(self.policies))

    def select(self, source: str) -> None:
        if source not in self.policies:
            raise ValueError(f"no policy for proposal source {source!r}; have {', '.join(self.policies)}")
        self.selected = source

    def next_gamma(self) -> int:
        return self.policies[self.selected].next_gamma()

    def observe(self, record: RoundRecord) -> None:
        self.policies[self.selected].observe(record)
