"""SmolLM2-135M-Instruct: exactspec's arms against llama.cpp (llama-cpp-python) on the same GGUF file.

Same chat prompts, greedy, ``--max-new-tokens`` tokens, the same thread count for every arm, and every run its
own process, so no arm's threads (llama.cpp's spin while idle) compete with another's. exactspec arms run as
`exactspec generate --json` (rate: prompt processing included, loading and calibration excluded); llama.cpp arms
run as a child of this script (rate: completion tokens over the completion call's wall time, prompt processing
included, loading excluded). Arms are interleaved per prompt and repetition; a
prompt's figure is the median over repetitions, the arm's figure the median over prompts.

    pip install llama-cpp-python   # see README for the build flags this machine needs
    python benchmarks/smollm2_vs_llamacpp.py --threads 2 --repeats 3

Run it with nothing else busy on the machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from exactspec.chat import chat_messages
from exactspec.loading import PACKAGED_MODELS
from exactspec.tokenizer import TextTokenizer

PROMPTS = [
    "Write a Python function that returns the squares of a list, with a docstring and an example.",
    "Explain how a hash table works, step by step.",
    "Rewrite this sentence three times in different styles: The quick brown fox jumps over the lazy dog.",
    "Write a short story about a robot who learns to paint.",
]
EXACTSPEC_ARMS = {
    "exactspec plain, dense bf16": ["--no-speculation"],
    "exactspec plain, q4": ["--no-speculation", "--weights", "q4"],
    "exactspec lookup auto, dense bf16": [],
    "exactspec lookup auto, q4": ["--weights", "q4"],
    "exactspec lookup auto, q4, invariant": ["--weights", "q4", "--invariant"],
}


def exactspec_rate(prompt: str, flags: list[str], args: argparse.Namespace) -> float:
    command = [sys.executable, "-m", "exactspec", "generate", "--target", "smollm2", "--user", prompt, "--json",
               "--temperature", "0", "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads), *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"generate failed: {done.stderr.strip()}")
    return json.loads(done.stdout)["tokens_per_second"]


LLAMA_CPP_ARMS = ("llama.cpp plain", "llama.cpp prompt lookup")


def llama_cpp_rate(arm: str, prompt: str, args: argparse.Namespace) -> float:
    command = [sys.executable, __file__, "--child", arm, "--child-prompt", prompt, "--threads", str(args.threads),
               "--max-new-tokens", str(args.max_new_tokens), "--lookup-tokens", str(args.lookup_tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"llama.cpp run failed: {done.stderr.strip()[-500:]}")
    return float(done.stdout.strip().splitlines()[-1])


def llama_cpp_child(args: argparse.Namespace) -> None:
    """One llama.cpp generation; prints its tokens/s."""
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    path = PACKAGED_MODELS["smollm2"].path()
    lookup = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)} if args.child.endswith("lookup") else {}
    model = Llama(model_path=str(path), n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False, **lookup)
    ids = TextTokenizer.from_path(path).encode_chat(chat_messages(args.child_prompt))
    start = time.perf_counter()
    out = model.create_completion(ids, max_tokens=args.max_new_tokens, temperature=0.0, top_k=1)
    print(out["usage"]["completion_tokens"] / (time.perf_counter() - start))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--lookup-tokens", type=int, default=2, help="llama-cpp-python's num_pred_tokens (2 is its CPU advice)")
    parser.add_argument("--child", choices=LLAMA_CPP_ARMS, help=argparse.SUPPRESS)
    parser.add_argument("--child-prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return llama_cpp_child(args)
    rates: dict[str, list[list[float]]] = {name: [] for name in [*LLAMA_CPP_ARMS, *EXACTSPEC_ARMS]}
    for prompt in PROMPTS[: args.prompts]:
        per_arm: dict[str, list[float]] = {name: [] for name in rates}
        for _ in range(args.repeats):
            for name in LLAMA_CPP_ARMS:
                per_arm[name].append(llama_cpp_rate(name, prompt, args))
            for name, flags in EXACTSPEC_ARMS.items():
                per_arm[name].append(exactspec_rate(prompt, flags, args))
        for name, values in per_arm.items():
            rates[name].append(values)
    baseline = statistics.median(statistics.median(v) for v in rates["llama.cpp plain"])
    print(f"SmolLM2-135M-Instruct Q4_1, greedy, {args.max_new_tokens} new tokens, {args.threads} threads, "
          f"{args.prompts} prompts x {args.repeats} repetitions (medians)")
    print(f"{'arm':42s} {'tokens/s':>9s} {'vs llama.cpp plain':>19s}  (llama.cpp prompt lookup: {args.lookup_tokens} tokens)")
    for name, per_prompt in rates.items():
        rate = statistics.median(statistics.median(v) for v in per_prompt)
        print(f"{name:42s} {rate:9.1f} {rate / baseline:19.2f}")


if __name__ == "__main__":
    main()
