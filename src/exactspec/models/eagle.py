"""A feature-level draft (EAGLE-style) that reads the target's own hidden states.

Slot j of the draft's sequence stands for target position j and predicts token x_{j+2}:

    u_j = fc([a_j ; b_j ; c_j])   the target's hidden states after three of its layers at position j
          or g_{j-1}              the draft's own output at the previous slot, where the target has not run yet
    h_j = w_in([u_j ; E x_{j+1}]) E: the target's token embedding (frozen, not stored)
    g_j = Block(h_j)              one Llama decoder layer over the slots so far (causal, own KV cache, rope at j)
    q(x_{j+2}) = softmax(H_S norm(g_j)) on S, zero elsewhere

That is the ``exactspec`` layout. The ``eagle3`` layout is EAGLE-3's own decoder layer (:class:`Eagle3Block`), the
one llama.cpp, vLLM and SGLang load: no w_in; u_j and E x_{j+1} are RMS-normed apart, q, k and v read both, and the
residual stream starts at u_j. Only that layout exports to EAGLE-3's checkpoint format
(:mod:`exactspec.training.eagle3_export`).

H_S is the target's LM head restricted to S, a set of frequent tokens (frozen, only the ids are stored). The
architecture follows EAGLE (Li et al. 2024, arXiv 2401.15077): features plus the next token's embedding, one
decoder layer, the target's head; EAGLE-3 (arXiv 2503.01840): low, middle and high layer features fused by ``fc``
and training on the draft's own features ("training-time test", :meth:`FeatureDraft.forward_train`); FR-Spec
(arXiv 2502.14856): the head restricted to frequent tokens. Exactness does not depend on any of it: q is a
distribution over the full vocabulary (zero outside S), checked by the usual rule.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from .llama import Block, LlamaDecoder
from .llama_config import LlamaConfig, rope_tables

__all__ = ["FeatureDraftConfig", "FeatureDraft", "Eagle3Block", "LAYOUTS", "layers_of_every_layout", "ttt_mask"]

CONFIG_FILE, WEIGHTS_FILE = "feature_draft.json", "feature_draft.safetensors"
LAYOUTS = ("exactspec", "eagle3")


class Eagle3Block(Block):
    """EAGLE-3's decoder layer (Li et al. 2025, arXiv 2503.01840, as llama.cpp's ``eagle3`` graph runs it). Its input
    is ``x = [u ; e]``, the fused state and the next token's embedding (B, T, 2C):

        y = u + W_o attn(W_qkv [norm_e(e) ; norm_u(u)])     g = y + mlp(norm(y))

    ``attn_norm`` is norm_e (EAGLE-3's ``input_layernorm``), ``hidden_norm`` is norm_u; q, k and v are 2C wide."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg)
        c = cfg.hidden_size
        self.wqkv = nn.Linear(2 * c, (self.n_head + 2 * self.n_kv) * self.hd, bias=False)  # q | k | v, over [e ; u]
        self.hidden_norm = nn.Parameter(torch.ones(c))

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):  # x: (B, T, 2C) = [u ; e]
        u, e = x.chunk(2, dim=-1)
        return self._project(
            torch.cat([self._norm(e, self.attn_norm), self._norm(u, self.hidden_norm)], dim=-1), cos, sin
        )

    def finish(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:  # (B, T, 2C), (B, nh, T, hd) -> (B, T, C)
        return super().finish(x.chunk(2, dim=-1)[0], y)


@dataclass(frozen=True)
class FeatureDraftConfig:
    target_hidden_size: int
    feature_layers: tuple[int, ...]  # target layers whose outputs are read (0-based)
    vocab_subset_size: int  # |S|
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 8192
    layout: str = "exactspec"  # one of LAYOUTS

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"a feature draft's layout is one of {', '.join(LAYOUTS)}, got {self.layout!r}")

    def layer_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.vocab_subset_size,
            hidden_size=self.target_hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
        )

    @classmethod
    def for_target(cls, target: LlamaConfig, vocab_subset_size: int, layout: str = "exactspec") -> FeatureDraftConfig:
        """The target's attention shape, and the outputs of three of its layers: at a quarter, a half and the end
        (``exactspec``), or EAGLE-3's choice (``eagle3``: the inputs of layers 2, n/2 and n-3, which llama.cpp can
        hand a draft; it has no hook after the last layer)."""
        n = target.num_hidden_layers
        picks = (
            {max(0, n // 4 - 1), max(0, n // 2 - 1), n - 1}
            if layout == "exactspec"
            else {max(0, i - 1) for i in (2, n // 2, n - 3)}
        )
        return cls(
            target.hidden_size,
            tuple(sorted(picks)),
            vocab_subset_size,
            target.num_attention_heads,
            target.num_key_value_heads,
            target.intermediate_size,
            target.rms_norm_eps,
            target.rope_theta,
            target.max_position_embeddings,
            layout,
        )


def layers_of_every_layout(target: LlamaConfig) -> tuple[int, ...]:
    """The target layers any layout's draft reads, ascending: a teacher pass that stores these serves every layout
    (``train-draft``'s, so that layouts are compared on the same data)."""
    return tuple(
        sorted({i for layout in LAYOUTS for i in FeatureDraftConfig.for_target(target, 1, layout).feature_layers})
    )


class FeatureDraft(nn.Module):
    """The trainable part of the draft; ``attach`` gives it the target's frozen embedding and head rows."""

    def __init__(self, cfg: FeatureDraftConfig) -> None:
        super().__init__()
        c = cfg.target_hidden_size
        self.cfg = cfg
        self.fc = nn.Linear(len(cfg.feature_layers) * c, c, bias=False)
        if cfg.layout == "eagle3":
            self.block: Block = Eagle3Block(cfg.layer_config())
        else:
            self.w_in = nn.Linear(2 * c, c, bias=False)
            self.block = Block(cfg.layer_config())
        self.norm = nn.Parameter(torch.ones(c))
        self.register_buffer("vocab_ids", torch.zeros(cfg.vocab_subset_size, dtype=torch.long))  # S, ascending
        cos, sin = rope_tables(cfg.layer_config(), cfg.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # (L, hd)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.embed: torch.Tensor | None = None  # (V, C) the target's, frozen
        self.head: torch.Tensor | None = None  # (|S|, C) the target's LM head rows of S, frozen

    def attach(self, target: LlamaDecoder) -> FeatureDraft:
        return self.attach_weights(target.embed.weight.detach(), target.lm_head.weight.detach())

    def attach_weights(self, embed: torch.Tensor, head: torch.Tensor) -> FeatureDraft:
        """The target's token embedding ``embed`` ``(V, C)`` and LM head ``head`` ``(V, C)`` (only S's rows kept),
        from a torch decoder or read from a file another runtime runs."""
        self.embed = embed
        self.head = head[self.vocab_ids.to(head.device)]
        return self

    def logits(self, g: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., |S|)
        xf = g.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps)
        return F.linear(self.norm * xf.to(g.dtype), self.head.to(g.dtype))

    def inputs(
        self, u: torch.Tensor, next_tokens: torch.Tensor
    ) -> torch.Tensor:  # (B, T, C), (B, T) -> (B, T, C or 2C)
        """The block's input: h = w_in([u ; E x]) (``exactspec``), or the pair [u ; E x] itself (``eagle3``)."""
        pair = torch.cat([u, self.embed[next_tokens].to(u.dtype)], dim=-1)
        return pair if self.cfg.layout == "eagle3" else self.w_in(pair)

    def forward_train(
        self,
        features: torch.Tensor,  # (B, T, F): the target's features at positions 0..T-1
        next_tokens: torch.Tensor,  # (B, T): x_{j+1} for slot j
        steps: int,
    ) -> list[torch.Tensor]:  # one (B, T, C) output per step; step k at slot j drafts x_{j+2} k-1 slots past the truth
        """Training-time test: step 1 runs every slot on the target's features; step k > 1 runs slot j on the
        draft's own step-(k-1) output of slot j - 1, attending (:func:`ttt_mask`) exactly to what decoding would
        have in its cache: true slots up to j - k + 1 and this chain's predicted slots after it."""
        b, t, _ = features.shape
        cos, sin = self.rope_cos[:t].to(features.dtype), self.rope_sin[:t].to(features.dtype)
        u = self.fc(features)
        keys, values, outputs = [], [], []
        for k in range(1, steps + 1):
            x = self.inputs(u, next_tokens)
            q, key, value = self.block.qkv(x, cos, sin)
            keys.append(key)
            values.append(value)
            mask = ttt_mask(t, k, features.device)
            y = F.scaled_dot_product_attention(
                q,
                torch.cat(keys, 2),
                torch.cat(values, 2),
                attn_mask=mask,
                enable_gqa=self.block.n_kv != self.block.n_head,
            )
            g = self.block.finish(x, y)
            outputs.append(g)
            u = torch.cat([torch.zeros_like(g[:, :1]), g[:, :-1]], dim=1)  # slot j reads g_{j-1}
        return outputs

    def widened(self, intermediate_size: int, generator: torch.Generator | None = None) -> FeatureDraft:
        """A copy whose MLP has ``intermediate_size`` units and computes the same function (Net2Net-style growth,
        Chen et al. 2016, arXiv 1511.05641): the new units' gate and up rows are drawn as a fresh layer's are and
        their down-projection columns are zero, so mlp(x) = W2 [silu(G x) * (U x)] is unchanged until training moves
        those columns. The target's frozen embedding and head stay attached."""
        old = self.cfg.intermediate_size
        if intermediate_size < old:
            raise ValueError(f"a draft's MLP grows, it does not shrink: {intermediate_size} < its {old} units")
        wide = FeatureDraft(replace(self.cfg, intermediate_size=intermediate_size))
        state = self.state_dict()
        bound = self.cfg.target_hidden_size**-0.5  # nn.Linear's initialisation for this fan-in
        new_gate, new_up = torch.empty(2, intermediate_size - old, self.cfg.target_hidden_size).uniform_(
            -bound, bound, generator=generator
        )
        gate, up = state["block.w13.weight"].chunk(2)  # (I, C) each
        state["block.w13.weight"] = torch.cat([gate, new_gate, up, new_up])
        state["block.w2.weight"] = torch.cat(
            [
                state["block.w2.weight"],
                state["block.w2.weight"].new_zeros(self.cfg.target_hidden_size, intermediate_size - old),
            ],
            dim=1,
        )
        wide.load_state_dict(state)
        wide.embed, wide.head = self.embed, self.head
        return wide

    # -- files --------------------------------------------------------------------------------
    def save(self, directory: str | Path, card: dict | None = None) -> None:
        from safetensors.torch import save_file

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        state = {
            k: v.detach().to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
            for k, v in self.state_dict().items()
        }
        save_file(state, str(directory / WEIGHTS_FILE))
        (directory / CONFIG_FILE).write_text(
            json.dumps(
                {"kind": "exactspec-feature-draft", **asdict(self.cfg), **({"card": card} if card else {})}, indent=2
            )
        )

    @classmethod
    def load(cls, directory: str | Path) -> FeatureDraft:
        from safetensors.torch import load_file

        directory = Path(directory)
        try:
            raw = json.loads((directory / CONFIG_FILE).read_text())
            raw.pop("kind", None)
            raw.pop("card", None)
            raw["feature_layers"] = tuple(raw["feature_layers"])
            model = cls(FeatureDraftConfig(**raw))
            state = load_file(str(directory / WEIGHTS_FILE))
            model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in state.items()})
        except (OSError, KeyError, TypeError, ValueError, RuntimeError) as error:
            raise ValueError(f"{directory} is not a readable feature draft ({str(error).splitlines()[0]})") from None
        return model

    @staticmethod
    def is_feature_draft(directory: str | Path) -> bool:
        return (Path(directory) / CONFIG_FILE).is_file()


def ttt_mask(slots: int, step: int, device: torch.device | str = "cpu") -> torch.Tensor:  # (T, step T) bool
    """Keys visible to step ``step``'s query at slot j, over the keys of steps 1..step concatenated: step 1's slots
    i <= j - step + 1 (the target's features: in the cache at decode time) and step s's slot j - step + s for
    1 < s <= step (the chain of the draft's own predictions leading to this one)."""
    j = torch.arange(slots, device=device).unsqueeze(1)  # (T, 1)
    i = torch.arange(slots, device=device).unsqueeze(0)  # (1, T)
    blocks = [i <= j - step + 1] + [i == j - step + s for s in range(2, step + 1)]
    return torch.cat(blocks, dim=1)
