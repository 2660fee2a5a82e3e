"""Precision defaults that fit the machine (exactspec.loading.native_bfloat16, default_dtype)."""

from __future__ import annotations

import pytest

from exactspec import loading
from exactspec.loading import PACKAGED_MODELS, default_dtype, native_bfloat16


def test_an_imitated_avx2_cpu_and_unknown_devices_have_no_native_bfloat16(monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
    assert native_bfloat16("cpu") is False and default_dtype("cpu") == "float32"
    assert native_bfloat16("nosuch") is False and native_bfloat16("meta") is False


def test_bfloat16_where_native_else_float32_except_for_a_gguf_files_q4_weights(monkeypatch):
    monkeypatch.setattr(loading, "native_bfloat16", lambda device="cpu": True)
    assert default_dtype("cpu") == "bfloat16"
    monkeypatch.setattr(loading, "native_bfloat16", lambda device="cpu": False)
    assert default_dtype("cpu") == "float32"  # the shipped pair: safetensors, no q4 path
    try:
        PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    assert default_dtype("cpu", "smollm2") == "bfloat16"  # torch's int4 kernel takes bfloat16 activations
    assert default_dtype("cpu", "smollm2", weights="dense") == "float32"
    assert default_dtype("cpu", "smollm2", backend="llamacpp") == "float32"  # llama.cpp's own numerics
    assert default_dtype("cpu", "no/such-model") == "float32"  # a missing model is reported where it is loaded
