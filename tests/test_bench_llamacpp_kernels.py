"""The llama.cpp kernel bench: both arms timed in child processes, and an arm that crashes or fails reported, not
fatal."""

from __future__ import annotations

import subprocess

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from test_gguf import random_hf_weights, write_llama_gguf  # noqa: E402
from test_llamacpp import spm_metadata  # noqa: E402

from exactspec.bench import llamacpp_kernels  # noqa: E402
from exactspec.bench.llamacpp_kernels import main, run_arm  # noqa: E402


def test_both_arms_are_timed_for_every_size(tmp_path, capsys):
    model = write_llama_gguf(tmp_path / "model.gguf", random_hf_weights(tie=False, seed=0), metadata=spm_metadata)
    assert main(["--target", str(model), "--threads", "1", "--sizes", "1,4", "--calls", "2", "--repeats", "1"]) == 0
    rows = {line.split("  ")[0]: line.split()[2:] for line in capsys.readouterr().out.splitlines()[2:]}
    assert set(rows) == {"extra buffers", "plain kernels"}
    assert all(len(costs) == 2 and all(float(ms) > 0 for ms in costs) for costs in rows.values())


def test_an_arm_that_crashes_or_fails_is_reported(tmp_path, monkeypatch):
    assert run_arm(tmp_path / "absent.gguf", True, [1], 1, 1).startswith("llama.cpp could not load")
    monkeypatch.setattr(llamacpp_kernels.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, -11, "", ""))
    assert run_arm(tmp_path / "absent.gguf", True, [1], 1, 1) == "killed by SIGSEGV"


def test_bad_options_are_one_line_errors(tmp_path, capsys):
    for args, message in (
        (["--sizes", "1,x"], "--sizes 1,x"),
        (["--target", str(tmp_path / "absent.gguf")], "no such file"),
        (["--calls", "0"], "must be >= 1"),
    ):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
