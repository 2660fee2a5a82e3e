"""`exactspec bench` for a target without a draft model: exactspec's arms against llama.cpp's, each run its own
process (exactspec.peers)."""

from __future__ import annotations

import itertools
import json

import pytest

pytest.importorskip("transformers")

from conftest import save_tiny_checkpoint, tiny_tokenizer_json

from exactspec.bench import peers
from exactspec.bench.workloads import CHAT_WORKLOADS
from exactspec.cli import main
from exactspec.loading import PACKAGED_MODELS


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_tiny_checkpoint(
        tmp_path_factory.mktemp("peers") / "target",
        vocab_rows=300,
        layers=1,
        seed=0,
        tokenizer_json=tiny_tokenizer_json(),
    )


def bench(capsys, *args):
    code = main(["bench", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_medians_spread_and_ratios_come_from_every_run(target, monkeypatch):
    """An arm's figure is the median over prompts of the median over repetitions; its spread the lowest and highest
    prompt median; ratios are to llama.cpp plain and exactspec plain of the same run; tokens per call averaged."""
    rates = itertools.count(1.0)
    monkeypatch.setattr(
        peers,
        "_run",
        lambda arm, prompt: {
            "tokens_per_second": next(rates),
            **({"tokens_per_round": 2.0} if "lookup" in arm.name else {}),
            "cost_model": {"efficiency": 0.9} if arm.name == peers.DEFAULT_ARM else None,
        },
    )
    monkeypatch.setattr(peers, "llama_cpp_version", lambda: {"version": "x", "system_info": "AVX2 = 1"})
    monkeypatch.setattr(peers, "llama_cpp_alone_survives", lambda config: True)
    config = peers.PeerBenchConfig(target, threads=1, num_prompts=2, repeats=3)  # greedy, chat only
    report = peers.run_peer_bench(config, progress=False)
    rows = {row["arm"]: row for row in report["results"]}
    assert list(rows) == [
        "exactspec plain",
        "exactspec prompt lookup (auto gamma)",
        peers.DEFAULT_ARM,
        "exactspec plain (llama.cpp runtime)",
        "exactspec prompt lookup (llama.cpp runtime, auto gamma)",
        "llama.cpp plain",
        "llama.cpp prompt lookup (2 tokens)",
    ]
    # Interleaved: prompt 1 repetition 1 runs arms 1..7 (rates 1..7), repetition 2 rates 8..14, and so on.
    assert rows["exactspec plain"]["per_prompt"] == [[1, 8, 15], [22, 29, 36]]
    assert rows["exactspec plain"]["tokens_per_second"] == (8 + 29) / 2 and rows["exactspec plain"]["spread"] == [8, 29]
    assert rows["llama.cpp plain"]["tokens_per_second"] == (13 + 34) / 2
    assert rows["exactspec plain"]["vs_llama_cpp_plain"] == pytest.approx(18.5 / 23.5)
    assert rows["llama.cpp plain"]["vs_llama_cpp_plain"] == 1.0
    assert rows["exactspec prompt lookup (auto gamma)"]["speedup"] == pytest.approx(19.5 / 18.5)
    assert (
        rows["exactspec prompt lookup (auto gamma)"]["tokens_per_call"] == 2.0
        and rows["exactspec plain"]["tokens_per_call"] is None
    )
    assert rows[peers.DEFAULT_ARM]["vs_cost_model"] == 0.9 and rows["exactspec plain"]["vs_cost_model"] is None
    assert report["llama_cpp"]["system_info"] == "AVX2 = 1" and "hidden states" in report["hf_assisted"]


def test_arms_run_only_the_groups_asked_for(target, monkeypatch):
    ran = []
    monkeypatch.setattr(peers, "_run", lambda arm, prompt: ran.append(arm.name) or {"tokens_per_second": 1.0})
    monkeypatch.setattr(peers, "llama_cpp_version", lambda: {"version": "x", "system_info": ""})
    monkeypatch.setattr(peers, "llama_cpp_alone_survives", lambda config: True)
    config = peers.PeerBenchConfig(target, threads=1, num_prompts=1, repeats=1, arm_groups=("default", "llama.cpp"))
    peers.run_peer_bench(config, progress=False)
    assert ran == [peers.DEFAULT_ARM, "llama.cpp plain", "llama.cpp prompt lookup (2 tokens)"]
    with pytest.raises(ValueError, match="--arms must be among torch, default"):
        peers.PeerBenchConfig(target, threads=1, arm_groups=("gpu",))


def test_llama_cpps_arms_run_without_extra_buffers_where_llama_cpp_alone_is_killed_with_them(target, monkeypatch):
    """A build whose AMX kernels crash (docs/runtimes.md) still gets its llama.cpp arms, run as its user would have
    to (without extra buffers), and the report says so; a build that survives runs them as shipped."""
    probes, commands = [], {}
    monkeypatch.setattr(peers, "survives", lambda command: probes.append(command) or False)
    monkeypatch.setattr(
        peers, "_run", lambda arm, prompt: commands.setdefault(arm.name, arm.command) and {"tokens_per_second": 1.0}
    )
    monkeypatch.setattr(peers, "llama_cpp_version", lambda: {"version": "x", "system_info": "AMX_INT8 = 1"})
    config = peers.PeerBenchConfig(target, threads=1, num_prompts=1, repeats=1, arm_groups=("default", "llama.cpp"))
    report = peers.run_peer_bench(config, progress=False)
    assert len(probes) == 1 and probes[0][:3] == [peers.sys.executable, "-m", "exactspec.bench.peers"]
    assert report["llama_cpp"][
        "extra_buffers"
    ] is False and "without its extra weight buffers" in peers.format_peer_table(report)
    assert ["--no-extra-buffers" in command for command in commands.values()] == [False, True, True]
    monkeypatch.setattr(peers, "survives", lambda command: None)  # no verdict: as shipped
    commands.clear()
    report = peers.run_peer_bench(config, progress=False)
    assert report["llama_cpp"]["extra_buffers"] is True and not any(
        "--no-extra-buffers" in c for c in commands.values()
    )
    assert "extra weight buffers" not in peers.format_peer_table(report)


def test_a_safetensors_target_runs_the_exactspec_arms_and_says_why_llama_cpp_did_not(target, tmp_path, capsys):
    out = tmp_path / "out"
    code, stdout, err = bench(
        capsys,
        "--target",
        str(target),
        "--prompts",
        "1",
        "--repeats",
        "2",
        "--max-new-tokens",
        "4",
        "--threads",
        "1",
        "--output-dir",
        str(out),
        "--json",
        "--modes",
        "greedy,sample",
        "--workloads",
        "grounded",
    )
    assert code == 0, err
    report = json.loads(stdout)
    assert report["llama_cpp_skipped"] == "the target is not a .gguf file"
    assert [(row["mode"], row["workload"], row["arm"]) for row in report["results"]] == [
        (mode, "grounded", arm)
        for mode in ("greedy", "sample")
        for arm in ("exactspec plain", "exactspec prompt lookup (auto gamma)", peers.DEFAULT_ARM)
    ]
    for row in report["results"]:
        (runs,) = row["per_prompt"]
        assert len(runs) == 2 and min(runs) > 0 and row["vs_llama_cpp_plain"] is None
    assert json.loads((out / "peers.json").read_text())["results"] == report["results"]
    assert "exactspec plain" in (out / "peers.txt").read_text() and (out / "peers.png").stat().st_size > 0


def test_a_failing_arm_and_bad_options_are_one_line_errors(target, tmp_path, capsys):
    code, _, err = bench(
        capsys,
        "--target",
        str(target),
        "--prompts",
        "1",
        "--repeats",
        "1",
        "--max-new-tokens",
        "2",
        "--weights",
        "q4",
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "exactspec plain failed" in err and "q4" in err and err.count("\n") == 1
    code, _, err = bench(
        capsys,
        "--target",
        str(target),
        "--prompts",
        str(len(CHAT_WORKLOADS["code"]) + 1),
        "--output-dir",
        str(tmp_path / "out"),
    )
    assert code == 2 and "prompts each at most" in err and err.count("\n") == 1
    code, _, err = bench(
        capsys, "--target", str(target), "--workloads", "heldout", "--output-dir", str(tmp_path / "out")
    )
    assert code == 2 and "against llama.cpp the workloads are" in err and err.count("\n") == 1


def test_smollm2_against_llama_cpp(tmp_path, capsys, monkeypatch):
    """Every arm on the packaged GGUF, the shipped trained draft among them, when llama-cpp-python is installed;
    otherwise the exactspec arms and a note naming the install command."""
    try:
        PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    available = peers.llama_cpp_available()
    if not available:
        monkeypatch.setattr(peers, "llama_cpp_available", lambda: False)
    code, stdout, err = bench(
        capsys,
        "--target",
        "smollm2",
        "--prompts",
        "1",
        "--repeats",
        "1",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        "--json",
        "--modes",
        "sample",
        "--workloads",
        "grounded",
        "--arms",
        "torch,default,llamacpp-runtime,llama.cpp",
    )  # llama-server's arms: test_llama_server
    assert code == 0, err
    report = json.loads(stdout)
    rows = {row["arm"]: row for row in report["results"]}
    assert rows["exactspec trained draft + lookup (auto gamma)"]["tokens_per_call"] >= 1
    if available:
        assert report["llama_cpp_skipped"] is None and len(rows) == 9 and report["llama_cpp"]["version"]
        assert (
            rows["llama.cpp plain"]["vs_llama_cpp_plain"] == 1.0 and rows["exactspec plain"]["vs_llama_cpp_plain"] > 0
        )
        assert rows["exactspec prompt lookup (llama.cpp runtime, auto gamma)"]["tokens_per_call"] >= 1
        assert rows["exactspec plain (llama.cpp runtime)"]["tokens_per_call"] == 1
        assert rows["exactspec trained draft + lookup (llama.cpp runtime, auto gamma)"]["tokens_per_call"] >= 1
    else:
        assert "pip install llama-cpp-python" in report["llama_cpp_skipped"] and "llama.cpp plain" not in rows


def test_the_onnx_runtime_arms_run_where_onnx_runtime_can_run_the_checkpoint(target, monkeypatch):
    config = peers.PeerBenchConfig(target, threads=1, num_prompts=1, repeats=1, arm_groups=("onnx-runtime",))
    monkeypatch.setattr(peers, "checkpoint_unsupported", lambda path: None)
    commands = [arm.command for arm in peers._arms(config, "greedy")]
    assert len(commands) == 2
    assert all(c[c.index("--backend") + 1] == "onnx" and "--int8-activations" in c for c in commands)
    assert "--no-speculation" in commands[0] and commands[1][commands[1].index("--draft") + 1] == "lookup"
    monkeypatch.setattr(peers, "checkpoint_unsupported", lambda path: "a head size of 8")
    assert peers._arms(config, "greedy") == []
