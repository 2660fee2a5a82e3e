"""The prompts a real target answers to make a draft's training data, by source, built offline.

Sources (:data:`SOURCES`):

* ``topics``: general questions and writing tasks over a list of topics;
* ``code``: small Python programming tasks;
* ``excerpts``: questions about excerpts of the CPython standard library's source;
* ``docs``: questions about the standard library's docstrings (read from the files, nothing imported);
* ``rewrite``: copy a given excerpt or docstring with one change (the kind of answer that repeats its prompt);
* ``multiturn``: a follow-up question after the target's own answer to a single-turn prompt
  (:func:`follow_ups`, made once those answers exist).

Excerpts and docstrings come from the training files only (``exactspec.training.data.train_files``). Every
``HELD_OUT_EVERY``-th prompt of each source (in a seeded order) is held out, so acceptance can be reported per
source; a follow-up is held out with the prompt it follows. Duplicates are dropped, and no prompt is a benchmark
prompt (:data:`exactspec.bench.workloads.CHAT_WORKLOADS`).
"""

from __future__ import annotations

import builtins
import hashlib
import inspect
import json
import keyword
import random
import re
from dataclasses import dataclass

from exactspec.training.data import read_source, train_files

__all__ = ["Prompt", "SOURCES", "HELD_OUT_EVERY", "chat_prompts", "follow_ups"]

SOURCES = ("topics", "code", "excerpts", "docs", "rewrite", "multiturn")
HELD_OUT_EVERY = 20


@dataclass(frozen=True)
class Prompt:
    """A conversation the target continues: ``turns`` of (role, content), the last one the user's."""

    source: str
    turns: tuple[tuple[str, str], ...]

    @classmethod
    def user(cls, text: str, source: str = "topics") -> Prompt:
        return cls(source, (("user", text),))

    @classmethod
    def from_key(cls, key: str, source: str) -> Prompt:
        """The prompt an answer row names (the inverse of :attr:`key`)."""
        if key.startswith("[["):
            try:
                return cls(source, tuple((role, content) for role, content in json.loads(key)))
            except (ValueError, TypeError):
                pass  # a single user turn that merely starts like JSON
        return cls.user(key, source)

    @property
    def key(self) -> str:
        """What an answer row names its prompt by: the user's text for one turn, the turns as JSON for more."""
        return self.turns[0][1] if len(self.turns) == 1 else json.dumps(self.turns)

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.turns]


TOPICS = (
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "vaccines",
    "climate change",
    "machine learning",
    "the stock market",
    "compound interest",
    "the immune system",
    "volcanoes",
    "the Roman Empire",
    "plate tectonics",
    "electric cars",
    "the internet",
    "DNA",
    "the solar system",
    "healthy sleep",
    "meditation",
    "coffee",
    "bread baking",
    "time management",
    "public speaking",
    "learning a new language",
    "recycling",
    "the printing press",
    "renewable energy",
    "inflation",
    "supply and demand",
    "the human heart",
    "bees",
    "ocean tides",
    "earthquakes",
    "the moon landing",
    "democracy",
    "chess",
    "jazz music",
    "gardening",
    "marathons",
    "budgeting",
    "job interviews",
    "email etiquette",
    "rainforests",
    "antibiotics",
    "3D printing",
    "quantum computers",
    "blockchains",
    "recursion",
    "version control with git",
    "unit testing",
    "databases",
    "HTTP",
    "encryption",
    "sorting algorithms",
    "object-oriented programming",
    "functional programming",
    "regular expressions",
    "Python decorators",
    "Python generators",
    "Big-O notation",
    "linked lists",
    "binary search",
    "REST APIs",
    "the Renaissance",
    "ancient Egypt",
    "the Industrial Revolution",
    "World War I",
    "the Cold War",
    "the Silk Road",
    "the Great Wall of China",
    "the Olympic Games",
    "Shakespeare",
    "Greek mythology",
    "the Moon",
    "Mars",
    "comets",
    "gravity",
    "electricity",
    "magnetism",
    "light and color",
    "sound waves",
    "atoms",
    "chemical reactions",
    "the periodic table",
    "evolution",
    "cells",
    "bacteria and viruses",
    "the brain",
    "nutrition",
    "exercise",
    "stress",
    "friendship",
    "habits",
    "motivation",
    "creativity",
    "critical thinking",
    "negotiation",
    "leadership",
    "teamwork",
    "remote work",
    "starting a small business",
    "marketing",
    "customer service",
    "saving for retirement",
    "credit scores",
    "taxes",
    "insurance",
    "renting an apartment",
    "cooking pasta",
    "making tea",
    "vegetarian diets",
    "food preservation",
    "composting",
    "houseplants",
    "birds",
    "dogs",
    "cats",
    "whales",
    "coral reefs",
    "deserts",
    "mountains",
    "rivers",
    "weather forecasting",
    "hurricanes",
    "snow",
    "maps",
    "photography",
    "painting",
    "classical music",
    "film making",
    "video games",
    "board games",
    "poetry",
    "novels",
    "libraries",
    "museums",
    "architecture",
    "bridges",
    "trains",
    "airplanes",
    "bicycles",
    "cities",
    "traffic",
    "public transport",
    "operating systems",
    "compilers",
    "computer networks",
    "cloud computing",
    "cybersecurity",
    "passwords",
    "open source software",
    "spreadsheets",
    "data visualization",
    "statistics",
    "probability",
    "prime numbers",
    "fractions",
    "geometry",
    "algebra",
    "calculus",
    "logic puzzles",
    "hash tables",
    "trees and graphs",
    "dynamic programming",
    "concurrency",
    "Python virtual environments",
    "type hints in Python",
    "JSON",
    "SQL",
    "Linux command line",
    "shell scripting",
    "code review",
    "debugging",
    "technical documentation",
)
TEMPLATES = (
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short paragraph about {t}.",
    "Give me a beginner's guide to {t}.",
    "What are the pros and cons of {t}?",
    "Summarize the history of {t}.",
    "Write a haiku about {t}.",
    "How would you teach {t} to a ten-year-old?",
    "What are common misconceptions about {t}?",
    "Write a short quiz with three questions about {t}.",
    "Describe {t} in five bullet points.",
    "Why does {t} matter today?",
    "Write a short dialogue between a student and a teacher about {t}.",
    "What are the key terms someone should know about {t}? Define each briefly.",
    "Compare {t} with something from everyday life.",
    "Write a limerick about {t}.",
)
CODE_TASKS = (
    "checks whether a string is a palindrome",
    "counts the words in a text file",
    "merges two sorted lists",
    "computes the n-th Fibonacci number iteratively",
    "removes duplicates from a list while keeping order",
    "flattens a nested list",
    "parses a date string in ISO format",
    "finds the most common element in a list",
    "converts Celsius to Fahrenheit",
    "validates an email address with a regular expression",
    "reads a CSV file into a list of dictionaries",
    "implements binary search",
    "transposes a matrix",
    "checks whether a number is prime",
    "computes the factorial of n recursively",
    "groups words by their first letter",
    "returns the n largest numbers of a list",
    "capitalizes every word of a sentence",
    "sums the digits of an integer",
    "implements a stack class with push and pop",
    "implements a simple LRU cache",
    "retries a function three times",
    "measures how long a function takes",
    "chunks a list into pieces of size n",
    "finds all anagrams in a word list",
    "reverses the words of a sentence",
    "counts the vowels in a string",
    "computes the greatest common divisor",
    "checks whether brackets in a string are balanced",
    "converts a Roman numeral to an integer",
    "generates all permutations of a list",
    "finds the second largest number in a list",
    "rotates a list by k places",
    "computes a running average",
    "writes a dictionary to a JSON file",
    "downloads nothing but parses a URL into parts",
    "implements a queue with two stacks",
    "counts the lines of code in a directory",
    "formats a number with commas",
    "checks whether two strings are anagrams",
    "computes the median of a list",
    "implements bubble sort",
    "implements merge sort",
    "finds the longest common prefix of strings",
    "converts a string to snake_case",
    "validates a password's strength",
    "simulates rolling two dice many times",
    "builds a word frequency table",
    "finds duplicate files by size",
    "implements a binary tree insert",
    "checks whether a year is a leap year",
    "converts seconds to hours, minutes and seconds",
    "deep-merges two dictionaries",
    "paginates a list",
)
CODE_TEMPLATES = (
    "Write a Python function that {t}.",
    "Write a Python function that {t}, with type hints and a docstring.",
    "Show me how to write a function that {t} in Python, and explain it.",
    "Write a Python function that {t}, and a few unit tests for it with pytest.",
)
EXCERPT_TEMPLATES = (
    "Explain what this Python code does:\n\n```python\n{t}\n```",
    "Add helpful comments to this code:\n\n```python\n{t}\n```",
    "Is there a bug in this code? Explain.\n\n```python\n{t}\n```",
    "Suggest a clearer way to write this code:\n\n```python\n{t}\n```",
)
DOC_TEMPLATES = (
    "Summarize this documentation in two sentences:\n\n{t}",
    "Explain this documentation to a beginner, with an example:\n\n{t}",
    "What questions might a reader have after reading this? Answer two of them.\n\n{t}",
)
FOLLOW_UPS = (
    "Can you give a concrete example?",
    "Summarize that in one sentence.",
    "Explain that more simply.",
    "What is a common mistake people make here?",
    "Can you expand on the first point?",
    "Why is that?",
    "Can you put that in a table?",
    "What should I read or learn next?",
)


def _excerpts(count: int, lines: int, rng: random.Random) -> list[str]:
    files = train_files()
    out = []
    for path in rng.sample(files, min(count, len(files))):
        text = read_source(path).splitlines()
        if len(text) > lines:
            start = rng.randrange(0, len(text) - lines)
            out.append("\n".join(text[start : start + lines]).strip())
    return [e for e in out if e]


_DOCSTRING = re.compile(r'(?:\A|:[ \t]*\n)[ \t]*[rRuU]?"""(.*?)"""', re.S)  # a module's, class's or function's


def _docstrings(count: int, rng: random.Random, max_chars: int = 900) -> list[str]:
    """Docstrings (one per file, at least three lines, cut to ``max_chars`` at a line end) of the training files
    outside the test suites."""
    files = [p for p in train_files() if not p.name.startswith("test") and "test" not in p.parent.name]
    found = []
    for path in rng.sample(files, len(files)):
        docs = [inspect.cleandoc(d) for d in _DOCSTRING.findall(read_source(path))]
        docs = [d for d in docs if d.count("\n") >= 2]
        if docs:
            doc = rng.choice(docs)
            found.append(doc[: doc.rfind("\n", 0, max_chars)] if len(doc) > max_chars else doc)
        if len(found) >= count:
            break
    return found


def _rewrite(text: str, code: bool, rng: random.Random) -> str | None:
    """A copy-with-one-change task over ``text``: rename an identifier used at least twice (code), or swap a word."""
    words = re.findall(r"\b[A-Za-z_][A-Za-z0-9_]{3,}\b", text)
    repeated = sorted(
        {
            w
            for w in words
            if words.count(w) >= 2
            and not (code and (keyword.iskeyword(w) or hasattr(builtins, w) or w in ("self", "cls")))
        }
    )
    if not repeated:
        return None
    old = rng.choice(repeated)
    if code:
        return f"Repeat this code, renaming {old} to {old}_new:\n\n```python\n{text}\n```"
    return f'Copy this text exactly, but replace the word "{old}" with "{old.upper()}":\n\n{text}'


def chat_prompts(
    seed: int = 0, excerpts: int = 600, docs: int = 600, rewrites: int = 400
) -> tuple[list[Prompt], list[Prompt]]:
    """(training prompts, held-out prompts) of every single-turn source, deterministic in ``seed``."""
    from exactspec.bench.workloads import CHAT_WORKLOADS

    rng = random.Random(seed)
    by_source = {
        "topics": [t.format(t=topic) for t in TEMPLATES for topic in TOPICS],
        "code": [t.format(t=task) for t in CODE_TEMPLATES for task in CODE_TASKS],
        "excerpts": [rng.choice(EXCERPT_TEMPLATES).format(t=e) for e in _excerpts(excerpts, 14, rng)],
        "docs": [rng.choice(DOC_TEMPLATES).format(t=d) for d in _docstrings(docs, rng)],
    }
    half = rewrites // 2
    by_source["rewrite"] = [
        r
        for r in [_rewrite(e, True, rng) for e in _excerpts(half, 10, rng)]
        + [_rewrite(d, False, rng) for d in _docstrings(half, rng, 500)]
        if r
    ]
    benchmark = {p for prompts in CHAT_WORKLOADS.values() for p in prompts}
    seen: set[str] = set(benchmark)
    train: list[Prompt] = []
    held: list[Prompt] = []
    for source, texts in by_source.items():
        texts = [t for t in dict.fromkeys(texts) if t not in seen]
        seen.update(texts)
        rng.shuffle(texts)
        held += [Prompt.user(t, source) for t in texts[::HELD_OUT_EVERY]]
        train += [Prompt.user(t, source) for i, t in enumerate(texts) if i % HELD_OUT_EVERY]
    rng.shuffle(train)
    return train, held


def follow_ups(answered: list[tuple[Prompt, str]], share: float = 0.3, seed: int = 0) -> list[Prompt]:
    """Multi-turn prompts: for about ``share`` of the (single-turn prompt, the target's answer text) pairs, chosen
    by a hash of the prompt, the conversation so far and a follow-up question."""
    out = []
    for prompt, answer in answered:
        digest = hashlib.sha256(f"{seed}:{prompt.key}".encode()).digest()
        if int.from_bytes(digest[:4], "big") / 2**32 < share and answer.strip():
            question = FOLLOW_UPS[digest[4] % len(FOLLOW_UPS)]
            out.append(Prompt("multiturn", prompt.turns + (("assistant", answer.strip()), ("user", question))))
    return out
