"""Cold start: `exactspec generate` with the default `--gamma auto` against fixed gammas, one fresh process per run.

Every run is its own `exactspec generate --json` process, as the CLI is used, so
each starts with nothing learned. Arms are interleaved per prompt and
repetition; a prompt's figure for an arm is the median tokens/s over
repetitions (the generate summary's rate: prompt processing included, model
loading and calibration excluded). For each prompt the best fixed gamma is
chosen in hindsight; the report gives auto over that best, per prompt and the
median over prompts, for each sampling mode.

    python -m exactspec.bench.cold_start                          # the default: code + heldout, greedy and T=1
    python -m exactspec.bench.cold_start --prompts 2 --repeats 1  # a quick look
    python -m exactspec.bench.cold_start --extra=--no-policy-cache  # first run on a machine: shipped priors only
    # a useless draft D: auto vs plain
    python -m exactspec.bench.cold_start --gammas plain --extra=--target=T --extra=--draft=D

Run it with nothing else busy on the machine; it states threads and dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from exactspec.bench.workloads import workload_prompts

MODES = {"greedy": ["--temperature", "0"], "sample": ["--temperature", "1"]}


def run_generate(prompt: str, arm: str, mode: str, seed: int, args: argparse.Namespace) -> dict:
    choice = ["--no-speculation"] if arm == "plain" else ["--gamma", arm]
    command = [
        sys.executable,
        "-m",
        "exactspec",
        "generate",
        prompt,
        "--json",
        "--ignore-eos",
        *choice,
        "--max-new-tokens",
        str(args.max_new_tokens),
        "--seed",
        str(seed),
        *MODES[mode],
        *args.extra,
    ]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"generate failed: {done.stderr.strip()}")
    return json.loads(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="code,heldout")
    parser.add_argument("--modes", default="greedy,sample")
    parser.add_argument("--prompts", type=int, default=3, help="prompts per workload")
    parser.add_argument("--lines", type=int, default=30, help="lines per prompt")
    parser.add_argument("--gammas", default="2,4,6,8", help="fixed gammas; 'plain' adds plain decoding as an arm")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--extra", action="append", default=[], help="an extra flag for every generate call")
    parser.add_argument("--output", help="write the raw figures as JSON here")
    args = parser.parse_args()
    prompts = [
        (w, i, text)
        for w in args.workloads.split(",")
        for i, text in enumerate(workload_prompts(w, args.prompts, args.lines))
    ]
    arms = ["auto", *args.gammas.split(",")]
    raw: dict = {}
    for mode in args.modes.split(","):
        for workload, index, text in prompts:
            for repeat in range(args.repeats):
                for arm in arms:
                    result = run_generate(text, arm, mode, repeat, args)
                    key = f"{mode}/{workload}{index}"
                    raw.setdefault(key, {}).setdefault(arm, []).append(result["tokens_per_second"])
                    if arm == "auto":
                        raw[key].setdefault("auto_gammas", []).append(result["gammas_used"])
                    print(f"{key} {arm:>4} {result['tokens_per_second']:7.1f} tok/s", file=sys.stderr)
    print(
        f"{args.max_new_tokens} new tokens per run, {args.repeats} repetitions, dtype: the "
        "default (bfloat16 where the CPU has it natively, else float32), torch threads: default"
    )
    print(f"{'mode/prompt':<18}" + "".join(f"{a:>8}" for a in arms) + f"{'best':>6}{'auto/best':>11}")
    for mode in args.modes.split(","):
        ratios = []
        for key, figures in raw.items():
            if not key.startswith(mode + "/"):
                continue
            medians = {arm: statistics.median(figures[arm]) for arm in arms}
            best = max((a for a in arms[1:] if a != "plain"), key=lambda a: medians[a], default="plain")
            ratios.append(medians["auto"] / medians[best])
            print(f"{key:<18}" + "".join(f"{medians[a]:8.1f}" for a in arms) + f"{best:>6}{ratios[-1]:11.3f}")
        print(
            f"{mode}: median auto / best fixed in hindsight = "
            f"{statistics.median(ratios):.3f} over {len(ratios)} prompts"
        )
    if args.output:
        with open(args.output, "w") as file:
            json.dump(raw, file, indent=2)


if __name__ == "__main__":
    main()
