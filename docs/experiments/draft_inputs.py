"""A one-off experiment, not part of the package (smollm2-log.md, "Nor do more target layers"): does the SmolLM2
draft gain from reading more of the target than EAGLE-3's three layers?

Gives the shipped draft's fusion ``fc`` the features of other stored target layers as well: the shipped columns keep
their layers, the new layers' columns start at zero, so the draft computes what the shipped one computes. Then trains
it exactly as `python -m exactspec.training.ablation RUN --variants eagle3 --init-from packaged --lr 3e-4 --steps
1500` trains its control (train_steps; same seed, schedule, and the same shards in memory, so the same batches) and
scores it on the run's held-out answers (held_out_acceptance). `--layers` with the shipped three reproduces the
control. Offline acceptance only.

    python docs/experiments/draft_inputs.py runs/smollm2e OUT --layers 1,6,14,26,29 --steps 1500 --lr 3e-4 --threads 2
"""

import argparse
import json
from dataclasses import replace
from pathlib import Path

import torch
from carry_on import carry_on, target_and_shipped

from exactspec.models.eagle import FeatureDraft
from exactspec.training.feature_draft import POOL_BYTES
from exactspec.training.teacher import ShardPool, shard_paths, stored_layers


def reading(shipped: FeatureDraft, layers: tuple[int, ...]) -> FeatureDraft:
    """The shipped draft, its ``fc`` widened to read ``layers`` (a superset of its own) with zero weight on the new."""
    missing = set(shipped.cfg.feature_layers) - set(layers)
    if missing:
        raise SystemExit(
            f"--layers must keep the shipped draft's layers {shipped.cfg.feature_layers}; {sorted(missing)} left out"
        )
    draft = FeatureDraft(replace(shipped.cfg, feature_layers=layers))
    state = shipped.state_dict()
    c = shipped.cfg.target_hidden_size
    fc = torch.zeros(c, len(layers) * c)
    for i, layer in enumerate(shipped.cfg.feature_layers):
        j = layers.index(layer)
        fc[:, j * c : (j + 1) * c] = state["fc.weight"][:, i * c : (i + 1) * c]
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
    layers = tuple(sorted(int(x) for x in args.layers.split(",")))
    stored = stored_layers(args.run / "teacher")
    if not set(layers) <= set(stored):
        raise SystemExit(f"the run's teacher shards store layers {stored}, not all of {layers}")
    target, shipped = target_and_shipped(args.threads)
    draft = reading(shipped, layers)
    control = ShardPool.within(args.run / "teacher", POOL_BYTES, 0, layers=shipped.cfg.feature_layers)
    pool = ShardPool(shard_paths(args.run / "teacher"), control.capacity, 0, layers=layers)
    result = {"layers": list(layers), **carry_on(target, draft, args.run, args.out, pool, args.steps, args.lr)}
    c = draft.cfg.target_hidden_size
    result["fc_norm_by_layer"] = {
        layer: round(draft.fc.weight[:, j * c : (j + 1) * c].norm().item(), 3) for j, layer in enumerate(layers)
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
