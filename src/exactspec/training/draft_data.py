"""Training text for a draft of a real target, built offline: chat prompts the target answers itself
(self-distillation), and CPython standard-library source.

Prompts are generated from templates (general questions over a list of topics, coding tasks, and questions about
stdlib code excerpts); every 20th is held out for the model card's acceptance figures. None of them is a
benchmark prompt (:data:`exactspec.bench.workloads.CHAT_WORKLOADS`). Answers are sampled from the target (temperature 0.7) by
exactspec's continuous-batching engine on the target's dense bfloat16 weights, written one JSON line per answer as
soon as it finishes, so an interrupted run continues where it stopped.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path
from typing import Callable

from exactspec.training.data import read_source, train_files

__all__ = ["chat_prompts", "generate_answers", "read_answers", "corpus_chunks"]

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "the French Revolution", "vaccines", "climate change",
    "machine learning", "the stock market", "compound interest", "the immune system", "volcanoes", "the Roman Empire",
    "plate tectonics", "electric cars", "the internet", "DNA", "the solar system", "healthy sleep", "meditation",
    "coffee", "bread baking", "time management", "public speaking", "learning a new language", "recycling",
    "the printing press", "renewable energy", "inflation", "supply and demand", "the human heart", "bees",
    "ocean tides", "earthquakes", "the moon landing", "democracy", "chess", "jazz music", "gardening", "marathons",
    "budgeting", "job interviews", "email etiquette", "rainforests", "antibiotics", "3D printing", "quantum computers",
    "blockchains", "recursion", "version control with git", "unit testing", "databases", "HTTP", "encryption",
    "sorting algorithms", "object-oriented programming", "functional programming", "regular expressions",
    "Python decorators", "Python generators", "Big-O notation", "linked lists", "binary search", "REST APIs",
)
TEMPLATES = (
    "Explain {t} in simple terms.", "What are three interesting facts about {t}?", "Write a short paragraph about {t}.",
    "Give me a beginner's guide to {t}.", "What are the pros and cons of {t}?", "Summarize the history of {t}.",
    "Write a haiku about {t}.", "How would you teach {t} to a ten-year-old?", "What are common misconceptions about {t}?",
    "Write a short quiz with three questions about {t}.", "Describe {t} in five bullet points.",
    "Why does {t} matter today?",
)
CODE_TASKS = (
    "checks whether a string is a palindrome", "counts the words in a text file", "merges two sorted lists",
    "computes the n-th Fibonacci number iteratively", "removes duplicates from a list while keeping order",
    "flattens a nested list", "parses a date string in ISO format", "finds the most common element in a list",
    "converts Celsius to Fahrenheit", "validates an email address with a regular expression",
    "reads a CSV file into a list of dictionaries", "implements binary search", "transposes a matrix",
    "checks whether a number is prime", "computes the factorial of n recursively", "groups words by their first letter",
    "returns the n largest numbers of a list", "capitalizes every word of a sentence", "sums the digits of an integer",
    "implements a stack class with push and pop", "implements a simple LRU cache", "retries a function three times",
    "measures how long a function takes", "chunks a list into pieces of size n", "finds all anagrams in a word list",
)
CODE_TEMPLATES = (
    "Write a Python function that {t}.", "Write a Python function that {t}, with type hints and a docstring.",
    "Show me how to write a function that {t} in Python, and explain it.",
)
EXCERPT_TEMPLATES = (
    "Explain what this Python code does:\n\n```python\n{t}\n```",
    "Add helpful comments to this code:\n\n```python\n{t}\n```",
    "Is there a bug in this code? Explain.\n\n```python\n{t}\n```",
)
HELD_OUT_EVERY = 20


def _excerpts(count: int, lines: int, rng: random.Random) -> list[str]:
    files = train_files()
    out = []
    for path in rng.sample(files, min(count, len(files))):
        text = read_source(path).splitlines()
        if len(text) > lines:
            start = rng.randrange(0, len(text) - lines)
            out.append("\n".join(text[start : start + lines]).strip())
    return [e for e in out if e]


def chat_prompts(seed: int = 0, excerpts: int = 240) -> tuple[list[str], list[str]]:
    """(training prompts, held-out prompts), shuffled deterministically."""
    rng = random.Random(seed)
    prompts = [t.format(t=topic) for t in TEMPLATES for topic in TOPICS]
    prompts += [t.format(t=task) for t in CODE_TEMPLATES for task in CODE_TASKS]
    prompts += [rng.choice(EXCERPT_TEMPLATES).format(t=e) for e in _excerpts(excerpts, 14, rng)]
    rng.shuffle(prompts)
    held = prompts[::HELD_OUT_EVERY]
    return [p for i, p in enumerate(prompts) if i % HELD_OUT_EVERY], held


def read_answers(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by an interruption
            break
    return rows


def answer_key(row: dict) -> tuple[str, int]:
    """What identifies an answer: its prompt and its sample number (0 for a run that drew one per prompt)."""
    return row["prompt"], row.get("sample", 0)


def generate_answers(
    target: Path,  # a .gguf file or a Llama directory
    prompts: list[str],
    out: Path,
    deadline: float,  # time.monotonic() value
    samples: int = 1,  # answers per prompt, each from its own seed
    slots: int = 64,
    max_new_tokens: int = 256,
    temperature: float = 0.7,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    backend: str = "lean",
) -> int:
    """Sample the target's answers to ``prompts`` (``samples`` each, skipping those already in ``out``) until done or
    ``deadline``; returns how many answers ``out`` holds. The target decodes in the continuous-batching engine
    (speculation off; ``backend`` lean: dense bfloat16 on torch; llamacpp: the .gguf file on llama.cpp, its slots
    llama.cpp sequences): a finished answer frees its slot for the next prompt at once, and is written as one JSON
    line when it finishes. Answer i of a prompt is seeded from the prompt and i, whichever run draws it
    (a resumed one included)."""
    import hashlib

    import torch

    from exactspec.chat import chat_messages
    from exactspec.models.lean import LeanModel, LeanRuntime
    from exactspec.decoding.sampling import SamplingParams
    from exactspec.decoding.engine import BatchEngine, SequenceRequest
    from exactspec.tokenizer import TextTokenizer

    done = {answer_key(row) for row in read_answers(out)}
    todo = [(p, i) for i in range(samples) for p in prompts if (p, i) not in done]  # every prompt once, then again
    if not todo or time.monotonic() > deadline:
        return len(done)
    tokenizer = TextTokenizer.from_path(target)
    if backend == "llamacpp":
        from exactspec.models.llamacpp import LlamaCppModel, LlamaCppRuntime

        model = LlamaCppModel.from_file(target, max_len=1)  # the file loaded once; the runtime below holds the slots
        window = model.runtime.weights.context_length
    else:
        model = LeanModel.from_pretrained(target, dtype=torch.bfloat16, weights="dense")
        window = model.cfg.max_position_embeddings
    encoded = {p: tokenizer.encode_chat(chat_messages(p)) for p, _ in todo}
    todo = [(p, i) for p, i in todo if len(encoded[p]) + 32 <= window]  # room for an answer in the model's window
    if not todo:
        return len(done)
    longest = max(len(encoded[p]) for p, _ in todo)
    slots, max_len = min(slots, len(todo)), min(window, longest + max_new_tokens)
    if backend == "llamacpp":  # a stream per slot: every slot decodes every call (bench.cache_layout measures it)
        runtime = LlamaCppRuntime.like(model, slots, max_len, split_cache=True)
    else:
        runtime = LeanRuntime.like(model, slots, max_len)
    engine = BatchEngine(runtime)
    params = SamplingParams(temperature=temperature)
    out.parent.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    submitted = 0
    with out.open("a") as sink:
        def submit(prompt: str, sample: int) -> None:
            ids = encoded[prompt]
            answer: list[int] = []
            digest = hashlib.sha256(f"{seed}:{sample}:{prompt}".encode()).digest()
            request = SequenceRequest(tuple(ids), params, min(max_new_tokens, window - len(ids)),
                                      frozenset(tokenizer.eos_token_ids), int.from_bytes(digest[:7], "big"), "off")

            def finished(handle) -> None:
                if handle.finish_reason == "error":
                    failures.append(handle.error)
                    return
                sink.write(json.dumps({"prompt": prompt, "sample": sample, "ids": ids + answer, "answer_start": len(ids)}) + "\n")
                sink.flush()
                done.add((prompt, sample))
                if progress:
                    progress(len(done), len(todo) - submitted + engine.batch_size + engine.queue_depth)

            engine.submit(request, lambda events: answer.extend(e.token for e in events), finished)

        while (submitted < len(todo) or engine.batch_size or engine.queue_depth) and time.monotonic() < deadline:
            while submitted < len(todo) and engine.queue_depth < engine.target.slots:
                submit(*todo[submitted])
                submitted += 1
            engine.step()
            if failures:
                raise RuntimeError(f"the target failed on a training prompt: {failures[0]}")
    return len(done)


def corpus_chunks(tokenizer, tokens: int, length: int, seed: int = 0) -> list[list[int]]:
    """About ``tokens`` tokens of standard-library source (training files only) in chunks of ``length``."""
    rng = random.Random(seed)
    files = train_files()
    rng.shuffle(files)
    chunks: list[list[int]] = []
    for path in files:
        ids = tokenizer.encode_prompt(read_source(path))
        chunks += [ids[i : i + length] for i in range(0, len(ids) - length + 1, length)]
        if len(chunks) * length >= tokens:
            break
    return chunks
