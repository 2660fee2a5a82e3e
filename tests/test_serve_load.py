"""The bounded load test (exactspec.bench.loadtest), short: 4 streaming clients for 4 seconds against a
server it starts on loopback; no error, every output equal to the same request run alone, and it ends by itself.
Greedy, so token identity does not depend on where a low-order bit of a batched kernel lands (see the module)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from exactspec.bench import loadtest  # noqa: E402


def test_a_short_load_test_passes_and_reports(capsys):
    code = loadtest.main(
        [
            "--spawn",
            "--clients",
            "4",
            "--seconds",
            "4",
            "--max-tokens",
            "16",
            "--threads",
            "1",
            "--temperature",
            "0",
            "--json",
        ]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0, report
    assert report["completed"] >= 4 and report["errors"] == [] and report["mismatches"] == []
    assert report["checked_against_solo"] == min(report["completed"], 64)
    assert report["latency_seconds"]["p50"] <= report["latency_seconds"]["p99"]
    assert report["aggregate_tokens_per_second"] > 0 and report["memory_bytes"]["after"] > 0


def test_only_loopback_is_load_tested():
    with pytest.raises(ValueError, match="loopback only"):
        loadtest.LoadConfig("http://example.com:8000", "m")
