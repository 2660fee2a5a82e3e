"""Load-time calibration: every call size the policy may use, warm-up calls untimed, draft steps via the proposer."""

from __future__ import annotations

import time

import pytest

from exactspec import MarkovLM
from exactspec.proposers import DraftModelProposer
from exactspec.tuning.calibration import calibrate


class SleepyModel(MarkovLM):
    """A MarkovLM whose calls take ``base + per_token * n`` seconds, and whose first call of each size takes longer."""

    def __init__(self, base: float, per_token: float, first_call_extra: float) -> None:
        super().__init__(MarkovLM.random(5, 1, seed=0).table, 1)
        self.base, self.per_token, self.first_call_extra = base, per_token, first_call_extra
        self.sizes_seen: set[int] = set()
        self.calls: list[int] = []

    def forward(self, token_ids):
        n = len(token_ids)
        time.sleep(self.base + self.per_token * n + (0 if n in self.sizes_seen else self.first_call_extra))
        self.sizes_seen.add(n)
        self.calls.append(n)
        return super().forward(token_ids)


def test_every_size_is_timed_after_a_warm_up_call():
    target = SleepyModel(0.002, 0.001, first_call_extra=0.05)
    result = calibrate(target, None, [1, 2, 3], max_gamma=4, repeats=1)  # one timed call: a timed warm-up would show
    assert sorted(result.target_ms) == [1, 2, 3, 4, 5] and result.draft_step_ms is None
    for n, ms in result.target_ms.items():
        # sleep never returns early; the 50 ms first call is never among the timed ones (a 2 s margin for a busy
        # machine)
        assert 2 + n <= ms < 50, (n, ms)
    assert all(target.calls.count(n) == 2 for n in range(1, 6))  # one warm-up and one timed call per size
    assert result.seconds > 0


def test_draft_steps_are_timed_through_the_proposer_without_its_setup():
    draft = SleepyModel(0.003, 0.001, first_call_extra=0.0)
    proposer = DraftModelProposer(draft)
    result = calibrate(SleepyModel(0.0, 0.0, 0.0), proposer, list(range(5)) * 8, max_gamma=3, repeats=5)
    # a step is a one-token call, 4 ms; the first proposal's 43 ms prefill of the context is warm-up, never timed.
    # A step is a difference of two medians (gamma 3 and 1 token): 5 repeats, so that one proposal slowed by a busy
    # machine cannot pull it under 4 ms (with 1 repeat it came out at 2.4 ms once, in a full run beside other work)
    assert 4 <= result.draft_step_ms < 14


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="non-empty context"):
        calibrate(MarkovLM.random(3), None, [], max_gamma=2)


def test_a_slow_model_times_a_few_sizes_and_interpolates_the_rest():
    target = SleepyModel(0.006, 0.001, first_call_extra=0.0)  # 7 ms and up: above SLOW_CALL_MS
    result = calibrate(target, None, [1, 2, 3], max_gamma=8, repeats=1)
    assert sorted(set(target.calls[1:])) == [1, 2, 3, 5, 9]  # after the prefill; the other sizes are never called
    assert sorted(result.target_ms) == list(range(1, 10))
    ms = result.target_ms
    assert ms[4] == pytest.approx((ms[3] + ms[5]) / 2) and ms[6] == pytest.approx((3 * ms[5] + ms[9]) / 4)
