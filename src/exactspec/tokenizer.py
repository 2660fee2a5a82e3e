"""Text <-> token ids for a local checkpoint directory, with streaming-safe decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Iterator

from exactspec.models.base import read_json

__all__ = ["TextTokenizer", "stream_text"]


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the checkpoint's end-of-sequence ids."""

    def __init__(self, tokenizer, eos_token_ids: frozenset[int] = frozenset(), bos_token_id: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id

    @classmethod
    def from_dir(cls, path: str | Path) -> "TextTokenizer":
        """Load ``tokenizer.json`` from a local directory (via transformers if only slow files exist)."""
        path = Path(path)
        if (path / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            try:
                tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
            except Exception as error:  # the Rust library raises a bare Exception
                raise ValueError(f"{path / 'tokenizer.json'} is not a readable tokenizer ({error})") from None
        else:
            tokenizer = _converted_tokenizer(path)
        config = _read_if_present(path / "config.json")
        return cls(tokenizer, _eos_ids(path), config.get("bos_token_id"))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids, led by the BOS token when the checkpoint names one."""
        lead = [self.bos_token_id] if isinstance(self.bos_token_id, int) else []
        return lead + self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def vocabulary(self) -> dict[str, int]:
        """Token string -> id, special tokens included."""
        return self.tokenizer.get_vocab(with_added_tokens=True)


def _read_if_present(file: Path) -> dict:
    return read_json(file) if file.is_file() else {}


def _converted_tokenizer(path: Path):
    """A fast tokenizer converted by transformers from the other formats it knows (tokenizer.model, vocab files)."""
    missing = f"{path} has no tokenizer.json"
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise FileNotFoundError(f"{missing} (install transformers to convert other tokenizer formats)") from None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, use_fast=True).backend_tokenizer
    except Exception as error:  # transformers raises many kinds here; all mean "no usable tokenizer"
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        reason = f" ({lines[-1]})" if lines else ""  # transformers puts the actionable sentence last
        raise FileNotFoundError(f"{missing} and transformers found no other usable tokenizer there{reason}") from None


def _eos_ids(path: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_if_present(path / name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def stream_text(tokenizer: TextTokenizer, tokens: Iterable[int]) -> Iterator[str]:
    """Yield printable text pieces as tokens arrive.

    Byte-level tokens can end inside a UTF-8 character; a piece is held back
    while the decoded text ends with the replacement character.
    """
    ids: list[int] = []
    printed = 0
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):
            continue
        yield text[printed:]
        printed = len(text)
    text = tokenizer.decode(ids)
    if len(text) > printed:
        yield text[printed:]
