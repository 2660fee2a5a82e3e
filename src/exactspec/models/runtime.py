"""The runtime interface the engine drives: a model's KV cache for a batch of slots.

A runtime holds ``slots`` sequences, each with its own length. The engine (:mod:`exactspec.decoding.engine`) talks to it
only through:

* ``forward(rows, outputs)``  feed each (slot, tokens) row its tokens; get the logits of each row's last
  ``outputs[i]`` positions ``(outputs_i, V)`` (every position, ``(t_i, V)``, without ``outputs``): a prompt's
  prefill needs only its last position's, and a runtime may then skip the head (and llama.cpp the last layer) for
  the rest;
* ``rollback(slot, n)``  keep only the first ``n`` positions of a slot;
* ``copy_prefix(source, slot, n)``  give a slot another slot's first ``n`` positions (a shared prompt);
* ``lengths``            positions held per slot; ``slots``, ``max_len``, ``vocab_size``;
* ``max_batched_row``    the longest row it takes in a call beside other rows (a longer one, a prompt, is fed alone);
* ``capture_features(layers)`` / ``last_features``  the outputs of target layers for each row of the last call,
  for a proposer that reads them (:mod:`exactspec.models.eagle`); a runtime without hidden states refuses
  ``capture_features`` with a ValueError;
* ``invariant``          whether a row's logits are the bits it gets alone, whatever the batch; ``device``.

:class:`exactspec.models.lean.LeanRuntime` implements it with one :class:`exactspec.models.kv_cache.KVCache` in
which the batch is a dimension (dense and 4-bit weights alike; a :class:`~exactspec.models.lean.LeanModel` is one
slot of it). :class:`SequenceSlots` implements it over single-sequence models
(:class:`exactspec.models.base.LanguageModel`: the Hugging Face adapter, :class:`exactspec.models.markov.MarkovLM`,
a lean model handed in alone), one model per slot, so a generation of one sequence runs the same loop as a served
batch, on the model's own cache and numerics.

Nothing here reads a runtime's cache: a runtime written in C that owns its cache (llama.cpp's sequences in one
context) implements the same five calls as its own operations (decode a batch of ragged sequences with logits
for every fed position, remove a sequence's positions past ``n``, copy a sequence's first ``n`` positions to
another), and refuses ``capture_features`` where it cannot hand back hidden states.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from .base import LanguageModel, check_rollback_length

__all__ = ["OneSlot", "Runtime", "SequenceSlots", "as_runtime", "check_rows", "outputs_per_row"]


def check_rows(slots: Sequence[int], added: Sequence[int], lengths: Sequence[int], max_len: int) -> None:
    """A call's rows: distinct slots that exist (``len(lengths)`` of them), each with room for the positions it adds
    (ValueError naming the problem otherwise)."""
    if len(set(slots)) != len(slots) or not all(0 <= s < len(lengths) for s in slots):
        raise ValueError(f"rows need distinct slots in [0, {len(lengths)}), got {list(slots)}")
    for slot, n in zip(slots, added):
        if lengths[slot] + n > max_len:
            raise ValueError(f"sequence too long: {lengths[slot]} cached + {n} new tokens exceeds {max_len} positions")


def outputs_per_row(rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None) -> list[int]:
    """How many of each row's last positions a ``forward`` call returns logits for: ``outputs`` checked against the
    rows (one count per row, between 0 and the row's length), or every position where it is None."""
    if outputs is None:
        return [len(tokens) for _, tokens in rows]
    counts = [int(k) for k in outputs]
    if len(counts) != len(rows) or any(not 0 <= k <= len(tokens) for k, (_, tokens) in zip(counts, rows)):
        raise ValueError(
            f"outputs must give each of the {len(rows)} rows a count between 0 and its length, got {list(outputs)}"
        )
    return counts


@runtime_checkable
class Runtime(Protocol):
    slots: int
    max_len: int
    max_batched_row: int
    lengths: list[int]
    last_features: list[torch.Tensor]
    invariant: bool
    device: torch.device

    @property
    def vocab_size(self) -> int: ...

    def forward(
        self, rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None = None
    ) -> list[torch.Tensor]: ...

    def rollback(self, slot: int, length: int) -> None: ...

    def copy_prefix(self, source: int, slot: int, length: int) -> None: ...

    def capture_features(self, layers: Sequence[int]) -> None: ...


class OneSlot:
    """The single-sequence model protocol (:class:`exactspec.models.base.LanguageModel`) as slot 0 of
    ``self.runtime``, a runtime of one slot: what :class:`~exactspec.models.lean.LeanModel`,
    :class:`~exactspec.models.llamacpp.LlamaCppModel` and :class:`~exactspec.models.onnx_runtime.OnnxModel` share.

    Why it stays: a loaded pair is one sequence's models (the Hugging Face model and the Markov test model have no
    other form), and :meth:`batched` turns one into a runtime of many slots on the same weights at the edge where
    serving and batch jobs need them; the engine itself only ever sees runtimes."""

    runtime: Runtime

    @property
    def vocab_size(self) -> int:
        return self.runtime.vocab_size

    @property
    def max_len(self) -> int:
        return self.runtime.max_len

    @property
    def length(self) -> int:
        return self.runtime.lengths[0]

    @property
    def last_features(self) -> torch.Tensor | None:  # (T, F) of the last call, when capture_features asked
        return self.runtime.last_features[0] if self.runtime.last_features else None

    def capture_features(self, layers: Sequence[int]) -> None:
        self.runtime.capture_features(layers)

    def prefill(self, token_ids: Sequence[int], outputs: int | None = None) -> torch.Tensor:  # (n or outputs, V)
        self.runtime.rollback(0, 0)
        return self.forward(token_ids, outputs)

    def forward(self, token_ids: Sequence[int], outputs: int | None = None) -> torch.Tensor:  # (n or outputs, V)
        """The logits of every fed position, or of the last ``outputs`` of them."""
        return self.runtime.forward([(0, token_ids)], None if outputs is None else [outputs])[0]

    def rollback(self, length: int) -> None:
        self.runtime.rollback(0, length)

    def batched(self, slots: int, max_len: int | None = None) -> Runtime:
        """A runtime of ``slots`` slots over this model's weights (shared), numerics and vocabulary cut."""
        return type(self.runtime).like(self, slots, max_len)


class SequenceSlots:
    """Slots over single-sequence models, one model (and its cache) per slot.

    Rows of a call run one after another. ``copy_prefix`` uses the model's own copy where it has one and otherwise
    feeds the source's tokens again. A model's cache changed by someone else while a slot holds a sequence (another
    decoder on the same model) is an error, not a silent mix of two sequences; an empty slot starts with a prefill,
    so what the model held before does not matter."""

    def __init__(self, models: Sequence[LanguageModel]) -> None:
        if not models or len({id(m) for m in models}) != len(models):
            raise ValueError("SequenceSlots needs one distinct model per slot")
        if len({m.vocab_size for m in models}) != 1:
            raise ValueError("the models of SequenceSlots must share one vocabulary size")
        self.models = list(models)
        self.slots = len(models)
        self.max_len = min(getattr(m, "max_len", 2**31) for m in models)
        self.max_batched_row = self.max_len  # rows run one after another, each as long as it is
        self.invariant = all(getattr(m, "invariant", False) for m in models)
        self.device = torch.device(getattr(models[0], "device", "cpu"))
        self.feature_layers: tuple[int, ...] = ()
        self.last_features: list[torch.Tensor] = []
        self._tokens: list[list[int]] = [[] for _ in models]  # what each slot holds, for copy_prefix and the guard

    @property
    def vocab_size(self) -> int:
        return self.models[0].vocab_size

    @property
    def lengths(self) -> list[int]:
        return [len(tokens) for tokens in self._tokens]

    def capture_features(self, layers: Sequence[int]) -> None:
        for model in self.models:
            if not hasattr(model, "capture_features"):
                raise ValueError("this proposer reads the target's hidden states, which only the lean backend provides")
            model.capture_features(layers)
        self.feature_layers = tuple(layers)

    def forward(
        self, rows: Sequence[tuple[int, Sequence[int]]], outputs: Sequence[int] | None = None
    ) -> list[torch.Tensor]:
        slots = [slot for slot, _ in rows]
        check_rows(slots, [len(tokens) for _, tokens in rows], self.lengths, self.max_len)
        counts = outputs_per_row(rows, outputs)
        out, features = [], []
        for (slot, tokens), count in zip(rows, counts):
            model, held = self.models[slot], self._tokens[slot]
            if held and model.length != len(held):  # an empty slot prefills, whatever the model held
                raise RuntimeError(
                    "the model's cache was changed outside this engine (another decoder on the same model?)"
                )
            call = model.forward if held else model.prefill
            if isinstance(model, OneSlot):  # its runtime computes only the logits asked for
                out.append(call(list(tokens), count))
            else:
                logits = call(list(tokens))
                out.append(logits[len(logits) - count :])
            held.extend(int(t) for t in tokens)
            if self.feature_layers:
                features.append(model.last_features)
        self.last_features = features
        return out

    def rollback(self, slot: int, length: int) -> None:
        held = len(self._tokens[slot])
        check_rollback_length(length, held)
        if length < held and self.models[slot].length == held:  # else forward reports the outside change
            self.models[slot].rollback(length)
        del self._tokens[slot][length:]

    def copy_prefix(self, source: int, slot: int, length: int) -> None:
        check_rollback_length(length, len(self._tokens[source]))
        tokens = self._tokens[source][:length]
        if hasattr(self.models[slot], "copy_prefix"):
            self.models[slot].copy_prefix(self.models[source], length)
        elif length:
            self.models[slot].prefill(tokens)
        self._tokens[slot] = tokens


def as_runtime(model: LanguageModel | Runtime) -> Runtime:
    """A runtime as it is; a single-sequence model as a runtime of one slot."""
    return model if isinstance(model, Runtime) else SequenceSlots([model])
