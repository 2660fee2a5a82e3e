"""``python -m exactspec.training --out runs/default [--resume] [--export DIR]``."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from .pipeline import ModelShape, TrainArgs, export_models, load_state, run, save_json


def _shape(s: str) -> ModelShape:
    try:
        parts = [int(x) for x in s.split(",")]
        return ModelShape(*parts)
    except (ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"expected LAYERS,HIDDEN,INTERMEDIATE,HEADS,KV_HEADS, got {s!r}") from None


def main(argv: list[str] | None = None) -> None:
    d = TrainArgs(out=Path("runs/default"))
    p = argparse.ArgumentParser(prog="python -m exactspec.training", description=__doc__)
    p.add_argument("--out", type=Path, required=True, help="run directory (checkpoints, data, models, metrics)")
    p.add_argument(
        "--resume", action="store_true", help="continue an interrupted run in --out (its saved settings are reused)"
    )
    p.add_argument(
        "--export",
        type=Path,
        default=None,
        metavar="DIR",
        help="only copy the finished run's target/ and draft/ into DIR and write MODEL_CARD.md",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], default=d.device)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--threads", type=int, default=d.threads)
    p.add_argument("--vocab-size", type=int, default=d.vocab_size)
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument(
        "--target-shape",
        type=_shape,
        default=d.target,
        metavar="L,C,I,H,KV",
        help="target layers,hidden,intermediate,heads,kv_heads (default 12,192,512,3,1)",
    )
    p.add_argument(
        "--draft-shape",
        type=_shape,
        default=d.draft,
        metavar="L,C,I,H,KV",
        help="draft layers,hidden,intermediate,heads,kv_heads (default 1,192,512,3,1)",
    )
    p.add_argument("--target-minutes", type=float, default=d.target_minutes)
    p.add_argument("--draft-minutes", type=float, default=d.draft_minutes)
    p.add_argument("--target-tokens", type=int, default=d.target_tokens, help="token budget (0 = time only)")
    p.add_argument("--draft-tokens", type=int, default=d.draft_tokens)
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--draft-lr", type=float, default=d.draft_lr)
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--ce-weight", type=float, default=d.ce_weight)
    p.add_argument("--checkpoint-minutes", type=float, default=d.checkpoint_minutes)
    p.add_argument("--eval-tokens", type=int, default=d.eval_tokens)
    p.add_argument("--max-files", type=int, default=0, help="use only the first N training files (smoke runs)")
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    command = "python -m exactspec.training " + " ".join(
        shlex.quote(x) for x in (argv if argv is not None else sys.argv[1:])
    )
    if a.export is not None:
        export_models(a.out, a.export)
        return
    args = TrainArgs(
        out=a.out,
        resume=a.resume,
        device=a.device,
        seed=a.seed,
        threads=a.threads,
        vocab_size=a.vocab_size,
        seq_len=a.seq_len,
        batch_size=a.batch_size,
        target=a.target_shape,
        draft=a.draft_shape,
        target_minutes=a.target_minutes,
        draft_minutes=a.draft_minutes,
        target_tokens=a.target_tokens,
        draft_tokens=a.draft_tokens,
        lr=a.lr,
        draft_lr=a.draft_lr,
        warmup_steps=a.warmup_steps,
        ce_weight=a.ce_weight,
        checkpoint_minutes=a.checkpoint_minutes,
        eval_tokens=a.eval_tokens,
        max_files=a.max_files,
        progress=not a.no_progress,
    )
    state = load_state(a.out)
    if not state.get("command"):  # remembered for the model card; a resume keeps the original
        a.out.mkdir(parents=True, exist_ok=True)
        state["command"] = command
        save_json(a.out / "state.json", state)
    metrics = run(args)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}, indent=2))


if __name__ == "__main__":
    main()
