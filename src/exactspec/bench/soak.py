"""A soak with faults: ``python -m exactspec.bench.soak [--minutes 10]``.

Three phases, against the shipped pair on loopback, served in float32 with ``--invariant`` (a batched row gets the
bits it gets alone, so a seeded completion must equal its solo run token for token; without it a low-order bit
flips a sampled token now and then: 1 of 200 completions in a 10-minute run, :mod:`exactspec.bench.loadtest`):

1. **serve under load with faults**: ``clients`` streaming clients for ``minutes`` (:func:`exactspec.bench.loadtest.
   run_load` with ``faults``): mixed lengths, every 4th client leaving mid-stream, every 8th sending a bad body every
   other turn. Every completed seeded request (up to ``check_limit``) is sent again alone and must stream the same
   text; the server's resident memory after the warm-up against the end; p50/p99 seconds per token;
2. **SIGTERM mid-load**: a burst of streaming requests, the server signalled while they run: each must end with
   ``data: [DONE]`` or with an error the client reads, never a dropped connection;
3. **generate-batch killed**: a job killed with SIGKILL once some results are written, then run again: its output
   must equal an uninterrupted run's, no line lost or duplicated (greedy, so the equality is token for token).

The exit status is 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from exactspec.bench.loadtest import PROMPTS, LoadConfig, free_port, run_load, wait_until_up

MODEL = "exactspec-default"
MEMORY_GROWTH_LIMIT = 0.05  # after the warm-up


def _serve(port: int, clients: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "exactspec", "serve", "--port", str(port), "--max-batch", str(clients)]
    return subprocess.Popen([*command, "--dtype", "float32", "--invariant"], stderr=subprocess.PIPE, text=True)


async def _until_done(client, body: dict) -> str:
    """One streaming request, read to its end: "done" ([DONE] arrived), "error" (a status or an error chunk), or
    "dropped" (the connection ended without either)."""
    import httpx

    try:
        async with client.stream("POST", "/v1/completions", json={**body, "model": MODEL, "stream": True}) as answer:
            if answer.status_code != 200:
                return "error"
            async for line in answer.aiter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: ") and "error" in json.loads(line[6:]):
                    return "error"
    except httpx.HTTPError:
        return "dropped"
    return "dropped"


async def _sigterm_burst(url: str, process: subprocess.Popen, requests: int) -> dict:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=120) as client:
        bodies = [
            {"prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 64, "temperature": 1.0, "seed": i}
            for i in range(requests)
        ]
        tasks = [asyncio.create_task(_until_done(client, body)) for body in bodies]
        await asyncio.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        ends = await asyncio.gather(*tasks)
    code = process.wait(timeout=120)
    return {
        "requests": requests,
        "ends": {end: ends.count(end) for end in ("done", "error", "dropped")},
        "exit_code": code,
        "traceback": "Traceback" in (process.stderr.read() if process.stderr else ""),
    }


def _batch(directory: Path, requests: int) -> dict:
    """generate-batch whole, then killed with SIGKILL once a few results are written and run again."""
    source = directory / "requests.jsonl"
    lines = [
        {"id": f"r{i}", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": 24, "temperature": 0, "seed": i}
        for i in range(requests)
    ]
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    command = [sys.executable, "-m", "exactspec", "generate-batch", "--input", str(source), "--json"]
    command += ["--backend", "lean", "--dtype", "float32", "--max-batch", "4"]
    whole, killed = directory / "whole.jsonl", directory / "killed.jsonl"
    subprocess.run([*command, "--output", str(whole)], check=True, capture_output=True)
    job = subprocess.Popen([*command, "--output", str(killed)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while job.poll() is None and (not killed.exists() or killed.read_text().count("\n") < requests // 4):
        time.sleep(0.05)
    job.send_signal(signal.SIGKILL)
    job.wait()
    written_when_killed = killed.read_text().count("\n") if killed.exists() else 0
    subprocess.run([*command, "--output", str(killed)], check=True, capture_output=True)

    def results(path: Path) -> list[tuple[str, list[int]]]:
        return [(r["id"], r["token_ids"]) for r in map(json.loads, path.read_text().splitlines())]

    ours, reference = results(killed), results(whole)
    return {
        "requests": requests,
        "written_when_killed": written_when_killed,
        "lines_after_resume": len(ours),
        "equal_to_uninterrupted": ours == reference,
        "duplicated_ids": len(ours) - len({i for i, _ in ours}),
    }


def run_soak(minutes: float, clients: int, max_tokens: int, check_limit: int, batch_requests: int) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = _serve(port, clients)
    try:
        wait_until_up(url, process)
        config = LoadConfig(url, MODEL, None, clients, minutes * 60, max_tokens, check_limit=check_limit, faults=True)
        load = asyncio.run(run_load(config))
        burst = asyncio.run(_sigterm_burst(url, process, clients))
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    with tempfile.TemporaryDirectory() as directory:
        batch = _batch(Path(directory), batch_requests)
    memory = load["memory_bytes"]
    growth = (memory["after"] - memory["after_warmup"]) / memory["after_warmup"] if memory["after_warmup"] else None
    checks = {
        "no unexpected errors": not load["errors"],
        "completions equal their solo runs": not load["mismatches"],
        f"memory growth after warm-up < {MEMORY_GROWTH_LIMIT:.0%}": growth is not None and growth < MEMORY_GROWTH_LIMIT,
        "SIGTERM: no stream dropped, no traceback": burst["ends"]["dropped"] == 0 and not burst["traceback"],
        "generate-batch resumed: nothing lost or duplicated": batch["equal_to_uninterrupted"]
        and batch["duplicated_ids"] == 0,
    }
    return {"load": load, "memory_growth": growth, "sigterm": burst, "batch": batch, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=48, help="the longest request of the mixed lengths")
    parser.add_argument("--check-limit", type=int, default=200, help="completed requests sent again alone")
    parser.add_argument("--batch-requests", type=int, default=48)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if min(args.minutes, args.clients, args.max_tokens, args.check_limit, args.batch_requests) <= 0:
        print(
            "soak: error: --minutes, --clients, --max-tokens, --check-limit and --batch-requests must be positive",
            file=sys.stderr,
        )
        return 2
    report = run_soak(args.minutes, args.clients, args.max_tokens, args.check_limit, args.batch_requests)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        load, per_token = report["load"], report["load"]["seconds_per_token"]
        print(
            f"{args.clients} clients x {args.minutes:g} min with faults: {load['completed']} completed, "
            f"{load['left_mid_stream']} left mid-stream, {load['bad_bodies_refused']} bad bodies refused, "
            f"{len(load['errors'])} unexpected errors, {len(load['mismatches'])} of {load['checked_against_solo']} "
            f"differ from their solo run; seconds per token p50 {per_token['p50']:.4f}, p99 {per_token['p99']:.4f}; "
            f"memory growth after warm-up {report['memory_growth']:.2%}\n"
            f"SIGTERM with {report['sigterm']['requests']} streams in flight: {report['sigterm']['ends']}, exit "
            f"{report['sigterm']['exit_code']}\n"
            f"generate-batch killed at {report['batch']['written_when_killed']} of {report['batch']['requests']} "
            f"results, resumed to {report['batch']['lines_after_resume']} lines, equal to an uninterrupted run: "
            f"{report['batch']['equal_to_uninterrupted']}"
        )
        for check, held in report["checks"].items():
            print(f"  {'ok  ' if held else 'FAIL'} {check}")
    return 0 if all(report["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
