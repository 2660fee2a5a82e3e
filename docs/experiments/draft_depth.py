"""A one-off experiment, not part of the package (smollm2-log.md, "Nor does a second layer"): does a second
decoder layer help the SmolLM2 draft?

Grows the shipped draft by one plain Llama layer whose output projections (wo, w2) start at zero, so the deeper draft
computes what the shipped one computes, then trains it exactly as `python -m exactspec.training.ablation RUN
--variants eagle3,mlp-2x --init-from packaged --lr 3e-4 --steps 1500` trains its arms (train_steps, same seed, data
and schedule) and scores it on the run's held-out answers (held_out_acceptance). Offline acceptance only: the
runtime has no multi-layer draft, so no draft-step cost.

    python docs/experiments/draft_depth.py runs/smollm2e OUT --steps 1500 --lr 3e-4 --threads 2
"""

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from carry_on import carry_on, target_and_shipped
from torch import nn

from exactspec.models.eagle import FeatureDraft, ttt_mask
from exactspec.models.llama import Block
from exactspec.training.feature_draft import POOL_BYTES
from exactspec.training.teacher import ShardPool


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
                y = F.scaled_dot_product_attention(
                    q,
                    torch.cat(keys[i], 2),
                    torch.cat(values[i], 2),
                    attn_mask=mask,
                    enable_gqa=layer.n_kv != layer.n_head,
                )
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
    target, shipped = target_and_shipped(args.threads)
    torch.manual_seed(0)
    draft = DeeperDraft(shipped.cfg, args.extra_layers)
    missing = draft.load_state_dict(shipped.state_dict(), strict=False)
    assert all(k.startswith("extra.") for k in missing.missing_keys) and not missing.unexpected_keys
    pool = ShardPool.within(args.run / "teacher", POOL_BYTES, 0, layers=draft.cfg.feature_layers)
    result = {
        "extra_layers": args.extra_layers,
        **carry_on(target, draft, args.run, args.out, pool, args.steps, args.lr),
    }
    (args.out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
