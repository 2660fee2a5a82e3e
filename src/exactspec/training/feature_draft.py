"""``exactspec train-draft``: a feature-level draft (:mod:`exactspec.models.eagle`) for a Llama-family target.

Phases, each resumable inside ``--out``:

1. answers: the target answers the chat prompts (:mod:`exactspec.training.prompts`, by source) and then follow-ups
   to its own answers, sampled (:mod:`exactspec.training.draft_data`); ``--answers`` starts from an earlier run's;
2. teacher: the target (on the data runtime; on torch's, its weights in the form that reads fastest here:
   :func:`fastest_teacher`) reads every answer and some standard-library source once; its features at the layers
   of every layout (so layouts can be compared on the same data) and its ``TOP_K`` most likely next tokens per
   position are stored in shards (:mod:`exactspec.training.teacher`);
3. train: the draft learns the target's next-token distributions (cross-entropy against the stored top-k
   probabilities, restricted to the vocabulary subset S) from its training-time-test forward: step k > 1 runs on
   its own step-(k-1) outputs, as decoding will; batches come from a bounded pool of shards, and the held-out
   first-position acceptance is measured every ``CURVE_MINUTES``;
4. export: the draft's files and a model card (data by source, every run on the directory, tokens seen, held-out
   acceptance by draft position and by prompt source, the acceptance curve).

The wall-clock budget (``minutes``) is split between phases (``PHASE_SHARES``; time a phase leaves unused passes to
the next); the learning rate follows a cosine over the training phase's time. Run again with the same ``--out`` to
resume: missing answers and teacher sequences are added, and training continues from its checkpoint for the new
run's training time (its cosine spanning the time already trained and the new).
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import torch

from exactspec.models.eagle import CONFIG_FILE, LAYOUTS, FeatureDraft, FeatureDraftConfig, layers_of_every_layout
from exactspec.models.lean import LeanModel
from exactspec.tokenizer import TextTokenizer
from exactspec.training.draft_data import (
    ANSWER_TEMPERATURE,
    answer_text,
    corpus_chunks,
    data_rates,
    generate_answers,
    import_answers,
    keep_answers,
    read_answers,
)
from exactspec.training.prompts import Prompt, chat_prompts, follow_ups
from exactspec.training.teacher import (
    TEACHER_BATCH,
    ShardPool,
    TeacherSequence,
    lean_teacher,
    load_shards,
    runtime_teacher,
    stored_keys,
    teacher_pass,
)
from exactspec.tuning.priors import write_shipped_prior

__all__ = ["TrainDraftArgs", "train_draft", "held_out_acceptance"]

PHASE_SHARES = {"answers": 0.35, "teacher": 0.2, "train": 0.45}
POOL_BYTES = 3e9  # teacher shards held in memory while training (exactspec.training.teacher.ShardPool)
CURVE_MINUTES = 15.0  # training time between two held-out acceptance measurements (the model card's curve)
DATA_RATE_SLOTS = 32  # slots of the decoding call that times each runtime for --backend auto (data_backend)
TRAIN_DTYPES = ("auto", "float32", "bfloat16")  # --train-dtype: the training steps' arithmetic (train_precision)
FOLLOW_UP_MAX_ANSWER = 160  # tokens: longer first answers get no follow-up (the conversation would pass max_sequence)


@dataclass(frozen=True)
class TrainDraftArgs:
    target: Path
    out: Path
    minutes: float = 60.0
    vocab_subset: int = 8192
    steps: int = 3  # training-time-test depth
    batch_size: int = 8
    window: int = 256  # tokens per training sequence
    max_sequence: int = 512
    corpus_share: float = 0.25  # of the teacher's tokens, standard-library source
    answers_per_prompt: int = 4  # the answers phase draws up to this many per prompt, in rounds over all prompts
    lr: float = 1e-3
    seed: int = 0
    threads: int | None = None
    backend: str = "auto"  # the answers' and teacher's runtime: lean, llamacpp, or auto (the faster here: data_backend)
    layout: str = (
        "eagle3"  # the draft's layer: EAGLE-3's (exportable: exactspec.training.eagle3_export), or exactspec's first
    )
    answers: Path | None = None  # an earlier run's answers (answers.jsonl, or gzipped) to start from
    keep_answers: Path | None = (
        None  # every answer of the run, gzipped here after the answers phase (where it survives)
    )
    init_from: Path | None = (
        None  # a trained draft of the same layout for this target, whose weights training starts from
    )
    mlp_units: int = (
        0  # the draft's MLP width (0: the target's); an --init-from draft with fewer units is widened to it
    )
    train_dtype: str = "auto"  # the training steps' arithmetic: float32, bfloat16 (autocast), or auto (train_precision)
    tv_weight: float = 4.0  # weight of the total-variation term beside the cross-entropy (step_losses; docs/smollm2.md)
    answer_temperature: float = (
        ANSWER_TEMPERATURE  # the temperature new answers are sampled at (each answer row records its own)
    )

    def __post_init__(self) -> None:
        if not self.minutes > 0 or self.vocab_subset < 16 or self.steps < 1 or self.batch_size < 1:
            raise ValueError("--minutes must be > 0, the vocabulary subset >= 16 tokens, steps and batch size >= 1")
        if self.answers_per_prompt < 1:
            raise ValueError("--answers-per-prompt must be >= 1")
        if self.mlp_units < 0:
            raise ValueError(f"--mlp-units {self.mlp_units}: must be > 0 (or 0: the target's width)")
        if not 0 < self.lr < math.inf:
            raise ValueError(f"--lr {self.lr}: must be > 0 and finite")
        if not 0 <= self.tv_weight < math.inf:
            raise ValueError(f"--tv-weight {self.tv_weight}: must be >= 0 and finite")
        if not 0 < self.answer_temperature < math.inf:
            raise ValueError(
                f"--answer-temperature {self.answer_temperature}: must be > 0 and finite (answers are samples)"
            )
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"--train-dtype {self.train_dtype}: must be one of {', '.join(TRAIN_DTYPES)}")
        if self.backend not in ("auto", "lean", "llamacpp"):
            raise ValueError(f"unknown backend {self.backend!r}; choose one of auto, lean, llamacpp")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        from exactspec.models.base import is_gguf

        if self.backend == "llamacpp" and not is_gguf(self.target):
            raise ValueError(f"--backend llamacpp runs .gguf files; {self.target} is not one (use --backend lean)")

    def data_backend(self, log: Callable[[str], None] = lambda message: None) -> str:
        """The runtime the answers and the teacher run on: the one named, or for ``auto`` the faster on this machine
        at the answers' workload (:func:`exactspec.training.draft_data.data_rates`) where both can run the target
        (a .gguf file with llama-cpp-python installed), else torch's."""
        if self.backend != "auto":
            return self.backend
        from exactspec.models.base import is_gguf
        from exactspec.models.llamacpp import llama_cpp_available

        if not (is_gguf(self.target) and llama_cpp_available()):
            return "lean"
        rates = data_rates(self.target, ("llamacpp", "lean"), DATA_RATE_SLOTS)
        chosen = max(rates, key=rates.get)
        log(
            f"data runtime: {chosen} (one call decoding {DATA_RATE_SLOTS} slots: "
            + ", ".join(f"{name} {rate:,.0f} tokens/s" for name, rate in rates.items())
            + ")"
        )
        return chosen


_bar = None  # the running train_draft's bar over its wall-clock budget, on a terminal; None elsewhere


def _log(message: str) -> None:
    """One time-stamped line per event (log files keep them); on a terminal, the bar shows the event's phase and
    the share of the budget spent."""
    line = f"[train-draft {time.strftime('%H:%M:%S')}] {message}"
    if _bar is None:
        print(line, file=sys.stderr, flush=True)
        return
    _bar.write(line, file=sys.stderr)
    _bar.set_description(f"train-draft {message.split(':')[0]}", refresh=False)
    _bar.n = min(_bar.total, round(_bar.format_dict["elapsed"]))
    _bar.refresh()


# ---- phase 2: the teacher ----------------------------------------------------------------------


def answer_sequences(args: TrainDraftArgs, answers: list[dict]) -> list[TeacherSequence]:
    return [
        TeacherSequence(
            f"{row['prompt']}#{row.get('sample', 0)}",
            row["ids"][: args.max_sequence],
            max(0, row["answer_start"] - 1),
            row.get("source", "chat"),
        )
        for row in answers
    ]


def _sequences(args: TrainDraftArgs, tokenizer: TextTokenizer, answers: list[dict]) -> list[TeacherSequence]:
    """Every training sequence: the answers, and standard-library chunks making ``corpus_share`` of the tokens."""
    chat = answer_sequences(args, answers)
    chat_tokens = sum(len(s.ids) for s in chat)
    corpus_tokens = int(chat_tokens * args.corpus_share / max(1e-9, 1 - args.corpus_share))
    corpus = [
        TeacherSequence(f"corpus:{i}", ids, 0, "corpus")
        for i, ids in enumerate(corpus_chunks(tokenizer, corpus_tokens, args.window, args.seed))
    ]
    sequences = chat + corpus
    random.Random(args.seed).shuffle(sequences)
    return sequences


def vocabulary_subset(sequences: list, size: int, always: set[int]) -> tuple[torch.Tensor, float]:
    """The ``size`` most frequent tokens of ``sequences`` (token ids each; plus ``always``), ascending, and the share
    of tokens they cover."""
    counts = torch.bincount(torch.cat([torch.as_tensor(ids).long() for ids in sequences]))
    order = counts.argsort(descending=True).tolist()
    chosen = set(always)
    for token in order:
        if len(chosen) >= size:
            break
        chosen.add(token)
    ids = torch.tensor(sorted(chosen))
    return ids, float(counts[ids[ids < len(counts)]].sum() / counts.sum())


# ---- phase 3: training ---------------------------------------------------------------------------


def _batch(rows: list[dict], size: int, window: int, rng: random.Random):
    """Random windows of ``size`` sequences, padded to one length: features (B, T, F), ids (B, T), probs and ids of
    the top-k (B, T, K), and the positions the loss counts (B, T) bool."""
    picked = [rows[rng.randrange(len(rows))] for _ in range(size)]
    starts = [rng.randrange(0, max(1, len(r["ids"]) - window)) for r in picked]
    length = min(window, max(len(r["ids"]) for r in picked))

    def take(r, s, key, fill=0):
        x = r[key][s : s + length]
        pad = length - x.shape[0]
        return torch.cat([x, torch.full((pad, *x.shape[1:]), fill, dtype=x.dtype)]) if pad else x

    feats = torch.stack([take(r, s, "features") for r, s in zip(picked, starts)]).float()
    ids = torch.stack([take(r, s, "ids") for r, s in zip(picked, starts)]).long()
    probs = torch.stack([take(r, s, "top_probs") for r, s in zip(picked, starts)]).float()
    top = torch.stack([take(r, s, "top_ids") for r, s in zip(picked, starts)]).long()
    counted = torch.stack(
        [
            (torch.arange(length) + s >= r["loss_from"]) & (torch.arange(length) + s < len(r["ids"]))
            for r, s in zip(picked, starts)
        ]
    )
    return feats, ids, probs, top, counted


def step_losses(
    draft: FeatureDraft, subset_index: torch.Tensor, feats, ids, probs, top, counted, steps: int, tv_weight: float = 0.0
) -> list[torch.Tensor]:
    """Per TTT step, the mean over counted slots of the loss for the token two places ahead: the cross-entropy
    -sum_{v in S} p(v) log q(v), plus ``tv_weight`` times 1 - sum_{v in S} min(p(v), q(v)), which is the rejection
    probability 1 - beta of one drafted token at T=1 (reference: acceptance rule, beta = sum_v min(p, q)) with p
    truncated to the teacher's top-k, so the term's gradient acts only where q falls short of p."""
    outputs = draft.forward_train(feats[:, :-1], ids[:, 1:], steps)  # slot j: f_j, x_{j+1} -> x_{j+2}
    label_ids, label_probs = subset_index[top[:, 1:]], probs[:, 1:]  # (B, T-1, K): p at position j + 1
    in_subset = label_ids >= 0
    valid = counted[:, 1:]
    losses = []
    for k, g in enumerate(outputs, start=1):
        log_q = draft.logits(g).float().log_softmax(-1)  # (B, T-1, |S|)
        log_q_at_p = log_q.gather(-1, label_ids.clamp(min=0))  # (B, T-1, K)
        per_slot = -(log_q_at_p * label_probs * in_subset).sum(-1)
        if tv_weight:
            per_slot = per_slot + tv_weight * (1 - (torch.minimum(log_q_at_p.exp(), label_probs) * in_subset).sum(-1))
        slots = valid.clone()
        slots[:, : k - 1] = False  # step k needs k - 1 earlier slots in its chain
        losses.append((per_slot * slots).sum() / slots.sum().clamp(min=1))
    return losses


def held_out_acceptance(draft: FeatureDraft, rows: list[dict], steps: int, vocab_size: int) -> dict[str, list[float]]:
    """Per draft position k (teacher-forced chains, as a fully accepted round sees them): the mean over held-out
    answer positions of sum_v min(p(v), q(v)) (acceptance at T=1, p truncated to its top-k) and of
    argmax q == argmax p (greedy)."""
    subset_ids = draft.vocab_ids
    subset_index = torch.full((vocab_size,), -1, dtype=torch.long)
    subset_index[subset_ids] = torch.arange(len(subset_ids))
    sampled, greedy = [0.0] * steps, [0.0] * steps
    counts = [0] * steps
    with torch.inference_mode():
        for r in rows:
            ids = r["ids"].long().unsqueeze(0)
            outputs = draft.forward_train(r["features"].float().unsqueeze(0)[:, :-1], ids[:, 1:], steps)
            p_ids, p_probs = r["top_ids"].long()[1:], r["top_probs"].float()[1:]  # (T-1, K)
            for k, g in enumerate(outputs):
                q = draft.logits(g[0]).float().softmax(-1)  # (T-1, |S|)
                where = subset_index[p_ids]  # (T-1, K): the top-k tokens' places in S, -1 outside
                q_at_p = q.gather(-1, where.clamp(min=0)) * (where >= 0)
                overlap = torch.minimum(q_at_p, p_probs).sum(-1)
                match = (subset_ids[q.argmax(-1)] == p_ids[:, 0]).float()
                slots = torch.arange(q.shape[0])
                keep = (slots >= max(k, r["loss_from"])) & (slots + 1 < ids.shape[1])
                sampled[k] += float(overlap[keep].sum())
                greedy[k] += float(match[keep].sum())
                counts[k] += int(keep.sum())
    return {
        "sampled": [s / max(1, c) for s, c in zip(sampled, counts)],
        "greedy": [g / max(1, c) for g, c in zip(greedy, counts)],
    }


def acceptance_by_source(draft: FeatureDraft, rows: list[dict], steps: int, vocab_size: int) -> dict[str, dict]:
    """:func:`held_out_acceptance` over all ``rows`` (``"all"``) and over each prompt source's, with each group's
    number of sequences."""
    groups: dict[str, list[dict]] = {"all": rows}
    for row in rows:
        groups.setdefault(row.get("source", "chat"), []).append(row)
    return {
        name: {**held_out_acceptance(draft, group, steps, vocab_size), "sequences": len(group)}
        for name, group in groups.items()
    }


def lineage(card: dict) -> list[dict]:
    """Every run that made the draft a card describes, oldest first: the runs that made the draft it started from
    (recorded in its own card), then its own."""
    return card.get("training", {}).get("runs_before", []) + card.get("runs", [])


def teacher_model(target: Path, weights: str = "auto") -> LeanModel:
    """The target as the lean teacher reads it: the weights and precision it decodes with by default
    (:func:`exactspec.loading.default_dtype`: bfloat16 where the CPU computes it natively or a GGUF file's 4-bit
    weights are kept, float32 elsewhere)."""
    from exactspec.loading import default_dtype

    return LeanModel.from_pretrained(target, dtype=getattr(torch, default_dtype("cpu", target)), weights=weights)


def fastest_teacher(
    target: Path,
    log: Callable[[str], None] = lambda message: None,
    rate: Callable[[LeanModel], float] | None = None,
    loaded: LeanModel | None = None,
) -> tuple[LeanModel, str]:
    """The lean teacher and its weights (``q4`` or ``dense``). Where the CPU computes bfloat16 natively and the
    target is a GGUF file whose 4-bit projections the lean runtime keeps, both forms run and the faster at the
    teacher's own work, a batch of whole sequences (``rate``: tokens/s, :func:`teacher_rate` by default), is kept:
    a decoding call reads every weight for a few tokens, a teacher batch does arithmetic on thousands, so the two
    rank the forms differently (dense wins on AMX: docs/experiments/smollm2-log.md). Both are the file's weights up
    to bfloat16 rounding. Elsewhere the target as it decodes by default (:func:`teacher_model`;
    ``loaded``: that model, when the caller has it already)."""
    from exactspec.loading import native_bfloat16
    from exactspec.models.quantized import Int4Linear

    model = loaded if loaded is not None else teacher_model(target)
    q4 = any(isinstance(module, Int4Linear) for module in model.decoder.modules())
    if not (q4 and native_bfloat16("cpu")):
        return model, "q4" if q4 else "dense"
    rate = rate or teacher_rate
    forms = {"q4": model, "dense": teacher_model(target, weights="dense")}
    rates = {name: rate(form) for name, form in forms.items()}
    chosen = max(rates, key=rates.get)
    log(
        f"teacher weights: {chosen} (a batch of {TEACHER_BATCH} sequences: "
        + ", ".join(f"{name} {value:,.0f} tokens/s" for name, value in rates.items())
        + ")"
    )
    return forms[chosen], chosen


def teacher_rate(model: LeanModel, width: int = 128) -> float:
    """Tokens/s of one teacher forward over ``TEACHER_BATCH`` sequences of ``width`` tokens (after one to warm up)."""
    ids = torch.randint(0, model.cfg.vocab_size, (TEACHER_BATCH, width), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        model.decoder.forward_train(ids[:, :16])
        start = time.perf_counter()
        model.decoder.forward_train(ids)
    return ids.numel() / (time.perf_counter() - start)


def train_precision(requested: str) -> str:
    """The arithmetic of the training steps: ``bfloat16`` is autocast (matrix products in bfloat16; weights,
    optimizer and the loss's softmax in float32); ``auto`` takes it where the CPU computes bfloat16 natively (on an
    Intel AMX CPU 1.7x the steps per second of float32 for the same acceptance: docs/smollm2.md) and float32 elsewhere,
    where bfloat16 is emulated."""
    from exactspec.loading import native_bfloat16

    return ("bfloat16" if native_bfloat16("cpu") else "float32") if requested == "auto" else requested


def train_steps(
    args: TrainDraftArgs,
    draft: FeatureDraft,
    rows: list[dict] | ShardPool,
    vocab_size: int,
    deadline: float,
    max_steps: int | None = None,
    measure: Callable[[dict], None] | None = None,
    tokens_before: int = 0,
) -> dict:
    """Train on ``rows`` (in memory, or drawn from a pool of shards) until ``deadline`` (or ``max_steps``, whichever
    comes first); the learning rate's cosine follows the larger share of either budget spent (a resumed run's cosine
    spans its time and the time already trained). Checkpoints every two minutes and resumes from the last
    checkpoint; ``measure(state)`` is called every ``CURVE_MINUTES`` of training and at the end. A fresh run counts
    its tokens seen from ``tokens_before`` (what the draft it starts from was trained on)."""
    rows_for = rows.rows_for if isinstance(rows, ShardPool) else lambda step: rows
    checkpoint = args.out / "train_checkpoint.pt"
    params = [p for p in draft.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    state = {"step": 0, "seconds": 0.0, "tokens": tokens_before, "budget": max(1.0, deadline - time.monotonic())}
    if checkpoint.is_file():
        saved = torch.load(checkpoint)
        draft.load_state_dict(saved["draft"])
        optimizer.load_state_dict(saved["optimizer"])
        state = saved["state"]
        state["budget"] = state["seconds"] + max(1.0, deadline - time.monotonic())  # this run's time comes on top
        _log(f"train: resumed at step {state['step']}")
    subset_index = torch.full((vocab_size,), -1, dtype=torch.long)
    subset_index[draft.vocab_ids] = torch.arange(len(draft.vocab_ids))
    rng = random.Random(args.seed + state["step"])
    precision = train_precision(args.train_dtype)
    _log(f"train: steps in {precision}")
    last_save = start = time.monotonic()
    seconds0 = state["seconds"]
    measured_at = state["seconds"]
    while state["seconds"] < state["budget"] and state["step"] < (max_steps or math.inf):
        progress = max(state["seconds"] / state["budget"], state["step"] / (max_steps or math.inf))
        for group in optimizer.param_groups:
            group["lr"] = (
                args.lr * min(1.0, (state["step"] + 1) / 50) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
            )
        feats, ids, probs, top, counted = _batch(rows_for(state["step"]), args.batch_size, args.window, rng)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bfloat16"):
            losses = step_losses(draft, subset_index, feats, ids, probs, top, counted, args.steps, args.tv_weight)
        total = sum(w * loss for w, loss in zip((1.0, 0.8, 0.6, 0.5, 0.4), losses))
        optimizer.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        state["step"] += 1
        state["tokens"] += int(counted.sum())
        state["seconds"] = seconds0 + time.monotonic() - start
        if state["step"] % 20 == 0:
            _log(
                f"train: step {state['step']}, {state['tokens']} tokens, losses "
                f"{[round(float(loss.detach()), 3) for loss in losses]}, {100 * progress:.0f}% of the time"
            )
        if time.monotonic() - last_save > 120 or state["seconds"] >= state["budget"] or state["step"] == max_steps:
            torch.save({"draft": draft.state_dict(), "optimizer": optimizer.state_dict(), "state": state}, checkpoint)
            last_save = time.monotonic()
        if measure and state["seconds"] - measured_at > CURVE_MINUTES * 60:
            measure(state)
            measured_at = state["seconds"]
    if measure:
        measure(state)
    return state


# ---- the command ------------------------------------------------------------------------------------


class _RunLog:
    """Every invocation on a run directory, in ``runs.json``: when it started, its budget, and what the directory
    held when it finished (an entry without ``finished`` is a run that was interrupted)."""

    def __init__(self, path: Path, args: TrainDraftArgs) -> None:
        from exactspec.version import __version__

        self.path = path
        self.entries = json.loads(path.read_text()) if path.is_file() else []
        self.entries.append(
            {
                "started": datetime.now(UTC).isoformat(timespec="seconds"),
                "minutes": args.minutes,
                "exactspec": __version__,
                "layout": args.layout,
                "tv_weight": args.tv_weight,
                "lr": args.lr,
                "answer_temperature": args.answer_temperature,
                **({"init_from": str(args.init_from)} if args.init_from else {}),
            }
        )
        self._write()

    def _write(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.entries, indent=1))

    def finish(self, **held: int | str) -> list[dict]:
        self.entries[-1].update(held, finished=datetime.now(UTC).isoformat(timespec="seconds"))
        self._write()
        return self.entries


class _Curve:
    """First-position held-out acceptance (T=1 and greedy) against teacher tokens seen, kept in ``path`` across runs."""

    def __init__(self, path: Path, draft: FeatureDraft, held_rows: list[dict], vocab_size: int) -> None:
        self.path, self.draft, self.held_rows, self.vocab_size = path, draft, held_rows, vocab_size
        self.points = json.loads(path.read_text()) if path.is_file() else []

    def measure(self, state: dict) -> None:
        acceptance = held_out_acceptance(self.draft.eval(), self.held_rows, 1, self.vocab_size)
        self.draft.train()
        self.points = [
            p for p in self.points if p["tokens_seen"] < state["tokens"]
        ]  # a resumed run replaces what it redoes
        self.points.append(
            {
                "tokens_seen": state["tokens"],
                "steps": state["step"],
                "minutes": round(state["seconds"] / 60, 1),
                "sampled": round(acceptance["sampled"][0], 4),
                "greedy": round(acceptance["greedy"][0], 4),
            }
        )
        self.path.write_text(json.dumps(self.points, indent=1))
        _log(
            f"train: held-out first-position acceptance {self.points[-1]['sampled']:.3f} (T=1), "
            f"{self.points[-1]['greedy']:.3f} (greedy) after {state['tokens']:,} tokens"
        )

    def plot(self, path: Path) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        figure, axes = plt.subplots(figsize=(6, 3.5))
        tokens = [p["tokens_seen"] / 1e6 for p in self.points]
        for key, label in (("sampled", "T=1"), ("greedy", "greedy")):
            axes.plot(tokens, [p[key] for p in self.points], marker="o", label=label)
        axes.set(
            xlabel="teacher tokens seen in training (millions)",
            ylabel="first-position acceptance",
            ylim=(0, 1),
            title="held-out acceptance while training",
        )
        axes.legend()
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)


def _vocabulary(
    args: TrainDraftArgs, sequences: list[list[int]], always: set[int], given: torch.Tensor | None = None
) -> tuple[torch.Tensor, float]:
    """The draft's vocabulary subset, chosen from the first run's data (or ``given``: the subset of the draft it
    starts from) and kept (``vocabulary.pt``): a resumed run's checkpoint has head rows for exactly these tokens."""
    path = args.out / "vocabulary.pt"
    if path.is_file():
        saved = torch.load(path)
        return saved["ids"], saved["coverage"]
    if given is not None:  # its own tokens, however often this data has them
        ids, coverage = vocabulary_subset(sequences, len(given), set(given.tolist()))
    else:
        ids, coverage = vocabulary_subset(sequences, args.vocab_subset, always)
    torch.save({"ids": ids, "coverage": coverage}, path)
    return ids, coverage


def _starting_draft(args: TrainDraftArgs, cfg: FeatureDraftConfig) -> tuple[FeatureDraft | None, dict]:
    """The draft ``--init-from`` names, checked against the one this run trains (same layout, target layers and
    shapes; an MLP narrower than this run's is widened, :meth:`FeatureDraft.widened`), and its model card;
    ``(None, {})`` without ``--init-from``. Where this run's own checkpoint already carries on from it, only its
    card (the weights to start from are the checkpoint's)."""
    if args.init_from is None:
        return None, {}
    if not FeatureDraft.is_feature_draft(args.init_from):
        raise ValueError(f"--init-from {args.init_from} is not a feature draft (it has no {CONFIG_FILE})")
    card = json.loads((Path(args.init_from) / CONFIG_FILE).read_text()).get("card", {})
    if (args.out / "train_checkpoint.pt").is_file():
        return None, card
    start = FeatureDraft.load(args.init_from)
    if start.cfg.intermediate_size < cfg.intermediate_size:
        start = start.widened(cfg.intermediate_size)
    mine = replace(cfg, vocab_subset_size=start.cfg.vocab_subset_size)
    if start.cfg != mine:
        differs = [
            f"{k} {getattr(start.cfg, k)} (this run: {getattr(mine, k)})"
            for k in asdict(mine)
            if getattr(start.cfg, k) != getattr(mine, k)
        ]
        raise ValueError(f"--init-from {args.init_from} is a draft of another shape: {'; '.join(differs)}")
    return start, card


def _check_layout(record: Path, cfg: FeatureDraftConfig, target_units: int) -> None:
    """A run directory holds a checkpoint of one layout and MLP width: a rerun with another ``--layout`` or
    ``--mlp-units`` would resume it as the wrong model, so it is refused (the first run writes ``record``; one written
    before the width was recorded had the target's, ``target_units``). Its teacher shards serve every layout."""
    mine = {"layout": cfg.layout, "feature_layers": list(cfg.feature_layers), "mlp_units": cfg.intermediate_size}
    if record.is_file():
        saved = {"mlp_units": target_units, **json.loads(record.read_text())}
        if saved != mine:
            raise ValueError(
                f"{record.parent} was made for the {saved['layout']} layout (target layers {saved['feature_layers']}) "
                f"with {saved['mlp_units']} MLP units: rerun it with --layout {saved['layout']} --mlp-units "
                f"{saved['mlp_units']}, or give a new --out"
            )
    else:
        record.write_text(json.dumps(mine))


def train_draft(args: TrainDraftArgs) -> dict:
    """Every phase in turn within ``args.minutes``; returns the model card (also written to ``args.out``)."""
    started = time.monotonic()
    budget = args.minutes * 60
    global _bar
    from tqdm import tqdm

    bar = tqdm(
        total=round(budget),
        desc="train-draft",
        unit="s",
        disable=None,
        leave=False,
        bar_format="{desc} {percentage:3.0f}%|{bar}| {n:.0f}/{total:.0f} s of the budget, {remaining} left",
    )
    _bar = None if bar.disable else bar
    try:
        return _run_phases(args, started, budget)
    finally:
        bar.close()
        _bar = None


def _answer_phase(
    args: TrainDraftArgs, tokenizer: TextTokenizer, answers_file: Path, deadline: float, backend: str
) -> set[str]:
    """The target answers every single-turn prompt once, then the follow-ups to its own training and held-out
    answers (:func:`exactspec.training.prompts.follow_ups`), then every training prompt again up to
    ``answers_per_prompt`` times, as time allows (held-out prompts keep one answer: more would buy no training
    data, and would change the held-out set a resumed run's curve is measured on). Returns the keys of the
    held-out prompts."""
    train_prompts, held_prompts = chat_prompts(args.seed)
    singles = held_prompts + train_prompts
    _log(
        f"answers: {len(held_prompts)} held-out and {len(train_prompts)} training prompts "
        f"on {backend}, then follow-ups, then up to {args.answers_per_prompt} answers each"
    )

    def run(prompts: list[Prompt], samples: int) -> None:
        generate_answers(
            args.target,
            prompts,
            answers_file,
            deadline,
            samples,
            temperature=args.answer_temperature,
            seed=args.seed,
            backend=backend,
            progress=lambda done, left: None if done % 64 else _log(f"answers: {done} done, {left} left"),
        )

    run(singles, 1)
    first = {row["prompt"]: row for row in read_answers(answers_file) if row.get("sample", 0) == 0}
    answered = [
        (p, answer_text(first[p.key], tokenizer))
        for p in singles
        if p.key in first and len(first[p.key]["ids"]) - first[p.key]["answer_start"] <= FOLLOW_UP_MAX_ANSWER
    ]
    held_keys = {p.key for p in held_prompts}
    multi = follow_ups(answered, seed=args.seed)
    held_keys |= {p.key for p in multi if p.turns[0][1] in held_keys}  # a follow-up is held out with its first turn
    run(multi, 1)
    if args.answers_per_prompt > 1:
        run([p for p in singles + multi if p.key not in held_keys], args.answers_per_prompt)
    return held_keys


def _run_phases(args: TrainDraftArgs, started: float, budget: float) -> dict:
    def deadline(phase):
        return started + budget * sum(
            share
            for name, share in PHASE_SHARES.items()
            if list(PHASE_SHARES).index(name) <= list(PHASE_SHARES).index(phase)
        )

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tokenizer = TextTokenizer.from_path(args.target)
    answers_file = args.out / "answers.jsonl"
    model = teacher_model(args.target)
    cfg = FeatureDraftConfig.for_target(model.cfg, args.vocab_subset, args.layout)
    cfg = replace(cfg, intermediate_size=args.mlp_units or cfg.intermediate_size)
    start, start_card = _starting_draft(args, cfg)  # both refusals before any work (this one writes nothing)
    _check_layout(args.out / "layout.json", cfg, model.cfg.intermediate_size)
    tokens_before = int(start_card.get("training", {}).get("tokens_seen", 0))
    if args.answers is not None:
        _log(f"answers: {import_answers(args.answers, answers_file, tokenizer)} taken from {args.answers}")
    runs = _RunLog(args.out / "runs.json", args)
    backend = args.data_backend(_log)
    held_keys = _answer_phase(args, tokenizer, answers_file, deadline("answers"), backend)
    if args.keep_answers is not None:
        _log(f"answers: {keep_answers(answers_file, args.keep_answers)} kept in {args.keep_answers}")
    answers = read_answers(answers_file)
    held = [r for r in answers if r["prompt"] in held_keys]
    train = [r for r in answers if r["prompt"] not in held_keys]

    args = replace(
        args,
        max_sequence=min(args.max_sequence, model.cfg.max_position_embeddings),
        window=min(args.window, model.cfg.max_position_embeddings),
        train_dtype=train_precision(args.train_dtype),
    )
    layers = layers_of_every_layout(model.cfg)
    if backend == "llamacpp":
        from exactspec.models.llamacpp import LlamaCppRuntime

        teacher = runtime_teacher(LlamaCppRuntime(args.target, TEACHER_BATCH, args.max_sequence, args.threads), layers)
        teacher_weights = "as stored"
    else:
        model, teacher_weights = fastest_teacher(args.target, _log, loaded=model)
        teacher = lean_teacher(model, layers)
    teacher_pass(teacher, layers, answer_sequences(args, held), args.out / "held_out", float("inf"), _log)
    sequences = _sequences(args, tokenizer, train)
    teacher_pass(teacher, layers, sequences, args.out / "teacher", deadline("teacher"), _log)
    stored = stored_keys(args.out / "teacher")
    sequences = [s for s in sequences if s.key in stored]
    if not sequences:
        raise RuntimeError("no teacher data: give train-draft more --minutes")
    held_rows = load_shards(args.out / "held_out", cfg.feature_layers)

    subset, coverage = _vocabulary(
        args, [s.ids for s in sequences], set(tokenizer.eos_token_ids), start and start.vocab_ids
    )
    cfg = replace(cfg, vocab_subset_size=len(subset))
    draft = FeatureDraft(cfg)
    if start is not None:
        draft.load_state_dict(start.state_dict())
    draft.vocab_ids.copy_(subset)
    draft.attach(model.decoder)
    draft.embed, draft.head = draft.embed.float(), draft.head.float()
    curve = _Curve(args.out / "curve.json", draft, held_rows, model.cfg.vocab_size)
    if start is not None:
        curve.measure({"tokens": tokens_before, "step": 0, "seconds": 0.0})  # where the curve starts
    pool = ShardPool.within(args.out / "teacher", POOL_BYTES, args.seed, layers=cfg.feature_layers)
    state = train_steps(
        args, draft, pool, model.cfg.vocab_size, deadline("train"), measure=curve.measure, tokens_before=tokens_before
    )
    by_source = acceptance_by_source(draft.eval(), held_rows, max(args.steps, 4), model.cfg.vocab_size)
    acceptance = {k: by_source["all"][k] for k in ("sampled", "greedy")}
    sources = Counter(row.get("source", "chat") for row in train)
    temperatures = Counter(f"{row.get('temperature', ANSWER_TEMPERATURE):g}" for row in train)
    card = {
        "target": str(args.target),
        "out": str(args.out / "draft"),
        "architecture": asdict(cfg),
        "data": {
            "runtime": backend,
            "teacher_weights": teacher_weights,
            "chat_answers": len(train),
            "held_out_answers": len(held),
            "answers_by_source": dict(sources),
            "answers_by_temperature": dict(temperatures),
            "teacher_sequences": len(sequences),
            "teacher_tokens": sum(len(s.ids) for s in sequences),
            "corpus_share": args.corpus_share,
            "vocabulary_subset_coverage": coverage,
        },
        "training": {
            "steps": state["step"],
            "tokens_seen": state["tokens"],
            "seconds": state["seconds"],
            "precision": args.train_dtype,
            "tv_weight": args.tv_weight,
            "ttt_steps": args.steps,
            "batch_size": args.batch_size,
            "window": args.window,
            "lr": args.lr,
            **(
                {
                    "initialised_from": str(args.init_from),
                    "tokens_seen_before": tokens_before,
                    "runs_before": lineage(start_card),
                }
                if args.init_from
                else {}
            ),
        },
        "held_out_acceptance_by_position": acceptance,
        "held_out_acceptance_by_source": by_source,
        "acceptance_curve": curve.points,
        "runs": runs.finish(
            runtime=backend,
            answers=len(answers),
            teacher_sequences=len(sequences),
            steps=state["step"],
            tokens_seen=state["tokens"],
        ),
        "total_minutes": (time.monotonic() - started) / 60,
    }
    draft.save(args.out / "draft", card)
    write_shipped_prior(
        args.out / "draft", args.target, acceptance, "held-out chat answers, training-time-test forward"
    )
    (args.out / "MODEL_CARD.json").write_text(json.dumps(card, indent=2))
    curve.plot(args.out / "acceptance_curve.png")
    _log(
        f"done: held-out acceptance by position, T=1 {[round(a, 3) for a in acceptance['sampled']]}, "
        f"greedy {[round(a, 3) for a in acceptance['greedy']]}"
    )
    return card
