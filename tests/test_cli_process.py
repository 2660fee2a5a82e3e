"""The CLI as a process: Ctrl-C, closed pipes, seeds, flag errors that name the flag, --version, --help."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from exactspec import __version__
from exactspec.cli import build_parser, main

EXACTSPEC = [sys.executable, "-m", "exactspec"]


def one_line_error(capsys, args, message):
    assert main(args) == 2
    captured = capsys.readouterr()
    assert message in captured.err and captured.err.count("\n") == 1 and "Traceback" not in captured.err, captured.err
    assert captured.out == ""


def test_ctrl_c_keeps_the_partial_output_prints_the_summary_and_exits_130():
    process = subprocess.Popen(
        [*EXACTSPEC, "generate", "def parse_args(", "--max-new-tokens", "900", "--ignore-eos", "--gamma", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # a shell's background job ignores SIGINT and a child inherits that: give it Ctrl-C as a terminal would
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    first = process.stdout.read(8)  # generation is under way
    process.send_signal(signal.SIGINT)
    rest, err = process.communicate(timeout=60)
    err = err.decode()
    assert process.returncode == 130, err
    assert first and "Traceback" not in err and "KeyboardInterrupt" not in err
    summary = err.strip().splitlines()[-1]
    assert "stop: interrupted" in summary and "tokens/s" in summary
    tokens = int(summary.split()[0].lstrip("["))
    assert 0 < tokens < 900


def test_ctrl_c_while_the_library_loads_is_one_line_and_130():
    """Ctrl-C before the command runs (torch still importing: exactspec.launch imports the library inside its try)."""
    process = subprocess.Popen(
        [*EXACTSPEC, "generate", "def parse_args(", "--max-new-tokens", "900"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    time.sleep(0.3)  # after Python's own start, inside the library's imports on any machine seen so far
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=60)
    err = err.decode()
    assert process.returncode == 130 and out == b"", err
    assert "Traceback" not in err and err.strip() == "exactspec: interrupted", err


def test_a_closed_pipe_ends_quietly():
    process = subprocess.Popen(
        [*EXACTSPEC, "generate", "def parse_args(", "--max-new-tokens", "900", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.read(4)
    process.stdout.close()  # like `| head -c 4`
    err = process.stderr.read().decode()
    assert process.wait(timeout=60) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err, err


def test_seed_range_and_a_random_seed_that_is_reported_and_reproducible(capsys):
    one_line_error(
        capsys,
        ["generate", "x", "--seed", "99999999999999999999999"],
        "argument --seed: must be an integer in [0, 2^64 - 1]",
    )
    one_line_error(capsys, ["generate", "x", "--seed", "-2"], "or -1 for a random seed")
    args = ["generate", "class Stack:", "--max-new-tokens", "12", "--ignore-eos", "--gamma", "3", "--json"]
    first = json.loads((main([*args, "--seed", "-1"]), capsys.readouterr().out)[1])
    second = json.loads((main([*args, "--seed", "-1"]), capsys.readouterr().out)[1])
    assert first["seed"] != second["seed"] and 0 <= first["seed"] < 2**64  # random: a collision has odds 2^-64
    again = json.loads((main([*args, "--seed", str(first["seed"])]), capsys.readouterr().out)[1])
    assert again["text"] == first["text"] and again["seed"] == first["seed"]
    assert main(["generate", "x", "--max-new-tokens", "2", "--seed", str(2**64 - 1)]) == 0
    assert f"seed {2**64 - 1}" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "x", "--presence-penalty", "1e39"], "--presence-penalty must be within +-1e+30, got 1e+39"),
        (["generate", "x", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["generate", "x", "--temperature", "1e-40"], "--temperature must be 0 (greedy) or in"),
        (["generate", "x", "--max-new-tokens", "0"], "argument --max-new-tokens: must be an integer >= 1, got '0'"),
        (["bench", "--gammas", "abc"], "argument --gammas: must be comma-separated integers >= 1, got 'abc'"),
        (["bench", "--gammas", "2,0"], "argument --gammas: must be comma-separated integers >= 1"),
        (
            ["bench", "--workloads", "poetry"],
            "argument --workloads: must be comma-separated names from heldout, code, grounded",
        ),
        (["bench", "--modes", "fast"], "argument --modes: must be comma-separated names"),
        (["bench", "--repeats", "0"], "argument --repeats: must be an integer >= 1"),
        (["serve", "--port", "99999"], "argument --port: must be an integer from 1 to 65535, got '99999'"),
        (
            ["cost", "--best-gamma", "--max-gamma=-1", "--alpha", "0.5", "--target-ms", "1", "--draft-ms", "0.1"],
            "argument --max-gamma: must be an integer >= 0, got '-1'",
        ),
    ],
)
def test_bad_values_name_their_flag(capsys, args, message):
    one_line_error(capsys, args, message)


def test_an_unwritable_output_dir_is_refused_before_the_run(tmp_path, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    one_line_error(
        capsys,
        ["bench", "--output-dir", str(blocker / "out")],
        f"--output-dir {blocker / 'out'}: cannot write there (Not a directory)",
    )
    if os.geteuid() != 0:  # root may write anywhere; the check above covers that case
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        one_line_error(capsys, ["bench", "--output-dir", str(locked / "out")], "cannot write there (Permission denied)")


@pytest.mark.parametrize(
    "args",
    [
        [
            "bench",
            "--no-hf",
            "--workloads",
            "code",
            "--modes",
            "greedy",
            "--repeats",
            "1",
            "--prompts",
            "1",
            "--max-new-tokens",
            "4",
            "--output-dir",
            "/proc/nope",
        ],
        ["certify", "--sequences", "2", "--output-dir", "/proc/nope"],
        ["train-draft", "--target", "smollm2-135m-instruct", "--out", "/proc/nope"],
        ["generate", "x", "--record", "/proc/nope.json"],
        ["bench", "--record", "/proc/nope.json"],
        ["generate-batch", "--input", "in.jsonl", "--output", "/proc/nope.jsonl"],
        [
            "audit",
            "--endpoint",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--target-weights",
            "x",
            "--output",
            "/proc/nope.json",
        ],
    ],
    ids=lambda args: f"{args[0]} {args[-2]}",
)
def test_every_file_a_command_writes_is_checked_before_the_work_even_as_root(capsys, args):
    """``os.access`` says yes to root on /proc: each command tries to write there before any work (nothing printed on
    stdout, one line on stderr naming the flag)."""
    one_line_error(capsys, args, f"{args[-2]} {args[-1]}: cannot write")


def test_an_empty_file_name_is_refused_not_ignored(capsys):
    one_line_error(capsys, ["generate", "x", "--record", ""], "--record needs a file name, got an empty one")


def test_a_file_that_fails_after_the_work_is_one_line_after_the_figures(tmp_path, capsys, monkeypatch):
    import exactspec.jobs.records as records

    def full_disk(record, path):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(records, "write_record", full_disk)
    record = tmp_path / "run.json"
    assert (
        main(
            ["generate", "def parse_args(", "--max-new-tokens", "4", "--ignore-eos", "--json", "--record", str(record)]
        )
        == 2
    )
    captured = capsys.readouterr()
    assert json.loads(captured.out)["tokens"] == 4  # the figures of the work that was done
    assert captured.err == f"exactspec: error: --record {record}: No space left on device\n" and not record.exists()


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"exactspec {__version__}"


def test_help_shows_every_default():
    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in commands.choices.items():
        text = " ".join(command.format_help().split())
        for action in command._actions:
            if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
                continue
            assert action.help and f"(default: {action.default})" in text, (name, action.dest)


def test_prompt_from_stdin_or_a_file_and_threads(tmp_path):
    """`-` reads standard input, --prompt-file a file; the same prompt gives the same greedy text; --threads is
    applied."""
    import subprocess
    import sys

    common = [
        sys.executable,
        "-m",
        "exactspec",
        "generate",
        "--max-new-tokens",
        "8",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    ]
    prompt = "def parse_args(argv):\n    "
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    runs = [
        subprocess.run([*common, prompt], capture_output=True, text=True),
        subprocess.run([*common, "-", "--threads", "1"], input=prompt, capture_output=True, text=True),
        subprocess.run([*common, "--prompt-file", str(tmp_path / "prompt.txt")], capture_output=True, text=True),
    ]
    results = [json.loads(run.stdout) for run in runs]
    assert all(r["prompt"] == prompt for r in results) and len({r["text"] for r in results}) == 1
    assert results[1]["threads"] == 1
    for args, message in (
        ([], "exactly one of them"),
        (["x", "--prompt-file", "p"], "exactly one of them"),
        (["--prompt-file", str(tmp_path / "absent.txt")], "--prompt-file"),
        (["x", "--threads", "0"], "argument --threads"),
    ):
        done = subprocess.run([*common, *args], capture_output=True, text=True)
        assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr
