"""The command line: reference numbers, JSON output, one-line errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from exactspec.cli import main


def run_json(capsys, *args):
    assert main([*args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_explain_reproduces_the_worked_example(capsys):
    r = run_json(capsys, "explain", "--target", "0.6,0.3,0.1", "--draft", "0.5,0.25,0.25")
    assert r["accepted_mass"] == pytest.approx([0.50, 0.25, 0.10])
    assert r["rejection_probability"] == pytest.approx(0.15)
    assert r["residual"] == pytest.approx([2 / 3, 1 / 3, 0.0])
    assert r["final_law"] == pytest.approx([0.60, 0.30, 0.10])
    assert r["naive_law"] == pytest.approx([0.59, 0.295, 0.115])
    assert r["acceptance_probability"] == pytest.approx([1.0, 1.0, 0.4])


def test_explain_equal_distributions_match_rate_against_acceptance(capsys):
    r = run_json(capsys, "explain", "--target", "0.6,0.3,0.1", "--draft", "0.6,0.3,0.1")
    assert r["independent_match_rate"] == pytest.approx(0.46)
    assert r["acceptance_rate"] == pytest.approx(1.0)
    assert r["rejection_probability"] == 0.0


def test_explain_block_puts_the_two_rules_side_by_side(capsys):
    """p = (0.6, 0.3, 0.1), q = (0.2, 0.3, 0.5): token-wise keeps 0.6 x 1.6 = 0.96 draft tokens of two in
    expectation, the block rule one; both laws of the first two output tokens are p x p."""
    r = run_json(capsys, "explain", "--target", "0.6,0.3,0.1", "--draft", "0.2,0.3,0.5", "--block")
    assert r["expected_accepted"]["token"] == pytest.approx(0.96)
    assert r["expected_accepted"]["block"] == pytest.approx(1.0)
    assert max(r["max_law_error"].values()) < 1e-12
    rows = {tuple(row["draft"]): row for row in r["block_rows"]}
    assert rows[2, 0]["token"] == pytest.approx([0.8, 0.0, 0.2])  # C rejected at once token-wise ...
    assert rows[2, 0]["block"][2] == pytest.approx(0.6)  # ... while the block C A is kept whole more often
    assert main(["explain", "--target", "0.6,0.3,0.1", "--draft", "0.2,0.3,0.5", "--labels", "A,B,C", "--block"]) == 0
    assert "C A" in capsys.readouterr().out


def test_explain_table_is_readable(capsys):
    assert main(["explain", "--target", "0.6,0.3,0.1", "--draft", "0.5,0.25,0.25", "--labels", "A,B,C"]) == 0
    out = capsys.readouterr().out
    assert "0.5900" in out and "0.6667" in out and "0.1500" in out and "A" in out


def test_cost_reproduces_the_reference_numbers(capsys):
    r = run_json(capsys, "cost", "--gamma", "2", "--alpha", "0.5", "--target-ms", "100", "--draft-ms", "20")
    assert (r["tokens_per_round"], r["ms_per_token"], r["speedup"]) == pytest.approx((1.75, 80.0, 1.25))
    r = run_json(capsys, "cost", "--gamma", "2", "--alpha", "0.5", "--target-ms", "100", "--draft-ms", "50")
    assert (r["ms_per_token"], r["speedup"]) == pytest.approx((114.2857, 0.875), abs=1e-4)


def test_cost_best_gamma_searches(capsys):
    r = run_json(capsys, "cost", "--alpha", "0.8", "--target-ms", "10", "--draft-ms", "1", "--best-gamma")
    assert r["gamma"] == 6 and r["speedup"] == pytest.approx(2.4696, abs=1e-4)


@pytest.mark.parametrize(
    "args,message",
    [
        (["explain", "--target", "0.6,0.3", "--draft", "0.5,0.5"], "sums to 0.9"),
        (["explain", "--target", "0.6,0.3,0.1", "--draft", "0.5,0.5"], "3 entries but --draft has 2"),
        (["explain", "--target", "1.2,-0.2", "--draft", "0.5,0.5"], "negative"),
        (["explain", "--target", "a,b", "--draft", "0.5,0.5"], "comma-separated numbers"),
        (["cost", "--alpha", "0.5", "--target-ms", "-1", "--draft-ms", "1"], "--target-ms must be a positive"),
        (["cost", "--alpha", "1.5", "--target-ms", "1", "--draft-ms", "1"], "--alpha must be in"),
        (
            ["cost", "--alpha", "0.5", "--target-ms", "1", "--draft-ms", "1", "--gamma", "-2"],
            "argument --gamma: must be an integer >= 0",
        ),
        (["cost", "--alpha", "x"], "invalid float value"),
        (["nonsense"], "invalid choice"),
    ],
)
def test_bad_arguments_give_one_line_and_exit_code_2(capsys, args, message):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_console_entry_point_runs_as_a_module():
    done = subprocess.run(
        [sys.executable, "-m", "exactspec", "cost", "--alpha", "2", "--target-ms", "1", "--draft-ms", "1"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.startswith("exactspec: error:") and "Traceback" not in done.stderr


def test_a_librarys_warning_is_one_line_on_stderr():
    """The library warns where it works around something (llama.cpp's crashing AMX kernels): on the command line that
    is one line naming exactspec, not Python's file, line number and source line (in a process of its own: pytest
    records warnings instead of showing them)."""
    script = (
        "import warnings, exactspec.cli.cache as command\n"
        "def warn_then_run(args):\n"
        "    warnings.warn('something to know', RuntimeWarning)\n"
        "    return {'entries': []}\n"
        "command.run = warn_then_run\n"
        "from exactspec.cli import main\n"
        "raise SystemExit(main(['cache', '--json']))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "exactspec: warning: something to know\n"
