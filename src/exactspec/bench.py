"""Speed benchmark: plain decoding against speculative decoding, in one process, on the same prompts.

Every arm decodes the same prompts with the same sampling settings and seeds.
Arms are interleaved inside each repetition (so slow drift of a shared machine
hits all arms alike) and the reported figure is the median over repetitions of
tokens per second, with the min-max spread. Next to the measured speedup it
reports the inputs of the cost model, measured on the same models:

* alpha: maximum-likelihood acceptance rate from the arm's rounds;
* c: time of one draft call over one target call (one token each, at the prompts' length);
* verify cost: time of one target call on gamma + 1 tokens over one on 1 token;
* predicted: ``costmodel.speedup(alpha, gamma, c, verify_cost)`` (Leviathan et al. 2023, Thm 3.8,
  generalised to a verify cost above 1), and measured / predicted.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import torch

from exactspec import costmodel
from exactspec.engine import GenerationConfig, SpeculativeDecoder
from exactspec.models.base import LanguageModel
from exactspec.sampling import SamplingParams
from exactspec.stats import GenerationStats
from exactspec.tokenizer import TextTokenizer

__all__ = ["BenchConfig", "ArmResult", "held_out_prompts", "measure_call_ms", "run_bench", "format_table"]


@dataclass(frozen=True)
class BenchConfig:
    gammas: tuple[int, ...] = (2, 4, 6)
    num_prompts: int = 8
    prompt_lines: int = 30
    max_new_tokens: int = 128
    repeats: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError(f"gammas must be integers >= 1, got {self.gammas}")
        for name in ("num_prompts", "prompt_lines", "max_new_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ArmResult:
    name: str
    gamma: int
    tokens_per_second: list[float] = field(default_factory=list)  # one per repetition
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (drafted, accepted) over all runs
    tokens: int = 0
    target_calls: int = 0
    accepted_by_position: list[float] = field(default_factory=list)

    @property
    def median_tps(self) -> float:
        return statistics.median(self.tokens_per_second)

    @property
    def alpha(self) -> float | None:
        return costmodel.estimate_alpha(self.rounds) if any(d for d, _ in self.rounds) else None


def held_out_prompts(tokenizer: TextTokenizer, count: int, lines: int, max_tokens: int = 384) -> list[list[int]]:
    """Prompts cut from the standard-library modules held out of the default pair's training.

    Each prompt is ``lines`` consecutive lines ending in the middle of a file, led by BOS.
    """
    from exactspec.training.data import held_out_files, read_source

    files = [f for f in held_out_files() if "/test" not in f.as_posix()] or held_out_files()
    prompts = []
    for index in range(count):
        text_lines = read_source(files[index % len(files)]).splitlines(keepends=True)
        end = max(lines, (len(text_lines) * (index + 1)) // (count + 1))
        ids = tokenizer.encode_prompt("".join(text_lines[max(0, end - lines) : end]))
        prompts.append(ids[-max_tokens:])
    return prompts


def measure_call_ms(model: LanguageModel, context: Sequence[int], new_tokens: int, repeats: int = 30) -> float:
    """Median milliseconds of one ``forward`` of ``new_tokens`` tokens after ``context`` (cache rolled back each time)."""
    model.prefill(list(context))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.forward(list(context[-new_tokens:]))
        times.append(time.perf_counter() - start)
        model.rollback(len(context))
    return 1000 * statistics.median(times)


def _decode_all(decoder: SpeculativeDecoder, prompts, gamma: int, config: BenchConfig) -> tuple[float, list[GenerationStats]]:
    tokens, seconds, all_stats = 0, 0.0, []
    for i, prompt in enumerate(prompts):
        run = GenerationConfig(max_new_tokens=config.max_new_tokens, gamma=gamma, seed=config.seed + i)
        start = time.perf_counter()
        generation = decoder.generate(prompt, run)
        seconds += time.perf_counter() - start
        tokens += len(generation.tokens)
        all_stats.append(generation.stats)
    return tokens / seconds, all_stats


def run_bench(
    target: LanguageModel,
    draft: LanguageModel,
    prompts: list[list[int]],
    params: SamplingParams,
    config: BenchConfig,
    progress: bool = True,
) -> dict:
    """Run every arm ``config.repeats`` times over ``prompts``; returns a JSON-ready report."""
    from tqdm import tqdm

    arms = [ArmResult("plain", 0)] + [ArmResult(f"speculative g={g}", g) for g in config.gammas]
    plain, speculative = SpeculativeDecoder(target, None, params), SpeculativeDecoder(target, draft, params)
    _decode_all(speculative, prompts[:1], max(config.gammas), BenchConfig(max_new_tokens=16))  # warm-up
    bar = tqdm(total=config.repeats * len(arms), desc="bench", disable=not progress, leave=False)
    for _ in range(config.repeats):
        for arm in arms:
            tps, runs = _decode_all(plain if arm.gamma == 0 else speculative, prompts, arm.gamma, config)
            arm.tokens_per_second.append(tps)
            for stats in runs:
                arm.rounds += [(r.drafted, r.accepted) for r in stats.rounds[1:]]
                arm.tokens += stats.committed
                arm.target_calls += len(stats.rounds)
            bar.update()
    bar.close()
    context = prompts[0]
    target_ms = measure_call_ms(target, context, 1)
    draft_ms = measure_call_ms(draft, context, 1)
    cost_ratio = draft_ms / target_ms
    baseline = arms[0].median_tps
    rows = []
    for arm in arms:
        verify_cost = measure_call_ms(target, context, arm.gamma + 1) / target_ms if arm.gamma else 1.0
        alpha = arm.alpha
        predicted = costmodel.speedup(alpha, arm.gamma, cost_ratio, verify_cost) if alpha is not None else 1.0
        speedup = arm.median_tps / baseline
        by_position = [
            sum(a > i for d, a in arm.rounds if d > i) / max(1, sum(d > i for d, _ in arm.rounds)) for i in range(arm.gamma)
        ]
        rows.append(
            {
                "arm": arm.name,
                "gamma": arm.gamma,
                "tokens_per_second": arm.median_tps,
                "tps_min": min(arm.tokens_per_second),
                "tps_max": max(arm.tokens_per_second),
                "speedup": speedup,
                "alpha": alpha,
                "acceptance_by_position": by_position,
                "tokens_per_round": arm.tokens / arm.target_calls,
                "verify_cost": verify_cost,
                "predicted_speedup": predicted,
                "efficiency": speedup / predicted,
            }
        )
    return {
        "config": asdict(config),
        "sampling": {k: v for k, v in asdict(params).items() if k not in ("logit_bias",)},
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "cost_ratio": cost_ratio,
        "threads": torch.get_num_threads(),
        "arms": rows,
    }


def format_table(report: dict) -> str:
    lines = [
        f"target call {report['target_ms']:.2f} ms, draft call {report['draft_ms']:.2f} ms, c = {report['cost_ratio']:.3f}",
        f"{'arm':<18}{'tok/s':>8}{'(min-max)':>16}{'speedup':>9}{'alpha':>7}{'tok/rnd':>8}{'verify':>8}{'pred':>7}{'meas/pred':>10}",
    ]
    for row in report["arms"]:
        alpha = "-" if row["alpha"] is None else f"{row['alpha']:.3f}"
        spread = f"({row['tps_min']:.0f}-{row['tps_max']:.0f})"
        lines.append(
            f"{row['arm']:<18}{row['tokens_per_second']:>8.1f}{spread:>16}{row['speedup']:>8.2f}x{alpha:>7}"
            f"{row['tokens_per_round']:>8.2f}{row['verify_cost']:>8.2f}{row['predicted_speedup']:>6.2f}x{row['efficiency']:>10.2f}"
        )
    return "\n".join(lines)


def write_report(report: dict, path: str | Path) -> None:
    import json

    Path(path).write_text(json.dumps(report, indent=2))
