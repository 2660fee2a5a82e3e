"""A one-off measurement, not part of the package: end-to-end tokens/s of exactspec generate on SmolLM2-135M-Instruct
(the shipped Q4_1 file), ONNX Runtime with int8 activations plain and speculative, against llama.cpp plain.

Every run is its own process (`exactspec generate ... --json`, its tokens/s counts the decoding, not the loading);
the arms are interleaved: each repetition runs every arm once per prompt and setting, in turn.

    python docs/experiments/onnx_speculation.py --reps 2 [--arms plain,auto,g2,g3,llamacpp] [--tokens 128]
"""

import argparse
import json
import statistics
import subprocess
import sys

PROMPTS = (
    "Explain how a hash map works, with an example in Python.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main causes of inflation, and how do central banks respond?",
)
ONNX = ("--backend", "onnx", "--int8-activations")
ARMS = {
    "plain": (*ONNX, "--no-speculation"),
    "auto": ONNX,
    "g2": (*ONNX, "--gamma", "2"),
    "g3": (*ONNX, "--gamma", "3"),
    "lookup": (*ONNX, "--draft", "lookup", "--gamma", "auto"),
    "llamacpp": ("--backend", "llamacpp", "--no-speculation"),
}
SETTINGS = {"greedy": ("--temperature", "0"), "T=1": ("--temperature", "1", "--seed", "7")}


def run(arm: str, setting: str, prompt: str, tokens: int, threads: int) -> dict:
    command = [sys.executable, "-m", "exactspec", "generate", "--target", "smollm2", "--user", prompt, "--json"]
    command += ["--max-new-tokens", str(tokens), "--ignore-eos", "--threads", str(threads), "--no-policy-cache"]
    out = subprocess.run([*command, *ARMS[arm], *SETTINGS[setting]], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--arms", default="plain,auto,g2,g3,llamacpp")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    arms = args.arms.split(",")
    rates = {(a, s, p): [] for a in arms for s in SETTINGS for p in range(len(PROMPTS))}
    extra = {}
    for rep in range(args.reps):
        for setting in SETTINGS:
            for p, prompt in enumerate(PROMPTS):
                for arm in arms:
                    result = run(arm, setting, prompt, args.tokens, args.threads)
                    rates[(arm, setting, p)].append(result["tokens_per_second"])
                    extra[(arm, setting, p)] = (result["tokens_per_round"], result["acceptance_rate"])
                    print(rep, setting, p, arm, f"{result['tokens_per_second']:.1f} tok/s", flush=True)
    print(f"\nmedian tokens/s over {args.reps} runs (tokens per target call, acceptance) per prompt")
    for setting in SETTINGS:
        for arm in arms:
            cells = []
            for p in range(len(PROMPTS)):
                tpr, acc = extra[(arm, setting, p)]
                base = statistics.median(rates[(arms[0], setting, p)])
                rate = statistics.median(rates[(arm, setting, p)])
                cells.append(f"{rate:.1f} ({rate / base:.2f}x; {tpr:.2f}, {acc:.2f})")
            print(f"{setting:7s} {arm:9s} " + " | ".join(cells))


if __name__ == "__main__":
    main()
