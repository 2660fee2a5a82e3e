"""Smoke test of the training pipeline on a few stdlib files and tiny models (a few seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from exactspec.models.lean import LeanModel
from exactspec.training import HELD_OUT, TrainArgs, export_models, held_out_files, run, train_files
from exactspec.training.data import EOT, corpus_files, stdlib_root
from exactspec.training.pipeline import ModelShape


def test_held_out_split_is_fixed_and_disjoint():
    root = stdlib_root()
    held, train = held_out_files(root), train_files(root)
    assert held and train
    assert not set(held) & set(train)
    assert set(held) | set(train) == set(corpus_files(root))
    rels = {p.relative_to(root).as_posix() for p in held}
    assert "argparse.py" in rels and any(r.startswith("json/") for r in rels)
    assert all("site-packages" not in p.parts for p in train)
    assert len(HELD_OUT) >= 12

    def size(ps):
        return sum(p.stat().st_size for p in ps)

    assert 0.02 < size(held) / size(corpus_files(root)) < 0.08


def test_pipeline_smoke(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "run"
    args = TrainArgs(
        out=out,
        vocab_size=300,
        seq_len=32,
        batch_size=4,
        max_files=8,
        max_position_embeddings=64,
        target=ModelShape(2, 32, 64, 2, 1),
        draft=ModelShape(1, 32, 64, 2, 1),
        target_minutes=10,
        draft_minutes=10,
        target_tokens=128 * 12,
        draft_tokens=128 * 6,
        warmup_steps=2,
        eval_tokens=256,
        checkpoint_minutes=0.0,
        progress=False,
        threads=1,
        timing_calls=0,
    )
    metrics = run(args)
    for key in ("target_heldout_loss", "draft_heldout_loss", "alpha_stochastic", "argmax_agreement"):
        assert key in metrics
    assert 0.0 <= metrics["alpha_stochastic"] <= 1.0
    assert json.loads((out / "metrics.json").read_text()) == metrics
    assert (out / "ckpt_target.pt").is_file() and (out / "ckpt_draft.pt").is_file()

    with pytest.raises(SystemExit, match="--resume"):
        run(args)
    args.resume = True
    assert run(args) == metrics  # everything done: nothing re-runs

    dest = tmp_path / "export"
    export_models(out, dest)
    assert "held-out" in (dest / "MODEL_CARD.md").read_text()
    text = "def f(x):\n    return x\n"
    for name in ("target", "draft"):
        d = dest / name
        cfg = json.loads((d / "config.json").read_text())
        assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "bfloat16"
        tok = transformers.AutoTokenizer.from_pretrained(d)
        ids = tok(text)["input_ids"]
        assert tok.decode(ids) == text and tok.eos_token == EOT
        hf = transformers.AutoModelForCausalLM.from_pretrained(d).float().eval()
        lean = LeanModel.from_pretrained(d)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(lean.prefill(ids), ref, atol=1e-4, rtol=0)
