"""Run records (exactspec.jobs.records) and ``exactspec replay``: a fixed-gamma sampled run replays to the same tokens;
a difference is explained; the record names the models by hash and the processors in the order they run."""

from __future__ import annotations

import json

from exactspec.cli import main
from exactspec.decoding.sampling import SamplingParams, processor_order
from exactspec.jobs.records import model_identity, redacted, replay_verdict
from exactspec.loading import default_pair_dirs


def test_a_fixed_gamma_record_replays_to_the_same_tokens(tmp_path, capsys):
    record_path = tmp_path / "run.json"
    argv = [
        "generate",
        "def main(",
        "--max-new-tokens",
        "24",
        "--gamma",
        "3",
        "--seed",
        "7",
        "--top-k",
        "40",
        "--dtype",
        "float32",
        "--record",
        str(record_path),
        "--json",
    ]
    assert main(argv) == 0
    generated = json.loads(capsys.readouterr().out)
    record = json.loads(record_path.read_text())
    assert record["figures"]["token_ids"] == generated["token_ids"] and len(generated["token_ids"]) == 24
    assert record["target"] == model_identity(default_pair_dirs()[0]) and len(record["target"]["weights_sha256"]) == 64
    assert record["sampling"] == [["top_k", 40]] and record["gamma_policy"] == "fixed 3" and record["seed"] == 7
    assert (
        record["figures"]["runtime_choice"] == generated["runtime_choice"]
        and "candidates" in record["figures"]["runtime_choice"]
    )
    assert (
        record["precision"] == "float32, dense weights, call-size dependent"
        and record["environment"]["libraries"]["torch"]
    )
    assert main(["replay", str(record_path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["identical"] is True
    assert json.loads(record_path.read_text()) == record  # replay leaves the record alone


def test_a_difference_is_explained(tmp_path):
    record = {
        "figures": {"token_ids": [1, 2, 3], "sampling": "sampled"},
        "gamma_policy": "auto",
        "precision": "float32, dense weights, call-size dependent",
        "environment": {"exactspec": None, "source_revision": None, "libraries": {}, "hardware": {}},
    }
    verdict = replay_verdict(record, [1, 2, 4])
    assert not verdict["identical"] and verdict["first_difference"] == 2 and "gamma auto" in verdict["reason"]
    record["gamma_policy"] = "fixed 4"
    assert "environment changed" in replay_verdict(record, [1, 5, 3])["reason"]
    record["precision"] = "bfloat16, dense weights, call-size dependent"
    assert "call size" in replay_verdict(record, [1, 5, 3])["reason"]


def test_processors_are_listed_in_the_order_they_run():
    params = SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.2, min_p=0.05)
    assert processor_order(params) == [
        ["repetition_penalty", 1.2],
        ["temperature", 0.7],
        ["top_p", 0.9],
        ["min_p", 0.05],
    ]
    assert processor_order(SamplingParams(temperature=0)) == [["argmax", True]]


def test_bad_records_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{")
    assert main(["replay", str(tmp_path / "bad.json")]) == 2
    assert main(["generate", "x", "--max-new-tokens", "2", "--record", str(tmp_path / "missing" / "r.json")]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all(e.startswith("exactspec: error:") for e in errors)


def test_an_api_key_never_reaches_a_record():
    assert redacted(["serve", "--api-key", "sk-1", "--port", "9"]) == ["serve", "--api-key", "***", "--port", "9"]
    assert redacted(["serve", "--api-key=sk-1"]) == ["serve", "--api-key=***"]
