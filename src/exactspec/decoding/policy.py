"""The gamma policy: how far to speculate each step, for one sequence or a running batch, from what past rounds showed.

One policy serves ``generate`` (a batch of one) and ``serve`` (a batch of many). It keeps running estimates of

* ``accept[source][i]``: the probability that draft position ``i`` is accepted given that positions ``< i`` were, per
  proposal source (``"draft"``, ``"lookup"``; the source a sequence's context routes to), estimated only from rounds
  that reached position i;
* the target call's cost as a function of the rows it carries (a call verifying one sequence's g draft tokens has
  g + 1 rows; a batched call carries every sequence's rows);
* one draft step's cost per source as a function of the sequences drafting together (lookup's start at zero);

and picks, for the sequences whose gamma it chooses (the *auto* ones), the gamma that maximises expected committed
tokens per second of the step: the cost model of Leviathan et al. (2023, eq. 1 and Thm 3.8) with acceptance by
position, summed over the batch,

    E_s(g)  = 1 + sum_{k=1..g} prod_{i<=k} accept[source_s][i]
    time(g) = g * sum_sources draft_step[source](sequences of it) + target(fixed_rows + auto_sequences * (g + 1))
    gamma   = argmax_g (fixed_tokens + sum_s E_s(g)) / time(g)

Alone, a target call is bound by reading the weights, so g + 1 rows cost little more than one and the optimum drafts
far; in a big batch every drafted row makes a call that already grows with its rows dearer, and the optimum falls to
0 (as in vLLM and SGLang, which switch speculation off above a batch size; here the cost model decides). Each average
weighs the newest observation by ``max(smoothing, 1 / count)``, so early estimates settle fast and later ones follow
slow drift; each cost is a count-weighted straight line over the sizes seen, so one slow call at a rare size cannot put
that size off limits. Gamma changes only for a rate ``switch_margin`` higher, so noise on a flat curve does not make
it wander. When plain decoding (g = 0) wins, the policy still probes with ``probe_gamma`` after ``probe_every`` plain
steps (``informed_probe_every`` when acceptance priors said so from the start), doubling the wait after each probe
that did not pay (up to ``max_probe_every``). Hysteresis and probing are kept per set of auto sources.

Cold start. Without priors the first steps guess (``initial_gamma``, ``prior_acceptance``) and learn; with
:class:`PolicyPriors` the very first step takes the optimum: call costs measured at load
(:mod:`exactspec.tuning.calibration`) and acceptance by draft position from the draft's shipped held-out figures or
the last run of the same pair (:mod:`exactspec.tuning.priors`). A prior counts as ``weight`` observations, after which
rounds take over at the usual rate, so a wrong prior costs a few rounds, not a generation.

The choice depends only on completed rounds, measured times and priors, never on the current round's random numbers,
so every round is still an exact speculative step. Because timings differ between runs, a stochastic run with this
policy is exact but not bit-reproducible from its seed; fix gamma for that.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exactspec.decoding.costmodel import expected_tokens_by_gamma
from exactspec.decoding.stats import RoundRecord

__all__ = ["AdaptiveConfig", "AdaptiveGamma", "CostCurve", "PolicyPriors", "RunningMean"]

#: Observations of a draft position before its own acceptance estimate is trusted (without an acceptance prior).
MIN_OBSERVATIONS = 8


@dataclass(frozen=True)
class AdaptiveConfig:
    max_gamma: int = 8
    initial_gamma: int = 4  # before any cost is known
    probe_every: int = 8  # plain steps before the first probe
    informed_probe_every: int = 64  # ...when acceptance priors already say plain decoding wins from the start
    max_probe_every: int = 256
    probe_gamma: int = 2
    smoothing: float = 0.05  # weight of the newest observation in each moving average
    prior_acceptance: float = 0.7  # per position, counted as one observation, for a source without a prior
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

    @classmethod
    def up_to(cls, max_gamma: int) -> AdaptiveConfig:
        """The defaults with gamma capped at ``max_gamma`` (>= 1)."""
        return cls(
            max_gamma=max_gamma,
            initial_gamma=min(cls.initial_gamma, max_gamma),
            probe_gamma=min(cls.probe_gamma, max_gamma),
        )


def _sizes_to_ms(name: str, value: Mapping[int, float]) -> dict[int, float]:
    out = {int(n): float(ms) for n, ms in dict(value).items()}
    if any(n < 1 or not ms >= 0 for n, ms in out.items()):
        raise ValueError(f"{name} must map sizes >= 1 to times >= 0 ms, got {out}")
    return out


@dataclass(frozen=True)
class PolicyPriors:
    """What is known before the first round (see the module docstring). Empty fields: learn from scratch."""

    target_ms: Mapping[int, float] = field(default_factory=dict)  # rows of one target call -> ms
    draft_step_ms: float | Mapping[int, float] | None = (
        None  # one draft-model step, by sequences drafting together (a number: one)
    )
    # by draft position per source (a sequence: "draft"'s); the last repeats
    acceptance: Sequence[float] | Mapping[str, Sequence[float]] = ()
    cost_weight: int = 4  # observations a calibrated cost counts as
    acceptance_weight: int = 4  # observations an acceptance prior counts as (trusted from the first round)
    source: str = "none"  # where the acceptance prior came from, for the run record

    def __post_init__(self) -> None:
        object.__setattr__(self, "target_ms", _sizes_to_ms("target_ms", self.target_ms))
        if any(ms <= 0 for ms in self.target_ms.values()):
            raise ValueError(f"target_ms must map call sizes to positive times, got {self.target_ms}")
        steps = self.draft_step_ms
        if steps is not None and not isinstance(steps, Mapping):
            if not float(steps) >= 0:
                raise ValueError(f"draft_step_ms must be >= 0, got {steps}")
            steps = {1: steps}
        object.__setattr__(self, "draft_step_ms", None if steps is None else _sizes_to_ms("draft_step_ms", steps))
        acceptance = (
            self.acceptance
            if isinstance(self.acceptance, Mapping)
            else {"draft": self.acceptance}
            if len(self.acceptance)
            else {}
        )
        acceptance = {source: tuple(float(a) for a in rates) for source, rates in acceptance.items() if len(rates)}
        if any(not 0 <= a <= 1 for rates in acceptance.values() for a in rates):
            raise ValueError(f"acceptance rates must be in [0, 1], got {acceptance}")
        object.__setattr__(self, "acceptance", acceptance)
        if self.cost_weight < 1 or self.acceptance_weight < 1:
            raise ValueError("cost_weight and acceptance_weight must be >= 1")


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
class CostCurve:
    """Milliseconds as a function of a size (rows of a call, sequences drafting together): a running mean per size
    seen, read through their count-weighted least-squares line (slope kept >= 0; one size seen gives a flat line)."""

    smoothing: float
    means: dict[int, RunningMean] = field(default_factory=dict)

    def observe(self, size: int, ms: float, weight: int = 1) -> None:
        mean = self.means.setdefault(size, RunningMean(ms, self.smoothing))
        for _ in range(weight):
            mean.update(ms)

    @property
    def known(self) -> bool:
        return bool(self.means)

    def line(self) -> tuple[float, float, float]:
        """``(n_bar, t_bar, slope)``: the cost at size n is ``t_bar + slope * (n - n_bar)``."""
        points = [(n, mean.value, mean.count) for n, mean in self.means.items()]
        weight = sum(w for _, _, w in points)
        n_bar = sum(w * n for n, _, w in points) / weight
        t_bar = sum(w * t for _, t, w in points) / weight
        spread = sum(w * (n - n_bar) ** 2 for n, _, w in points)
        slope = sum(w * (n - n_bar) * (t - t_bar) for n, t, w in points) / spread if spread else 0.0
        return n_bar, t_bar, max(slope, 0.0)

    def __call__(self, size: float) -> float:
        n_bar, t_bar, slope = self.line()
        return max(0.0, t_bar + slope * (size - n_bar))


@dataclass
class _Source:
    """What the policy knows of one proposal source."""

    accept: list[RunningMean]  # per draft position
    prior: tuple[float, ...]  # its acceptance prior by position (empty: the generic one)
    step_ms: CostCurve  # one draft step, by sequences drafting together


@dataclass
class _Choice:
    """Hysteresis and probing state for one set of auto sources."""

    current: int = -1  # the gamma chosen last (-1: none yet)
    plain: int = 0  # plain steps since the last drafting one
    probe_wait: int = 0


@dataclass
class AdaptiveGamma:
    """Picks gamma per step by the cost model on running estimates (see the module docstring).

    The engine asks :meth:`choose` before each step and reports with :meth:`observe_round` (one per sequence),
    :meth:`observe_target` and :meth:`observe_draft` (one per call). For one sequence outside an engine,
    :meth:`next_gamma` and :meth:`observe` take the same roles with a round record.
    """

    config: AdaptiveConfig = field(default_factory=AdaptiveConfig)
    priors: PolicyPriors = field(default_factory=PolicyPriors)
    target_ms: CostCurve = field(init=False)  # by rows of the call
    sources: dict[str, _Source] = field(init=False, default_factory=dict)
    choices: dict[frozenset, _Choice] = field(init=False, default_factory=dict)

    def __post_init__(self) -> None:
        self.target_ms = CostCurve(self.config.smoothing)
        for rows, ms in self.priors.target_ms.items():
            self.target_ms.observe(rows, ms, self.priors.cost_weight)
        for source in set(self.priors.acceptance) | {"draft", "lookup"}:  # the proposers' sources; others as they come
            self._source(source)

    def _source(self, name: str) -> _Source:
        if name not in self.sources:
            config, priors = self.config, self.priors
            prior = priors.acceptance.get(name, ())
            if prior:  # trusted from the first round, weighing acceptance_weight observations
                accept = [
                    RunningMean(prior[min(i, len(prior) - 1)], config.smoothing, priors.acceptance_weight)
                    for i in range(config.max_gamma)
                ]
            else:  # the generic prior counts as one observation per position
                accept = [RunningMean(config.prior_acceptance, config.smoothing, 1) for _ in range(config.max_gamma)]
            steps = CostCurve(config.smoothing)
            if name == "draft" and priors.draft_step_ms is not None:
                for sequences, ms in priors.draft_step_ms.items():
                    steps.observe(sequences, ms, priors.cost_weight)
            elif name == "lookup":  # a search of the context: next to nothing next to a model call
                steps.observe(1, 0.0, priors.cost_weight)
            self.sources[name] = _Source(accept, prior, steps)
        return self.sources[name]

    # ---- learning -------------------------------------------------------------------------------------------
    def observe_round(self, source: str, record: RoundRecord) -> None:
        """Learn ``source``'s acceptance by position from one sequence's round (a plain round teaches nothing)."""
        if record.drafted == 0:
            return
        accept = self._source(source).accept
        for position in range(min(record.drafted, record.accepted + 1, len(accept))):  # positions that were reached
            accept[position].update(float(record.accepted > position))

    def observe_target(self, rows: int, seconds: float) -> None:
        """One target call of ``rows`` rows took ``seconds``."""
        self.target_ms.observe(rows, 1000 * seconds)

    def observe_draft(self, sources: Sequence[str], seconds_per_step: float) -> None:
        """One draft call for sequences of ``sources`` took ``seconds_per_step`` per step. A call that mixes lookup
        with the draft model is the draft model's step (lookup costs next to nothing)."""
        counts = collections.Counter(sources)
        source = "draft" if "draft" in counts else next(iter(counts))
        self._source(source).step_ms.observe(counts[source], 1000 * seconds_per_step)

    def observe(self, record: RoundRecord, source: str = "draft") -> None:
        """One sequence's round outside an engine: its acceptance, its target call and its draft steps."""
        self.observe_round(source, record)
        self.observe_target(record.drafted + 1, record.target_seconds)
        if record.drafted:
            self.observe_draft([source], (record.draft_seconds - record.draft_setup_seconds) / record.drafted)

    # ---- choosing -------------------------------------------------------------------------------------------
    def acceptance(self, source: str, positions: int | None = None) -> list[float]:
        """The rates the cost model uses for ``source``'s first ``positions`` draft positions (default max_gamma).

        Without an acceptance prior, position 0 is its running mean from the first round (a useless draft is dropped
        after a round or two), and a later position reached fewer than ``MIN_OBSERVATIONS`` times borrows the rate of
        the last position that was (so longer drafts get tried). With one, a position not reached yet takes its prior
        scaled by how the evidence moved the last reached position (estimate over prior), so a draft that disappoints
        early loses its whole optimistic prior, not just the first position's. Positions past max_gamma repeat the last.
        """
        state = self._source(source)
        rates, rate, level = [], self.config.prior_acceptance, 1.0
        for i, mean in enumerate(state.accept):
            if not state.prior:
                if mean.count > MIN_OBSERVATIONS or i == 0:  # position 0: the generic prior is one observation
                    rate = mean.value
            else:
                start = state.prior[min(i, len(state.prior) - 1)]
                if mean.count > self.priors.acceptance_weight:  # reached in this run: its blend of prior and data
                    rate = mean.value
                    level = mean.value / start if start > 0 else 1.0
                else:
                    rate = min(1.0, start * level)
            rates.append(rate)
        positions = self.config.max_gamma if positions is None else positions
        return (rates + [rates[-1]] * positions)[:positions] if rates else [self.config.prior_acceptance] * positions

    def expected_tokens(self, source: str, gamma: int) -> float:
        """E[committed tokens] of one round of ``source`` drafting ``gamma`` (eq. 1 with acceptance by position)."""
        if source == "off" or gamma == 0:
            return 1.0
        return expected_tokens_by_gamma(self.acceptance(source, gamma))[gamma]

    def rates(self, sources: Sequence[str], fixed_rows: int = 0, fixed_tokens: float = 0.0) -> list[float] | None:
        """Expected committed tokens per ms of the step for gamma = 0..max_gamma, given the auto sequences' sources
        and the rows and expected commits of the sequences whose gamma is fixed; None while a cost is unknown."""
        counts = collections.Counter(sources)
        states = {source: self._source(source) for source in counts}
        if not self.target_ms.known or not all(state.step_ms.known for state in states.values()):
            return None
        tokens = {source: expected_tokens_by_gamma(self.acceptance(source)) for source in counts}
        step_ms = sum(state.step_ms(counts[source]) for source, state in states.items())
        out = []
        for gamma in range(self.config.max_gamma + 1):
            committed = fixed_tokens + sum(n * tokens[source][gamma] for source, n in counts.items())
            ms = gamma * step_ms + self.target_ms(fixed_rows + len(sources) * (gamma + 1))
            out.append(committed / max(ms, 1e-9))
        return out

    def choose(self, sources: Sequence[str], fixed_rows: int = 0, fixed_tokens: float = 0.0) -> int:
        """The gamma of this step's auto sequences (their proposal sources given), with hysteresis and probing."""
        config = self.config
        rates = self.rates(sources, fixed_rows, fixed_tokens)
        if rates is None:
            return config.initial_gamma
        key = frozenset(sources)
        choice = self.choices.setdefault(key, _Choice(probe_wait=config.probe_every))
        best = max(range(len(rates)), key=lambda g: (rates[g], -g))
        if 0 <= choice.current and rates[best] < rates[choice.current] * (1 + config.switch_margin):
            best = choice.current  # hysteresis: noisy estimates of a flat curve should not make gamma wander
        if (
            choice.current < 0 and best == 0 and all(self._source(s).prior for s in key)
        ):  # priors, not a guess, say plain
            choice.probe_wait = config.informed_probe_every
        choice.current = best
        if best > 0:
            choice.plain, choice.probe_wait = 0, config.probe_every
            return best
        if choice.plain >= choice.probe_wait:  # a probe; if it does not pay, the next one waits twice as long
            choice.plain, choice.probe_wait = 0, min(2 * choice.probe_wait, config.max_probe_every)
            return config.probe_gamma
        choice.plain += 1
        return 0

    def next_gamma(self, source: str = "draft") -> int:
        """:meth:`choose` for one sequence drafting from ``source``."""
        return self.choose([source])
