"""Target and draft must speak the same vocabulary: checked when a pair is loaded.

* identical tokenizers: both models are restricted to the real vocabulary,
  the ids the tokenizer can produce, whenever their output has more rows
  (embedding matrices padded to a multiple of 64 are a common habit). Padding
  rows are no token, so excluding them loses nothing a user could see, and the
  output law cannot depend on how either model happens to be padded. A target
  decoded alone (plain decoding) is restricted the same way;
* tokenizers that map an id to different strings: refused, naming the ids.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from exactspec.models.base import LanguageModel

__all__ = ["shared_vocabulary_size", "RestrictedVocabulary", "align_pair", "restrict_to_vocabulary"]


def shared_vocabulary_size(
    target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int], target_rows: int, draft_rows: int
) -> int:
    """Size of the real vocabulary both models share; ValueError if the tokenizers differ."""
    target_by_id = {i: t for t, i in target_vocab.items()}
    draft_by_id = {i: t for t, i in draft_vocab.items()}
    differing = sorted(i for i in target_by_id.keys() | draft_by_id.keys() if target_by_id.get(i) != draft_by_id.get(i))
    if differing:
        shown = ", ".join(
            f"id {i}: target {target_by_id.get(i, '<none>')!r} vs draft {draft_by_id.get(i, '<none>')!r}"
            for i in differing[:3]
        )
        raise ValueError(
            f"target and draft tokenizers differ at {len(differing)} ids ({shown}); they must share a vocabulary"
        )
    size = max(target_by_id) + 1 if target_by_id else 0
    for name, rows in (("target", target_rows), ("draft", draft_rows)):
        if rows < size:
            raise ValueError(f"the {name} model has {rows} output rows but its tokenizer uses ids up to {size - 1}")
    return size


class RestrictedVocabulary:
    """A model whose logits are cut to the first ``size`` ids (the real vocabulary)."""

    def __init__(self, model: LanguageModel, size: int) -> None:
        self.model = model
        self.size = size

    @property
    def vocab_size(self) -> int:
        return self.size

    @property
    def length(self) -> int:
        return self.model.length

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:  # (n, size)
        return self.model.prefill(token_ids)[:, : self.size]

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:  # (n, size)
        return self.model.forward(token_ids)[:, : self.size]

    def rollback(self, length: int) -> None:
        self.model.rollback(length)

    def capture_features(self, layers: Sequence[int]) -> None:
        self.model.capture_features(layers)

    @property
    def last_features(self) -> torch.Tensor | None:
        return self.model.last_features


def restrict_to_vocabulary(model: LanguageModel, vocab: Mapping[str, int]) -> LanguageModel:
    """``model`` cut to its tokenizer's real vocabulary (unchanged when it has no padding rows)."""
    return _restrict(model, shared_vocabulary_size(vocab, vocab, model.vocab_size, model.vocab_size))


def align_pair(
    target: LanguageModel, draft: LanguageModel, target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int]
) -> tuple[LanguageModel, LanguageModel]:
    """Check the pair's vocabularies and restrict both to the shared real vocabulary."""
    size = shared_vocabulary_size(target_vocab, draft_vocab, target.vocab_size, draft.vocab_size)
    return _restrict(target, size), _restrict(draft, size)


def _restrict(model: LanguageModel, size: int) -> LanguageModel:
    return model if model.vocab_size == size else RestrictedVocabulary(model, size)
