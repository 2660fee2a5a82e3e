"""A feature draft in EAGLE-3's checkpoint format, the one llama.cpp's converter, vLLM and SGLang load.

The format (SpecForge's ``LlamaForCausalLMEagle3``): ``config.json`` with the draft's Llama shape, one hidden layer,
``vocab_size`` (the target's), ``draft_vocab_size`` and ``eagle_aux_hidden_state_layer_ids``; ``model.safetensors``
with ``fc.weight``, ``midlayer.*`` (one Llama decoder layer whose q, k and v read 2C inputs, plus ``hidden_norm``),
``norm.weight``, ``lm_head.weight`` over the draft's vocabulary, ``d2t`` (draft id i -> target id ``i + d2t[i]``)
and ``t2d`` (which target ids the draft has). The token embedding is the target's and is not stored.

What maps exactly, and what does not:

- Only the ``eagle3`` layout (:class:`exactspec.models.eagle.Eagle3Block`) is EAGLE-3's layer. The ``exactspec``
  layout mixes the fused state and the embedding in ``w_in`` before one norm, and its residual starts there; no
  choice of EAGLE-3 weights computes that, so it is refused with that reason.
- The layer ids: exactspec reads the *output* of layer l, EAGLE-3 names the *input* of layer l + 1. llama.cpp has
  no hook after a Llama target's last layer, so a draft reading it exports, but llama.cpp will not run it.
- The head: exactspec's is the target's LM head restricted to S (frozen); it is written as the draft's own
  ``lm_head`` with ``d2t`` mapping its rows to S's ids, which computes the same logits.

:func:`target_hf_layout` writes the Hugging Face layout of a GGUF target (``config.json``, ``tokenizer.json``,
``tokenizer_config.json``) that llama.cpp's converter reads with ``--target-model-dir``; :func:`convert_to_gguf`
runs that converter from a llama.cpp source tree.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from exactspec.models.eagle import FeatureDraft

__all__ = ["eagle3_layer_ids", "eagle3_state", "export_eagle3", "target_hf_layout", "convert_to_gguf"]


def eagle3_layer_ids(draft: FeatureDraft) -> list[int]:
    """EAGLE-3's ``eagle_aux_hidden_state_layer_ids``: the input of layer l + 1 is the output of layer l."""
    return [layer + 1 for layer in draft.cfg.feature_layers]


def eagle3_state(draft: FeatureDraft, target_vocab_size: int) -> dict[str, torch.Tensor]:
    """EAGLE-3's tensors from an attached ``eagle3``-layout draft (module docstring): q, k, v, gate and up split
    from exactspec's fused matrices, the head rows of S as ``lm_head``, S as ``d2t`` offsets and ``t2d``."""
    cfg = draft.cfg
    if cfg.layout != "eagle3":
        raise ValueError(
            "only an eagle3-layout draft maps to EAGLE-3 exactly: the exactspec layout mixes the fused state and the "
            "token embedding in w_in before one norm, where EAGLE-3 norms each apart and its q, k and v read both "
            "(train one with train-draft --layout eagle3)"
        )
    if draft.head is None:
        raise ValueError(
            "attach the target's embedding and head first "
            "(FeatureDraft.attach_weights): lm_head is the head's rows of S"
        )
    block, heads, kv, hd = draft.block, draft.block.n_head, draft.block.n_kv, draft.block.hd
    q, k, v = block.wqkv.weight.split([heads * hd, kv * hd, kv * hd])
    gate, up = block.w13.weight.chunk(2)
    ids = draft.vocab_ids.long()
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": draft.fc.weight,
        "midlayer.input_layernorm.weight": block.attn_norm,
        "midlayer.hidden_norm.weight": block.hidden_norm,
        "midlayer.self_attn.q_proj.weight": q,
        "midlayer.self_attn.k_proj.weight": k,
        "midlayer.self_attn.v_proj.weight": v,
        "midlayer.self_attn.o_proj.weight": block.wo.weight,
        "midlayer.post_attention_layernorm.weight": block.mlp_norm,
        "midlayer.mlp.gate_proj.weight": gate,
        "midlayer.mlp.up_proj.weight": up,
        "midlayer.mlp.down_proj.weight": block.w2.weight,
        "norm.weight": draft.norm,
        "lm_head.weight": draft.head,
    }
    state = {name: tensor.detach().to(torch.float32).contiguous() for name, tensor in tensors.items()}
    state["d2t"] = (ids - torch.arange(len(ids))).contiguous()
    state["t2d"] = t2d
    return state


def export_eagle3(
    draft: FeatureDraft, out: str | Path, target_vocab_size: int, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """``config.json`` and ``model.safetensors`` in EAGLE-3's format in directory ``out``; the directory."""
    from safetensors.torch import save_file

    state = eagle3_state(draft, target_vocab_size)
    cfg = draft.cfg
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    layer_ids = eagle3_layer_ids(draft)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": cfg.target_hidden_size,
        "target_hidden_size": cfg.target_hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.target_hidden_size // cfg.num_attention_heads,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "vocab_size": target_vocab_size,
        "draft_vocab_size": cfg.vocab_subset_size,
        "tie_word_embeddings": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "eagle_aux_hidden_state_layer_ids": layer_ids,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": layer_ids},
    }
    save_file(
        {name: t.to(dtype) if t.is_floating_point() else t for name, t in state.items()}, str(out / "model.safetensors")
    )
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def target_hf_layout(gguf_path: str | Path, out: str | Path) -> Path:
    """The Hugging Face layout of a Llama GGUF target that llama.cpp's converter reads for an EAGLE-3 draft
    (``--target-model-dir``): its config, and its tokenizer as exactspec reads it from the file."""
    from exactspec.models.gguf import llama_config, read_gguf
    from exactspec.tokenizer import TextTokenizer

    cfg = llama_config(read_gguf(gguf_path))
    tokenizer = TextTokenizer.from_gguf(gguf_path)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "hidden_act": "silu",
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": sorted(tokenizer.eos_token_ids),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.tokenizer.save(str(out / "tokenizer.json"))
    names = {"bos_token": tokenizer.token_text(tokenizer.bos_token_id)} if tokenizer.bos_token_id is not None else {}
    eos = sorted(tokenizer.eos_token_ids)
    if eos:
        names["eos_token"] = tokenizer.token_text(eos[0])
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                **names,
                **({"chat_template": tokenizer.chat_template} if tokenizer.chat_template else {}),
            },
            indent=2,
        )
    )
    return out


def convert_to_gguf(
    draft_dir: str | Path,
    target_dir: str | Path,
    out_file: str | Path,
    llama_cpp_source: str | Path,
    outtype: str = "f32",
) -> Path:
    """Run llama.cpp's ``convert_hf_to_gguf.py`` (from the source tree ``llama_cpp_source``, with its own ``gguf-py``)
    on an exported draft; the GGUF file that llama-server loads with ``--spec-type draft-eagle3 --model-draft``."""
    source = Path(llama_cpp_source)
    script = source / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise FileNotFoundError(f"{source} is not a llama.cpp source tree (no convert_hf_to_gguf.py)")
    environment = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(source / "gguf-py"), os.environ.get("PYTHONPATH")])),
    }
    done = subprocess.run(
        [
            sys.executable,
            str(script),
            str(draft_dir),
            "--target-model-dir",
            str(target_dir),
            "--outfile",
            str(out_file),
            "--outtype",
            outtype,
        ],
        capture_output=True,
        text=True,
        env=environment,
        check=False,
    )
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"llama.cpp's converter failed: {last}")
    return Path(out_file)
