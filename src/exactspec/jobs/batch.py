"""Exact batch generation: requests in, results out, in input order, on the continuous-batching engine.

:func:`generate_batch` is the library entry point (an iterable of request dicts in, an iterator of result dicts
out); :func:`run_job` is ``exactspec generate-batch``: JSONL in, JSONL out, resumable. Every request carries a
seed (its own, or the job's seed's sample number ``line``: :mod:`exactspec.decoding.seeds`), and a seeded sequence
draws with the fixed gamma on its own generator, so its tokens depend neither on which other requests share its
batch nor on which worker runs it.
Its law is the target's in every precision mode; token for token, results are reproducible across batch
compositions in the call-size invariant mode (``--invariant``), where a row's logits do not depend on the call.

A request line is a JSON object with ``prompt`` (text) or ``messages`` (chat turns), and optionally ``id``,
``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty``, ``presence_penalty``,
``frequency_penalty``, ``seed``, ``ignore_eos`` and ``verify`` ("block" or "token"). A result line holds ``line`` (the
request's 0-based line), ``id``, ``text``, ``token_ids``, ``stop_reason``, the request's ``speculation`` figures and
``record_id`` (the job's run record, written beside the output).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from exactspec.decoding.block import check_rule
from exactspec.decoding.engine import BatchEngine, EngineConfig, SequenceRequest
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.seeds import sample_seed
from exactspec.loading import LoadedPair

__all__ = ["BatchJobConfig", "build_batch_engine", "generate_batch", "parse_request", "run_job", "completed_lines"]

REQUEST_FIELDS = {
    "id",
    "prompt",
    "messages",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "ignore_eos",
    "verify",
}
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)


@dataclass(frozen=True)
class BatchJobConfig:
    max_tokens: int = 128  # per request unless it says otherwise
    max_tokens_limit: int = 4096
    seed: int = 0  # a request without a seed draws from sample_seed(seed, its line number)
    gamma: int = 4
    slots: int = 16  # sequences decoded together
    max_len: int = 2048  # prompt + completion positions per sequence
    verify: str = "block"  # the rule for sampled drafts of a request that names none ("block" or "token")

    def __post_init__(self) -> None:
        if min(self.max_tokens, self.gamma, self.slots, self.max_len) < 1 or self.max_tokens > self.max_tokens_limit:
            raise ValueError(
                "max_tokens, gamma, slots and max_len must be >= 1, and max_tokens at most max_tokens_limit"
            )
        check_rule(self.verify)


def parse_request(obj: object, line: int, tokenizer, config: BatchJobConfig) -> SequenceRequest:
    """One request object as the engine's request; ValueError names the line and the field."""
    where = f"line {line + 1}"
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r} (known: {', '.join(sorted(REQUEST_FIELDS))})")
    if ("prompt" in obj) == ("messages" in obj):
        raise ValueError(f"{where}: give exactly one of prompt and messages")
    try:
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str) or not obj["prompt"]:
                raise ValueError("prompt must be non-empty text")
            prompt = tokenizer.encode_prompt(obj["prompt"])
        else:
            prompt = tokenizer.encode_chat(obj["messages"])
        params = SamplingParams(**{name: obj[name] for name in SAMPLING_FIELDS if name in obj})
        max_tokens = obj.get("max_tokens", config.max_tokens)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= config.max_tokens_limit:
            raise ValueError(f"max_tokens must be an integer in [1, {config.max_tokens_limit}]")
        if len(prompt) + max_tokens > config.max_len:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + max_tokens {max_tokens} "
                f"exceeds the {config.max_len} positions per sequence"
            )
        seed = obj.get("seed", sample_seed(config.seed, line))  # the job's seed, sample number `line`
        if not isinstance(seed, int) or not 0 <= seed < 2**63:
            raise ValueError("seed must be an integer in [0, 2^63)")
        verify = check_rule(obj.get("verify", config.verify))
    except (ValueError, TypeError, KeyError) as error:
        raise ValueError(f"{where}: {error}") from None
    stops = frozenset() if obj.get("ignore_eos") else tokenizer.eos_token_ids
    return SequenceRequest(
        prompt=tuple(prompt),
        params=params,
        max_new_tokens=max_tokens,
        stop_token_ids=stops,
        seed=seed,
        speculation="draft",
        verify=verify,
    )


def build_batch_engine(pair: LoadedPair, config: BatchJobConfig) -> BatchEngine:
    from exactspec.speculator import build_engine

    return build_engine(pair, config.slots, config.max_len, EngineConfig(gamma=config.gamma), calibrated=False)


def generate_batch(
    pair: LoadedPair,
    requests: Iterable[dict],
    config: BatchJobConfig = BatchJobConfig(),
    first_line: int = 0,
    engine: BatchEngine | None = None,
) -> Iterator[dict]:
    """Results of ``requests`` (dicts as in the module docstring), in order, decoded ``config.slots`` at a time.
    ``first_line`` numbers the first request (for default seeds and the ``line`` field of its result)."""
    if pair.draft is None:
        raise ValueError("batch generation drafts with a draft model or a trained feature draft; this pair has none")
    engine = engine or build_batch_engine(pair, config)
    pending: dict[int, tuple[dict, object, list]] = {}  # line -> (request object, handle, its tokens so far)
    source, next_line, next_out, exhausted = iter(requests), first_line, first_line, False
    while pending or not exhausted:
        while not exhausted and len(pending) < 2 * config.slots:  # keep the engine's queue full
            obj = next(source, None)
            if obj is None:
                exhausted = True
                break
            request, tokens = parse_request(obj, next_line, pair.tokenizer, config), []
            handle = engine.submit(
                request, lambda events, tokens=tokens: tokens.extend(e.token for e in events), lambda h: None
            )
            pending[next_line] = (obj, handle, tokens)
            next_line += 1
        if next_out in pending and pending[next_out][1].finish_reason is not None:
            obj, handle, tokens = pending.pop(next_out)
            if handle.finish_reason == "error":
                raise RuntimeError(f"line {next_out + 1}: generation failed: {handle.error}")
            shown = [t for t in tokens if t not in handle.request.stop_token_ids]
            yield {
                "line": next_out,
                "id": obj.get("id"),
                "text": pair.tokenizer.decode(shown),
                "token_ids": tokens,
                "stop_reason": handle.finish_reason,
                "speculation": handle.figures(),
            }
            next_out += 1
        elif pending:
            engine.step()


def completed_lines(output: Path) -> int:
    """How many results ``output`` already holds; a last line cut short by a kill is removed."""
    if not output.exists():
        return 0
    data = output.read_bytes()
    keep = data.rfind(b"\n") + 1  # everything after the last newline is a partial write
    lines = data[:keep].splitlines()
    for number, raw in enumerate(lines):
        try:
            if json.loads(raw)["line"] != number:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"line {number + 1} is not result {number} of this job; give a new --output") from None
    if keep < len(data):
        with output.open("r+b") as handle:
            handle.truncate(keep)
    return len(lines)


def read_requests(path: Path) -> list[dict]:
    requests = []
    with path.open(encoding="utf-8") as handle:
        for number, raw in enumerate(handle):
            if not raw.strip():
                raise ValueError(f"line {number + 1} is empty: one JSON request per line")
            try:
                requests.append(json.loads(raw))
            except json.JSONDecodeError as error:
                raise ValueError(f"line {number + 1} is not JSON: {error.msg}") from None
    return requests


def record_id(record: dict) -> str:
    """A short stable id of a run record's identity (models, mechanism, precision; not its figures)."""
    identity = {
        k: record[k]
        for k in (
            "target",
            "draft",
            "proposal",
            "acceptance",
            "residual",
            "gamma_policy",
            "precision",
            "draw_order_version",
        )
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]


def run_job(
    requests: list[dict],
    output: Path,
    record: dict,
    produce: Callable[[list[dict], int], Iterator[dict]],
    progress: bool = True,
) -> dict:
    """Append the results of ``requests`` not yet in ``output`` (in order, one line each, flushed as written);
    ``produce(remaining, first_line)`` makes them (locally or on Ray). The run record goes beside the output."""
    from tqdm import tqdm

    from exactspec.jobs.records import write_record

    done = completed_lines(output)
    rid = record_id(record)
    write_record({**record, "record_id": rid}, output.with_name(output.name + ".record.json"))
    written = tokens = 0
    bar = tqdm(total=len(requests), initial=done, desc="generate-batch", unit="req", disable=not progress)
    with output.open("a", encoding="utf-8") as sink:
        for result in produce(requests[done:], done):
            sink.write(json.dumps({**result, "record_id": rid}) + "\n")
            sink.flush()
            written += 1
            tokens += len(result["token_ids"])
            bar.update(1)
            bar.set_postfix(tokens_per_s=f"{tokens / max(bar.format_dict['elapsed'], 1e-9):.0f}")
        os.fsync(sink.fileno())
    bar.close()
    return {
        "output": str(output),
        "requests": len(requests),
        "already_done": done,
        "written": written,
        "tokens": tokens,
        "record_id": rid,
    }
