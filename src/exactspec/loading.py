"""Loading models and the shipped default pair from local directories."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import torch

from exactspec.models.base import LanguageModel, check_local_checkpoint
from exactspec.tokenizer import TextTokenizer
from exactspec.vocab import align_pair, restrict_to_vocabulary

__all__ = ["BACKENDS", "DTYPES", "default_pair_dirs", "load_model", "load_pair", "LoadedPair", "model_capacity"]

BACKENDS = ("lean", "hf")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def default_pair_dirs() -> tuple[Path, Path]:
    """The target and draft directories shipped inside the package."""
    root = Path(str(resources.files("exactspec") / "default_models"))
    return root / "target", root / "draft"


def load_model(path: str | Path, backend: str = "lean", dtype: torch.dtype = torch.float32) -> LanguageModel:
    """One model from a local checkpoint directory (never a download)."""
    if backend == "lean":
        from exactspec.models.lean import LeanModel

        return LeanModel.from_pretrained(path, dtype=dtype)
    if backend == "hf":
        try:
            from transformers.utils import logging as hf_logging
        except ImportError:
            raise ValueError("the hf backend needs transformers: pip install 'exactspec[hf]'") from None

        from exactspec.models.hf import HFModel

        hf_logging.disable_progress_bar()  # loading bars would mix with the streamed text
        hf_logging.set_verbosity_error()

        return HFModel.from_pretrained(path, dtype=dtype)
    raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")


def model_capacity(model: LanguageModel) -> int | None:
    """How many positions the model's cache holds, where it has a fixed limit."""
    while not hasattr(model, "max_len") and hasattr(model, "model"):
        model = model.model
    return getattr(model, "max_len", None)


@dataclass(frozen=True)
class LoadedPair:
    target: LanguageModel
    draft: LanguageModel | None
    tokenizer: TextTokenizer


def load_pair(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    backend: str = "lean",
    dtype: torch.dtype = torch.float32,
) -> LoadedPair:
    """Target (and draft) with the target's tokenizer, both restricted to its real vocabulary (padding rows cut)."""
    for path in (target_dir, draft_dir):
        if path is not None:
            check_local_checkpoint(path)
    tokenizer = TextTokenizer.from_dir(target_dir)
    target = load_model(target_dir, backend, dtype)
    if draft_dir is None:
        return LoadedPair(restrict_to_vocabulary(target, tokenizer.vocabulary()), None, tokenizer)
    draft = load_model(draft_dir, backend, dtype)
    draft_tokenizer = TextTokenizer.from_dir(draft_dir)
    target, draft = align_pair(target, draft, tokenizer.vocabulary(), draft_tokenizer.vocabulary())
    return LoadedPair(target, draft, tokenizer)
