"""Files a command writes: checked (or created) before the work, so a bad path fails first, and written after it
so that a failure is one line and the figures are still shown (:class:`exactspec.cli.common.CliError` with the
command's result)."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from exactspec.cli.common import CliError

T = TypeVar("T")


def _probe(directory: Path) -> None:
    """Create and remove a file in ``directory``: the one test of writability that also holds for root (``os.access``
    says yes to root on a read-only or virtual file system)."""
    with tempfile.TemporaryFile(dir=directory):
        pass


def check_record_path(path: str | None, flag: str = "--record") -> None:
    """Before the run: the file's directory exists and takes a new file (nothing is written to ``path`` itself)."""
    if path is None:
        return
    if not path.strip():
        raise CliError(f"{flag} needs a file name, got an empty one")
    parent = Path(path).resolve().parent
    if not parent.is_dir():
        raise CliError(f"{flag} {path}: the directory {parent} does not exist")
    try:
        _probe(parent)
    except OSError as error:
        raise CliError(f"{flag} {path}: cannot write in {parent} ({error.strerror or error})") from None


def prepare_output_dir(directory: Path, flag: str) -> None:
    """Before a long run: create the directory (and its parents) and check that it takes a new file."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        _probe(directory)
    except OSError as error:
        raise CliError(f"{flag} {directory}: cannot write there ({error.strerror or error})") from None


def write_after(flag: str, path: str | Path, write: Callable[[], T], result: dict) -> T:
    """Run ``write`` after a command's work: a failure becomes one line naming the flag, shown after ``result``."""
    try:
        return write()
    except OSError as error:
        raise CliError(f"{flag} {path}: {error.strerror or error}", result) from None


def write_record_file(record: dict, path: str, result: dict) -> None:
    from exactspec.jobs.records import write_record

    write_after("--record", path, lambda: write_record(record, path), result)
