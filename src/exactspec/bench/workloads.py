"""The benchmark prompts every bench and check uses: code workloads cut at run time from files on this machine
(nothing is copied into the repo), and chat workloads of user turns for an instruct model.

* ``code``: code completion. Prompts are cut from the Python sources of installed
  third-party packages (site-packages), never from the standard library the
  default pair was trained on: ``lines`` consecutive lines ending mid-file.
* ``heldout``: code completion on the standard-library modules held out of the
  default pair's training (``exactspec.training.data.HELD_OUT``);
* ``grounded``: input-grounded editing. A prompt holds a short source file and
  asks for it again with one identifier renamed, then starts the copy; most of
  the continuation repeats the input, which is where prompt lookup shines.

Files are chosen deterministically (sorted paths, evenly spaced), so two runs
on the same machine use the same prompts. ``CHAT_WORKLOADS`` (``chat``, ``code``, ``grounded``) are the same
three tasks as user turns: what the bench against llama.cpp sends an instruct target, and the prompts ``certify``
and ``audit`` use for a model with a chat template.
"""

from __future__ import annotations

import re
import site
from pathlib import Path

__all__ = ["CHAT_WORKLOADS", "WORKLOADS", "third_party_sources", "code_prompts", "grounded_prompts", "workload_prompts"]

WORKLOADS = ("heldout", "code", "grounded")

CHAT_WORKLOADS = {  # user turns for an instruct model, by workload
    "chat": (  # questions about code and general tasks
        "Write a Python function that returns the squares of a list, with a docstring and an example.",
        "Explain how a hash table works, step by step.",
        "Rewrite this sentence three times in different styles: The quick brown fox jumps over the lazy dog.",
        "Write a short story about a robot who learns to paint.",
        "List five tips for writing clear emails, with one sentence each.",
        "What is the difference between a list and a tuple in Python? Give examples.",
    ),
    "code": (  # code completion
        'Complete this Python code:\n\ndef fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
        (
            "Complete this Python code:\n\nclass Stack:\n    def __init__(self):\n"
            "        self.items = []\n\n    def push(self, item):\n"
        ),
        (
            "Complete this Python code:\n\nimport json\n\ndef load_config(path):\n"
            '    """Read a JSON file and return its content as a dict."""\n'
        ),
        (
            "Complete this Python code:\n\ndef is_palindrome(text):\n"
            '    """True if text reads the same backwards, ignoring case and spaces."""\n'
        ),
    ),
    "grounded": (  # repeat a given text with a change
        "Repeat this code, renaming the variable total to result:\n\ndef add_all(numbers):\n    total = 0\n"
        "    for number in numbers:\n        total = total + number\n    print(total)\n    return total\n",
        (
            "Repeat this list, replacing every comma with a semicolon: apples, pears, plums, "
            "cherries, grapes, lemons, limes, melons, figs, dates, oranges, kiwis, peaches, mangoes."
        ),
        "Copy this paragraph, changing the name Anna to Maria: Anna walked to the market in the morning. Anna bought "
        "bread, cheese and tomatoes. On the way home Anna met a friend, and Anna told her about the new library.",
        (
            "Repeat this code with the function renamed from area to rectangle_area:\n\ndef area(width, height):\n"
            '    """Return the area of a rectangle."""\n    return width * height\n\n'
            "print(area(3, 4))\nprint(area(5, 6))\n"
        ),
    ),
}


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
        names = sorted(
            set(re.findall(r"\b([a-z_][a-z0-9_]{4,})\b", excerpt))
            - {"return", "import", "class", "print", "while", "False", "raise"}
        )
        old = names[len(names) // 2] if names else "value"
        new = old + "_renamed"
        head = excerpt.splitlines(keepends=True)[:2]
        prompts.append(
            f"# Original:\n{excerpt}\n# The same code with `{old}` renamed to `{new}`:\n"
            + "".join(head).replace(old, new)
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
