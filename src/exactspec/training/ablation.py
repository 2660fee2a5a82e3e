"""Which feature-draft architecture to ship: variants trained on the same teacher data, compared by predicted speed.

Reads a finished (or interrupted) `exactspec train-draft` run directory: its teacher shards (the target's
features at the layers of every layout and top-16 next-token probabilities) and its held-out answers. Each variant
is trained for the same number of steps from the same seed, on its own layers of the same shards, drawn as
train-draft draws them, then measured two ways:

* held-out acceptance by draft position (T=1: sum_v min(p, q); greedy: argmax agreement), teacher-forced chains
  as `train-draft`'s model card reports them;
* one draft step's cost through the proposer the engine uses (T=1 sampling included), and the target's call
  cost by call size, both measured here after training, with nothing else running.

The predicted speedup over plain decoding combines them (`costmodel.chain_speedup`: acceptance by position,
best chain length up to 4), beside the ceiling that the call costs allow (every draft token accepted). The
variants: the two layouts (exactspec's layer on layers at a quarter, a half and the end; EAGLE-3's layer and
layers, which llama.cpp, vLLM and SGLang load), and, on train-draft's default layout, the last layer only (EAGLE),
the head's vocabulary subset (FR-Spec) at 4k, 16k and the whole vocabulary, no training-time test, the training
steps in float32 or in bfloat16 autocast (train-draft's default, ``--train-dtype auto``, picks by the CPU), and a
loss of cross-entropy alone and with a total-variation term at weight 1 (train-draft's default weight is 4:
``--tv-weight``; DistillSpec found the divergence that pays depends on the decoding, and T=1 acceptance is 1 - TV),
and an MLP twice the target's width (train-draft's ``--mlp-units``).

Variants train from scratch, or with ``--init-from`` all from one trained draft (the shipped one, say): then only
the variants that keep its layout, layers and vocabulary run, mlp-2x on the draft widened so that it computes
what it computed (:meth:`FeatureDraft.widened`); the question is then which carries on best from where it is.

    python -m exactspec.training.ablation runs/smollm2_draft --steps 300 --threads 2
    python -m exactspec.training.ablation runs/smollm2_draft --variants exactspec,eagle3 --steps 50   # a quick look
    python -m exactspec.training.ablation runs/smollm2_draft --variants "" --compare packaged  # the shipped draft alone
    python -m exactspec.training.ablation runs/smollm2_draft --variants eagle3,mlp-2x --init-from packaged \\
        --lr 3e-4 --steps 1500

Writes OUT/ablation.json and prints a table. States threads, dtype and weights.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from exactspec.decoding import costmodel
from exactspec.decoding.sampling import SamplingParams
from exactspec.loading import PACKAGED_MODELS, resolve_checkpoint
from exactspec.models.eagle import CONFIG_FILE, FeatureDraft, FeatureDraftConfig
from exactspec.models.lean import LeanModel
from exactspec.proposers.feature_draft import FeatureDraftProposer
from exactspec.tokenizer import TextTokenizer
from exactspec.training.feature_draft import (
    POOL_BYTES,
    TrainDraftArgs,
    held_out_acceptance,
    teacher_model,
    train_precision,
    train_steps,
    vocabulary_subset,
)
from exactspec.training.teacher import ShardPool, load_shards, shard_paths, stored_layers
from exactspec.tuning.calibration import calibrate


@dataclass(frozen=True)
class Variant:
    """One architecture or training choice; the fields left at their defaults are train-draft's."""

    layout: str = TrainDraftArgs.layout
    layers: str = "all"  # the layout's feature layers: "all", or "last" only
    vocab: int = TrainDraftArgs.vocab_subset  # the head's vocabulary subset (0: the whole vocabulary)
    ttt: int = TrainDraftArgs.steps  # training-time-test depth
    train_dtype: str = TrainDraftArgs.train_dtype
    tv_weight: float = TrainDraftArgs.tv_weight
    mlp_scale: int = 1  # the MLP's units, in multiples of the target's


VARIANTS = {
    "exactspec": Variant(layout="exactspec"),
    "eagle3": Variant(layout="eagle3"),
    "last-layer": Variant(layers="last"),
    "vocab-4k": Variant(vocab=4096),
    "vocab-16k": Variant(vocab=16384),
    "vocab-full": Variant(vocab=0),
    "ttt-1": Variant(ttt=1),
    "train-float32": Variant(train_dtype="float32"),
    "train-bfloat16": Variant(train_dtype="bfloat16"),
    "loss-ce": Variant(tv_weight=0.0),
    "loss-tv": Variant(tv_weight=1.0),
    "mlp-2x": Variant(mlp_scale=2),
}
POSITIONS = 4


def run_variant(name: str, run: Path, target: LeanModel, tokenizer: TextTokenizer, args: argparse.Namespace) -> dict:
    """One variant trained for ``args.steps`` on the run's teacher shards (its own layers of them, drawn as
    train-draft draws), from scratch or from ``args.init_from`` (widened where the variant widens), scored on the
    run's held-out answers."""
    variant = VARIANTS[name]
    torch.manual_seed(args.seed)
    draft, coverage = _starting_draft(name, variant, target, tokenizer, run, args)
    pool = ShardPool.within(run / "teacher", POOL_BYTES, args.seed, layers=draft.cfg.feature_layers)
    held = load_shards(run / "held_out", draft.cfg.feature_layers)
    draft.attach(target.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    train_args = TrainDraftArgs(
        target=run,
        out=out,
        steps=variant.ttt,
        seed=args.seed,
        layout=draft.cfg.layout,
        lr=args.lr,
        train_dtype=variant.train_dtype,
        tv_weight=variant.tv_weight,
    )
    began = time.monotonic()
    state = train_steps(train_args, draft, pool, target.cfg.vocab_size, deadline=math.inf, max_steps=args.steps)
    acceptance = held_out_acceptance(draft.eval(), held, POSITIONS, target.cfg.vocab_size)
    draft.save(out / "draft")
    return {
        "variant": name,
        "layout": draft.cfg.layout,
        "draft_dir": str(out / "draft"),
        "feature_layers": list(draft.cfg.feature_layers),
        "vocab_subset": draft.cfg.vocab_subset_size,
        "subset_coverage": coverage,
        "mlp_units": draft.cfg.intermediate_size,
        "ttt_steps": variant.ttt,
        "train_dtype": train_precision(variant.train_dtype),
        "tv_weight": variant.tv_weight,
        "init_from": str(args.init_from) if args.init_from else None,
        "steps": state["step"],
        "tokens_seen": state["tokens"],
        "train_seconds": time.monotonic() - began,
        "acceptance": acceptance,
    }


def _starting_draft(
    name: str, variant: Variant, target: LeanModel, tokenizer: TextTokenizer, run: Path, args: argparse.Namespace
) -> tuple[FeatureDraft, float]:
    """The variant's draft before training and its vocabulary subset's coverage: fresh (the subset counted on the
    run's shards), or the draft ``args.init_from`` names with its MLP widened by the variant's scale (the variant
    may change nothing else of it)."""
    units, init_from = variant.mlp_scale * target.cfg.intermediate_size, args.init_from
    if init_from is not None:
        start = FeatureDraft.load(init_from)
        card = json.loads((init_from / CONFIG_FILE).read_text()).get("card", {})
        coverage = card.get("data", {}).get("vocabulary_subset_coverage", math.nan)
        fresh = FeatureDraftConfig.for_target(target.cfg, start.cfg.vocab_subset_size, variant.layout)
        if (
            variant.layers != "all"
            or variant.vocab != TrainDraftArgs.vocab_subset
            or fresh.feature_layers != start.cfg.feature_layers
        ):
            raise SystemExit(
                f"variant {name} changes the draft's layout, layers or vocabulary: it cannot start from {init_from}"
            )
        return (start.widened(units) if units > start.cfg.intermediate_size else start), coverage
    cfg = replace(
        FeatureDraftConfig.for_target(target.cfg, variant.vocab or target.cfg.vocab_size, variant.layout),
        intermediate_size=units,
    )
    if variant.layers == "last":
        cfg = replace(cfg, feature_layers=cfg.feature_layers[-1:])
    if variant.vocab:
        rows = ShardPool.within(run / "teacher", POOL_BYTES, args.seed, layers=cfg.feature_layers).rows_for(0)
        subset, coverage = vocabulary_subset([r["ids"] for r in rows], variant.vocab, set(tokenizer.eos_token_ids))
    else:
        subset, coverage = torch.arange(target.cfg.vocab_size), 1.0
    draft = FeatureDraft(replace(cfg, vocab_subset_size=len(subset)))
    draft.vocab_ids.copy_(subset)
    return draft, coverage


def evaluate_given(directory: Path, target: LeanModel, run: Path) -> dict:
    """A draft trained elsewhere (the packaged one, a longer run), evaluated on this run's held-out answers."""
    try:
        draft = FeatureDraft.load(directory).attach(target.decoder)
        held = load_shards(run / "held_out", draft.cfg.feature_layers)
    except ValueError as error:
        raise SystemExit(f"{directory}: {error}") from None
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    card = json.loads((directory / "feature_draft.json").read_text()).get("card", {})
    return {
        "variant": f"given: {directory.name}",
        "layout": draft.cfg.layout,
        "draft_dir": str(directory),
        "feature_layers": list(draft.cfg.feature_layers),
        "vocab_subset": draft.cfg.vocab_subset_size,
        "mlp_units": draft.cfg.intermediate_size,
        "subset_coverage": card.get("data", {}).get("vocabulary_subset_coverage", math.nan),
        "ttt_steps": card.get("training", {}).get("ttt_steps", 0),
        "train_dtype": card.get("training", {}).get("precision", "float32"),
        "tv_weight": card.get("training", {}).get("tv_weight", 0.0),
        "steps": card.get("training", {}).get("steps", 0),
        "train_seconds": card.get("training", {}).get("seconds", math.nan),
        "acceptance": held_out_acceptance(draft.eval(), held, POSITIONS, target.cfg.vocab_size),
    }


def measure_costs(results: list[dict], target: LeanModel, context: list[int], repeats: int) -> dict[int, float]:
    """Each variant's draft step (ms, T=1, median of ``repeats`` proposals of 4) into its result; the target's
    call cost by size (ms, median over the variants' calibrations)."""
    by_size: dict[int, list[float]] = {}
    for result in results:
        draft = FeatureDraft.load(result["draft_dir"]).attach(target.decoder)
        target.capture_features(draft.cfg.feature_layers)
        proposer = FeatureDraftProposer.solo(draft, target.vocab_size, target.max_len, target.device, target.dtype)
        calibration = calibrate(target, proposer, context, POSITIONS, repeats, params=SamplingParams(temperature=1.0))
        result["draft_step_ms"] = calibration.draft_step_ms
        for size, ms in calibration.target_ms.items():
            by_size.setdefault(size, []).append(ms)
    return {size: statistics.median(values) for size, values in by_size.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="an `exactspec train-draft` run directory (teacher/, held_out/)")
    parser.add_argument("--target", default="smollm2", help="the target the run was made for")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=300, help="training steps per variant (batch 8 x 256 tokens)")
    parser.add_argument(
        "--compare",
        type=Path,
        action="append",
        default=[],
        help="a trained draft directory to evaluate beside the variants, untrained here ('packaged': the "
        "target's shipped draft); repeatable",
    )
    parser.add_argument("--out", type=Path, help="where the variants go (default: RUN/ablation)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=20, help="timed proposals per variant")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--lr", type=float, default=TrainDraftArgs.lr, help="peak learning rate (warm-up, then cosine to a tenth)"
    )
    parser.add_argument(
        "--init-from",
        type=Path,
        help="a trained draft every variant starts from ('packaged': the target's shipped draft); variants "
        "may then only change its training or widen its MLP",
    )
    args = parser.parse_args()
    unknown = sorted(set(filter(None, args.variants.split(","))) - set(VARIANTS))
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    missing = [part for part in ("teacher", "held_out") if not shard_paths(args.run / part)]
    if missing:
        raise SystemExit(
            f"{args.run} has no {' or '.join(missing)} shards: give the directory of an `exactspec train-draft` run"
        )
    if stored_layers(args.run / "teacher") is None:
        raise SystemExit(
            f"{args.run}'s teacher shards do not record their target layers (an older train-draft): run train-draft "
            "again with a new --out"
        )
    if str(args.init_from) == "packaged":
        if args.target not in PACKAGED_MODELS:
            raise SystemExit(f"--init-from packaged: {args.target} is not a packaged model; name a draft directory")
        args.init_from = PACKAGED_MODELS[args.target].shipped_draft()
    if args.init_from is not None and not FeatureDraft.is_feature_draft(args.init_from):
        raise SystemExit(f"--init-from {args.init_from} is not a feature draft (it has no {CONFIG_FILE})")
    args.out = args.out or args.run / "ablation"
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    path = resolve_checkpoint(args.target)
    tokenizer = TextTokenizer.from_path(path)
    teacher = teacher_model(path)  # the weights train-draft reads
    results = []
    for directory in args.compare:
        packaged = PACKAGED_MODELS[args.target].shipped_draft() if str(directory) == "packaged" else directory
        results.append(evaluate_given(packaged, teacher, args.run))
        print(json.dumps(results[-1]), flush=True)
    for name in filter(None, args.variants.split(",")):
        result = run_variant(name, args.run, teacher, tokenizer, args)
        print(json.dumps(result), flush=True)
        results.append(result)
    del teacher
    target = teacher_model(path)  # what generate decodes with by default
    dtype = str(target.dtype).removeprefix("torch.")
    context = load_shards(shard_paths(args.run / "held_out")[:1])[0]["ids"][:160].tolist()
    target_ms = measure_costs(results, target, context, args.repeats)
    for result in results:
        for mode in ("sampled", "greedy"):
            best = costmodel.chain_speedup(result["acceptance"][mode], result["draft_step_ms"], target_ms)
            result[f"predicted_{mode}"] = {"gamma": best.gamma, "speedup": best.speedup}
        ceiling = costmodel.chain_speedup([1.0] * POSITIONS, result["draft_step_ms"], target_ms)
        result["ceiling"] = {"gamma": ceiling.gamma, "speedup": ceiling.speedup}  # every draft token accepted
    report = {
        "threads": args.threads,
        "dtype": dtype,
        "weights": "auto (q4 where the GGUF has it)",
        "steps": args.steps,
        "target_ms_by_call_size": target_ms,
        "variants": results,
    }
    (args.out / "ablation.json").write_text(json.dumps(report, indent=2))
    print(
        f"\n{args.steps} steps per variant trained here; target "
        f"{', '.join(f'{n} tok {ms:.1f} ms' for n, ms in target_ms.items())}; {dtype}, {args.threads} threads"
    )
    print(
        "| variant | layout | layers | |S| (coverage) | MLP units | TTT | train dtype "
        "| TV weight | train s | T=1 acceptance by position | greedy | draft step ms "
        "| predicted T=1 (gamma) | predicted greedy (gamma) | all accepted (gamma) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        acc = {m: " / ".join(f"{a:.2f}" for a in r["acceptance"][m]) for m in ("sampled", "greedy")}
        print(
            f"| {r['variant']} | {r['layout']} | {r['feature_layers']} | {r['vocab_subset']} "
            f"({r['subset_coverage']:.3f}) | {r['mlp_units']} | {r['ttt_steps']} | {r['train_dtype']} | "
            f"{r['tv_weight']:g} | {r['train_seconds']:.0f} | {acc['sampled']} | {acc['greedy']} | "
            f"{r['draft_step_ms']:.2f} | {r['predicted_sampled']['speedup']:.2f}x "
            f"({r['predicted_sampled']['gamma']}) | {r['predicted_greedy']['speedup']:.2f}x "
            f"({r['predicted_greedy']['gamma']}) | {r['ceiling']['speedup']:.2f}x ({r['ceiling']['gamma']}) |"
        )


if __name__ == "__main__":
    main()
