"""``exactspec bench`` for a target without a draft model: exactspec against llama.cpp on the same GGUF file.

Arms: exactspec plain (``--no-speculation``), exactspec with prompt lookup, exactspec with a trained draft (when
one is given or shipped), llama.cpp plain and llama.cpp with prompt lookup (llama-cpp-python's
``LlamaPromptLookupDecoding``). Same chat prompts, greedy (T=0) and/or sampled (T=1, no truncation: llama.cpp's
default top-k, top-p and min-p are switched off), the same thread count, and exactly ``max_new_tokens`` new tokens in every arm (end-of-sequence
tokens are never chosen: ``--ignore-eos`` here, a -inf logit bias in llama.cpp), so that no arm's rate is a
different mix of prompt processing and decoding.

Every run is its own process (exactspec: ``exactspec generate --json``; llama.cpp: ``python -m exactspec.peers``),
so no arm's threads compete with another's (llama.cpp's workers spin while idle) and each starts as a user's
run would. A rate is new tokens over the generation's wall time, prompt processing included, loading (and
exactspec's calibration) excluded. Arms interleave inside each repetition, so drift of a shared machine hits all
alike; a prompt's figure is the median over repetitions, an arm's the median over prompts, and every arm is also
given as a ratio to llama.cpp plain measured in the same run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exactspec.chat import chat_messages
from exactspec.tokenizer import TextTokenizer

__all__ = ["CHAT_PROMPTS", "PeerBenchConfig", "run_peer_bench", "format_peer_table", "llama_cpp_available"]

CHAT_PROMPTS = (
    "Write a Python function that returns the squares of a list, with a docstring and an example.",
    "Explain how a hash table works, step by step.",
    "Rewrite this sentence three times in different styles: The quick brown fox jumps over the lazy dog.",
    "Write a short story about a robot who learns to paint.",
    "List five tips for writing clear emails, with one sentence each.",
    "What is the difference between a list and a tuple in Python? Give examples.",
)
BASELINE = "llama.cpp plain"
MODES = {"greedy": 0.0, "sample": 1.0}  # temperature


@dataclass(frozen=True)
class PeerBenchConfig:
    target: Path  # a .gguf file (llama.cpp arms) or any checkpoint exactspec loads (exactspec arms only)
    threads: int
    num_prompts: int = 3
    max_new_tokens: int = 128
    repeats: int = 3
    lookup_tokens: int = 2  # llama-cpp-python's num_pred_tokens; 2 is its advice for CPUs
    generate_flags: tuple[str, ...] = ()  # passed to every exactspec arm (--dtype, --weights, --invariant ...)
    llama_cpp: bool = True
    draft: Path | None = None  # a trained draft: one more exactspec arm
    modes: tuple[str, ...] = ("greedy",)  # greedy: T = 0; sample: T = 1, no truncation

    def __post_init__(self) -> None:
        for name in ("threads", "num_prompts", "max_new_tokens", "repeats", "lookup_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        if self.num_prompts > len(CHAT_PROMPTS):
            raise ValueError(f"--prompts: this benchmark has {len(CHAT_PROMPTS)} chat prompts, got {self.num_prompts}")


@dataclass
class PeerArm:
    name: str
    command: list[str]  # without the prompt, which goes last
    per_prompt: list[list[float]] = field(default_factory=list)  # tokens/s, one list of repetitions per prompt


def llama_cpp_available() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def _arms(config: PeerBenchConfig, mode: str) -> list[PeerArm]:
    temperature = str(MODES[mode])
    generate = [sys.executable, "-m", "exactspec", "generate", "--target", str(config.target), "--json", "--ignore-eos",
                "--temperature", temperature, "--max-new-tokens", str(config.max_new_tokens), "--threads", str(config.threads),
                *config.generate_flags]
    chat = TextTokenizer.from_path(config.target).chat_template is not None  # else the prompt is plain text
    prompt_flag = ["--user"] if chat else ["--"]
    arms = [PeerArm("exactspec plain", [*generate, "--no-speculation", *prompt_flag]),
            PeerArm("exactspec prompt lookup (auto gamma)", [*generate, "--draft", "lookup", *prompt_flag])]
    if config.draft is not None:
        arms.append(PeerArm("exactspec trained draft (auto gamma)", [*generate, "--draft", str(config.draft), *prompt_flag]))
    if config.llama_cpp:
        child = [sys.executable, "-m", "exactspec.peers", "--target", str(config.target), "--threads", str(config.threads),
                 "--max-new-tokens", str(config.max_new_tokens), "--temperature", temperature, *(["--chat"] if chat else [])]
        arms += [PeerArm(BASELINE, [*child, "--prompt"]),
                 PeerArm(f"llama.cpp prompt lookup ({config.lookup_tokens} tokens)", [*child, "--lookup-tokens", str(config.lookup_tokens), "--prompt"])]
    return arms


def _rate(arm: PeerArm, prompt: str) -> float:
    done = subprocess.run([*arm.command, prompt], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{arm.name} failed: {last}")
    try:
        return float(json.loads(done.stdout[done.stdout.index("{"):])["tokens_per_second"])
    except (ValueError, KeyError):
        raise RuntimeError(f"{arm.name} printed no tokens_per_second: {done.stdout.strip()[-200:]!r}") from None


def run_peer_bench(config: PeerBenchConfig, progress: bool = True) -> dict:
    """Run every arm on every prompt ``repeats`` times per mode, interleaved; the report of :func:`format_peer_table`."""
    prompts = CHAT_PROMPTS[: config.num_prompts]
    results = []
    for mode in config.modes:
        arms = _arms(config, mode)
        for i, prompt in enumerate(prompts):
            runs = {arm.name: [] for arm in arms}
            for r in range(config.repeats):
                for arm in arms:
                    if progress:
                        print(f"\r[{mode}, prompt {i + 1}/{len(prompts)}, repetition {r + 1}/{config.repeats}] {arm.name:45s}", end="", file=sys.stderr, flush=True)
                    runs[arm.name].append(_rate(arm, prompt))
            for arm in arms:
                arm.per_prompt.append(runs[arm.name])
        rates = {arm.name: statistics.median(statistics.median(v) for v in arm.per_prompt) for arm in arms}
        baseline = rates.get(BASELINE)
        results += [{"mode": mode, "arm": arm.name, "tokens_per_second": rates[arm.name],
                     "vs_llama_cpp_plain": rates[arm.name] / baseline if baseline else None,
                     "per_prompt": arm.per_prompt} for arm in arms]
    if progress:
        print(file=sys.stderr)
    return {"config": {**asdict(config), "target": str(config.target), "draft": config.draft and str(config.draft)}, "results": results}


def format_peer_table(report: dict) -> str:
    c = report["config"]
    lines = [f"{Path(c['target']).name}: {c['max_new_tokens']} new tokens, {c['threads']} threads, "
             f"{c['num_prompts']} chat prompts x {c['repeats']} repetitions (medians), each run its own process; greedy: T=0, sample: T=1",
             f"{'mode':7s} {'arm':45s} {'tokens/s':>9s} {'vs llama.cpp plain':>19s}"]
    for row in report["results"]:
        ratio = f"{row['vs_llama_cpp_plain']:19.2f}" if row["vs_llama_cpp_plain"] else f"{'-':>19s}"
        lines.append(f"{row['mode']:7s} {row['arm']:45s} {row['tokens_per_second']:9.1f} {ratio}")
    return "\n".join(lines)


def _llama_cpp_run(argv: list[str] | None = None) -> None:
    """One llama.cpp greedy generation (a child of :func:`run_peer_bench`); prints ``{"tokens_per_second": ...}``."""
    parser = argparse.ArgumentParser(description="one llama.cpp greedy chat generation, timed")
    parser.add_argument("--target", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--lookup-tokens", type=int, default=0, help="0: plain decoding")
    parser.add_argument("--chat", action="store_true", help="the prompt is a user turn in the file's chat template")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else plain sampling at this temperature")
    parser.add_argument("--prompt", required=True)
    args = parser.parse_args(argv)
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    lookup = {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)} if args.lookup_tokens else {}
    model = Llama(model_path=args.target, n_threads=args.threads, n_threads_batch=args.threads, n_ctx=2048, verbose=False, **lookup)
    tokenizer = TextTokenizer.from_path(args.target)
    ids = tokenizer.encode_chat(chat_messages(args.prompt)) if args.chat else tokenizer.encode_prompt(args.prompt)
    never = {token: float("-inf") for token in tokenizer.eos_token_ids}  # every arm makes max_new_tokens tokens
    start = time.perf_counter()
    sampling = {"temperature": 0.0, "top_k": 1} if args.temperature == 0 else {"temperature": args.temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    out = model.create_completion(ids, max_tokens=args.max_new_tokens, logit_bias=never, **sampling)
    if out["usage"]["completion_tokens"] != args.max_new_tokens:
        raise SystemExit(f"llama.cpp stopped after {out['usage']['completion_tokens']} of {args.max_new_tokens} tokens")
    print(json.dumps({"tokens_per_second": out["usage"]["completion_tokens"] / (time.perf_counter() - start)}))


if __name__ == "__main__":
    _llama_cpp_run()
