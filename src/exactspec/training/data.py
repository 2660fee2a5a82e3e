"""Training corpus (the running interpreter's standard library) and the byte-level BPE tokenizer.

The corpus is every ``*.py`` file under ``sysconfig.get_paths()["stdlib"]``,
excluding ``site-packages`` / ``dist-packages``. A fixed list of modules (and
their test files), :data:`HELD_OUT`, is kept out of training: those files are
the validation set, and benchmarks may use them as prompts that the models
have never seen.
"""

from __future__ import annotations

import functools
import json
import sysconfig
from collections.abc import Iterable
from pathlib import Path

import numpy as np

__all__ = [
    "HELD_OUT",
    "EOT",
    "stdlib_root",
    "corpus_files",
    "held_out_files",
    "train_files",
    "read_source",
    "train_tokenizer",
    "write_tokenizer_files",
    "encode_files",
]

#: The separator / BOS / EOS token between files.
EOT = "<|endoftext|>"

#: Held-out modules, relative to the stdlib root; a trailing "/" means a whole package.
HELD_OUT: tuple[str, ...] = (
    "argparse.py",
    "csv.py",
    "json/",
    "difflib.py",
    "textwrap.py",
    "ftplib.py",
    "smtplib.py",
    "calendar.py",
    "fractions.py",
    "shlex.py",
    "configparser.py",
    "statistics.py",
    "tomllib/",
    "test/test_argparse.py",
    "test/test_csv.py",
    "test/test_json/",
    "test/test_difflib.py",
    "test/test_textwrap.py",
    "test/test_ftplib.py",
    "test/test_smtplib.py",
    "test/test_calendar.py",
    "test/test_fractions.py",
    "test/test_shlex.py",
    "test/test_configparser.py",
    "test/test_statistics.py",
    "test/test_tomllib/",
)


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]).resolve()


def _rel(path: Path, root: Path) -> str:
    return path.relative_to(root).as_posix()


def _is_held_out(rel: str) -> bool:
    return any(rel.startswith(h) if h.endswith("/") else rel == h for h in HELD_OUT)


def corpus_files(root: Path | None = None) -> list[Path]:
    """All stdlib ``*.py`` files (sorted, deterministic), site/dist-packages excluded."""
    return list(_corpus_files(root or stdlib_root()))


@functools.lru_cache(maxsize=4)
def _corpus_files(root: Path) -> tuple[Path, ...]:
    out = []
    for p in root.rglob("*.py"):
        parts = p.relative_to(root).parts
        if "site-packages" in parts or "dist-packages" in parts or "__pycache__" in parts:
            continue
        if p.is_file():
            out.append(p)
    return tuple(sorted(out, key=lambda p: _rel(p, root)))


def held_out_files(root: Path | None = None) -> list[Path]:
    """The validation files: never trained on, usable as unseen benchmark prompts."""
    root = root or stdlib_root()
    return [p for p in corpus_files(root) if _is_held_out(_rel(p, root))]


def train_files(root: Path | None = None) -> list[Path]:
    root = root or stdlib_root()
    return [p for p in corpus_files(root) if not _is_held_out(_rel(p, root))]


def read_source(path: Path) -> str:
    """File text as UTF-8 (undecodable bytes replaced; a few test files are not UTF-8)."""
    return path.read_bytes().decode("utf-8", errors="replace")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096):
    """Byte-level BPE (GPT-2 style pre-tokenization), ``<|endoftext|>`` as id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def write_tokenizer_files(tok, directory: Path) -> None:
    """``tokenizer.json`` plus the small JSON files that make ``AutoTokenizer`` work offline."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": EOT,
                "eos_token": EOT,
                "unk_token": EOT,
                "add_bos_token": False,
                "add_eos_token": False,
                "clean_up_tokenization_spaces": False,
                "model_max_length": 1024,
            },
            indent=2,
        )
        + "\n"
    )
    (directory / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": EOT, "eos_token": EOT, "unk_token": EOT}, indent=2) + "\n"
    )


def encode_files(tok, files: list[Path]) -> np.ndarray:
    """One uint16 stream: ``<|endoftext|> file0 <|endoftext|> file1 ...``."""
    eot = tok.token_to_id(EOT)
    encs = tok.encode_batch([read_source(p) for p in files], add_special_tokens=False)
    total = sum(len(e.ids) + 1 for e in encs)
    out = np.empty(total, dtype=np.uint16)
    i = 0
    for e in encs:
        out[i] = eot
        out[i + 1 : i + 1 + len(e.ids)] = e.ids
        i += 1 + len(e.ids)
    return out
