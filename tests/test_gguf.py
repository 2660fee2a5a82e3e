"""GGUF files written by the `gguf` package (llama.cpp's own writer) against exactspec's reader and lean loader.

The reference is independent of exactspec: `gguf.GGUFReader` + `gguf.quants.dequantize` for the tensors, and
transformers' LlamaForCausalLM, built from the same quantized-then-dequantized weights in Hugging Face layout,
for the logits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf import GGMLQuantizationType as Q  # noqa: E402
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402

from exactspec.models.gguf import llama_config, read_gguf  # noqa: E402
from exactspec.models.lean import LeanModel  # noqa: E402

VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, CONTEXT = 256, 64, 128, 2, 4, 2, 128
EPS, THETA = 1e-5, 500.0
TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"]
#: float32 tolerance of lean-vs-transformers logits on identical weights (logits of size ~10; observed 0 on CPU).
ATOL = 1e-5
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
IDS = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(7)).tolist()


def hf_config(tie: bool, **extra) -> transformers.LlamaConfig:
    """The tiny Llama (64 hidden, a multiple of the 32-weight blocks) in transformers' terms."""
    return transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=CONTEXT,
        rms_norm_eps=EPS,
        rope_theta=THETA,
        tie_word_embeddings=tie,
        **extra,
    )


def random_hf_weights(tie: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random Llama's weights under Hugging Face names, wide enough that logits are far from uniform."""
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(hf_config(tie))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    if tie:
        state.pop("lm_head.weight", None)
    return state


def permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute: rotate_half halves -> interleaved pairs per head."""
    w = w.numpy()
    return torch.from_numpy(
        np.ascontiguousarray(
            w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        )
    )


def gguf_name(hf_name: str) -> str:
    fixed = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if hf_name in fixed:
        return fixed[hf_name]
    _, _, layer, *module, _ = hf_name.split(".")
    return f"blk.{layer}.{_LAYER['.'.join(module)]}.weight"


def gguf_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Hugging Face weights -> llama.cpp names and row order (Q by head count, K by KV head count)."""
    out = {}
    for name, w in state.items():
        if name.endswith("q_proj.weight"):
            w = permute(w, HEADS)
        elif name.endswith("k_proj.weight"):
            w = permute(w, KV_HEADS)
        out[gguf_name(name)] = w
    return out


def quantized(w: torch.Tensor, type_name: str) -> tuple[np.ndarray, Q]:
    """The stored data of one tensor as llama.cpp writes it (norms, 1-D, always F32)."""
    qtype = Q[type_name] if w.dim() == 2 else Q.F32
    return gguf.quants.quantize(w.float().numpy(), qtype), qtype


def llama_metadata(writer: GGUFWriter, arch: str = "llama") -> None:
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.context_length", CONTEXT)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", INTERMEDIATE)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_float32(f"{arch}.rope.freq_base", THETA)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", EPS)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    writer.add_uint32(f"{arch}.rope.dimension_count", HIDDEN // HEADS)


def write_gguf(
    path, tensors: dict[str, tuple[np.ndarray, Q]], arch: str = "llama", extra_metadata=(), metadata=llama_metadata
):
    """A GGUF file through gguf.GGUFWriter; ``extra_metadata``: (key, value, GGUFValueType) triples."""
    writer = GGUFWriter(path, arch)
    metadata(writer, arch)
    for key, value, vtype in extra_metadata:
        writer.add_key_value(key, value, vtype)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_llama_gguf(path, state: dict[str, torch.Tensor], type_name: str = "F32", **kwargs):
    """``state`` (Hugging Face names) converted the way llama.cpp's converter does, stored as ``type_name``."""
    return write_gguf(path, {name: quantized(w, type_name) for name, w in gguf_tensors(state).items()}, **kwargs)


def reference_weights(
    state: dict[str, torch.Tensor], type_name: str, permuted: bool = False
) -> dict[str, torch.Tensor]:
    """What the file holds, in Hugging Face layout, computed by gguf alone: quantize + dequantize each HF matrix.

    Quantization works row by row (blocks of 32 along a row), so quantizing the HF rows equals quantizing the
    permuted rows and permuting back; ``permuted=True`` keeps llama.cpp's row order (the un-permutation skipped)."""
    out = {}
    for name, w in state.items():
        if permuted and name.endswith("q_proj.weight"):
            w = permute(w, HEADS)
        elif permuted and name.endswith("k_proj.weight"):
            w = permute(w, KV_HEADS)
        data, qtype = quantized(w, type_name)
        out[name] = torch.from_numpy(gguf.quants.dequantize(data, qtype).astype(np.float32)).reshape(w.shape)
    return out


def transformers_logits(weights: dict[str, torch.Tensor], tie: bool, ids=IDS, **config) -> torch.Tensor:  # (T, V)
    model = transformers.LlamaForCausalLM(hf_config(tie, **config)).eval()
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


@pytest.fixture(scope="module")
def untied_state():
    return random_hf_weights(tie=False)


@pytest.fixture(scope="module")
def tied_state():
    return random_hf_weights(tie=True, seed=1)


@pytest.fixture(scope="module", params=TYPES)
def typed_file(request, tmp_path_factory, untied_state):
    """(type name, path of the untied model stored as that type)."""
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    return request.param, write_llama_gguf(path, untied_state, request.param)


# ---- tensors --------------------------------------------------------------------------------


def test_tensors_equal_gguf_dequantize_bit_for_bit(typed_file):
    """Every tensor read by exactspec equals gguf's own reader + dequantize of the stored bytes, exactly."""
    type_name, path = typed_file
    ours, theirs = read_gguf(path), GGUFReader(path)
    assert set(ours.tensors) == {t.name for t in theirs.tensors}
    stored_types = set()
    for ref in theirs.tensors:
        info = ours.tensors[ref.name]
        stored_types.add(ref.tensor_type.name)
        assert info.type_id == int(ref.tensor_type) and info.type_name == ref.tensor_type.name
        expected = torch.from_numpy(gguf.quants.dequantize(ref.data, ref.tensor_type).astype(np.float32))
        got = ours.tensor(ref.name)
        assert got.dtype == torch.float32 and got.shape == tuple(int(d) for d in reversed(ref.shape))
        assert torch.equal(got, expected.reshape(got.shape)), ref.name
    assert type_name in stored_types  # the matrices really are stored in the type under test


def test_metadata_and_config(typed_file):
    """The llama.* metadata becomes the LlamaConfig transformers would use."""
    _, path = typed_file
    cfg = llama_config(read_gguf(path))
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (
        VOCAB,
        HIDDEN,
        INTERMEDIATE,
        LAYERS,
    )
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_size) == (HEADS, KV_HEADS, HIDDEN // HEADS)
    assert cfg.max_position_embeddings == CONTEXT and cfg.rope_theta == THETA and cfg.rope_scaling is None
    assert cfg.rms_norm_eps == pytest.approx(EPS, rel=1e-6) and cfg.tie_word_embeddings is False


# ---- the model ------------------------------------------------------------------------------


def test_logits_equal_transformers_on_the_dequantized_weights(typed_file, untied_state):
    """The lean model loaded from the GGUF file computes transformers' logits on the same (dequantized) weights."""
    type_name, path = typed_file
    out = LeanModel.from_pretrained(path, dtype=torch.float32).prefill(IDS)
    ref = transformers_logits(reference_weights(untied_state, type_name), tie=False)
    assert out.shape == (len(IDS), VOCAB)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_rotary_rows_are_unpermuted(tmp_path, untied_state):
    """Keeping llama.cpp's interleaved Q/K row order would change the logits a lot: the un-permutation is needed,
    and the comparison above can see it."""
    path = write_llama_gguf(tmp_path / "f32.gguf", untied_state, "F32")
    out = LeanModel.from_pretrained(path).prefill(IDS)
    right = transformers_logits(reference_weights(untied_state, "F32"), tie=False)
    wrong = transformers_logits(reference_weights(untied_state, "F32", permuted=True), tie=False)
    torch.testing.assert_close(out, right, atol=ATOL, rtol=0)
    assert (out - wrong).abs().max() > 0.1
    # the first position attends only to itself, so the rotation cannot matter there; it does afterwards
    torch.testing.assert_close(wrong[0], right[0], atol=ATOL, rtol=0)


def test_tied_head_uses_the_embeddings(tmp_path, tied_state):
    """Without output.weight the head is the token embedding matrix."""
    path = write_llama_gguf(tmp_path / "tied.gguf", tied_state, "Q8_0")
    assert "output.weight" not in read_gguf(path).tensors
    model = LeanModel.from_pretrained(path)
    assert model.cfg.tie_word_embeddings is True
    ref = transformers_logits(reference_weights(tied_state, "Q8_0"), tie=True)
    torch.testing.assert_close(model.prefill(IDS), ref, atol=ATOL, rtol=0)


def test_untied_head_uses_output_weight(tmp_path, untied_state):
    """With output.weight the head is that matrix, not the embeddings (which would give other logits)."""
    path = write_llama_gguf(tmp_path / "untied.gguf", untied_state, "F16")
    model = LeanModel.from_pretrained(path)
    assert model.cfg.tie_word_embeddings is False
    weights = reference_weights(untied_state, "F16")
    assert torch.equal(model.decoder.lm_head.weight, weights["lm_head.weight"])
    out = model.prefill(IDS)
    torch.testing.assert_close(out, transformers_logits(weights, tie=False), atol=ATOL, rtol=0)
    as_if_tied = transformers_logits({k: v for k, v in weights.items() if k != "lm_head.weight"}, tie=True)
    assert (out - as_if_tied).abs().max() > 0.1


def test_linear_rope_scaling_matches_transformers(tmp_path, untied_state):
    """llama.rope.scaling.type 'linear' with a factor is read and applied as transformers applies it."""
    extra = [
        ("llama.rope.scaling.type", "linear", GGUFValueType.STRING),
        ("llama.rope.scaling.factor", 4.0, GGUFValueType.FLOAT32),
    ]
    path = write_llama_gguf(tmp_path / "linear.gguf", untied_state, "F32", extra_metadata=extra)
    out = LeanModel.from_pretrained(path).prefill(IDS)
    weights = reference_weights(untied_state, "F32")
    scaled = transformers_logits(weights, tie=False, rope_scaling={"rope_type": "linear", "factor": 4.0})
    torch.testing.assert_close(out, scaled, atol=ATOL, rtol=0)
    assert (out - transformers_logits(weights, tie=False)).abs().max() > 1e-2


# ---- refusals -------------------------------------------------------------------------------


def _f32(state: dict[str, torch.Tensor]) -> dict[str, tuple[np.ndarray, Q]]:
    return {name: quantized(w, "F32") for name, w in gguf_tensors(state).items()}


@pytest.mark.parametrize("type_name", ["Q5_0", "Q5_1", "Q2_K", "Q4_K", "Q6_K", "IQ4_NL", "IQ4_XS"])
def test_other_types_are_dequantized_as_the_gguf_package_does(tmp_path, type_name):
    """Types beyond exactspec's own (K-quants, I-quants, Q5_*) come through gguf.quants.dequantize, row by row, at
    the tensor's offset and in torch's dimension order."""
    qtype = Q[type_name]
    per_block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = np.random.default_rng(0).integers(0, 256, (3, 2 * block_bytes), dtype=np.uint8)  # 3 rows of 2 blocks
    path = write_gguf(
        tmp_path / "k.gguf", {"output_norm.weight": quantized(torch.ones(8), "F32"), "token_embd.weight": (raw, qtype)}
    )
    file = read_gguf(path)
    assert file.tensors["token_embd.weight"].shape == (3, 2 * per_block)
    expected = torch.from_numpy(gguf.quants.dequantize(raw, qtype).astype(np.float32))
    torch.testing.assert_close(file.tensor("token_embd.weight"), expected, rtol=0, atol=0, equal_nan=True)


def test_a_type_nothing_reads_is_refused_by_name(tmp_path, monkeypatch):
    """Without the gguf package a K-quant tensor is a ValueError naming its type and what is read, not garbage."""
    import exactspec.models.gguf as reader

    monkeypatch.setattr(reader, "_gguf_type", lambda type_id: None)
    raw = np.zeros((4, gguf.GGML_QUANT_SIZES[Q.Q6_K][1]), dtype=np.uint8)
    file = read_gguf(write_gguf(tmp_path / "k.gguf", {"token_embd.weight": (raw, Q.Q6_K)}))
    with pytest.raises(
        ValueError, match=r"token_embd\.weight is Q6_K, which exactspec does not read .*Q4_0.*pip install gguf"
    ):
        file.tensor("token_embd.weight")


def test_a_model_with_a_type_nothing_reads_fails_to_load_by_name(tmp_path, monkeypatch):
    """Loading a whole model with one Q6_K matrix, where no reader knows Q6_K, is a ValueError naming the type."""
    import exactspec.models.gguf as reader

    monkeypatch.setattr(reader, "_gguf_type", lambda type_id: None)
    hidden = 256
    cfg = dict(
        vocab_size=16,
        hidden_size=hidden,
        intermediate_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg, tie_word_embeddings=True))
    tensors = {
        name: quantized(w, "F32") for name, w in gguf_tensors(model.state_dict()).items() if name != "output.weight"
    }
    tensors["blk.0.ffn_down.weight"] = (np.zeros((hidden, 210), dtype=np.uint8), Q.Q6_K)  # one 256-weight block a row

    def metadata(writer, arch):
        for key, value in [
            ("block_count", 1),
            ("context_length", 32),
            ("embedding_length", hidden),
            ("feed_forward_length", hidden),
            ("attention.head_count", 4),
            ("attention.head_count_kv", 2),
        ]:
            writer.add_uint32(f"llama.{key}", value)
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
        writer.add_uint32("llama.vocab_size", 16)

    path = write_gguf(tmp_path / "q6k.gguf", tensors, metadata=metadata)
    with pytest.raises(ValueError, match="blk.0.ffn_down.weight is Q6_K"):
        LeanModel.from_pretrained(path)


def test_non_llama_architecture_is_refused(tmp_path, untied_state):
    """A qwen2 file is refused by architecture name, even with Llama-shaped tensors."""
    path = write_gguf(tmp_path / "qwen.gguf", _f32(untied_state), arch="qwen2")
    with pytest.raises(ValueError, match="holds a 'qwen2' model; the lean backend reads Llama GGUF files only"):
        LeanModel.from_pretrained(path)


def test_unknown_llama_metadata_key_is_refused(tmp_path, untied_state):
    """A llama.* key the decoder does not implement (here a mixture of experts) is named, not ignored."""
    extra = [("llama.expert_count", 8, GGUFValueType.UINT32)]
    path = write_gguf(tmp_path / "moe.gguf", _f32(untied_state), extra_metadata=extra)
    with pytest.raises(ValueError, match=r"metadata llama\.expert_count unknown to the lean backend"):
        LeanModel.from_pretrained(path)


def test_unknown_tensor_is_refused(tmp_path, untied_state):
    """An extra tensor such as rope_freqs.weight (Llama 3.1 style frequency factors) is named, not ignored."""
    tensors = {**_f32(untied_state), "rope_freqs.weight": (np.ones(HIDDEN // HEADS // 2, dtype=np.float32), Q.F32)}
    path = write_gguf(tmp_path / "freqs.gguf", tensors)
    with pytest.raises(ValueError, match=r"tensor\(s\) rope_freqs\.weight unknown to the lean backend"):
        LeanModel.from_pretrained(path)


def test_yarn_rope_scaling_is_refused(tmp_path, untied_state):
    """YaRN rotary scaling is not implemented: refused by name rather than ignored."""
    extra = [
        ("llama.rope.scaling.type", "yarn", GGUFValueType.STRING),
        ("llama.rope.scaling.factor", 4.0, GGUFValueType.FLOAT32),
    ]
    path = write_gguf(tmp_path / "yarn.gguf", _f32(untied_state), extra_metadata=extra)
    with pytest.raises(ValueError, match="rope scaling 'yarn' is not implemented"):
        LeanModel.from_pretrained(path)


def test_truncated_file_is_refused(tmp_path, untied_state):
    """A file cut in its tensor data, or in its header, is a ValueError saying it is truncated."""
    path = write_gguf(tmp_path / "full.gguf", _f32(untied_state))
    data = path.read_bytes()
    tail_cut = tmp_path / "tail.gguf"
    tail_cut.write_bytes(data[:-100])
    with pytest.raises(ValueError, match="is truncated: tensor .* ends past the end of the file"):
        read_gguf(tail_cut)
    with pytest.raises(ValueError, match="is truncated"):
        LeanModel.from_pretrained(tail_cut)
    head_cut = tmp_path / "head.gguf"
    head_cut.write_bytes(data[:200])
    with pytest.raises(ValueError, match=r"is truncated \(its header ends early\)"):
        read_gguf(head_cut)
    read_gguf(path)  # the uncut file reads


def test_file_not_starting_with_gguf_is_refused(tmp_path, untied_state):
    """A file whose magic is not GGUF (here an old GGML header) is refused by read_gguf and the loader."""
    data = write_gguf(tmp_path / "ok.gguf", _f32(untied_state)).read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGML" + data[4:])
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_gguf(bad)
    with pytest.raises(ValueError, match="is not a GGUF file"):
        LeanModel.from_pretrained(bad)


def test_custom_alignment_is_honoured(tmp_path, untied_state):
    """general.alignment moves where tensor data starts; the tensors still read as gguf reads them."""

    def metadata(writer, arch):
        llama_metadata(writer, arch)
        writer.add_custom_alignment(64)

    path = write_llama_gguf(tmp_path / "aligned.gguf", untied_state, "Q4_0", metadata=metadata)
    file, reference = read_gguf(path), GGUFReader(path)
    assert file.metadata["general.alignment"] == 64 and all(t.offset % 64 == 0 for t in file.tensors.values())
    for ref in reference.tensors:
        expected = torch.from_numpy(gguf.quants.dequantize(ref.data, ref.tensor_type).astype(np.float32))
        assert torch.equal(file.tensor(ref.name).reshape(expected.shape), expected), ref.name


def test_weight_shape_that_contradicts_the_metadata_is_refused(tmp_path, untied_state):
    """llama.vocab_size larger than token_embd's rows: a ValueError naming the file, not a RuntimeError."""

    def metadata(writer, arch):
        for key, value in [
            ("block_count", LAYERS),
            ("context_length", CONTEXT),
            ("embedding_length", HIDDEN),
            ("feed_forward_length", INTERMEDIATE),
            ("attention.head_count", HEADS),
            ("attention.head_count_kv", KV_HEADS),
            ("vocab_size", VOCAB + 44),
        ]:
            writer.add_uint32(f"llama.{key}", value)
        writer.add_float32("llama.attention.layer_norm_rms_epsilon", EPS)

    path = write_gguf(tmp_path / "shapes.gguf", _f32(untied_state), metadata=metadata)
    with pytest.raises(ValueError, match=rf"{path.name}: a weight does not match .*\(300\) must match .*\(256\)"):
        LeanModel.from_pretrained(path)
