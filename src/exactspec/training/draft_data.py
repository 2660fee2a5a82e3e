"""Training text for a draft of a real target, built offline: the target's own answers to chat prompts
(self-distillation; the prompts are :mod:`exactspec.training.prompts`), and CPython standard-library source.

Answers are sampled from the target (at temperature 0.7 unless asked otherwise; each row records its own) by
exactspec's continuous-batching engine, on llama.cpp for a GGUF target (a KV stream per slot) or on the dense
weights in torch (bfloat16 where the CPU computes it natively, else float32), written one JSON line per answer as soon
as it finishes, so an interrupted run continues where it stopped. The answers' token ids are the costly part of a
draft's data and small (a few MB per million tokens); everything else is recomputed from them.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from exactspec.training.data import read_source, train_files
from exactspec.training.prompts import Prompt

__all__ = [
    "ANSWER_TEMPERATURE",
    "generate_answers",
    "data_rates",
    "read_answers",
    "import_answers",
    "answer_key",
    "answer_text",
    "corpus_chunks",
]

#: The temperature answers are sampled at unless asked otherwise (and that of rows written before rows recorded theirs).
ANSWER_TEMPERATURE = 0.7


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


def import_answers(source: Path, out: Path, tokenizer) -> int:
    """Append to ``out`` the answers of ``source`` (an earlier run's ``answers.jsonl``, or a gzipped copy) that ``out``
    lacks; returns how many. Every row must be this target's: its prompt part the ids this tokenizer's chat template
    gives its prompt; otherwise ValueError, naming the row, and nothing is written."""
    import gzip

    opener = gzip.open if source.suffix == ".gz" else open
    try:
        with opener(source, "rt") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError, EOFError) as error:
        raise ValueError(f"--answers {source}: not a readable JSONL file of answers ({error})") from None
    have = {answer_key(row) for row in read_answers(out)}
    new = []
    for number, row in enumerate(rows, start=1):
        try:
            prompt = Prompt.from_key(row["prompt"], row.get("source", "chat"))
            ids, start = row["ids"], row["answer_start"]
            valid = (
                isinstance(start, int)
                and 0 < start <= len(ids)
                and ids[:start] == tokenizer.encode_chat(prompt.messages)
            )
        except (KeyError, TypeError, AttributeError):
            valid = False
        if not valid:
            raise ValueError(
                f"--answers {source}: row {number} is not an answer of this target (its prompt's ids differ "
                "from this tokenizer's, or a field is missing)"
            )
        if answer_key(row) not in have:
            have.add(answer_key(row))
            new.append(row)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in new)
    return len(new)


def keep_answers(answers_file: Path, keep: Path) -> int:
    """Write every answer of ``answers_file`` (a run's ``answers.jsonl``) gzipped to ``keep``, where it outlives the
    run's machine: the costly part of a draft's data, which ``--answers`` starts a later run from. Readers see the
    old file or the new one; returns how many answers it holds."""
    import gzip
    import os

    rows = read_answers(answers_file)
    partial = keep.with_name(keep.name + ".tmp")
    with gzip.open(partial, "wt") as sink:
        sink.writelines(json.dumps(row) + "\n" for row in rows)
    os.replace(partial, keep)
    return len(rows)


def answer_key(row: dict) -> tuple[str, int]:
    """What identifies an answer: its prompt and its sample number (0 for a run that drew one per prompt)."""
    return row["prompt"], row.get("sample", 0)


def answer_text(row: dict, tokenizer) -> str:
    """The answer of a row as text, its stop token left out."""
    answer = row["ids"][row["answer_start"] :]
    return tokenizer.decode([t for t in answer if t not in tokenizer.eos_token_ids])


def generate_answers(
    target: Path,  # a .gguf file or a Llama directory
    prompts: Sequence[Prompt],
    out: Path,
    deadline: float,  # time.monotonic() value
    samples: int = 1,  # answers per prompt, each from its own seed
    slots: int = 64,
    max_new_tokens: int = 256,
    temperature: float = ANSWER_TEMPERATURE,
    seed: int = 0,
    progress: Callable[[int, int], None] | None = None,
    backend: str = "lean",
) -> int:
    """Sample the target's answers to ``prompts`` (``samples`` each, skipping those already in ``out``) until done or
    ``deadline``; returns how many answers ``out`` holds. The target decodes in the continuous-batching engine
    (speculation off; ``backend`` lean: dense weights on torch (:func:`_answer_model`); llamacpp: the .gguf file on
    llama.cpp, its slots llama.cpp sequences): a finished answer frees its slot for the next prompt at once, and is
    written as one JSON line when it finishes. Answer i of a prompt is seeded from the prompt and i, whichever run draws
    it (a resumed one included)."""
    import hashlib

    from exactspec.decoding.engine import BatchEngine, SequenceRequest
    from exactspec.decoding.sampling import SamplingParams
    from exactspec.tokenizer import TextTokenizer

    done = {answer_key(row) for row in read_answers(out)}
    todo = [(p, i) for i in range(samples) for p in prompts if (p.key, i) not in done]  # every prompt once, then again
    if not todo or time.monotonic() > deadline:
        return len(done)
    tokenizer = TextTokenizer.from_path(target)
    model, window = _answer_model(target, backend)
    encoded = {p: tokenizer.encode_chat(p.messages) for p, _ in todo}
    todo = [(p, i) for p, i in todo if len(encoded[p]) + 32 <= window]  # room for an answer in the model's window
    if not todo:
        return len(done)
    longest = max(len(encoded[p]) for p, _ in todo)
    slots, max_len = min(slots, len(todo)), min(window, longest + max_new_tokens)
    engine = BatchEngine(_answer_runtime(model, backend, slots, max_len))
    params = SamplingParams(temperature=temperature)
    out.parent.mkdir(parents=True, exist_ok=True)
    failures: list[str] = []
    submitted = 0
    with out.open("a") as sink:

        def submit(prompt: Prompt, sample: int) -> None:
            ids = encoded[prompt]
            answer: list[int] = []
            digest = hashlib.sha256(f"{seed}:{sample}:{prompt.key}".encode()).digest()
            request = SequenceRequest(
                prompt=tuple(ids),
                params=params,
                max_new_tokens=min(max_new_tokens, window - len(ids)),
                stop_token_ids=frozenset(tokenizer.eos_token_ids),
                seed=int.from_bytes(digest[:7], "big"),
                speculation="off",
            )

            def finished(handle) -> None:
                if handle.finish_reason == "error":
                    failures.append(handle.error)
                    return
                sink.write(
                    json.dumps(
                        {
                            "prompt": prompt.key,
                            "source": prompt.source,
                            "sample": sample,
                            "ids": ids + answer,
                            "answer_start": len(ids),
                            "temperature": temperature,
                        }
                    )
                    + "\n"
                )
                sink.flush()
                done.add((prompt.key, sample))
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


def _answer_model(target: Path, backend: str):
    """The target as the answers decode it, and its window: the .gguf file on llama.cpp, or dense in torch (bfloat16
    where the CPU computes it natively, float32 where it would be emulated)."""
    import torch

    if backend == "llamacpp":
        from exactspec.models.llamacpp import LlamaCppModel

        model = LlamaCppModel.from_file(target, max_len=1)  # the file loaded once; the runtime holds the slots
        return model, model.runtime.weights.context_length
    from exactspec.loading import default_dtype
    from exactspec.models.lean import LeanModel

    model = LeanModel.from_pretrained(target, dtype=getattr(torch, default_dtype("cpu")), weights="dense")
    return model, model.cfg.max_position_embeddings


def _answer_runtime(model, backend: str, slots: int, max_len: int):
    if backend == "llamacpp":  # a stream per slot: every slot decodes every call (bench.cache_layout measures it)
        from exactspec.models.llamacpp import LlamaCppRuntime

        return LlamaCppRuntime.like(model, slots, max_len, split_cache=True)
    from exactspec.models.lean import LeanRuntime

    return LeanRuntime.like(model, slots, max_len)


def data_rates(target: Path, backends: Sequence[str], slots: int = 32, calls: int = 3) -> dict[str, float]:
    """Tokens per second of the answers' workload on each of ``backends``: one call that decodes a token in each of
    ``slots`` slots (after an 8-token start in each), the median of ``calls``. Which runtime wins depends on the CPU:
    llama.cpp by 2x on an AVX2 CPU where torch emulates bfloat16, torch by 3x where the CPU has AMX tiles."""
    import statistics

    rates = {}
    for backend in backends:
        model, _ = _answer_model(target, backend)
        runtime = _answer_runtime(model, backend, slots, 16)
        runtime.forward([(slot, list(range(1, 9))) for slot in range(slots)])
        seconds = []
        for call in range(calls):
            started = time.perf_counter()
            runtime.forward([(slot, [9 + call]) for slot in range(slots)])
            seconds.append(time.perf_counter() - started)
        rates[backend] = slots / statistics.median(seconds)
    return rates


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
