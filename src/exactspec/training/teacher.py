"""The teacher's pass over a draft's training sequences, the shards it writes, and the pool training draws from.

The target (as it decodes: the same weights and runtime) reads each sequence once; its features at the draft's
layers and its ``TOP_K`` most likely next tokens per position are stored in shards of ``SHARD_SEQUENCES``
sequences. Each shard has a small index beside it (``shard_NNNN.keys.json``: the keys of its sequences), written
after the shard, so a rerun skips exactly the sequences already read, however the list of sequences has grown
since (new answers, more corpus), and a shard cut by an interruption is written again.

Features are the bulk (about 3.5 KB per token for three 576-wide layers in bfloat16: 7 GB for 2M tokens), and
recomputable from the answers' token ids, so training does not hold them all: :class:`ShardPool` keeps a bounded
set of shards in memory and draws a new set every ``swap_every`` batches, as a pure function of the seed and the
batch number (a resumed run draws what an uninterrupted one would).
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch

__all__ = ["TOP_K", "SHARD_SEQUENCES", "TEACHER_BATCH", "TeacherSequence", "Teacher", "lean_teacher", "runtime_teacher",
           "teacher_pass", "shard_paths", "stored_keys", "load_shards", "ShardPool"]

TOP_K = 16  # target probabilities kept per position
SHARD_SEQUENCES = 64
TEACHER_BATCH = 8  # sequences per teacher forward


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


def _save_atomically(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    os.replace(tmp, path)


def teacher_pass(teacher: Teacher, sequences: Sequence[TeacherSequence], shards: Path, deadline: float,
                 log: Callable[[str], None] = lambda message: None) -> int:
    """Store features and top-k next-token probabilities of the ``sequences`` not yet in ``shards``, in their order,
    until done or ``deadline`` (a ``time.monotonic()`` value); returns how many sequences the shards hold."""
    shards.mkdir(parents=True, exist_ok=True)
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
                rows[i] = {"key": shard[i].key, "source": shard[i].source, "ids": torch.tensor(shard[i].ids, dtype=torch.int32),
                           "loss_from": shard[i].loss_from, "features": features.to(torch.bfloat16),
                           "top_probs": top.values.half(), "top_ids": top.indices.int()}
        path = shards / f"shard_{index:04d}.pt"
        _save_atomically(path, lambda tmp: torch.save(rows, tmp))
        _save_atomically(path.with_suffix(".keys.json"), lambda tmp: tmp.write_text(json.dumps([s.key for s in shard])))
        done.update(s.key for s in shard)
        index += 1
        log(f"teacher: shard {path.name}, {len(done)} sequences stored")
    return len(done)


def load_shards(shards: Path | Sequence[Path]) -> list[dict]:
    """Every row of a directory's complete shards (or of the given shard files), in order."""
    paths = shard_paths(shards) if isinstance(shards, Path) else shards
    rows: list[dict] = []
    for path in paths:
        rows += torch.load(path)
    return rows


class ShardPool:
    """Training rows from shards on disk, at most ``capacity`` shards in memory at once. Batch ``b`` draws from the
    shards ``random.Random(seed, b // swap_every).sample(paths, capacity)`` (every shard, loaded once, when they
    all fit), so a resumed run sees what an uninterrupted one would."""

    def __init__(self, paths: Sequence[Path], capacity: int, seed: int = 0, swap_every: int = 200) -> None:
        if not paths:
            raise ValueError("no teacher shards to train on")
        self.paths, self.capacity, self.seed, self.swap_every = list(paths), max(1, capacity), seed, swap_every
        self._period: int | None = None
        self.rows: list[dict] = []

    @classmethod
    def within(cls, shards: Path, memory_bytes: float, seed: int = 0, swap_every: int = 200) -> "ShardPool":
        """A pool over a directory's shards holding about ``memory_bytes`` of them."""
        paths = shard_paths(shards)
        mean = sum(p.stat().st_size for p in paths) / max(1, len(paths))
        return cls(paths, math.floor(memory_bytes / max(mean, 1.0)), seed, swap_every)

    def rows_for(self, batch: int) -> list[dict]:
        """The rows batch number ``batch`` draws from."""
        everything = self.capacity >= len(self.paths)
        period = 0 if everything else batch // self.swap_every
        if period != self._period:
            chosen = self.paths if everything else random.Random(f"{self.seed}:{period}").sample(self.paths, self.capacity)
            self.rows, self._period = [], None  # the old set freed before the new one loads
            self.rows, self._period = load_shards(sorted(chosen)), period
        return self.rows
