"""Text <-> token ids for a local checkpoint (a Hugging Face directory or a GGUF file), its chat template,
and streaming-safe decoding.

A GGUF file carries its tokenizer as lists (tokens, merges, token types) plus a
pre-tokenizer name; :func:`_gguf_tokenizer` rebuilds the byte-level BPE
tokenizer with the splitting rules llama.cpp uses for that name (``smollm``,
``starcoder`` and kin: each digit on its own, then GPT-2's pattern; ``gpt-2``;
``llama-bpe``: Llama 3's pattern). Other names and SentencePiece vocabularies
are refused rather than tokenized differently from the model's own tokenizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from exactspec.models.base import is_gguf, read_json

__all__ = ["TextTokenizer", "stream_text"]


class TextTokenizer:
    """A ``tokenizers.Tokenizer`` plus the checkpoint's end-of-sequence ids and chat template."""

    def __init__(
        self,
        tokenizer,
        eos_token_ids: frozenset[int] = frozenset(),
        bos_token_id: int | None = None,
        chat_template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.chat_template = chat_template

    @classmethod
    def from_path(cls, path: str | Path) -> TextTokenizer:
        """From a checkpoint directory or a ``.gguf`` file."""
        path = Path(path)
        return cls.from_gguf(path) if is_gguf(path) else cls.from_dir(path)

    @classmethod
    def from_gguf(cls, path: str | Path) -> TextTokenizer:
        from exactspec.models.gguf import read_gguf

        meta = read_gguf(path).metadata
        tokenizer = _gguf_tokenizer(meta, path)
        eos = {meta[k] for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id") if k in meta}
        bos = meta.get("tokenizer.ggml.bos_token_id") if meta.get("tokenizer.ggml.add_bos_token", False) else None
        return cls(tokenizer, frozenset(int(i) for i in eos), bos, meta.get("tokenizer.chat_template"))

    @classmethod
    def from_dir(cls, path: str | Path) -> TextTokenizer:
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
        return cls(tokenizer, _eos_ids(path), config.get("bos_token_id"), _chat_template(path))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The prompt's ids, led by the BOS token when the checkpoint names one."""
        lead = [self.bos_token_id] if isinstance(self.bos_token_id, int) else []
        return lead + self.encode(text)

    def encode_chat(self, messages: Sequence[dict[str, str]]) -> list[int]:
        """The ids of ``messages`` rendered by the chat template, ready for the assistant's turn."""
        if not self.chat_template:
            raise ValueError("this model has no chat template; give a plain prompt instead of --chat/--system/--user")
        from exactspec.chat import render_chat

        return self.encode(
            render_chat(
                self.chat_template,
                messages,
                self.token_text(self.bos_token_id),
                self.token_text(min(self.eos_token_ids, default=None)),
            )
        )

    def token_text(self, token_id: int | None) -> str:
        return "" if token_id is None else self.tokenizer.id_to_token(token_id) or ""

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def vocabulary(self) -> dict[str, int]:
        """Token string -> id, special tokens included."""
        return self.tokenizer.get_vocab(with_added_tokens=True)


def _read_if_present(file: Path) -> dict:
    return read_json(file) if file.is_file() else {}


def _chat_template(path: Path) -> str | None:
    """The chat template of a Hugging Face directory: ``chat_template.jinja`` or ``tokenizer_config.json``."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    template = _read_if_present(path / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):  # named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else None


# Pre-tokenizer names llama.cpp writes (tokenizer.ggml.pre) -> the split rules of the original tokenizer.
_LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_FIRST = {"smollm", "starcoder", "refact", "codeshell", "command-r", "exaone", "minerva"}
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def _gguf_tokenizer(meta: dict, path: Path):
    """A ``tokenizers.Tokenizer`` equal to the byte-level BPE tokenizer a GGUF file describes."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer model {kind!r} is not supported (exactspec rebuilds byte-level BPE, 'gpt2', "
            "from GGUF); use the model's Hugging Face directory instead"
        )
    if pre in _DIGITS_FIRST:
        splits = [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    elif pre in ("default", "gpt-2"):
        splits = [pre_tokenizers.ByteLevel(add_prefix_space=False)]
    elif pre in ("llama-bpe", "llama3"):
        splits = [
            pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    else:
        raise ValueError(
            f"{path}: pre-tokenizer {pre!r} is not supported; use the model's Hugging Face directory instead"
        )
    tokens, types = meta["tokenizer.ggml.tokens"], meta.get("tokenizer.ggml.token_type", [])
    merges = [tuple(merge.split(" ", 1)) for merge in meta.get("tokenizer.ggml.merges", [])]
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types) if kind == _GGUF_TOKEN_CONTROL]
    )
    tokenizer.add_tokens(
        [AddedToken(t, normalized=False) for t, kind in zip(tokens, types) if kind == _GGUF_TOKEN_USER_DEFINED]
    )
    return tokenizer


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
