"""A one-off experiment, not part of the package (docs/smollm2.md, "Nor does a second layer"): does a second
decoder layer help the SmolLM2 draft?

Grows the shipped draft by one plain Llama layer whose output projections (wo, w2) start at zero, so the deeper draft
computes what the shipped one computes, then trains it exactly as `python -m exactspec.training.ablation RUN
--variants eagle3,mlp-2x --init-from packaged --lr 3e-4 --steps 1500` trains its arms (train_steps, same seed, data
and schedule) and scores it on the run's held-out answers (held_out_acceptance). Offline acceptance only: the
runtime has no multi-layer draft, so no draft-step cost.

    python docs/experiments/draft_depth.py runs/smollm2e OUT --steps 1500 --lr 3e-4 --threads 2
"""
import argparse, json, math, time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from exactspec.loading import PACKAGED_MODELS, resolve_checkpoint
from exactspec.models.eagle import FeatureDraft, ttt_mask
from exactspec.models.llama import Block
from exactspec.training.feature_draft import POOL_BYTES, TrainDraftArgs, held_out_acceptance, teacher_model, train_steps
from exactspec.training.teacher import ShardPool, load_shards


class DeeperDraft(FeatureDraft):
    def __init__(self, cfg, extra_layers: int) -> None:
        super().__init__(cfg)
        self.extra = nn.ModuleList(Block(cfg.layer_config()) for _ in range(extra_layers))
        with torch.no_grad():
            for layer in self.extra:  # identity at the start: the residual stream passes through
                layer.wo.weight.zero_()
                layer.w2.weight.zero_()

    def forward_train(self, features, next_tokens, steps):
        b, t, _ = features.shape
        cos, sin = self.rope_cos[:t].to(features.dtype), self.rope_sin[:t].to(features.dtype)
        u = self.fc(features)
        layers = [self.block, *self.extra]
        keys, values, outputs = [[] for _ in layers], [[] for _ in layers], []
        for k in range(1, steps + 1):
            mask = ttt_mask(t, k, features.device)
            x = self.inputs(u, next_tokens)
            for i, layer in enumerate(layers):
                q, key, value = layer.qkv(x, cos, sin)
                keys[i].append(key)
                values[i].append(value)
                y = F.scaled_dot_product_attention(q, torch.cat(keys[i], 2), torch.cat(values[i], 2), attn_mask=mask,
                                                   enable_gqa=layer.n_kv != layer.n_head)
                x = layer.finish(x, y)
            outputs.append(x)
            u = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
        return outputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("run", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--extra-layers", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target = teacher_model(resolve_checkpoint("smollm2"))
    shipped = FeatureDraft.load(PACKAGED_MODELS["smollm2"].shipped_draft())
    torch.manual_seed(0)
    draft = DeeperDraft(shipped.cfg, args.extra_layers)
    missing = draft.load_state_dict(shipped.state_dict(), strict=False)
    assert all(k.startswith("extra.") for k in missing.missing_keys) and not missing.unexpected_keys
    draft.attach(target.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    held = load_shards(args.run / "held_out", draft.cfg.feature_layers)
    before = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    print("before", json.dumps(before), flush=True)
    draft.train()
    pool = ShardPool.within(args.run / "teacher", POOL_BYTES, 0, layers=draft.cfg.feature_layers)
    args.out.mkdir(parents=True, exist_ok=True)
    train_args = TrainDraftArgs(target=args.run, out=args.out, seed=0, layout=draft.cfg.layout, lr=args.lr)
    began = time.monotonic()
    state = train_steps(train_args, draft, pool, target.cfg.vocab_size, deadline=math.inf, max_steps=args.steps)
    after = held_out_acceptance(draft.eval(), held, 4, target.cfg.vocab_size)
    result = {"extra_layers": args.extra_layers, "steps": state["step"], "lr": args.lr, "seconds": time.monotonic() - began,
              "before": before, "after": after}
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    torch.save(draft.state_dict(), args.out / "draft.pt")
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
