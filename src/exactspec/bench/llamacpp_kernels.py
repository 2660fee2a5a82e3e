"""llama.cpp's call cost with its extra weight buffers (its AMX kernels, where built for them) and with its plain
kernels.

``python -m exactspec.bench.llamacpp_kernels --target smollm2 --threads 2`` times c(n), one call of n tokens after a
100-token context, for each n in ``--sizes``: the median of ``--calls`` calls, then the median over ``--repeats``
runs, the two arms interleaved. Each run is a child process of llama.cpp alone (no torch in it, as llama-server
runs), so an arm that crashes is reported with its signal instead of ending the bench. This is the measurement behind
:mod:`exactspec.models.llamacpp_tiles`: what exactspec's llama.cpp runtime gives up where it must run without them.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["time_calls", "run_arm", "main"]

CONTEXT = 100


def time_calls(model: Path, extra_buffers: bool, sizes: Sequence[int], threads: int, calls: int) -> dict[int, float]:
    """ms per call of n tokens, for each n in ``sizes`` (median of ``calls``), in this process."""
    import llama_cpp as llama

    llama.llama_backend_init()
    params = llama.llama_model_default_params()
    params.use_extra_bufts = extra_buffers
    handle = llama.llama_model_load_from_file(str(model).encode(), params)
    if not handle:
        raise SystemExit(f"llama.cpp could not load {model}")
    context_params = llama.llama_context_default_params()
    context_params.n_ctx = context_params.n_batch = context_params.n_ubatch = CONTEXT + max(sizes)
    context_params.n_threads = context_params.n_threads_batch = threads
    context = llama.llama_init_from_model(handle, context_params)
    memory = llama.llama_get_memory(context)

    def decode(first: int, n: int) -> None:
        batch = llama.llama_batch_init(n, 0, 1)
        for i in range(n):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = (
                100 + first + i,
                first + i,
                1,
                0,
                True,
            )
        batch.n_tokens = n
        status = llama.llama_decode(context, batch)
        llama.llama_batch_free(batch)
        if status != 0:
            raise SystemExit(f"llama_decode failed on {n} tokens")

    decode(0, CONTEXT)
    costs = {}
    for n in sizes:
        times = []
        for _ in range(calls + 1):  # the first call warms up
            llama.llama_memory_seq_rm(memory, 0, CONTEXT, -1)
            start = time.perf_counter()
            decode(CONTEXT, n)
            times.append(time.perf_counter() - start)
        costs[n] = 1000 * statistics.median(times[1:])
    return costs


def run_arm(model: Path, extra_buffers: bool, sizes: Sequence[int], threads: int, calls: int) -> dict[int, float] | str:
    """:func:`time_calls` in a child process: its costs, or what ended it (``killed by SIGSEGV``, or its error)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "exactspec.bench.llamacpp_kernels",
            "--child",
            "--target",
            str(model),
            "--extra-buffers",
            str(int(extra_buffers)),
            "--sizes",
            ",".join(map(str, sizes)),
            "--threads",
            str(threads),
            "--calls",
            str(calls),
        ],
        capture_output=True,
        text=True,
    )
    if done.returncode < 0:
        return f"killed by {signal.Signals(-done.returncode).name}"
    if done.returncode != 0:
        return (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return {int(n): ms for n, ms in json.loads(done.stdout).items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m exactspec.bench.llamacpp_kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--target", default="smollm2", help="a GGUF file, or smollm2 (the packaged one)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--sizes", default="1,2,3,5,9,64", help="tokens per call, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="timed calls per size and run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per arm, interleaved")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--extra-buffers", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sizes = [int(n) for n in args.sizes.split(",") if n.strip().isdigit() and int(n) > 0]
    if args.target == "smollm2":
        from exactspec.loading import PACKAGED_MODELS

        args.target = PACKAGED_MODELS["smollm2"].path()
    problems = (
        [f"--sizes {args.sizes}: give positive token counts, comma-separated"]
        if len(sizes) != len(args.sizes.split(","))
        else []
    )
    if not (args.child or Path(args.target).is_file()):  # the child's own load says what is wrong with a file
        problems.append(f"--target {args.target}: no such file")
    if min(args.threads, args.calls, args.repeats) < 1:
        problems.append("--threads, --calls and --repeats must be >= 1")
    if problems:
        print(f"error: {problems[0]}", file=sys.stderr)
        return 2
    if args.child:
        print(json.dumps(time_calls(Path(args.target), bool(args.extra_buffers), sizes, args.threads, args.calls)))
        return 0
    from exactspec.models.llamacpp import llama_cpp_version

    runs: dict[str, list] = {"extra buffers": [], "plain kernels": []}
    for _ in range(args.repeats):
        for arm, extra in (("extra buffers", True), ("plain kernels", False)):
            runs[arm].append(run_arm(Path(args.target), extra, sizes, args.threads, args.calls))
    build = llama_cpp_version()
    print(f"{args.target}, {args.threads} threads; llama-cpp-python {build['version']}: {build['system_info']}")
    print("arm            " + "".join(f"{f'c({n}) ms':>10}" for n in sizes))
    for arm, results in runs.items():
        failed = next((r for r in results if isinstance(r, str)), None)
        row = f" {failed}" if failed else "".join(f"{statistics.median(r[n] for r in results):10.2f}" for n in sizes)
        print(f"{arm:15}{row}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
