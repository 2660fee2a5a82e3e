"""The training pipeline: tokenizer -> data -> target -> distilled draft -> evaluation -> export.

Each phase records itself in ``<out>/state.json`` when done, and the two
training phases checkpoint every few minutes (``<out>/ckpt_<name>.pt``), so an
interrupted run continues with ``--resume``. The learning-rate schedule is a
cosine over *training progress*, the larger of elapsed-training-time/budget and
tokens/token-budget, so a wall-clock budget gives a complete schedule.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ..models.lean import LeanModel
from ..models.llama import LlamaDecoder, hf_state_dict
from ..models.llama_config import LlamaConfig
from . import data

__all__ = ["TrainArgs", "run", "export_models"]


@dataclass
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int


@dataclass
class TrainArgs:
    out: Path
    resume: bool = False
    device: str = "cpu"
    seed: int = 1234
    threads: int = 2
    vocab_size: int = 4096
    seq_len: int = 512
    batch_size: int = 16
    target: ModelShape = field(default_factory=lambda: ModelShape(12, 192, 512, 3, 1))
    draft: ModelShape = field(default_factory=lambda: ModelShape(1, 192, 512, 3, 1))
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    target_minutes: float = 45.0
    draft_minutes: float = 18.0
    target_tokens: int = 0  # 0 = no token budget (time only)
    draft_tokens: int = 0
    lr: float = 1.5e-3
    draft_lr: float = 2e-3
    min_lr_frac: float = 0.1
    warmup_steps: int = 40
    weight_decay: float = 0.1
    ce_weight: float = 0.1
    checkpoint_minutes: float = 4.0
    eval_tokens: int = 131072
    max_files: int = 0  # 0 = whole corpus (smoke tests use a few files)
    timing_calls: int = 100  # calls per measurement of the exported models' per-call cost (0 = skip)
    progress: bool = True


# ---------------------------------------------------------------------------------------------


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def load_state(out: Path) -> dict[str, Any]:
    p = out / "state.json"
    return json.loads(p.read_text()) if p.is_file() else {"done": []}


def save_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def _mark_done(out: Path, state: dict[str, Any], phase: str, **extra: Any) -> None:
    state["done"].append(phase)
    state.update(extra)
    save_json(out / "state.json", state)


def _config(args: TrainArgs, shape: ModelShape) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        rms_norm_eps=1e-5,
        rope_theta=args.rope_theta,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=0,
    )


def _batch(tokens: np.ndarray, args: TrainArgs, step: int, salt: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows, a pure function of (seed, salt, step): resuming replays the same stream."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + salt * 7919 + step)
    starts = torch.randint(0, len(tokens) - args.seq_len - 1, (args.batch_size,), generator=g).numpy()
    win = np.stack([tokens[s : s + args.seq_len + 1] for s in starts]).astype(np.int64)
    t = torch.from_numpy(win).to(args.device)  # (B, T + 1)
    return t[:, :-1], t[:, 1:]


def _autocast(args: TrainArgs):
    return torch.autocast(device_type=args.device, dtype=torch.bfloat16)


def _optimizer(model: torch.nn.Module, lr: float, wd: float) -> torch.optim.Optimizer:
    params = {id(p): p for p in model.parameters()}.values()  # tied weights once
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def _lr(args: TrainArgs, base: float, step: int, progress: float) -> float:
    if step < args.warmup_steps:
        return base * (step + 1) / args.warmup_steps
    lo = base * args.min_lr_frac
    return lo + 0.5 * (base - lo) * (1 + math.cos(math.pi * min(1.0, progress)))


def _train_loop(
    args: TrainArgs,
    name: str,
    model: LlamaDecoder,
    tokens: np.ndarray,
    loss_fn,
    base_lr: float,
    minutes: float,
    token_budget: int,
    salt: int,
) -> dict[str, Any]:
    """Generic loop: AdamW, bf16 autocast, clip 1.0, cosine on progress, periodic checkpoints."""
    from tqdm import tqdm

    out = args.out
    ckpt = out / f"ckpt_{name}.pt"
    opt = _optimizer(model, base_lr, args.weight_decay)
    step, elapsed, seen, ema = 0, 0.0, 0, None
    if ckpt.is_file():
        st = torch.load(ckpt, map_location=args.device, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        step, elapsed, seen, ema = st["step"], st["elapsed"], st["tokens"], st["ema"]
        _log(f"{name}: resumed at step {step}, {elapsed / 60:.1f} min, {seen:,} tokens")

    def save() -> None:
        tmp = ckpt.with_suffix(".tmp")
        torch.save(
            {
                "model": model.state_dict(),
                "opt": opt.state_dict(),
                "step": step,
                "elapsed": elapsed,
                "tokens": seen,
                "ema": ema,
            },
            tmp,
        )
        os.replace(tmp, ckpt)

    budget_s = minutes * 60.0

    def progress() -> float:
        p = elapsed / budget_s if budget_s > 0 else 0.0
        if token_budget > 0:
            p = max(p, seen / token_budget)
        return p

    model.train()
    bar = tqdm(
        total=1000,
        desc=name,
        unit="‰",
        disable=not args.progress,
        mininterval=5.0,
        initial=int(1000 * min(1.0, progress())),
    )
    last_ckpt = time.monotonic()
    history = []
    while progress() < 1.0:
        t0 = time.perf_counter()
        lr = _lr(args, base_lr, step, progress())
        for g in opt.param_groups:
            g["lr"] = lr
        x, y = _batch(tokens, args, step, salt)
        with _autocast(args):
            loss, extra = loss_fn(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        seen += x.numel()
        dt = time.perf_counter() - t0
        elapsed += dt
        lv = float(loss.detach())
        ema = lv if ema is None else 0.95 * ema + 0.05 * lv
        new = int(1000 * min(1.0, progress()))
        bar.update(max(0, new - bar.n))
        bar.set_postfix(loss=f"{ema:.3f}", lr=f"{lr:.1e}", tok_s=f"{x.numel() / dt:.0f}", step=step, refresh=False)
        if step % 25 == 0:
            history.append(
                {"step": step, "tokens": seen, "minutes": round(elapsed / 60, 2), "loss": round(ema, 4), **extra}
            )
            _log(
                f"{name} step {step} tokens {seen:,} loss(ema) {ema:.4f} lr {lr:.2e} {x.numel() / dt:.0f} tok/s "
                f"{elapsed / 60:.1f}/{minutes:.1f} min"
            )
        if time.monotonic() - last_ckpt > args.checkpoint_minutes * 60:
            save()
            last_ckpt = time.monotonic()
    bar.close()
    save()
    model.eval()
    return {
        "steps": step,
        "tokens": seen,
        "minutes": round(elapsed / 60, 2),
        "final_loss_ema": ema,
        "tokens_per_s": round(seen / max(elapsed, 1e-9)),
        "log": history,
    }


def _lm_loss(model: LlamaDecoder, x: torch.Tensor, y: torch.Tensor):
    logits = model(x)  # (B, T, V)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten()), {}


def _distill_loss(teacher: LlamaDecoder, ce_weight: float):
    def fn(model: LlamaDecoder, x: torch.Tensor, y: torch.Tensor):
        with torch.no_grad():
            t_logp = F.log_softmax(teacher(x).float(), dim=-1)  # (B, T, V)
        s_logp = F.log_softmax(model(x).float(), dim=-1)  # (B, T, V)
        kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()  # KL(target || draft)
        ce = F.nll_loss(s_logp.flatten(0, 1), y.flatten())
        return kl + ce_weight * ce, {"ce": round(float(ce.detach()), 4)}

    return fn


# ---------------------------------------------------------------------------------------------


def _write_model_dir(model: LlamaDecoder, tok_dir: Path, directory: Path) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    sd = {k: v.to(torch.bfloat16).cpu().contiguous() for k, v in hf_state_dict(model).items()}
    save_file(sd, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "model.safetensors").chmod(0o644)
    save_json(directory / "config.json", model.cfg.to_hf_dict("bfloat16"))
    save_json(directory / "generation_config.json", {"bos_token_id": 0, "eos_token_id": 0, "do_sample": False})
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tok_dir / f, directory / f)


@torch.no_grad()
def _evaluate(args: TrainArgs, val: np.ndarray) -> dict[str, Any]:
    """Held-out loss of both exported (bf16) models computed in float32, and one-step acceptance."""
    tgt = LeanModel.from_pretrained(args.out / "target", dtype=torch.float32).decoder
    dft = LeanModel.from_pretrained(args.out / "draft", dtype=torch.float32).decoder
    T = args.seq_len
    n_win = max(1, min(len(val) - 1, args.eval_tokens) // T)
    sums = {"target_nll": 0.0, "draft_nll": 0.0, "alpha": 0.0, "argmax_agree": 0.0, "kl": 0.0}
    count = 0
    for w in range(0, n_win, 8):
        rows = [val[(w + j) * T : (w + j) * T + T + 1].astype(np.int64) for j in range(min(8, n_win - w))]
        rows = [r for r in rows if len(r) == T + 1]
        if not rows:
            break
        b = torch.from_numpy(np.stack(rows))  # (b, T + 1)
        x, y = b[:, :-1], b[:, 1:]
        lp = F.log_softmax(tgt(x).float(), -1)  # (b, T, V)
        lq = F.log_softmax(dft(x).float(), -1)  # (b, T, V)
        sums["target_nll"] += float(F.nll_loss(lp.flatten(0, 1), y.flatten(), reduction="sum"))
        sums["draft_nll"] += float(F.nll_loss(lq.flatten(0, 1), y.flatten(), reduction="sum"))
        p, q = lp.exp(), lq.exp()
        sums["alpha"] += float(torch.minimum(p, q).sum(-1).sum())
        sums["argmax_agree"] += float((lp.argmax(-1) == lq.argmax(-1)).float().sum())
        sums["kl"] += float((p * (lp - lq)).sum(-1).sum())
        count += y.numel()
    m = {k: v / count for k, v in sums.items()}
    return {
        "heldout_tokens": count,
        "target_heldout_loss": round(m["target_nll"], 4),
        "draft_heldout_loss": round(m["draft_nll"], 4),
        "target_heldout_ppl": round(math.exp(m["target_nll"]), 3),
        "draft_heldout_ppl": round(math.exp(m["draft_nll"]), 3),
        "alpha_stochastic": round(m["alpha"], 4),
        "argmax_agreement": round(m["argmax_agree"], 4),
        "kl_target_draft": round(m["kl"], 4),
    }


def _time_calls(directory: Path, n: int = 100) -> dict[str, float]:
    """Per-call cost (ms) of the exported model in bf16 at context 200: 1 token and 8 tokens."""
    m = LeanModel.from_pretrained(directory, dtype=torch.bfloat16, max_len=512)
    m.prefill(list(range(1, 201)))
    res = {}
    for k in (1, 8):
        for _ in range(10):
            m.forward([5] * k)
            m.rollback(200)
        t0 = time.perf_counter()
        for _ in range(n):
            m.forward([5] * k)
            m.rollback(200)
        res[f"ms_per_call_{k}tok_bf16"] = round((time.perf_counter() - t0) / n * 1e3, 3)
    return res


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


_RUNTIME_FIELDS = ("out", "resume", "device", "threads", "progress")


def _restore_args(args: TrainArgs, saved: dict[str, Any]) -> TrainArgs:
    """On ``--resume`` the run's own settings win over the command line (except runtime ones)."""
    kw = {k: v for k, v in saved.items() if k not in _RUNTIME_FIELDS and k in TrainArgs.__dataclass_fields__}
    kw["target"], kw["draft"] = ModelShape(**kw["target"]), ModelShape(**kw["draft"])
    kw.update({k: getattr(args, k) for k in _RUNTIME_FIELDS})
    return TrainArgs(**kw)


def run(args: TrainArgs) -> dict[str, Any]:
    out = args.out
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    state = load_state(out)
    if state["done"] and not args.resume:
        raise SystemExit(f"{out} already holds a run ({', '.join(state['done'])} done); pass --resume or a new --out")
    out.mkdir(parents=True, exist_ok=True)
    if args.resume and "args" in state:
        args = _restore_args(args, state["args"])
    else:
        state["args"] = json.loads(json.dumps(asdict(args), default=str))
        save_json(out / "state.json", state)
    tok_dir, data_dir = out / "tokenizer", out / "data"

    root = data.stdlib_root()
    train_f, val_f = data.train_files(root), data.held_out_files(root)
    if args.max_files:
        train_f, val_f = train_f[: args.max_files], val_f[: max(2, args.max_files // 10)]

    if "tokenizer" not in state["done"]:
        _log(f"training tokenizer (vocab {args.vocab_size}) on {len(train_f)} files")
        tok = data.train_tokenizer((data.read_source(p) for p in train_f), args.vocab_size)
        data.write_tokenizer_files(tok, tok_dir)
        _mark_done(out, state, "tokenizer")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))

    if "data" not in state["done"]:
        _log("encoding corpus")
        data_dir.mkdir(exist_ok=True)
        tr, va = data.encode_files(tok, train_f), data.encode_files(tok, val_f)
        np.save(data_dir / "train.npy", tr)
        np.save(data_dir / "val.npy", va)
        (data_dir / "held_out.txt").write_text("\n".join(p.relative_to(root).as_posix() for p in val_f) + "\n")
        chars = sum(len(data.read_source(p)) for p in train_f)
        _mark_done(
            out,
            state,
            "data",
            train_tokens=int(len(tr)),
            val_tokens=int(len(va)),
            train_files=len(train_f),
            val_files=len(val_f),
            train_chars=chars,
        )
        _log(f"train {len(tr):,} tokens ({chars / len(tr):.2f} chars/token), held-out {len(va):,} tokens")
    train_tok = np.load(data_dir / "train.npy")
    val_tok = np.load(data_dir / "val.npy")

    tcfg, dcfg = _config(args, args.target), _config(args, args.draft)
    target = LlamaDecoder(tcfg, rope_len=args.seq_len).to(args.device)
    if "target" not in state["done"]:
        target.init_weights(torch.Generator().manual_seed(args.seed))
        _log(f"target: {_n_params(target):,} parameters {args.target}")
        info = _train_loop(
            args, "target", target, train_tok, _lm_loss, args.lr, args.target_minutes, args.target_tokens, salt=1
        )
        _write_model_dir(target, tok_dir, out / "target")
        _mark_done(out, state, "target", target_train=info)
    else:
        target.load_state_dict(
            torch.load(out / "ckpt_target.pt", map_location=args.device, weights_only=False)["model"]
        )
    target.eval()
    for p in target.parameters():
        p.requires_grad_(False)

    draft = LlamaDecoder(dcfg, rope_len=args.seq_len).to(args.device)
    if "draft" not in state["done"]:
        draft.init_weights(torch.Generator().manual_seed(args.seed + 1))
        if dcfg.hidden_size == tcfg.hidden_size:
            with torch.no_grad():
                draft.embed.weight.copy_(target.embed.weight)  # tied: also the LM head
                draft.norm.copy_(target.norm)
            _log("draft: embedding (= tied LM head) and final norm initialised from the target")
        _log(f"draft: {_n_params(draft):,} parameters {args.draft}")
        info = _train_loop(
            args,
            "draft",
            draft,
            train_tok,
            _distill_loss(target, args.ce_weight),
            args.draft_lr,
            args.draft_minutes,
            args.draft_tokens,
            salt=2,
        )
        _write_model_dir(draft, tok_dir, out / "draft")
        _mark_done(out, state, "draft", draft_train=info)

    if "eval" not in state["done"]:
        _log("evaluating on held-out files")
        metrics = _evaluate(args, val_tok)
        metrics["target_params"] = _n_params(target)
        metrics["draft_params"] = _n_params(draft)
        metrics["target_shape"] = asdict(args.target)
        metrics["draft_shape"] = asdict(args.draft)
        metrics["target_train_tokens"] = state["target_train"]["tokens"]
        metrics["draft_train_tokens"] = state["draft_train"]["tokens"]
        metrics["target_train_minutes"] = state["target_train"]["minutes"]
        metrics["draft_train_minutes"] = state["draft_train"]["minutes"]
        metrics["corpus_train_tokens"] = state["train_tokens"]
        metrics["corpus_heldout_tokens"] = state["val_tokens"]
        metrics["held_out"] = list(data.HELD_OUT)
        if args.timing_calls:
            metrics["target_timing"] = _time_calls(out / "target", args.timing_calls)
            metrics["draft_timing"] = _time_calls(out / "draft", args.timing_calls)
            metrics["cost_ratio_1tok"] = round(
                metrics["draft_timing"]["ms_per_call_1tok_bf16"] / metrics["target_timing"]["ms_per_call_1tok_bf16"], 4
            )
        save_json(out / "metrics.json", metrics)
        _mark_done(out, state, "eval")
        _log("metrics: " + json.dumps({k: v for k, v in metrics.items() if not isinstance(v, (dict, list))}))
    return json.loads((out / "metrics.json").read_text())


# ---------------------------------------------------------------------------------------------

MODEL_CARD = """# exactspec default models: a target and its distilled draft

Two tiny Llama-architecture causal LMs trained from scratch on Python source, shipped so that
`exactspec` works offline out of the box. They share one tokenizer. They are toys: they write
plausible-looking Python, not correct programs.

## Corpus
The `*.py` files of the CPython {pyver} standard library of the training interpreter
(`sysconfig.get_paths()["stdlib"]`, excluding `site-packages` / `dist-packages`):
{train_files} training files, {train_tokens:,} tokens. Held out (never trained on; the
validation set and the source of "unseen" benchmark prompts, see
`exactspec.training.data.HELD_OUT` / `held_out_files()`): {val_files} files, {val_tokens:,} tokens:
`{held_out}`.

## Tokenizer
Byte-level BPE (`tokenizers`), vocabulary {vocab}, trained on the training files only.
`<|endoftext|>` (id 0) separates files and serves as BOS/EOS.

## Models
| | layers | hidden | MLP | heads (q/kv) | parameters | training tokens | training time | held-out loss (nats/token) |
|---|---|---|---|---|---|---|---|---|
| target | {t[layers]} | {t[hidden]} | {t[intermediate]} | {t[heads]}/{t[kv_heads]} | {tp:,} | {ttok:,} \
| {tmin} min | {tl} (ppl {tppl}) |
| draft | {d[layers]} | {d[hidden]} | {d[intermediate]} | {d[heads]}/{d[kv_heads]} | {dp:,} | {dtok:,} \
| {dmin} min | {dl} (ppl {dppl}) |

Both: RMSNorm, rotary embeddings (theta {theta}), SwiGLU, tied embeddings,
`max_position_embeddings` {maxpos} (trained on {seqlen}-token windows; quality degrades beyond that),
weights stored in bfloat16. Target: AdamW (0.9, 0.95), weight decay 0.1, cosine schedule, bf16 autocast.
Draft: distilled from the trained target with KL(target || draft) on the full next-token
distribution (temperature 1) + {ce} x cross-entropy; embedding / LM head / final norm initialised
from the target's.

## Draft vs target on the held-out files ({ho_tok:,} positions)
- stochastic one-step acceptance alpha = E[sum_x min(p, q)]: **{alpha}**
- greedy agreement (argmax p == argmax q): **{agree}**
- KL(target || draft): {kl} nats/token
- per-call cost on the training machine (2 CPU cores, bf16, context 200, 1 token): target
  {tms} ms, draft {dms} ms, cost ratio c = {c}

## Reproduce
```
{command}
python -m exactspec.training --out runs/default --export src/exactspec/default_models
```
Both directories load with `transformers.AutoModelForCausalLM.from_pretrained(dir)` and
`exactspec.models.lean.LeanModel.from_pretrained(dir)`.
"""


def export_models(out: Path, dest: Path, command: str | None = None) -> None:
    """Copy ``<out>/{target,draft}`` into ``dest`` and write ``MODEL_CARD.md`` + ``metrics.json``."""
    import sys

    metrics = json.loads((out / "metrics.json").read_text())
    state = load_state(out)
    a = state["args"]
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("target", "draft"):
        if (dest / name).exists():
            shutil.rmtree(dest / name)
        shutil.copytree(out / name, dest / name)
        for f in (dest / name).iterdir():
            f.chmod(0o644)  # safetensors writes 0600; package data must be world-readable
    shutil.copy(out / "metrics.json", dest / "metrics.json")
    card = MODEL_CARD.format(
        pyver=".".join(map(str, sys.version_info[:3])),
        train_files=state["train_files"],
        train_tokens=state["train_tokens"],
        val_files=state["val_files"],
        val_tokens=state["val_tokens"],
        held_out="`, `".join(data.HELD_OUT),
        vocab=a["vocab_size"],
        t=metrics["target_shape"],
        d=metrics["draft_shape"],
        tp=metrics["target_params"],
        dp=metrics["draft_params"],
        ttok=metrics["target_train_tokens"],
        dtok=metrics["draft_train_tokens"],
        tmin=metrics["target_train_minutes"],
        dmin=metrics["draft_train_minutes"],
        tl=metrics["target_heldout_loss"],
        tppl=metrics["target_heldout_ppl"],
        dl=metrics["draft_heldout_loss"],
        dppl=metrics["draft_heldout_ppl"],
        theta=a["rope_theta"],
        maxpos=a["max_position_embeddings"],
        seqlen=a["seq_len"],
        ce=a["ce_weight"],
        ho_tok=metrics["heldout_tokens"],
        alpha=metrics["alpha_stochastic"],
        agree=metrics["argmax_agreement"],
        kl=metrics["kl_target_draft"],
        tms=metrics.get("target_timing", {}).get("ms_per_call_1tok_bf16", "n/a"),
        dms=metrics.get("draft_timing", {}).get("ms_per_call_1tok_bf16", "n/a"),
        c=metrics.get("cost_ratio_1tok", "n/a"),
        command=command or state.get("command", "python -m exactspec.training --out runs/default"),
    )
    (dest / "MODEL_CARD.md").write_text(card)
    _log(f"exported target/ and draft/ to {dest}")
