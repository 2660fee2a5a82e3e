"""The benchmark harness: workloads are built from the right files, every arm runs, outputs are written."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from conftest import save_tiny_checkpoint, tiny_tokenizer_json

from exactspec.bench.arms import BenchConfig
from exactspec.bench.workloads import third_party_sources, workload_prompts
from exactspec.cli import main


def test_code_prompts_come_from_third_party_packages_not_the_standard_library():
    stdlib = Path(sysconfig.get_paths()["stdlib"]).resolve()
    files = third_party_sources()
    assert files and all("site-packages" in f.parts or stdlib not in f.resolve().parents for f in files)
    assert workload_prompts("code", 3) == workload_prompts("code", 3)  # deterministic


def test_grounded_prompts_repeat_their_input():
    for prompt in workload_prompts("grounded", 3):
        original, request = prompt.split("\n# The same code with `", 1)
        assert "renamed to" in request and original.startswith("# Original:\n")


def test_bad_configuration_is_refused():
    with pytest.raises(ValueError, match="unknown workload or mode: poetry"):
        BenchConfig(workloads=("poetry",))
    with pytest.raises(ValueError, match="gammas"):
        BenchConfig(gammas=(0,))


def test_bench_cli_runs_every_arm_and_writes_report_and_plots(tmp_path, capsys):
    tokenizer = tiny_tokenizer_json()
    target = save_tiny_checkpoint(tmp_path / "target", vocab_rows=300, layers=2, seed=0, tokenizer_json=tokenizer)
    draft = save_tiny_checkpoint(tmp_path / "draft", vocab_rows=300, layers=1, seed=1, tokenizer_json=tokenizer)
    out = tmp_path / "out"
    args = [
        "bench",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--workloads",
        "grounded",
        "--modes",
        "greedy,sample",
        "--gammas",
        "1,2",
        "--prompts",
        "1",
        "--max-new-tokens",
        "6",
        "--repeats",
        "2",
        "--output-dir",
        str(out),
        "--json",
        "--record",
        str(tmp_path / "record.json"),
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    record = json.loads((tmp_path / "record.json").read_text())
    assert (
        record["kind"] == "bench"
        and record["figures"]["results"] == report["results"]
        and record["draft"]["weights_sha256"]
    )
    names = ["plain", "draft g=1", "draft g=2", "adaptive", "lookup", "hf plain", "hf assisted g=4"]
    assert [(r["mode"], r["arm"]) for r in report["results"]] == [
        (mode, arm) for mode in ("greedy", "sample") for arm in names
    ]
    plain, draft_row = report["results"][:2]
    assert plain["speedup"] == 1.0 and plain["spread"][0] <= plain["tokens_per_second"] <= plain["spread"][1]
    assert draft_row["vs_hf_assisted"] == draft_row["tokens_per_second"] / report["results"][6]["tokens_per_second"]
    assert draft_row["predicted_speedup"] > 0 and draft_row["efficiency"] > 0 and draft_row["alpha"] is not None
    for name in ("report.json", "report.txt", "speedup.png", "acceptance.png"):
        assert (out / name).stat().st_size > 0
    assert main(["bench", "--target", str(target), "--draft", str(draft), "--modes", "fast"]) == 2


def test_bench_rules_compares_the_rules_on_the_same_rounds(tmp_path, capsys):
    """--rules: both rules' tokens per call from the same sampled rounds (one-sided bound below the ratio), and
    --gamma auto's speed under each beside plain decoding; the pooled row is every workload's rounds together, and the
    table names the runtime that ran."""
    from exactspec.bench.rules import format_rules_table

    tokenizer = tiny_tokenizer_json()
    target = save_tiny_checkpoint(tmp_path / "target", vocab_rows=300, layers=2, seed=0, tokenizer_json=tokenizer)
    draft = save_tiny_checkpoint(tmp_path / "draft", vocab_rows=300, layers=1, seed=1, tokenizer_json=tokenizer)
    args = [
        "bench",
        "--rules",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--workloads",
        "grounded,code",
        "--gammas",
        "3",
        "--prompts",
        "2",
        "--max-new-tokens",
        "24",
        "--repeats",
        "1",
        "--output-dir",
        str(tmp_path / "out"),
        "--json",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    for row in report["results"]:
        assert row["rounds"] >= 4 and row["ratio_lower_bound"] < row["ratio"]
        assert row["ratio"] == pytest.approx(row["block_tokens_per_round"] / row["token_tokens_per_round"])
        assert 1 <= row["token_tokens_per_round"] <= 4 and 1 <= row["block_tokens_per_round"] <= 4
        assert set(row["tokens_per_second"]) == {"plain", "auto block", "auto token"} and row["block_over_token"] > 0
    pooled, rows = report["pooled"], report["results"]
    assert pooled["rounds"] == sum(r["rounds"] for r in rows)
    for rule in ("block_tokens_per_round", "token_tokens_per_round"):
        assert pooled[rule] == pytest.approx(sum(r[rule] * r["rounds"] for r in rows) / pooled["rounds"])
    table = format_rules_table(report)
    assert (
        f"{report['backend']} runtime ({report['precision']}), threads: {report['threads']}" in table
        and report["backend"] != "auto"
    )
    assert table.splitlines()[-1].split()[:2] == ["pooled", str(pooled["rounds"])]
    assert main(["bench", "--rules", "--target", str(target), "--draft", "lookup"]) == 2


def test_ctrl_c_keeps_the_arms_finished_so_far(tmp_path, capsys, monkeypatch):
    """An interrupt in the second repetition of the fourth arm: every arm keeps its first repetition, exit 130."""
    from exactspec.bench import arms as bench

    tokenizer = tiny_tokenizer_json()
    target = save_tiny_checkpoint(tmp_path / "target", vocab_rows=300, layers=1, seed=0, tokenizer_json=tokenizer)
    draft = save_tiny_checkpoint(tmp_path / "draft", vocab_rows=300, layers=1, seed=1, tokenizer_json=tokenizer)
    real_arms, calls = bench._arms, {"n": 0}

    def arms_with_an_interrupt(*args):
        arms = real_arms(*args)
        record, run = arms[3]

        def interrupted(prompt, seed):
            calls["n"] += 1
            if calls["n"] == 3:  # warm-up, first repetition, then Ctrl-C
                raise KeyboardInterrupt
            return run(prompt, seed)

        return arms[:3] + [(record, interrupted)] + arms[4:]

    monkeypatch.setattr(bench, "_arms", arms_with_an_interrupt)
    out = tmp_path / "out"
    args = [
        "bench",
        "--target",
        str(target),
        "--draft",
        str(draft),
        "--workloads",
        "grounded,code",
        "--modes",
        "greedy",
        "--gammas",
        "1,2",
        "--prompts",
        "1",
        "--max-new-tokens",
        "4",
        "--repeats",
        "3",
        "--no-hf",
        "--output-dir",
        str(out),
        "--json",
    ]
    assert main(args) == 130
    report = json.loads(capsys.readouterr().out)
    rows = report["results"]
    assert report["interrupted"] and {row["workload"] for row in rows} == {
        "grounded"
    }  # the second workload never started
    assert [row["arm"] for row in rows] == ["plain", "draft g=1", "draft g=2", "adaptive", "lookup"]
    # two repetitions before the interrupted arm, one from it on (low == high only for a single measurement)
    assert [row["repeats"] for row in rows] == [2, 2, 2, 1, 1]
    assert [row["spread"][0] == row["spread"][1] for row in rows] == [False, False, False, True, True]
    assert json.loads((out / "report.json").read_text())["interrupted"] and (out / "speedup.png").stat().st_size > 0
