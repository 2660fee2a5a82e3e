"""EAGLE-3's checkpoint format (exactspec.training.eagle3_export): what we write computes what our draft computes.

The judge is an independent reading of the exported tensors: EAGLE-3's decoder layer as llama.cpp's ``eagle3``
graph runs it (norm the embedding and the fused state apart, concatenate them in that order, q/k/v from both, the
residual from the fused state, the draft's own head, ``d2t`` placing its rows in the target's vocabulary). Its
logits must equal the draft's own, as the engine runs it, to float32 rounding; a checkpoint with its two input
norms swapped must not (the reading can tell them apart). The exactspec layout is refused with the reason.
Where llama.cpp's source and llama-server are at hand (slow), the checkpoint converts to GGUF and llama-server
drafts with it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import installed_llama_server

from exactspec.models.eagle import FeatureDraft, FeatureDraftConfig
from exactspec.models.llama import rotate_half
from exactspec.models.llama_config import rope_tables
from exactspec.training.eagle3_export import eagle3_layer_ids, eagle3_state, export_eagle3

TARGET_VOCAB, C = 40, 32


def random_draft(layout: str = "eagle3", seed: int = 0) -> FeatureDraft:
    torch.manual_seed(seed)
    cfg = FeatureDraftConfig(
        C, (0, 2, 4), 12, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48, layout=layout
    )
    draft = FeatureDraft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.copy_(torch.randn_like(p) * 0.3) if p.dim() == 2 else p.uniform_(0.5, 1.5)
        draft.vocab_ids.copy_(torch.randperm(TARGET_VOCAB)[:12].sort().values)
    return draft.attach_weights(torch.randn(TARGET_VOCAB, C), torch.randn(TARGET_VOCAB, C)).eval()


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def eagle3_reference(
    state: dict, config: dict, embed: torch.Tensor, features: torch.Tensor, next_tokens: torch.Tensor
) -> torch.Tensor:
    """Full-vocabulary logits (B, T, V) of EAGLE-3's first step, read from the checkpoint alone."""
    eps, heads, kv = config["rms_norm_eps"], config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // heads
    b, t, _ = features.shape
    u = features @ state["fc.weight"].T  # (B, T, C)
    x = torch.cat(
        [
            rms(embed[next_tokens], state["midlayer.input_layernorm.weight"], eps),
            rms(u, state["midlayer.hidden_norm.weight"], eps),
        ],
        dim=-1,
    )  # (B, T, 2C)
    q = (x @ state["midlayer.self_attn.q_proj.weight"].T).view(b, t, heads, hd).transpose(1, 2)
    k = (x @ state["midlayer.self_attn.k_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    v = (x @ state["midlayer.self_attn.v_proj.weight"].T).view(b, t, kv, hd).transpose(1, 2)
    cos, sin = rope_tables(
        FeatureDraftConfig(
            config["hidden_size"], (0,), 1, heads, kv, config["intermediate_size"], rope_theta=config["rope_theta"]
        ).layer_config(),
        t,
    )
    q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    attention = F.scaled_dot_product_attention(
        q, k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1), is_causal=True
    )
    y = u + attention.transpose(1, 2).reshape(b, t, heads * hd) @ state["midlayer.self_attn.o_proj.weight"].T
    mlp_in = rms(y, state["midlayer.post_attention_layernorm.weight"], eps)
    g = (
        y
        + (
            F.silu(mlp_in @ state["midlayer.mlp.gate_proj.weight"].T)
            * (mlp_in @ state["midlayer.mlp.up_proj.weight"].T)
        )
        @ state["midlayer.mlp.down_proj.weight"].T
    )
    draft_logits = rms(g, state["norm.weight"], eps) @ state["lm_head.weight"].T  # (B, T, |S|)
    full = torch.full((b, t, config["vocab_size"]), float("-inf"))
    full[..., torch.arange(len(state["d2t"])) + state["d2t"]] = draft_logits
    return full


def ours(draft: FeatureDraft, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:  # (B, T, V)
    with torch.no_grad():
        logits = draft.logits(draft.forward_train(features, next_tokens, steps=1)[0])
    full = torch.full((*logits.shape[:2], TARGET_VOCAB), float("-inf"))
    full[..., draft.vocab_ids] = logits
    return full


def test_the_checkpoint_computes_the_drafts_logits(tmp_path):
    draft = random_draft()
    out = export_eagle3(draft, tmp_path / "eagle3", TARGET_VOCAB, dtype=torch.float32)
    from safetensors.torch import load_file

    state, config = load_file(str(out / "model.safetensors")), json.loads((out / "config.json").read_text())
    generator = torch.Generator().manual_seed(1)
    features = torch.randn((2, 7, 3 * C), generator=generator)
    next_tokens = torch.randint(0, TARGET_VOCAB, (2, 7), generator=generator)
    expected = ours(draft, features, next_tokens)
    torch.testing.assert_close(
        eagle3_reference(state, config, draft.embed, features, next_tokens), expected, atol=1e-4, rtol=1e-4
    )
    swapped = {
        **state,
        "midlayer.input_layernorm.weight": state["midlayer.hidden_norm.weight"],
        "midlayer.hidden_norm.weight": state["midlayer.input_layernorm.weight"],
    }
    finite = expected.isfinite()
    assert (
        eagle3_reference(swapped, config, draft.embed, features, next_tokens)[finite] - expected[finite]
    ).abs().max() > 1e-2
    assert (
        config["draft_vocab_size"] == 12 and config["vocab_size"] == TARGET_VOCAB and config["num_hidden_layers"] == 1
    )
    assert (
        config["eagle_aux_hidden_state_layer_ids"] == eagle3_layer_ids(draft) == [1, 3, 5]
    )  # inputs of the next layers
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and state["t2d"].sum() == 12
    assert (state["d2t"] + torch.arange(12)).tolist() == draft.vocab_ids.tolist()


def test_the_exactspec_layout_and_a_detached_draft_are_refused():
    with pytest.raises(
        ValueError, match="only an eagle3-layout draft maps to EAGLE-3 exactly: the exactspec layout mixes"
    ):
        eagle3_state(random_draft("exactspec"), TARGET_VOCAB)
    draft = random_draft()
    draft.head = None
    with pytest.raises(ValueError, match="attach the target's embedding and head"):
        eagle3_state(draft, TARGET_VOCAB)


def test_export_eagle3_command_refuses_the_exactspec_layout_in_one_line(tmp_path, capsys):
    from exactspec.cli import main
    from exactspec.loading import PACKAGED_MODELS

    try:
        PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    random_draft("exactspec").save(tmp_path / "draft")
    code = main(
        ["export-eagle3", "--draft", str(tmp_path / "draft"), "--target", "smollm2", "--out", str(tmp_path / "x")]
    )
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "only an eagle3-layout draft" in err
    code = main(
        ["export-eagle3", "--draft", "x", "--target", "smollm2", "--out", str(tmp_path / "y"), "--gguf", "d.gguf"]
    )
    assert code == 2 and "--llama-cpp-source" in capsys.readouterr().err


def _llama_cpp_tools():
    """llama.cpp's source tree ($EXACTSPEC_LLAMA_CPP_SOURCE) and llama-server, where both are at hand."""
    source, binary = os.environ.get("EXACTSPEC_LLAMA_CPP_SOURCE"), installed_llama_server()
    return (source, binary) if source and binary else None


@pytest.mark.slow
@pytest.mark.skipif(
    _llama_cpp_tools() is None, reason="needs llama.cpp's source ($EXACTSPEC_LLAMA_CPP_SOURCE) and llama-server"
)
def test_llama_server_drafts_with_the_converted_checkpoint(tmp_path):
    """A SmolLM2 draft in the eagle3 layout (random weights: this checks the format, not a draft's quality) converts
    with llama.cpp's converter, and llama-server loads it and drafts with it."""
    from exactspec.bench.llama_server import LlamaServer, LlamaServerConfig, sampling_fields
    from exactspec.decoding.sampling import GREEDY
    from exactspec.loading import PACKAGED_MODELS
    from exactspec.models.gguf import embedding_and_head, llama_config, read_gguf
    from exactspec.training.eagle3_export import convert_to_gguf, target_hf_layout

    try:
        gguf = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    source, binary = _llama_cpp_tools()
    draft = FeatureDraft(FeatureDraftConfig.for_target(llama_config(read_gguf(gguf)), 4096, "eagle3"))
    draft.vocab_ids.copy_(torch.arange(4096))
    embed, head = embedding_and_head(read_gguf(gguf))
    exported = export_eagle3(draft.attach_weights(embed, head), tmp_path / "eagle3", embed.shape[0])
    converted = convert_to_gguf(exported, target_hf_layout(gguf, tmp_path / "target"), tmp_path / "draft.gguf", source)
    config = LlamaServerConfig(binary, gguf, threads=2, mode="draft-eagle3", draft_model=converted)
    with LlamaServer(config) as server:
        answer = server.complete(
            {"prompt": [1, 2, 3], "n_predict": 16, "return_tokens": True, **sampling_fields(GREEDY, 19)}
        )
    assert len(answer["tokens"]) == 16 and answer["timings"].get("draft_n", 0) > 0


@pytest.mark.slow
@pytest.mark.skipif(
    _llama_cpp_tools() is None, reason="needs llama.cpp's source ($EXACTSPEC_LLAMA_CPP_SOURCE) and llama-server"
)
def test_the_shipped_draft_exported_keeps_at_greedy_what_exactspec_keeps(tmp_path):
    """The cross-check of the export and of both tools' accounting: at greedy a drafted token is kept where the
    target's argmax equals the draft's, in exactspec (min(1, p/q) with one-hot p and q) and in llama-server's
    sample-and-match alike. The shipped draft on exactspec's llama.cpp runtime and its EAGLE-3 export on
    llama-server, 3 drafted a round, the same prompts: where the two llama.cpp builds write the same greedy text,
    every argmax is the same, so each must keep exactly as many drafted tokens as the other (a wrong export keeps
    next to none). Where a near-tie flips in one build the texts part (seen once in three prompts on an Intel AMX
    machine, 2026-12-06: 20 kept against 12 after they parted at token 9) and the counts are not comparable."""
    from exactspec.bench.llama_server import LlamaServer, LlamaServerConfig, sampling_fields
    from exactspec.bench.workloads import CHAT_WORKLOADS
    from exactspec.chat import chat_messages
    from exactspec.decoding.sampling import GREEDY
    from exactspec.loading import PACKAGED_MODELS
    from exactspec.speculator import Speculator

    pytest.importorskip("llama_cpp")
    try:
        gguf = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    source, binary = _llama_cpp_tools()
    shipped = PACKAGED_MODELS["smollm2"].shipped_draft()
    if FeatureDraft.load(shipped).cfg.layout != "eagle3":
        pytest.skip("the shipped SmolLM2 draft is not in the eagle3 layout")
    from exactspec.cli import main

    assert (
        main(
            [
                "export-eagle3",
                "--draft",
                str(shipped),
                "--target",
                "smollm2",
                "--out",
                str(tmp_path),
                "--gguf",
                str(tmp_path / "draft.gguf"),
                "--llama-cpp-source",
                source,
            ]
        )
        == 0
    )
    speculator = Speculator.load(
        "smollm2", str(shipped), backend="llamacpp", threads=2, lookup_routing=False, policy_cache=False
    )
    prompts = [speculator.tokenizer.encode_chat(chat_messages(text)) for text in CHAT_WORKLOADS["chat"][:4]]
    kept = []  # (exactspec, llama-server) accepted drafts, per prompt whose greedy texts agree
    config = LlamaServerConfig(
        binary, gguf, threads=2, mode="draft-eagle3", draft_model=tmp_path / "draft.gguf", draft_tokens=3
    )
    with LlamaServer(config) as server:
        for ids in prompts:
            generation = speculator.generate(ids, 48, GREEDY, gamma=3, seed=0, stop_at_eos=False).generation
            answer = server.complete(
                {
                    "prompt": ids,
                    "n_predict": 48,
                    "ignore_eos": True,
                    "return_tokens": True,
                    "cache_prompt": False,
                    **sampling_fields(GREEDY, len(ids) + 48),
                }
            )
            if list(generation.tokens) == answer["tokens"]:
                kept.append(
                    (
                        generation.stats.by_source()["draft"]["accepted"],
                        int(answer["timings"].get("draft_n_accepted", 0)),
                    )
                )
    assert len(kept) >= 2, (
        f"the two builds' greedy texts agree on {len(kept)} of {len(prompts)} prompts: too few to compare"
    )
    assert sum(ours for ours, _ in kept) >= 10, f"the shipped draft kept only {kept}: too few to compare"
    assert all(ours == theirs for ours, theirs in kept), kept
