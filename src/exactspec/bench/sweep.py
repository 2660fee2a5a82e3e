"""Throughput and latency of the batch engine against concurrency: ``python -m exactspec.bench.sweep``.

For each concurrency c (default 1, 2, 4, 8, 16) and each speculation setting (``off``: plain decoding; ``draft``:
the draft model at the fixed gamma; ``auto``: the gamma policy's choice per step), c sequences run at once for
``rounds`` waves of requests (a finished sequence is replaced at once, so the batch stays full). Reported per cell:
aggregate tokens/s, mean per-request latency, and how often the policy speculated. In process, without HTTP, so
the figures are the engine's own. Writes ``sweep.json`` and ``sweep.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

__all__ = ["sweep"]

SETTINGS = ("off", "draft", "auto")


def _cell(engine, prompts: list[list[int]], concurrency: int, mode: str, requests: int, max_tokens: int) -> dict:
    from exactspec.decoding.engine import SequenceRequest
    from exactspec.decoding.sampling import GREEDY

    on, off = engine.metrics.speculation_on, engine.metrics.speculation_off
    started, latencies, tokens, submitted, live = time.perf_counter(), [], [0], 0, []

    def submit() -> None:
        nonlocal submitted
        begun = time.perf_counter()
        request = SequenceRequest(
            prompt=tuple(prompts[submitted % len(prompts)]), params=GREEDY, max_new_tokens=max_tokens, speculation=mode
        )
        live.append(
            engine.submit(
                request,
                lambda events: tokens.__setitem__(0, tokens[0] + len(events)),
                lambda handle, begun=begun: latencies.append(time.perf_counter() - begun),
            )
        )
        submitted += 1

    for _ in range(concurrency):
        submit()
    while live:
        engine.step()
        for handle in [h for h in live if h.finish_reason is not None]:
            live.remove(handle)
            if submitted < requests:
                submit()
    seconds = time.perf_counter() - started
    decisions = (engine.metrics.speculation_on - on) + (engine.metrics.speculation_off - off)
    return {
        "concurrency": concurrency,
        "mode": mode,
        "tokens_per_second": tokens[0] / seconds,
        "mean_latency_seconds": statistics.mean(latencies),
        "speculating_share": (engine.metrics.speculation_on - on) / decisions if decisions else None,
    }


def sweep(
    concurrency: tuple[int, ...] = (1, 2, 4, 8, 16),
    requests_per_slot: int = 3,
    max_tokens: int = 64,
    dtype: torch.dtype = torch.float32,
    threads: int = 2,
) -> dict:
    from exactspec.bench.workloads import workload_prompts
    from exactspec.loading import default_pair_dirs, load_pair
    from exactspec.speculator import build_engine

    torch.set_num_threads(threads)
    pair = load_pair(*default_pair_dirs(), backend="lean", dtype=dtype)
    prompts = [pair.tokenizer.encode_prompt(text)[-64:] for text in workload_prompts("heldout", 8, lines=6)]
    engine = build_engine(pair, max(concurrency), 512)
    rows = []
    for c in concurrency:
        for mode in SETTINGS:  # interleaved per concurrency, so drift hits every setting alike
            rows.append(_cell(engine, prompts, c, mode, requests_per_slot * c, max_tokens))
            print(
                f"[sweep] c={c:2d} {mode:5s} {rows[-1]['tokens_per_second']:7.1f} tokens/s", file=sys.stderr, flush=True
            )
    return {"threads": threads, "dtype": str(dtype).replace("torch.", ""), "max_tokens": max_tokens, "rows": rows}


def write(report: dict, directory: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sweep.json").write_text(json.dumps(report, indent=2))
    figure, (rate_axis, latency_axis) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in SETTINGS:
        rows = [r for r in report["rows"] if r["mode"] == mode]
        xs = [r["concurrency"] for r in rows]
        rate_axis.plot(xs, [r["tokens_per_second"] for r in rows], "o-", label=mode)
        latency_axis.plot(xs, [r["mean_latency_seconds"] for r in rows], "o-", label=mode)
    for axis, label in ((rate_axis, "aggregate tokens/s"), (latency_axis, "mean request latency (s)")):
        axis.set(
            xscale="log",
            xlabel="concurrent sequences",
            ylabel=label,
            title=f"shipped pair, {report['dtype']}, {report['threads']} threads, {report['max_tokens']} tokens",
        )
        axis.set_xticks(
            sorted({r["concurrency"] for r in report["rows"]}),
            [str(c) for c in sorted({r["concurrency"] for r in report["rows"]})],
        )
        axis.legend()
    figure.tight_layout()
    figure.savefig(directory / "sweep.png", dpi=110)
    plt.close("all")
    return [directory / "sweep.json", directory / "sweep.png"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exactspec.bench.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated concurrency levels")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--requests-per-slot", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--output-dir", default="sweep_out")
    args = parser.parse_args(argv)
    try:
        levels = tuple(int(c) for c in args.concurrency.split(","))
        if min(levels) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--concurrency must be positive integers separated by commas, got {args.concurrency!r}")
    report = sweep(levels, args.requests_per_slot, args.max_tokens, getattr(torch, args.dtype), args.threads)
    for path in write(report, Path(args.output_dir)):
        print(path)
    for row in report["rows"]:
        share = "-" if row["speculating_share"] is None else f"{row['speculating_share']:.2f}"
        print(
            f"c={row['concurrency']:2d} {row['mode']:5s} {row['tokens_per_second']:7.1f} "
            f"tokens/s, latency {row['mean_latency_seconds']:.2f} s, speculating {share}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
