"""A one-off experiment, not part of the package (docs/smollm2.md, "Nor do more target layers"): does the SmolLM2
draft gain from reading more of the target than EAGLE-3's three layers?

Gives the shipped draft's fusion ``fc`` the features of other stored target layers as well: the shipped columns keep
their layers, the new layers' columns start at zero, so the draft computes what the shipped one computes. Then trains
it exactly as `python -m exactspec.training.ablation RUN --variants eagle3 --init-from packaged --lr 3e-4 --steps
1500` trains its control (train_steps; same seed, schedule, and the same shards in memory, so the same batches) and
scores it on the run's held-out answers (held_out_acceptance). `--layers` with the shipped three reproduces the
control. Offline acceptance only.

    python docs/experiments/draft_inputs.py runs/smollm2e OUT --layers 1,6,14,26,29 --steps 1500 --lr 3e-4 --threads 2
"""
import argparse, json, math, time
from dataclasses import replace
from pathlib import Path

import torch

from exactspec.loading import PACKAGED_MODELS, resolve_checkpoint
from exactspec.models.eagle import FeatureDraft
from exactspec.training.feature_draft import POOL_BYTES, TrainDraftArgs, held_out_acceptance, teacher_model, train_steps
from exactspec.training.teacher import ShardPool, load_shards, shard_paths, stored_layers


def reading(shipped: FeatureDraft, layers: tuple[int, ...]) -> FeatureDraft:
    """The shipped draft, its ``fc`` widened to read ``layers`` (a superset of its own) with zero weight on the new."""
    missing = set(shipped.cfg.feature_layers) - set(layers)
    if missing:
        raise SystemExit(f"--layers must keep the shipped draft's layers {shipped.cfg.feature_layers}; {sorted(missing)} left out")
    draft = FeatureDraft(replace(shipped.cfg, feature_layers=layers))
    state = shipped.state_dict()
    c = shipped.cfg.target_hidden_size
    fc = torch.zeros(c, len(layers) * c)
    for i, layer in enumerate(shipped.cfg.feature_layers):
        j = layers.index(layer)
        fc[:, j * c:(j + 1) * c] = state["fc.weight"][:, i * c:(i + 1) * c]
    state["fc.weight"] = fc
    draft.load_state_dict(state)
    return draft


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", default="1,6,14,26,29")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    layers = tuple(sorted(int(x) for x in args.layers.split(",")))
    stored = stored_layers(args.run / "teacher")
    if not set(layers) <= set(stored):
        raise SystemExit(f"the run's teacher shards store layers {stored}, not all of {layers}")
    target = teacher_model(resolve_checkpoint("smollm2"))
    shipped = FeatureDraft.load(PACKAGED_MODELS["smollm2"].shipped_draft())
    draft = reading(shipped, layers)
    draft.attach(target.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    held = load_shards(args.run / "held_out", layers)
    before = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    print("before", json.dumps(before), flush=True)
    draft.train()
    control = ShardPool.within(args.run / "teacher", POOL_BYTES, 0, layers=shipped.cfg.feature_layers)
    pool = ShardPool(shard_paths(args.run / "teacher"), control.capacity, 0, layers=layers)
    args.out.mkdir(parents=True, exist_ok=True)
    train_args = TrainDraftArgs(target=args.run, out=args.out, seed=0, layout=draft.cfg.layout, lr=args.lr)
    began = time.monotonic()
    state = train_steps(train_args, draft, pool, target.cfg.vocab_size, deadline=math.inf, max_steps=args.steps)
    after = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    c = draft.cfg.target_hidden_size
    column_norms = {layer: round(draft.fc.weight[:, j * c:(j + 1) * c].norm().item(), 3) for j, layer in enumerate(layers)}
    result = {"layers": list(layers), "steps": state["step"], "lr": args.lr, "seconds": time.monotonic() - began,
              "before": before, "after": after, "fc_norm_by_layer": column_norms}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    torch.save(draft.state_dict(), args.out / "draft.pt")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
