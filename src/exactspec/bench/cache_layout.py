"""llama.cpp's unified KV cache against a stream per slot, timed on one GGUF target.

``python -m exactspec.bench.cache_layout --target smollm2`` fills every slot with ``--context`` positions, then
times ``--calls`` calls of one token per slot, for each slot count and both layouts, and prints tokens per second
(a median over ``--repeats``, the layouts interleaved). This is the measurement behind
:class:`exactspec.models.llamacpp.LlamaCppRuntime`'s ``split_cache`` and behind ``train-draft``'s answers using it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

__all__ = ["time_layout", "main"]


def time_layout(target, slots: int, split_cache: bool, context: int, calls: int, threads: int) -> float:
    """Tokens per second of ``calls`` one-token-per-slot calls after ``context`` positions in every slot."""
    from exactspec.models.llamacpp import LlamaCppRuntime

    runtime = LlamaCppRuntime(target, slots, context + calls + 1, threads, split_cache=split_cache)
    runtime.forward([(slot, [(slot + i) % 1000 + 10 for i in range(context)]) for slot in range(slots)], [1] * slots)
    start = time.perf_counter()
    for call in range(calls):
        runtime.forward([(slot, [100 + call]) for slot in range(slots)])
    return slots * calls / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2", help="a .gguf file or a packaged model's name")
    parser.add_argument("--slots", default="16,32,64", help="comma-separated slot counts")
    parser.add_argument("--context", type=int, default=300, help="positions cached in each slot before the timed calls")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    from exactspec.loading import resolve_checkpoint
    from exactspec.tuning.machine import machine_signature

    target = resolve_checkpoint(args.target)
    signature = machine_signature()
    print(
        f"{signature['cpu']} ({', '.join(signature['flags'])}), {args.threads} threads, {target.name}, "
        f"{args.context} cached positions per slot"
    )
    rows = []
    for slots in (int(s) for s in args.slots.split(",")):
        rates = {False: [], True: []}
        for _ in range(args.repeats):
            for split in (False, True):
                rates[split].append(time_layout(target, slots, split, args.context, args.calls, args.threads))
        unified, split = statistics.median(rates[False]), statistics.median(rates[True])
        rows.append({"slots": slots, "unified_tokens_per_s": round(unified, 1), "split_tokens_per_s": round(split, 1)})
        print(
            f"{slots:3d} slots: unified {unified:6.1f} tok/s, split "
            f"{split:6.1f} tok/s, split/unified {split / unified:.2f}"
        )
    print(json.dumps({"machine": signature, "threads": args.threads, "context": args.context, "rows": rows}))


if __name__ == "__main__":
    try:
        main()
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(f"error: {error}") from None
