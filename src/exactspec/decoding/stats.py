"""Per-round records of a generation and their summaries."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class RoundRecord:
    """One target call: how many tokens were drafted, accepted and committed, and where the time went."""

    drafted: int
    accepted: int
    committed: int
    draft_seconds: float
    target_seconds: float
    verify_seconds: float
    draft_setup_seconds: float = 0.0  # part of draft_seconds that was one-off setup (a lazy prefill)
    rule: str = "token"  # the verification rule that ran: "greedy", "token" or "block"
    expected_block: float | None = None  # E[accepted | this round's draft] under the block rule (sampled drafts)
    expected_token: float | None = None  # the same under the token-wise rule
    source: str = "off"  # what proposed: "draft", "lookup", or "off" (a round without a proposer)


@dataclass
class GenerationStats:
    """Accumulates :class:`RoundRecord` s; every summary is derived from them."""

    rounds: list[RoundRecord] = field(default_factory=list)
    wall_seconds: float | None = None  # the whole generation as a caller waits for it (set by the decoder)

    def observe(self, record: RoundRecord) -> None:
        self.rounds.append(record)

    @property
    def drafted(self) -> int:
        return sum(r.drafted for r in self.rounds)

    @property
    def accepted(self) -> int:
        return sum(r.accepted for r in self.rounds)

    @property
    def committed(self) -> int:
        return sum(r.committed for r in self.rounds)

    @property
    def acceptance_rate(self) -> float:
        """Accepted draft tokens over drafted ones (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.committed / len(self.rounds) if self.rounds else 0.0

    def position_counts(self) -> tuple[list[int], list[int]]:
        """``(reached, accepted)`` per draft position ``i``: rounds that drafted ``i`` and accepted every position
        before it, and those of them that accepted ``i`` too."""
        longest = max((r.drafted for r in self.rounds), default=0)
        reached, accepted = [0] * longest, [0] * longest
        for r in self.rounds:
            for position in range(min(r.drafted, r.accepted + 1)):
                reached[position] += 1
                accepted[position] += r.accepted > position
        return reached, accepted

    def acceptance_by_position(self) -> list[float]:
        """Entry ``i``: P(draft position ``i`` accepted | reached), the per-position rate the cost model and the
        adaptive policy use (0 for a position never reached)."""
        reached, accepted = self.position_counts()
        return [a / n if n else 0.0 for n, a in zip(reached, accepted)]

    @property
    def draft_seconds(self) -> float:
        return sum(r.draft_seconds for r in self.rounds)

    @property
    def target_seconds(self) -> float:
        return sum(r.target_seconds for r in self.rounds)

    @property
    def verify_seconds(self) -> float:
        return sum(r.verify_seconds for r in self.rounds)

    @property
    def total_seconds(self) -> float:
        """Drafting, target calls and verification; the loop's own work between them is not in it (see wall_seconds)."""
        return self.draft_seconds + self.target_seconds + self.verify_seconds

    def modelled_seconds(self, target_ms: Mapping[int, float], draft_step_ms: float | None) -> float | None:
        """What the cost model says these rounds take: the first (the prompt's prefill) as measured, every later one
        gamma d + c(gamma + 1) with c(n) and d the calibration's milliseconds per target call of n tokens and per
        draft step (the model of :mod:`exactspec.decoding.costmodel`, here with the rounds' actual gammas). None
        where a round needs a cost the calibration lacks."""
        seconds = self.rounds[0].target_seconds if self.rounds else 0.0
        for r in self.rounds[1:]:
            if r.drafted + 1 not in target_ms or (r.drafted and draft_step_ms is None):
                return None
            seconds += (r.drafted * (draft_step_ms or 0.0) + target_ms[r.drafted + 1]) / 1000
        return seconds

    def expected_tokens_per_round(self) -> dict[str, float] | None:
        """Per rule, 1 + the mean over sampled draft rounds of E[accepted | the round's draft] (recorded with
        ``compare_rules``): both rules judged on the same drafts, whichever ran. None when no round recorded it."""
        rounds = [r for r in self.rounds if r.expected_block is not None]
        if not rounds:
            return None
        return {
            "block": 1 + sum(r.expected_block for r in rounds) / len(rounds),
            "token": 1 + sum(r.expected_token for r in rounds) / len(rounds),
            "rounds": len(rounds),
        }

    @property
    def rules(self) -> list[str]:
        """The verification rules the rounds with a draft ran ("greedy", "token", "block")."""
        return sorted({r.rule for r in self.rounds if r.drafted})

    def by_source(self) -> dict[str, dict]:
        """Per proposal source that drafted (``draft``, ``lookup``): its rounds, tokens drafted and accepted,
        acceptance by position and tokens per round, from its own drafting rounds alone (lookup's point masses and a
        draft's samples have very different acceptance, which one pooled figure would blur)."""
        out = {}
        for source in sorted({r.source for r in self.rounds if r.drafted}):
            own = GenerationStats([r for r in self.rounds if r.drafted and r.source == source])
            out[source] = {
                "rounds": len(own.rounds),
                "drafted": own.drafted,
                "accepted": own.accepted,
                "acceptance_by_position": own.acceptance_by_position(),
                "tokens_per_round": own.tokens_per_round,
            }
        return out

    def summary(self) -> dict[str, float | int | list[float]]:
        return {
            "verify": self.rules,
            "expected_tokens_per_round": self.expected_tokens_per_round(),
            "tokens": self.committed,
            "rounds": len(self.rounds),
            "drafted": self.drafted,
            "accepted": self.accepted,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
            "acceptance_by_position": self.acceptance_by_position(),
            "acceptance_by_source": self.by_source(),
            "draft_seconds": self.draft_seconds,
            "target_seconds": self.target_seconds,
            "verify_seconds": self.verify_seconds,
            "total_seconds": self.total_seconds,
            "wall_seconds": self.wall_seconds,
        }
