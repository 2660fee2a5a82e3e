"""The soak with faults (exactspec.bench.soak), short: 8 clients for 9 seconds against a spawned server with clients
leaving mid-stream and bad bodies, a SIGTERM while streams run, and a generate-batch job killed with SIGKILL and
resumed. Every check of the long run (docs/serving.md) must hold here too."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")

from exactspec.bench.soak import run_soak  # noqa: E402


@pytest.mark.slow
def test_a_short_soak_with_faults_holds_every_check():
    report = run_soak(minutes=0.15, clients=8, max_tokens=24, check_limit=16, batch_requests=16)
    assert all(report["checks"].values()), report["checks"]
    load = report["load"]
    assert load["completed"] > 0 and load["left_mid_stream"] > 0 and load["bad_bodies_refused"] > 0
    assert load["checked_against_solo"] == 16 and report["sigterm"]["ends"]["done"] > 0
    assert 0 < report["batch"]["written_when_killed"] < 16 == report["batch"]["lines_after_resume"]
