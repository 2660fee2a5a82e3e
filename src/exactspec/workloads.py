"""Benchmark prompts, generated at run time from files on this machine (nothing is copied into the repo).

* ``code``: code completion. Prompts are cut from the Python sources of installed
  third-party packages (site-packages), never from the standard library the
  default pair was trained on: ``lines`` consecutive lines ending mid-file.
* ``heldout``: code completion on the standard-library modules held out of the
  default pair's training (``exactspec.training.data.HELD_OUT``);
* ``grounded``: input-grounded editing. A prompt holds a short source file and
  asks for it again with one identifier renamed, then starts the copy; most of
  the continuation repeats the input, which is where prompt lookup shines.

Files are chosen deterministically (sorted paths, evenly spaced), so two runs
on the same machine use the same prompts.
"""

from __future__ import annotations

import re
import site
from pathlib import Path

__all__ = ["WORKLOADS", "third_party_sources", "code_prompts", "grounded_prompts", "workload_prompts"]

WORKLOADS = ("heldout", "code", "grounded")


def third_party_sources(min_bytes: int = 3000, max_bytes: int = 60000) -> list[Path]:
    """``*.py`` files of installed third-party packages, sorted; the standard library is excluded."""
    roots = {Path(p).resolve() for p in site.getsitepackages() + [site.getusersitepackages()] if Path(p).is_dir()}
    files = []
    for root in sorted(roots):
        for path in root.rglob("*.py"):
            if "test" in path.parts or path.name.startswith("test"):
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue
            if min_bytes <= size <= max_bytes:
                files.append(path)
    if not files:
        raise FileNotFoundError("no Python sources of third-party packages found to build benchmark prompts from")
    return sorted(files)


def _evenly_spaced(files: list[Path], count: int) -> list[Path]:
    return [files[(i * len(files)) // count] for i in range(count)]


def _read(path: Path) -> list[str]:
    return path.read_bytes().decode("utf-8", errors="replace").splitlines(keepends=True)


def code_prompts(count: int, lines: int = 30, files: list[Path] | None = None) -> list[str]:
    """Code-completion prompts: ``lines`` lines ending in the middle of each chosen file."""
    prompts = []
    for path in _evenly_spaced(files or third_party_sources(), count):
        text = _read(path)
        end = max(min(lines, len(text)), len(text) // 2)
        prompts.append("".join(text[max(0, end - lines) : end]))
    return prompts


def grounded_prompts(count: int, lines: int = 30) -> list[str]:
    """Input-grounded prompts: a source excerpt, an instruction to rename one identifier, the copy begun."""
    prompts = []
    for path in _evenly_spaced(third_party_sources(), count):
        excerpt = "".join(_read(path)[:lines])
        names = sorted(set(re.findall(r"\b([a-z_][a-z0-9_]{4,})\b", excerpt)) - {"return", "import", "class", "print", "while", "False", "raise"})
        old = names[len(names) // 2] if names else "value"
        new = old + "_renamed"
        head = excerpt.splitlines(keepends=True)[:2]
        prompts.append(
            f"# Original:\n{excerpt}\n# The same code with `{old}` renamed to `{new}`:\n" + "".join(head).replace(old, new)
        )
    return prompts


def workload_prompts(name: str, count: int, lines: int = 30) -> list[str]:
    if name == "heldout":
        from exactspec.training.data import held_out_files

        return code_prompts(count, lines, [f for f in held_out_files() if "/test" not in f.as_posix()])
    if name == "code":
        return code_prompts(count, lines)
    if name == "grounded":
        return grounded_prompts(count, lines)
    raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
