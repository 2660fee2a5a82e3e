"""exactspec's cache directory and its small JSON files: what any layer may remember between runs (policy priors,
machine measurements, llama.cpp's AMX verdicts), never fatal when missing or damaged.

The directory is ``$EXACTSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/exactspec``, else ``~/.cache/exactspec``.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["CacheDirectory", "default_cache_dir", "read_json_object", "write_json_atomically"]


def default_cache_dir() -> Path:
    """Where exactspec keeps what it rebuilds when gone (the module docstring)."""
    if os.environ.get("EXACTSPEC_CACHE_DIR"):
        return Path(os.environ["EXACTSPEC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "exactspec"


class CacheDirectory:
    """A directory of entries (``pattern``: small JSON files by default) that exactspec rebuilds when they are gone."""

    directory: Path
    pattern = "*.json"

    def entries(self) -> list[Path]:
        return sorted(self.directory.glob(self.pattern)) if self.directory.is_dir() else []

    def clear(self) -> int:
        """Remove every entry; returns how many there were."""
        entries = self.entries()
        for file in entries:
            file.unlink()
        return len(entries)


def read_json_object(file: Path) -> dict:
    """A JSON file's object; {} for a missing, damaged or foreign file (a cache is never fatal)."""
    try:
        value = json.loads(file.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def write_json_atomically(file: Path, value: dict) -> None:
    """Readers see the old file or the new one, never half of one."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=file.parent, suffix=".tmp", delete=False) as handle:
        json.dump(value, handle, indent=1)
    os.replace(handle.name, file)
