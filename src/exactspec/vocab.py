"""Target and draft must speak the same vocabulary: checked when a pair is loaded, before any weight is read.

* identical tokenizers: both models compute logits over the real vocabulary only, the ids the tokenizer can
  produce, whenever their output has more rows (embedding matrices padded to a multiple of 64 are a common habit).
  The cut lives inside each runtime (its ``vocab_size``), so padding rows are no token, excluding them loses nothing
  a user could see, and the output law cannot depend on how either model happens to be padded. A target decoded
  alone (plain decoding) is cut the same way;
* tokenizers that map an id to different strings: refused, naming the ids;
* a model with fewer output rows than its tokenizer's ids: refused where it is loaded (:func:`check_output_rows`).
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["check_output_rows", "real_vocabulary_size", "shared_vocabulary_size"]


def real_vocabulary_size(target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int] | None = None) -> int:
    """How many ids the tokenizer can produce (its largest id + 1; 0 for an empty vocabulary, which cuts nothing);
    ValueError naming the differing ids where a draft's tokenizer differs from the target's."""
    target_by_id = {i: t for t, i in target_vocab.items()}
    if draft_vocab is not None:
        draft_by_id = {i: t for t, i in draft_vocab.items()}
        differing = sorted(
            i for i in target_by_id.keys() | draft_by_id.keys() if target_by_id.get(i) != draft_by_id.get(i)
        )
        if differing:
            shown = ", ".join(
                f"id {i}: target {target_by_id.get(i, '<none>')!r} vs draft {draft_by_id.get(i, '<none>')!r}"
                for i in differing[:3]
            )
            raise ValueError(
                f"target and draft tokenizers differ at {len(differing)} ids ({shown}); they must share a vocabulary"
            )
    return max(target_by_id) + 1 if target_by_id else 0


def check_output_rows(rows: int, size: int | None, name: str = "model") -> int:
    """The rows a model's logits keep: ``size`` (the real vocabulary), or all ``rows`` where ``size`` is None or 0;
    ValueError where the model has fewer rows than its tokenizer has ids."""
    if size and rows < size:
        raise ValueError(f"the {name} has {rows} output rows but its tokenizer uses ids up to {size - 1}")
    return size or rows


def shared_vocabulary_size(
    target_vocab: Mapping[str, int], draft_vocab: Mapping[str, int], target_rows: int, draft_rows: int
) -> int:
    """Size of the real vocabulary both models share; ValueError if the tokenizers differ or a model is too small."""
    size = real_vocabulary_size(target_vocab, draft_vocab)
    check_output_rows(target_rows, size, "target model")
    check_output_rows(draft_rows, size, "draft model")
    return size
