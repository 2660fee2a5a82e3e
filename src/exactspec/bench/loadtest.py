"""A bounded load test of an exactspec server on loopback: ``python -m exactspec.bench.loadtest``.

Phases, each bounded in time or count, so the test always ends by itself:

1. baseline: one client, speculation off, greedy, ``baseline_requests`` requests one after another: the tokens/s
   of plain decoding for a single user;
2. load: ``clients`` concurrent streaming clients for ``seconds``; each sends seeded sampled requests (prompt,
   seed and speculation mode fixed by client and turn) until the time is up, recording time to first token,
   latency, tokens and errors; the server's resident memory is read from ``/metrics`` before and after;
3. check: every distinct request of the load phase (up to ``check_limit``) is sent again alone, and its text
   must equal what it streamed under load: no lost, duplicated or mixed tokens. Sampled tokens can still differ
   where batching moves a probability across the draw by a low-order bit (:mod:`exactspec.models.lean`): measured
   with the shipped pair, 1 of 48 seeded 96-token sequences in float32, none in float64, more in bfloat16. So
   ``--spawn`` serves in float32, and ``--temperature 0`` (greedy) checks token identity without that caveat.

The report: aggregate tokens/s under load and its ratio to the baseline, p50/p95/p99 latency and time to first
token, errors, mismatches and memory growth. ``--spawn`` starts ``exactspec serve`` on a free loopback port with
the shipped pair (or ``--target``), runs the test against it and stops it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

__all__ = ["LoadConfig", "run_load"]

PROMPTS = (
    "def parse_args(argv):\n    ",
    "class Cache:\n    def __init__(self, size):\n        ",
    "import os\n\ndef walk(root):\n    ",
    "    for line in lines:\n        ",
)
MODES = ("auto", "draft", "lookup", "off")


@dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str
    api_key: str | None = None
    clients: int = 16
    seconds: float = 20.0
    max_tokens: int = 48
    baseline_requests: int = 3
    check_limit: int = 64
    temperature: float = 1.0  # of the load phase's requests (seeded); 0: greedy
    faults: bool = (
        False  # mixed lengths; every 4th client leaves mid-stream, every 8th sends a bad body every other turn
    )
    warmup: float = 0.1  # the share of the load phase after which the server's memory is read the first time

    def __post_init__(self) -> None:
        if self.clients < 1 or not self.seconds > 0 or self.max_tokens < 1 or self.baseline_requests < 1:
            raise ValueError("clients, seconds, max_tokens and baseline_requests must be positive")
        host = self.url.split("//", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise ValueError(f"the load test runs on loopback only, not against {host}")


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p95": None, "p99": None}
    ordered = sorted(values)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {"p50": pick(0.50), "p95": pick(0.95), "p99": pick(0.99)}


async def _stream(client, config: LoadConfig, body: dict, leave_after: int | None = None) -> dict:
    """One streaming request: its text, tokens, time to first token and latency (or its error); with
    ``leave_after``, the client closes the connection after that many chunks (``{"left": True}``)."""
    started = time.perf_counter()
    first, pieces, tokens, chunks = None, [], 0, 0
    async with client.stream(
        "POST",
        "/v1/completions",
        json={**body, "model": config.model, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        if response.status_code != 200:
            return {"error": f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"}
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return {"error": chunk["error"]["message"]}
            chunks += 1
            if leave_after is not None and chunks >= leave_after:
                return {"left": True}
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first or time.perf_counter()
                    pieces.append(choice["text"])
    end = time.perf_counter()
    return {"text": "".join(pieces), "tokens": tokens, "ttft": (first or end) - started, "latency": end - started}


BAD_BODIES = ({"temperature": "hot"}, {"max_tokens": -3}, {"prompt": None}, {"n": 10**6}, {"logit_bias": [1]})


async def _bad_body(client, config: LoadConfig, body: dict, refused: dict) -> None:
    """A request a fault-injecting client breaks on purpose: a 4xx with an error body is expected."""
    bad = {**body, "model": config.model, **BAD_BODIES[body["seed"] % len(BAD_BODIES)]}
    response = await client.post("/v1/completions", json=bad)
    if 400 <= response.status_code < 500 and "error" in response.json():
        refused["expected"] += 1
    else:
        refused["unexpected"].append(f"bad body {bad} answered HTTP {response.status_code}")


async def _memory(client) -> float | None:
    text = (await client.get("/metrics")).text
    for line in text.splitlines():
        if line.startswith("exactspec_resident_memory_bytes "):
            return float(line.split()[1])
    return None


async def run_load(config: LoadConfig) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    limits = httpx.Limits(max_connections=config.clients + 4)
    async with httpx.AsyncClient(base_url=config.url, headers=headers, timeout=120, limits=limits) as client:
        began, baseline_tokens = time.perf_counter(), 0
        for i in range(config.baseline_requests):
            result = await _stream(
                client,
                config,
                {
                    "prompt": PROMPTS[i % len(PROMPTS)],
                    "max_tokens": config.max_tokens,
                    "temperature": 0,
                    "speculation": "off",
                },
            )
            if "error" in result:
                raise RuntimeError(f"baseline request failed: {result['error']}")
            baseline_tokens += result["tokens"]
        baseline = baseline_tokens / (time.perf_counter() - began)

        memory_before = await _memory(client)
        deadline = time.perf_counter() + config.seconds
        records: list[tuple[dict, dict]] = []
        refused = {"expected": 0, "unexpected": []}  # the faults' bad bodies

        async def user(index: int) -> None:
            turn = 0
            while time.perf_counter() < deadline:
                length = 4 + (7 * index + 5 * turn) % config.max_tokens if config.faults else config.max_tokens
                body = {
                    "prompt": PROMPTS[(index + turn) % len(PROMPTS)],
                    "max_tokens": length,
                    "temperature": config.temperature,
                    "seed": 1000 * index + turn,
                    "speculation": MODES[(index + turn) % len(MODES)],
                }
                turn += 1
                try:
                    if config.faults and index % 8 == 6 and turn % 2:
                        await _bad_body(client, config, body, refused)
                        continue
                    leave = 2 + turn % 3 if config.faults and index % 4 == 3 else None
                    records.append((body, await _stream(client, config, body, leave)))
                except httpx.HTTPError as error:
                    records.append((body, {"error": f"{type(error).__name__}: {error}"}))

        async def warm_memory() -> float | None:
            await asyncio.sleep(config.warmup * config.seconds)
            return await _memory(client)

        load_began = time.perf_counter()
        memory_warm, *_ = await asyncio.gather(warm_memory(), *(user(i) for i in range(config.clients)))
        load_seconds = time.perf_counter() - load_began
        memory_after = await _memory(client)

        done = [r for _, r in records if "error" not in r and "left" not in r]
        mismatches = []
        for body, result in [(b, r) for b, r in records if "error" not in r and "left" not in r][: config.check_limit]:
            alone = await _stream(client, config, body)
            if alone.get("text") != result["text"]:
                mismatches.append(
                    {"request": body, "under_load": result["text"], "alone": alone.get("text", alone.get("error"))}
                )
    tokens = sum(r["tokens"] for r in done)
    aggregate = tokens / load_seconds
    return {
        "config": asdict(config),
        "baseline_tokens_per_second": baseline,
        "requests": len(records),
        "completed": len(done),
        "left_mid_stream": sum("left" in r for _, r in records),
        "bad_bodies_refused": refused["expected"],
        "errors": [r["error"] for _, r in records if "error" in r] + refused["unexpected"],
        "aggregate_tokens_per_second": aggregate,
        "speedup_over_one_plain_client": aggregate / baseline,
        "latency_seconds": _percentiles([r["latency"] for r in done]),
        "ttft_seconds": _percentiles([r["ttft"] for r in done]),
        "seconds_per_token": _percentiles([r["latency"] / r["tokens"] for r in done if r["tokens"]]),
        "checked_against_solo": min(len(done), config.check_limit),
        "mismatches": mismatches,
        "memory_bytes": {"before": memory_before, "after_warmup": memory_warm, "after": memory_after},
    }


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.loadtest", description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a running server, e.g. http://127.0.0.1:8000 (loopback only)")
    parser.add_argument(
        "--spawn", action="store_true", help="start `exactspec serve` on a free loopback port for the test"
    )
    parser.add_argument("--target", help="with --spawn: the target to serve (default: the shipped pair)")
    parser.add_argument("--model", default="exactspec-default", help="the model id the server expects")
    parser.add_argument("--api-key")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="of the load phase's seeded requests (0: greedy)"
    )
    parser.add_argument("--threads", type=int, help="with --spawn: the server's torch threads")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["float32", "bfloat16"],
        help="with --spawn: the server's dtype; in bfloat16 a batch's matrix kernels change low-order bits "
        "enough to flip sampled tokens, so outputs match solo runs in law, not token for token",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if bool(args.url) == args.spawn:
        parser.error("give exactly one of --url and --spawn")
    process = None
    try:
        if args.spawn:
            port = free_port()
            args.url = f"http://127.0.0.1:{port}"
            command = [
                sys.executable,
                "-m",
                "exactspec",
                "serve",
                "--port",
                str(port),
                "--max-batch",
                str(args.clients),
            ]
            command += ["--target", args.target, "--model-name", args.model] if args.target else []
            command += ["--threads", str(args.threads)] if args.threads else []
            command += ["--dtype", args.dtype]
            process = subprocess.Popen(command, stderr=subprocess.DEVNULL)
            wait_until_up(args.url, process)
        config = LoadConfig(
            args.url,
            args.model,
            args.api_key,
            args.clients,
            args.seconds,
            args.max_tokens,
            temperature=args.temperature,
        )
        report = asyncio.run(run_load(config))
    except (ValueError, RuntimeError) as error:
        print(f"loadtest: error: {error}", file=sys.stderr)
        return 2
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        lat, ttft = report["latency_seconds"], report["ttft_seconds"]
        print(
            f"{config.clients} clients x {config.seconds:.0f} s, {config.max_tokens} tokens per request: "
            f"{report['completed']} requests, {len(report['errors'])} errors, {len(report['mismatches'])} mismatches "
            f"of {report['checked_against_solo']} checked alone\n"
            f"aggregate {report['aggregate_tokens_per_second']:.1f} tokens/s = "
            f"{report['speedup_over_one_plain_client']:.2f}x one plain client "
            f"({report['baseline_tokens_per_second']:.1f} tokens/s)\n"
            f"latency p50/p95/p99 {lat['p50']:.2f}/{lat['p95']:.2f}/{lat['p99']:.2f} s, "
            f"time to first token {ttft['p50']:.3f}/{ttft['p95']:.3f}/{ttft['p99']:.3f} s, "
            f"server memory {report['memory_bytes']['before']} -> {report['memory_bytes']['after']} bytes"
        )
    return 0 if not report["errors"] and not report["mismatches"] else 1


def wait_until_up(url: str, process: subprocess.Popen, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with code {process.returncode} before it was up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.2)
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
