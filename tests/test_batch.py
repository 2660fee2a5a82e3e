"""``exactspec generate-batch`` and the library entry point (exactspec.jobs.batch), locally: results in input order,
each equal to the same request run alone (shipped pair, float32, call-size invariant, so that token identity does
not hang on a low-order bit of a batched kernel; seeded sequences draw with a fixed gamma on their own
generators); a job killed mid-write resumes to the same file as an uninterrupted one; bad requests are refused,
naming the line, before any work."""

from __future__ import annotations

import json

import pytest

from exactspec.cli import main
from exactspec.jobs.batch import BatchJobConfig, completed_lines, generate_batch
from exactspec.loading import default_pair_dirs, load_pair

REQUESTS = [
    {"prompt": f"def f{i}(x):\n    ", "max_tokens": 8 + i % 5, **({"temperature": 0} if i % 3 == 0 else {"top_k": 20})}
    for i in range(10)
] + [{"id": "chatless", "prompt": "import os\n", "seed": 99, "ignore_eos": True}]


def write_requests(path, requests=REQUESTS):
    path.write_text("".join(json.dumps(r) + "\n" for r in requests))
    return path


def run(tmp_path, output, *extra):
    return main(
        [
            "generate-batch",
            "--input",
            str(write_requests(tmp_path / "in.jsonl")),
            "--output",
            str(output),
            "--max-tokens",
            "12",
            "--max-batch",
            "4",
            "--invariant",
            "--json",
            *extra,
        ]
    )


def test_results_come_in_input_order_and_equal_each_request_alone(tmp_path, capsys):
    assert run(tmp_path, tmp_path / "out.jsonl") == 0
    summary = json.loads(capsys.readouterr().out)
    lines = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["line"] for r in lines] == list(range(len(REQUESTS))) and summary["written"] == len(REQUESTS)
    assert lines[-1]["id"] == "chatless" and len(lines[-1]["token_ids"]) == 12 and lines[-1]["stop_reason"] == "length"
    assert all(r["record_id"] == summary["record_id"] for r in lines)
    record = json.loads((tmp_path / "out.jsonl.record.json").read_text())
    assert (
        record["record_id"] == summary["record_id"]
        and record["gamma_policy"] == "fixed 4"
        and record["verify"] == "block"
    )
    pair = load_pair(*default_pair_dirs(), invariant=True)
    alone = [
        next(generate_batch(pair, [r], BatchJobConfig(max_tokens=12, slots=1), first_line=i))
        for i, r in enumerate(REQUESTS)
    ]
    assert [r["token_ids"] for r in lines] == [r["token_ids"] for r in alone]
    assert all(0 <= r["speculation"]["acceptance_rate"] <= 1 for r in lines)


def test_a_killed_job_resumes_to_the_same_output(tmp_path, capsys):
    assert run(tmp_path, tmp_path / "whole.jsonl") == 0
    capsys.readouterr()
    whole = (tmp_path / "whole.jsonl").read_text()
    lines = whole.splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_text("".join(lines[:4]) + lines[4][:17])  # killed while writing the fifth result
    assert completed_lines(cut) == 4 and cut.read_text() == "".join(lines[:4])  # the partial line is dropped
    assert run(tmp_path, cut) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["already_done"], summary["written"]) == (4, len(REQUESTS) - 4)
    assert cut.read_text() == whole
    assert run(tmp_path, cut) == 0 and cut.read_text() == whole  # nothing left to do: nothing duplicated


@pytest.mark.parametrize(
    "line, words",
    [
        ({"prompt": "x", "temprature": 1}, "line 2: unknown field 'temprature'"),
        ({"prompt": "x", "messages": []}, "line 2: give exactly one of prompt and messages"),
        ({"prompt": "x", "max_tokens": 0}, "line 2: max_tokens must be an integer"),
        ({"prompt": "x", "top_p": 0}, "line 2: top_p"),
        ({"prompt": "x", "verify": "blocks"}, "line 2: verify must be one of block, token"),
    ],
)
def test_a_bad_request_is_refused_before_any_work(tmp_path, capsys, line, words):
    source = write_requests(tmp_path / "in.jsonl", [{"prompt": "ok"}, line])
    code = main(["generate-batch", "--input", str(source), "--output", str(tmp_path / "out.jsonl")])
    error = capsys.readouterr().err.strip()
    assert code == 2 and words in error and len(error.splitlines()) == 1
    assert not (tmp_path / "out.jsonl").exists()
