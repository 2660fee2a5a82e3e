"""The teacher's pass over a draft's training sequences, the shards it writes, and the pool training draws from.

The target (as it decodes: the same weights and runtime) reads each sequence once; its features at the draft's
layers and its ``TOP_K`` most likely next tokens per position are stored in shards of ``SHARD_SEQUENCES``
sequences. Each shard has a small index beside it (``shard_NNNN.keys.json``: the keys of its sequences), written
after the shard, so a rerun skips exactly the sequences already read, however the list of sequences has grown
since (new answers, more corpus), and a shard cut by an interruption is written again.

Features are the bulk (5.8 KB per token for the five 576-wide layers SmolLM2's layouts read, in bfloat16: 11.5 GB
for 2M tokens), and recomputable from the answers' token ids, so training does not hold them all: :class:`ShardPool`
keeps a bounded set of shards in memory and draws a new set every ``swap_every`` batches, as a pure function of the
seed and the batch number (a resumed run draws what an uninterrupted one would).

A directory's features may cover more target layers than one draft reads (``layers.json`` names them, in the
order they are concatenated: ascending): drafts of different layouts then train on the same pass, and a reader
asks for its own layers (:func:`select_layers`).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = [
    "TOP_K",
    "SHARD_SEQUENCES",
    "TEACHER_BATCH",
    "TeacherSequence",
    "Teacher",
    "lean_teacher",
    "runtime_teacher",
    "teacher_pass",
    "shard_paths",
    "stored_keys",
    "stored_layers",
    "select_layers",
    "load_shards",
    "ShardPool",
]

TOP_K = 16  # target probabilities kept per position
SHARD_SEQUENCES = 64
TEACHER_BATCH = 8  # sequences per teacher forward
LAYERS_FILE = "layers.json"


@dataclass(frozen=True)
class TeacherSequence:
    key: str  # what identifies it across reruns: an answer's prompt and sample, or a corpus chunk's number
    ids: list[int]
    loss_from: int  # the first position whose next token the loss counts (the answer's start, 0 for corpus)
    source: str  # the prompt source (exactspec.training.prompts.SOURCES) or "corpus"


#: What the teacher reads a batch of sequences with: each sequence's logits ``(t, V)`` and features ``(t, F)``.
Teacher = Callable[[list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]


def lean_teacher(model, layers: tuple[int, ...]) -> Teacher:
    """The torch decoder's cache-free forward over a right-padded batch (causal: a position never reads the padding
    after it)."""

    def run(batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        width = max(map(len, batch))
        ids = torch.tensor([tokens + [0] * (width - len(tokens)) for tokens in batch])  # (B, T)
        with torch.inference_mode():
            logits, features = model.decoder.forward_train(ids, layers)  # (B, T, V), (B, T, F)
        return [(logits[row, : len(tokens)], features[row, : len(tokens)]) for row, tokens in enumerate(batch)]

    return run


def runtime_teacher(runtime, layers: tuple[int, ...]) -> Teacher:
    """A runtime's own call (llama.cpp's: the numbers and features the draft will read when it drafts there), each
    sequence in its own slot, the slots emptied after each batch."""
    runtime.capture_features(layers)

    def run(batch: list[list[int]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        logits = runtime.forward(list(enumerate(batch)))
        out = list(zip(logits, runtime.last_features))
        for slot in range(len(batch)):
            runtime.rollback(slot, 0)
        return out

    return run


def shard_paths(shards: Path) -> list[Path]:
    """The complete shards of a directory (those whose index was written), in order."""
    return sorted(p for p in shards.glob("shard_*.pt") if p.with_suffix(".keys.json").is_file())


def stored_keys(shards: Path) -> set[str]:
    """The keys of the sequences a directory's complete shards hold."""
    return {key for path in shard_paths(shards) for key in json.loads(path.with_suffix(".keys.json").read_text())}


def stored_layers(shards: Path) -> tuple[int, ...] | None:
    """The target layers whose outputs a directory's features hold, ascending (None for a directory written before
    this was recorded: its features are the layers of the run's own layout)."""
    path = shards / LAYERS_FILE
    return tuple(json.loads(path.read_text())) if path.is_file() else None


def _record_layers(shards: Path, layers: tuple[int, ...]) -> None:
    stored = stored_layers(shards)
    if stored is None and shard_paths(shards):
        raise ValueError(f"{shards} holds features of unrecorded layers: give the run a new --out")
    if stored is not None and stored != layers:
        raise ValueError(
            f"{shards} holds features of target layers {list(stored)}, not {list(layers)}: give the run a new --out"
        )
    shards.mkdir(parents=True, exist_ok=True)
    (shards / LAYERS_FILE).write_text(json.dumps(list(layers)))


def select_layers(rows: list[dict], stored: Sequence[int] | None, wanted: Sequence[int]) -> list[dict]:
    """``rows`` with the features of the ``wanted`` layers only (ascending), cut from features of the ``stored``
    layers (concatenated in ascending order, equal widths); ``stored=None`` means the rows hold ``wanted``."""
    stored, wanted = (tuple(wanted) if stored is None else tuple(stored)), tuple(sorted(wanted))
    if stored == wanted or not rows:
        return rows
    missing = [layer for layer in wanted if layer not in stored]
    if missing:
        raise ValueError(f"the teacher's features hold target layers {list(stored)}, not {missing}")
    width = rows[0]["features"].shape[-1] // len(stored)
    index = torch.cat(
        [torch.arange(stored.index(layer) * width, (stored.index(layer) + 1) * width) for layer in wanted]
    )
    return [{**row, "features": row["features"][:, index]} for row in rows]


def _save_atomically(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def teacher_pass(
    teacher: Teacher,
    layers: Sequence[int],
    sequences: Sequence[TeacherSequence],
    shards: Path,
    deadline: float,
    log: Callable[[str], None] = lambda message: None,
) -> int:
    """Store features (of the target ``layers`` the ``teacher`` reads) and top-k next-token probabilities of the
    ``sequences`` not yet in ``shards``, in their order, until done or ``deadline`` (a ``time.monotonic()``
    value); returns how many sequences the shards hold."""
    _record_layers(shards, tuple(sorted(layers)))
    done = stored_keys(shards)
    pending = [s for s in sequences if s.key not in done]
    index = max((int(p.stem.split("_")[1]) + 1 for p in shard_paths(shards)), default=0)
    for start in range(0, len(pending), SHARD_SEQUENCES):
        if time.monotonic() > deadline:
            break
        shard = pending[start : start + SHARD_SEQUENCES]
        rows: list[dict | None] = [None] * len(shard)
        by_length = sorted(range(len(shard)), key=lambda i: len(shard[i].ids))
        for first in range(0, len(shard), TEACHER_BATCH):  # similar lengths together: little padding
            batch = by_length[first : first + TEACHER_BATCH]
            for i, (logits, features) in zip(batch, teacher([shard[i].ids for i in batch])):
                top = logits.float().softmax(-1).topk(TOP_K)
                rows[i] = {
                    "key": shard[i].key,
                    "source": shard[i].source,
                    "ids": torch.tensor(shard[i].ids, dtype=torch.int32),
                    "loss_from": shard[i].loss_from,
                    "features": features.to(torch.bfloat16),
                    "top_probs": top.values.half(),
                    "top_ids": top.indices.int(),
                }
        path = shards / f"shard_{index:04d}.pt"
        _save_atomically(path, lambda tmp, rows=rows: torch.save(rows, tmp))
        _save_atomically(
            path.with_suffix(".keys.json"), lambda tmp, shard=shard: tmp.write_text(json.dumps([s.key for s in shard]))
        )
        done.update(s.key for s in shard)
        index += 1
        log(f"teacher: shard {path.name}, {len(done)} sequences stored")
    return len(done)


def load_shards(shards: Path | Sequence[Path], layers: Sequence[int] | None = None) -> list[dict]:
    """Every row of a directory's complete shards (or of the given shard files of one directory), in order; with
    ``layers``, the features of those target layers only (:func:`select_layers`)."""
    paths = shard_paths(shards) if isinstance(shards, Path) else list(shards)
    rows: list[dict] = []
    for path in paths:
        rows += torch.load(path)
    return rows if layers is None or not paths else select_layers(rows, stored_layers(paths[0].parent), layers)


class ShardPool:
    """Training rows from shards on disk, at most ``capacity`` shards in memory at once. Batch ``b`` draws from the
    shards ``random.Random(seed, b // swap_every).sample(paths, capacity)`` (every shard, loaded once, when they
    all fit), so a resumed run sees what an uninterrupted one would."""

    def __init__(
        self,
        paths: Sequence[Path],
        capacity: int,
        seed: int = 0,
        swap_every: int = 200,
        layers: Sequence[int] | None = None,
    ) -> None:
        if not paths:
            raise ValueError("no teacher shards to train on")
        self.paths, self.capacity, self.seed, self.swap_every = list(paths), max(1, capacity), seed, swap_every
        self.layers = layers
        self._period: int | None = None
        self.rows: list[dict] = []

    @classmethod
    def within(
        cls,
        shards: Path,
        memory_bytes: float,
        seed: int = 0,
        swap_every: int = 200,
        layers: Sequence[int] | None = None,
    ) -> ShardPool:
        """A pool over a directory's shards holding about ``memory_bytes`` of them once cut to ``layers`` (the
        features are nearly all of a shard)."""
        paths = shard_paths(shards)
        stored = stored_layers(shards)
        kept = len(layers) / len(stored) if layers is not None and stored else 1.0
        mean = kept * sum(p.stat().st_size for p in paths) / max(1, len(paths))
        return cls(paths, math.floor(memory_bytes / max(mean, 1.0)), seed, swap_every, layers)

    def rows_for(self, batch: int) -> list[dict]:
        """The rows batch number ``batch`` draws from."""
        everything = self.capacity >= len(self.paths)
        period = 0 if everything else batch // self.swap_every
        if period != self._period:
            chosen = (
                self.paths if everything else random.Random(f"{self.seed}:{period}").sample(self.paths, self.capacity)
            )
            self.rows, self._period = [], None  # the old set freed before the new one loads
            self.rows, self._period = load_shards(sorted(chosen), self.layers), period
        return self.rows
