"""The batch policy (exactspec.serving.policy): speculation while it pays, none once the batch makes each drafted
row cost as much as it brings."""

from __future__ import annotations

from exactspec.serving.policy import BatchPolicy, CostLine
from exactspec.stats import RoundRecord


def policy_with_costs(per_call: float, per_row: float, draft_step: float, alpha: float) -> BatchPolicy:
    policy = BatchPolicy(max_gamma=8, prior_acceptance={"draft": alpha})
    for rows in (1, 4, 16, 64, 144):
        policy.observe_target(rows, per_call + per_row * rows)
    policy.observe_draft(1, draft_step)
    policy.observe_draft(16, draft_step)
    return policy


def test_speculates_alone_and_stops_when_rows_cost_as_much_as_they_bring():
    policy = policy_with_costs(per_call=0.010, per_row=0.001, draft_step=0.0005, alpha=0.7)
    assert policy.choose(["draft"]) >= 3  # one sequence: a call of g + 1 rows costs little more than one row
    assert policy.choose(["draft"] * 16) < policy.choose(["draft"])
    assert policy.choose(["draft"] * 64) == 0  # each drafted row now costs more than the 0.7 token it brings


def test_rates_follow_the_cost_model():
    policy = policy_with_costs(per_call=0.010, per_row=0.001, draft_step=0.0005, alpha=0.5)
    rates = policy.rates(["draft", "draft"], fixed_rows=3, fixed_tokens=1.0)
    expected_g2 = (1.0 + 2 * (1 + 0.5 + 0.25)) / (2 * 0.0005 + 0.010 + 0.001 * (3 + 2 * 3))
    assert abs(rates[2] - expected_g2) < 1e-6 * expected_g2


def test_acceptance_is_learnt_per_source():
    policy = BatchPolicy(prior_acceptance={"draft": 0.9, "lookup": 0.9})
    for _ in range(100):
        policy.observe_round("lookup", RoundRecord(drafted=4, accepted=0, committed=1, draft_seconds=0.0, target_seconds=0.01, verify_seconds=0.0))
    assert policy.acceptance["lookup"].value < 0.2 and policy.acceptance["draft"].value == 0.9


def test_cost_line_fits_and_never_slopes_down():
    line = CostLine()
    for size, seconds in ((1, 1.0), (3, 3.0)):
        line.observe(size, seconds)
    assert abs(line(2) - 2.0) < 1e-9
    falling = CostLine()
    falling.observe(1, 2.0)
    falling.observe(5, 1.0)
    assert falling(100) == falling(1)
