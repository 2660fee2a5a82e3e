"""What the one-off draft experiments beside this file share (not part of the package): the SmolLM2 target and its
shipped draft, and carrying a grown copy of that draft on for a number of steps exactly as `python -m
exactspec.training.ablation RUN --init-from packaged` trains its arms (train_steps: seed 0, the same schedule),
scored on the run's held-out answers before and after (held_out_acceptance)."""

import json
import math
import time
from pathlib import Path

import torch

from exactspec.loading import PACKAGED_MODELS, resolve_checkpoint
from exactspec.models.eagle import FeatureDraft
from exactspec.models.lean import LeanModel
from exactspec.training.feature_draft import TrainDraftArgs, held_out_acceptance, teacher_model, train_steps
from exactspec.training.teacher import ShardPool, load_shards


def target_and_shipped(threads: int) -> tuple[LeanModel, FeatureDraft]:
    torch.set_num_threads(threads)
    return teacher_model(resolve_checkpoint("smollm2")), FeatureDraft.load(PACKAGED_MODELS["smollm2"].shipped_draft())


def carry_on(
    target: LeanModel, draft: FeatureDraft, run: Path, out: Path, pool: ShardPool, steps: int, lr: float
) -> dict:
    """Trains ``draft`` for ``steps`` on ``pool``; its held-out acceptance before and after, the steps, the learning
    rate and the seconds it took. The trained weights go to ``out/draft.pt``."""
    draft.attach(target.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    held = load_shards(run / "held_out", draft.cfg.feature_layers)
    before = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    print("before", json.dumps(before), flush=True)
    draft.train()
    out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    state = train_steps(
        TrainDraftArgs(target=run, out=out, seed=0, layout=draft.cfg.layout, lr=lr),
        draft,
        pool,
        target.cfg.vocab_size,
        deadline=math.inf,
        max_steps=steps,
    )
    seconds = time.monotonic() - began
    after = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    torch.save(draft.state_dict(), out / "draft.pt")
    return {"steps": state["step"], "lr": lr, "seconds": seconds, "before": before, "after": after}
