"""Batch generation on a local Ray cluster started by the test (exactspec.jobs.distributed): two engine replicas, and
one of them killed (SIGKILL) while the job runs; the job finishes and its output equals the local run's line for
line (shipped pair, float32, call-size invariant; per-request seeds and a fixed gamma make each result a function
of its request)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from exactspec.cli import main  # noqa: E402
from exactspec.jobs.batch import BatchJobConfig, generate_batch  # noqa: E402
from exactspec.jobs.distributed import ray_results  # noqa: E402
from exactspec.loading import (  # noqa: E402
    PairSpec,  # noqa: E402
    default_pair_dirs,
    load_pair,
)

REQUESTS = [
    {"prompt": f"class C{i}:\n    def ", "max_tokens": 10, **({"temperature": 0} if i % 4 == 0 else {})}
    for i in range(16)
]
CONFIG = BatchJobConfig(max_tokens=10, slots=4)


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def worker_pids() -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"BatchWorker" in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def test_a_killed_worker_does_not_change_the_output(cluster):
    local = list(generate_batch(load_pair(*default_pair_dirs(), invariant=True), REQUESTS, CONFIG))
    target, draft = default_pair_dirs()
    results = ray_results(PairSpec(str(target), str(draft), invariant=True), REQUESTS, CONFIG, workers=2, shard_size=2)
    collected = [next(results)]
    deadline = time.monotonic() + 60
    while len(pids := worker_pids()) < 2 and time.monotonic() < deadline:  # the second actor may still be starting
        time.sleep(0.1)
    assert len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    collected += list(results)
    assert [r["line"] for r in collected] == list(range(len(REQUESTS)))
    assert [(r["token_ids"], r["text"], r["stop_reason"]) for r in collected] == [
        (r["token_ids"], r["text"], r["stop_reason"]) for r in local
    ]


def test_the_command_on_ray_writes_what_the_local_command_writes(cluster, tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in REQUESTS))
    common = ["generate-batch", "--input", str(source), "--max-batch", "4", "--invariant", "--json"]
    assert main([*common, "--output", str(tmp_path / "local.jsonl")]) == 0
    assert main([*common, "--output", str(tmp_path / "ray.jsonl"), "--ray", "--workers", "2", "--shard-size", "3"]) == 0
    assert (tmp_path / "ray.jsonl").read_text() == (tmp_path / "local.jsonl").read_text()


def test_certify_on_ray_merges_shards_into_one_verdict(cluster, tmp_path):
    from exactspec.certification.certify import CertifyConfig, certify, default_prompts
    from exactspec.jobs.distributed import RaySampler

    pair = load_pair(*default_pair_dirs())
    prompts = default_prompts(pair.tokenizer)
    config = CertifyConfig(
        configs=("T=1",), sequences=96, max_tokens=24, self_check=True, mutants=("argmax_draft_sampled_ratio",)
    )
    target, draft = default_pair_dirs()
    sampler = RaySampler(PairSpec(str(target), str(draft)), prompts, config, workers=2)
    try:
        report = certify(pair, prompts, config, progress=False, sampler=sampler)
    finally:
        sampler.close()
    local = certify(pair, prompts, config, progress=False)
    assert report["passed"] and report["tokens"] == local["tokens"] == 96 * 24
    assert report["self_check"]["argmax_draft_sampled_ratio"]["rejected"]
    # the same seeded sequences, batched differently: the same law, so acceptance rates agree up to sampling noise
    for ray_rate, local_rate in zip(
        report["per_config"]["T=1"]["acceptance_by_position"], local["per_config"]["T=1"]["acceptance_by_position"]
    ):
        assert abs(ray_rate - local_rate) < 0.1
