"""The speed profile (exactspec.bench.ceiling): the predicted speedup and the ceilings are the cost model's, each
with one cost taken away; the break-even acceptance is where the best chain length first pays."""

from __future__ import annotations

import pytest

from exactspec.bench.ceiling import CEILINGS, break_even_acceptance, format_profiles, main, measure_profiles, profile


def test_the_ceiling_that_rises_names_what_stops_speculation():
    """A verification whose cost grows with every token: nothing pays as measured, nor with every draft token
    accepted or a free draft; a flat verification would (1.75 tokens per round of 2 x 1 + 12 ms, against 10 ms)."""
    plain = {1: 10.0, 2: 20.0, 3: 30.0}
    capture = {1: 12.0, 2: 22.0, 3: 32.0}
    figures = profile(plain, capture, 1.0, [0.5, 0.5])
    assert figures["predicted"] == {"gamma": 0, "speedup": 1.0}
    ceilings = figures["ceilings"]
    assert list(ceilings) == list(CEILINGS)
    assert ceilings["every draft token accepted"]["gamma"] == 0 and ceilings["free draft step"]["gamma"] == 0
    assert ceilings["flat verification (c'(n) = c'(1))"] == {"gamma": 2, "speedup": pytest.approx(1.75 * 10 / 14)}
    assert ceilings["no capture (c' = c)"]["gamma"] == 0
    assert ceilings["free draft step and flat verification"] == {"gamma": 2, "speedup": pytest.approx(1.75 * 10 / 12)}
    assert (
        figures["break_even_acceptance"] is None and figures["capture_ms"] == 2.0 and figures["verify_ratio"] == 32 / 12
    )


def test_the_prediction_counts_the_capture_against_plain_decoding():
    """Rounds pay c'(n); plain decoding pays c(1) without capture: 1.5 tokens per (1 + 11) ms against 10 ms a token."""
    figures = profile({1: 10.0, 2: 11.0}, {1: 11.0, 2: 11.0}, 1.0, [0.5])
    assert figures["predicted"] == {"gamma": 1, "speedup": pytest.approx(15 / 12)}
    assert figures["ceilings"]["no capture (c' = c)"]["speedup"] == pytest.approx(15 / 12)  # c'(2) = c(2) here


def test_break_even_is_the_smallest_acceptance_that_pays():
    """gamma 1 pays from (1 + a) 10 >= 1 + 11, a = 0.2; gamma 2 needs more, (1 + a + a^2) 10 >= 2 + 12."""
    assert break_even_acceptance(2, 1.0, {1: 10.0, 2: 11.0, 3: 12.0}, 10.0) == pytest.approx(0.2, abs=1e-6)
    assert break_even_acceptance(2, 0.0, {1: 10.0, 2: 10.0, 3: 10.0}, 10.0) == pytest.approx(0.0, abs=1e-6)
    assert break_even_acceptance(1, 5.0, {1: 10.0, 2: 20.0}, 10.0) is None


def test_a_profile_of_the_shipped_pair_measures_both_modes_on_each_runtime(capsys):
    """Dense float32, and bfloat16 too where the CPU computes it natively: each runtime profiled in both modes."""
    from exactspec.loading import native_bfloat16

    report = measure_profiles(None, None, "lean", 1, 1)
    runtimes = report["runtimes"]
    assert [r["candidate"]["dtype"] for r in runtimes] == ["float32"] + (["bfloat16"] if native_bfloat16("cpu") else [])
    for runtime in runtimes:
        assert runtime["candidate"]["backend"] == "lean" and runtime["candidate"]["threads"] == 1
        assert set(runtime["modes"]) == {"sampled", "greedy"} and runtime["draft_step_ms"] > 0
        positions = len(runtime["modes"]["sampled"]["acceptance"])
        assert set(runtime["plain_ms"]) == set(runtime["capture_ms"]) == set(range(1, positions + 2))
    text = format_profiles(report)
    assert "ceiling, every draft token accepted" in text and "break-even acceptance" in text


def test_bad_input_is_one_line():
    with pytest.raises(SystemExit, match="ceiling: --repeats and --threads must be >= 1"):
        main(["--repeats", "0"])
    with pytest.raises(SystemExit, match="ceiling: .*nowhere"):
        main(["--target", "smollm2", "--draft", "/nowhere"])
