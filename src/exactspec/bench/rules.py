"""The verification rules side by side (``exactspec bench --rules``): block against token-wise on the same drafts.

Two measurements per workload, sampled at T = 1:

* **tokens per target call from the same rounds**: every prompt generated at a fixed gamma with
  ``compare_rules``, so each sampled draft round records both rules' expected accepted length given its draft
  (:func:`exactspec.decoding.block.expected_accepted`); the ratio of the means of ``1 + E[accepted]`` is the rules'
  gain in tokens per target call, free of the noise of which tokens happened to be drawn. A one-sided lower bound
  on that ratio (paired over rounds, normal approximation, rate ``ONE_SIDED_ALPHA``) says whether the block rule
  could be worse on the workload;
* **wall clock at ``--gamma auto``**: plain and both rules, each with its own gamma policy (no policy cache), arms
  interleaved in each repetition; tokens per second, medians over repetitions, ratios in the same run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from exactspec.bench.workloads import CHAT_WORKLOADS, WORKLOADS, workload_prompts
from exactspec.loading import model_capacity
from exactspec.speculator import Speculator

__all__ = ["RulesConfig", "run_rules", "ratio_summary", "format_rules_table", "ONE_SIDED_ALPHA"]

ONE_SIDED_ALPHA = 0.01
Z_ONE_SIDED = 2.3263  # the standard normal's 0.99 quantile


@dataclass(frozen=True)
class RulesConfig:
    workloads: tuple[str, ...]
    chat: bool = False  # prompts as user turns in the model's chat template (CHAT_WORKLOADS)
    num_prompts: int = 4
    max_new_tokens: int = 96
    gamma: int = 4
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        known = tuple(CHAT_WORKLOADS) if self.chat else WORKLOADS
        if not self.workloads or set(self.workloads) - set(known):
            raise ValueError(f"workloads must be among {', '.join(known)}, got {', '.join(self.workloads)}")
        if min(self.num_prompts, self.max_new_tokens, self.gamma, self.repeats) < 1:
            raise ValueError("prompts, max_new_tokens, gamma and repeats must be >= 1")


def _prompts(speculator: Speculator, config: RulesConfig, workload: str) -> list[list[int]]:
    """The workload's prompts; a plain-text one keeps its last tokens where the target's window is short (as the
    arms bench does)."""
    tokenizer = speculator.tokenizer
    if config.chat:
        from exactspec.chat import chat_messages

        texts = CHAT_WORKLOADS[workload][: config.num_prompts]
        return [tokenizer.encode_chat(chat_messages(text)) for text in texts]
    keep = min(768, (model_capacity(speculator.pair.target) or 4096) - config.max_new_tokens - config.gamma - 2)
    return [tokenizer.encode_prompt(text)[-keep:] for text in workload_prompts(workload, config.num_prompts)]


def _expected(speculator: Speculator, prompts: list[list[int]], config: RulesConfig) -> tuple[list[float], list[float]]:
    """Both rules' expected tokens per round (``1 + E[accepted]``) over the sampled draft rounds of fixed-gamma runs
    (block running): ``(block, token)``, one entry per round."""
    block, token = [], []
    for i, prompt in enumerate(prompts):
        generation = speculator.generate(
            prompt,
            max_new_tokens=config.max_new_tokens,
            gamma=config.gamma,
            seed=config.seed + i,
            stop_at_eos=False,
            compare_rules=True,
        )
        rounds = [r for r in generation.stats.rounds if r.expected_block is not None]
        block += [1 + r.expected_block for r in rounds]
        token += [1 + r.expected_token for r in rounds]
    return block, token


def ratio_summary(block: list[float], token: list[float]) -> dict:
    """Block over token-wise tokens per round, paired over the same rounds: the ratio of the means and its one-sided
    lower bound at rate ``ONE_SIDED_ALPHA`` (normal approximation to the mean paired difference, divided by the
    token-wise mean)."""
    n = len(block)
    if n < 2:
        return {"rounds": n}
    differences = [b - t for b, t in zip(block, token)]
    mean_token = statistics.fmean(token)
    lower = statistics.fmean(differences) - Z_ONE_SIDED * statistics.stdev(differences) / math.sqrt(n)
    return {
        "rounds": n,
        "block_tokens_per_round": statistics.fmean(block),
        "token_tokens_per_round": mean_token,
        "ratio": statistics.fmean(block) / mean_token,
        "ratio_lower_bound": 1 + lower / mean_token,
    }


def _wall_clock(speculators: dict[str, Speculator], prompts: list[list[int]], config: RulesConfig) -> dict:
    """Tokens per second of plain decoding and of --gamma auto under each rule, interleaved per repetition."""
    arms = {
        "plain": ("plain", 0, "block"),
        "auto block": ("block", "auto", "block"),
        "auto token": ("token", "auto", "token"),
    }
    rates: dict[str, list[float]] = {name: [] for name in arms}
    for _ in range(config.repeats + 1):  # the first repetition warms up (calibration, caches) and is not counted
        for name, (owner, gamma, rule) in arms.items():
            tokens, began = 0, time.perf_counter()
            for i, prompt in enumerate(prompts):
                generation = speculators[owner].generate(
                    prompt,
                    max_new_tokens=config.max_new_tokens,
                    gamma=gamma,
                    seed=config.seed + i,
                    stop_at_eos=False,
                    verify=rule,
                )
                tokens += len(generation.tokens)
            rates[name].append(tokens / (time.perf_counter() - began))
    medians = {name: statistics.median(values[1:]) for name, values in rates.items()}
    return {
        "tokens_per_second": medians,
        "block_over_token": statistics.median(b / t for b, t in zip(rates["auto block"][1:], rates["auto token"][1:])),
        "block_over_plain": statistics.median(b / p for b, p in zip(rates["auto block"][1:], rates["plain"][1:])),
    }


def run_rules(speculators: dict[str, Speculator], config: RulesConfig, progress: bool = True) -> dict:
    """``speculators``: "block", "token" and "plain", over one loaded pair (their own decoders and policies). With
    several workloads, ``pooled`` summarises every workload's rounds together."""
    results, every_block, every_token = [], [], []
    for workload in config.workloads:
        prompts = _prompts(speculators["block"], config, workload)
        block, token = _expected(speculators["block"], prompts, config)
        every_block += block
        every_token += token
        row = {"workload": workload, **ratio_summary(block, token), **_wall_clock(speculators, prompts, config)}
        results.append(row)
        if progress:
            print(f"[{workload}: {row.get('ratio', float('nan')):.3f}x tokens per call]", flush=True)
    pooled = {"pooled": ratio_summary(every_block, every_token)} if len(results) > 1 else {}
    return {"rules": "block against token-wise verification", "config": config.__dict__, "results": results, **pooled}


def format_rules_table(report: dict) -> str:
    """The report as a table, under a line naming what ran it; with several workloads, a last row pools their rounds."""
    config = report["config"]

    def expectations(row: dict) -> list[str]:  # rounds, both rules' tokens per call, their ratio and its bound
        return [
            str(row["rounds"]),
            *(
                f"{row.get(key, float('nan')):.3f}"
                for key in ("token_tokens_per_round", "block_tokens_per_round", "ratio", "ratio_lower_bound")
            ),
        ]

    rows = [
        [
            r["workload"],
            *expectations(r),
            *(f"{r['tokens_per_second'][arm]:.1f}" for arm in ("plain", "auto token", "auto block")),
            f"{r['block_over_token']:.3f}",
        ]
        for r in report["results"]
    ]
    if "pooled" in report:
        rows.append(["pooled", *expectations(report["pooled"]), "", "", "", ""])
    header = [
        "workload",
        "draft rounds",
        f"token-wise tok/call (g={config['gamma']})",
        "block tok/call",
        "block/token",
        f"lower bound ({ONE_SIDED_ALPHA:g} one-sided)",
        "plain tok/s",
        "auto token tok/s",
        "auto block tok/s",
        "auto block/token",
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    ran = (
        f"T=1, {config['num_prompts']} prompts x {config['max_new_tokens']} tokens per workload, "
        f"{report.get('backend', '?')} runtime ({report.get('precision', '?')}), threads: {report.get('threads', '?')}"
    )
    return "\n".join([ran, *("  ".join(cell.rjust(w) for cell, w in zip(line, widths)) for line in [header, *rows])])
