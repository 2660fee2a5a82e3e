"""The protocol every model backend implements.

A backend holds the key/value state of ONE sequence. The engine talks to it
only through four operations:

* ``prefill(token_ids)``  reset the state, run the tokens, return their logits;
* ``forward(token_ids)``  append tokens to the state, return logits for each new position;
* ``length``              how many tokens the state holds;
* ``rollback(length)``    forget every token after the first ``length``.

Logits come back as a float32 CPU tensor of shape ``(n, vocab_size)`` where row
``i`` is the next-token logits after the ``i``-th new token. After
``rollback(k)`` the state must be indistinguishable from ``prefill(tokens[:k])``:
the next ``forward`` returns the same logits (bit-exact for table models,
within floating-point tolerance for neural ones).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class LanguageModel(Protocol):
    """A causal language model with a rollback-able cache for a single sequence."""

    @property
    def vocab_size(self) -> int:
        """Number of rows of the output distribution (may exceed the tokenizer's size)."""
        ...

    @property
    def length(self) -> int:
        """Number of tokens currently held in the state."""
        ...

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reset the state, then run ``token_ids``. Returns ``(len(token_ids), V)`` logits."""
        ...

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Append ``token_ids`` to the state. Returns ``(len(token_ids), V)`` logits."""
        ...

    def rollback(self, length: int) -> None:
        """Keep only the first ``length`` tokens of the state (``0 <= length <= self.length``)."""
        ...


def check_rollback_length(length: int, current: int) -> None:
    """Shared argument check for ``rollback``: a clear error instead of silent corruption."""
    if not isinstance(length, int) or isinstance(length, bool):
        raise TypeError(f"rollback length must be an int, got {type(length).__name__}")
    if not 0 <= length <= current:
        raise ValueError(f"cannot roll back to length {length}: the state holds {current} tokens")


def check_token_ids(token_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Validate a list of token ids against a vocabulary size; returns it as a list of ints."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("expected at least one token id, got an empty sequence")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return ids


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a single-file GGUF checkpoint (else a checkpoint directory is expected)."""
    return Path(path).suffix == ".gguf" and Path(path).is_file()


def check_local_checkpoint(path: str | Path) -> Path:
    """The path as a Path, or a clear error if it is neither a ``.gguf`` file nor a local directory with a config.json
    (never a download)."""
    path = Path(path)
    if is_gguf(path):
        return path
    if not path.is_dir():
        raise FileNotFoundError(
            f"model directory not found: {path} (exactspec loads local directories and .gguf files, never downloads)"
        )
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: not a Hugging Face checkpoint directory")
    return path


def read_json(file: Path) -> dict[str, Any]:
    """A JSON object from a checkpoint file, or a ValueError that names the file."""
    try:
        value = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{file} is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file} must hold a JSON object, got {type(value).__name__}")
    return value
