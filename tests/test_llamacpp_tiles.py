"""The probe of llama.cpp's AMX kernels: a crash in the child is seen as one, the verdict is cached, and where the
kernels are not in play nothing is probed."""

from __future__ import annotations

import sys

import pytest

from exactspec.models import llamacpp_tiles
from exactspec.models.llamacpp_tiles import cpu_has_amx, extra_buffers_work, probe_command, survives

AMX_BUILD = "CPU : SSE3 = 1 | AVX512 = 1 | AMX_INT8 = 1 | REPACK = 1 |"


def test_a_child_killed_by_a_signal_does_not_survive_and_an_error_exit_does():
    assert survives([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]) is False
    assert survives([sys.executable, "-c", "raise SystemExit(3)"]) is True
    assert survives([sys.executable, "-c", "import time; time.sleep(30)"], timeout=0.5) is None


def test_amx_is_read_from_the_cpus_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile amx_int8\n")
    assert cpu_has_amx(info)
    info.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_bf16 amx_tile\n")
    assert not cpu_has_amx(info)
    assert not cpu_has_amx(tmp_path / "absent")


@pytest.fixture
def files(tmp_path):
    (tmp_path / "lib").mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    return tmp_path / "model.gguf", tmp_path / "lib"


def _no_probe(command, timeout=None):
    raise AssertionError("probed")


def test_nothing_is_probed_where_the_amx_kernels_are_not_in_play(files, monkeypatch):
    monkeypatch.setattr(llamacpp_tiles, "survives", _no_probe)
    monkeypatch.setattr(llamacpp_tiles, "cpu_has_amx", lambda: True)
    assert extra_buffers_work(*files, AMX_BUILD.replace("AMX_INT8 = 1", "AMX_INT8 = 0"))
    assert extra_buffers_work(files[0].with_name("absent.gguf"), files[1], AMX_BUILD)
    monkeypatch.setattr(llamacpp_tiles, "cpu_has_amx", lambda: False)
    assert extra_buffers_work(*files, AMX_BUILD)


def test_a_crashing_build_loses_its_extra_buffers_once_probed_and_says_why(files, monkeypatch):
    monkeypatch.setattr(llamacpp_tiles, "cpu_has_amx", lambda: True)
    probes = []
    monkeypatch.setattr(llamacpp_tiles, "survives", lambda command, timeout=None: probes.append(command) or False)
    with pytest.warns(RuntimeWarning, match="AMX kernels crash"):
        assert not extra_buffers_work(*files, AMX_BUILD)
    assert len(probes) == 1 and str(files[0]) in probes[0]
    monkeypatch.setattr(llamacpp_tiles, "survives", _no_probe)  # cached from here on
    with pytest.warns(RuntimeWarning):
        assert not extra_buffers_work(*files, AMX_BUILD)
    files[0].write_bytes(b"GGUF, another model")  # another file: probed again
    monkeypatch.setattr(llamacpp_tiles, "survives", lambda command, timeout=None: True)
    assert extra_buffers_work(*files, AMX_BUILD)


def test_a_probe_without_a_verdict_keeps_llama_cpps_choice_and_is_not_cached(files, monkeypatch):
    monkeypatch.setattr(llamacpp_tiles, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(llamacpp_tiles, "survives", lambda command, timeout=None: None)
    assert extra_buffers_work(*files, AMX_BUILD)
    monkeypatch.setattr(llamacpp_tiles, "survives", lambda command, timeout=None: False)
    with pytest.warns(RuntimeWarning):
        assert not extra_buffers_work(*files, AMX_BUILD)


def test_the_probe_decodes_a_batch_of_a_real_file(tmp_path):
    """The child's own code on a small GGUF (float weights: no AMX kernel, so it must end cleanly on any CPU)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    import subprocess

    from test_gguf import random_hf_weights, write_llama_gguf
    from test_llamacpp import spm_metadata

    model = write_llama_gguf(tmp_path / "model.gguf", random_hf_weights(tie=False, seed=0), metadata=spm_metadata)
    done = subprocess.run(probe_command(model), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert subprocess.run(probe_command(tmp_path / "absent.gguf"), capture_output=True).returncode == 1
