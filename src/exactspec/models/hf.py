"""Hugging Face backend: any local ``AutoModelForCausalLM`` checkpoint behind the model protocol.

The key/value state is a ``transformers.DynamicCache``; rollback is
``cache.crop(-tokens_to_remove)``: a negative count is what transformers 5.x
accepts, and what 4.x (>= 4.45) reads as "remove that many" too. Tested with
transformers 5.24. Caches that cannot be rolled back (sliding-window or
recurrent layers report ``is_croppable == False``) are refused.

Nothing is ever downloaded: the path must be an existing local directory (or
``.gguf`` file, which transformers dequantizes with the ``gguf`` package) and
loading runs with ``local_files_only=True``.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from pathlib import Path

import torch

from exactspec.models.base import check_local_checkpoint, check_rollback_length, check_token_ids, is_gguf, read_json
from exactspec.vocab import check_output_rows

__all__ = ["HFModel"]


def _one_line(error: Exception, limit: int = 200) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


class HFModel:
    """A ``transformers`` causal LM with a rollback-able ``DynamicCache``, for one sequence."""

    def __init__(self, model: torch.nn.Module, vocab_size: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model.eval()
        rows = int(model.get_output_embeddings().weight.shape[0])
        self._vocab_size = check_output_rows(rows, vocab_size)  # the tokenizer's real vocabulary: padding rows cut
        # transformers 5.x names the argument `cache`; 4.x `past_key_values`. The cache is updated in place.
        self._cache_argument = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._cache_class = DynamicCache
        self._cache = DynamicCache()
        self._length = 0
        self.device = next(model.parameters()).device
        config = model.config  # the learned or trained position window, where the architecture has one
        self.max_len: int | None = getattr(config, "max_position_embeddings", None) or getattr(
            config, "n_positions", None
        )

    @classmethod
    def from_pretrained(
        cls, path: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu", vocab_size: int | None = None
    ) -> HFModel:
        from transformers import AutoConfig, AutoModelForCausalLM

        path = check_local_checkpoint(path)
        location = {"pretrained_model_name_or_path": path, "local_files_only": True}
        if is_gguf(path):  # a .gguf file: transformers dequantizes it (needs the gguf and accelerate packages)
            location.update(pretrained_model_name_or_path=path.parent, gguf_file=path.name)
        else:
            read_json(path / "config.json")  # a broken file is named here, not deep inside transformers
        try:
            config = AutoConfig.from_pretrained(**location)
        except Exception as error:  # transformers raises many kinds for a config it cannot use
            raise ValueError(
                f"transformers cannot use {path if is_gguf(path) else path / 'config.json'}: {_one_line(error)}"
            ) from None
        causal_configs = getattr(AutoModelForCausalLM, "_model_mapping", None)  # transformers' registry of causal LMs
        if causal_configs is not None and type(config) not in causal_configs:
            kind = getattr(config, "model_type", "unknown")
            raise ValueError(f"{path} holds a '{kind}' checkpoint, which is not a causal language model")
        try:
            model = AutoModelForCausalLM.from_pretrained(**location, dtype=dtype)
        except Exception as error:  # truncated weights, missing shards, shape mismatches...
            raise ValueError(f"transformers cannot load the weights in {path}: {_one_line(error)}") from None
        return cls(model.to(device), vocab_size)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def length(self) -> int:
        return self._length

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:
        self._cache = self._cache_class()
        self._length = 0
        return self.forward(token_ids)

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:  # (n, V) float32
        ids = check_token_ids(token_ids, self.vocab_size)
        if self.max_len is not None and self._length + len(ids) > self.max_len:
            raise ValueError(
                f"sequence too long: {self._length} cached + {len(ids)} "
                f"new tokens exceeds the model's {self.max_len} positions"
            )
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)  # (1, n)
        with torch.inference_mode():
            out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_argument: self._cache})
        if self._length == 0 and not getattr(self._cache, "is_croppable", True):
            raise ValueError(
                f"{type(self.model).__name__} uses a cache that cannot be "
                "rolled back; speculative decoding needs one that can"
            )
        self._length += len(ids)
        return out.logits[0, :, : self._vocab_size].float().cpu()

    def rollback(self, length: int) -> None:
        check_rollback_length(length, self._length)
        if length < self._length:
            self._cache.crop(length - self._length)  # negative: remove that many tokens
            self._length = length
