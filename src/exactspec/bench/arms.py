"""Side-by-side speed benchmark: one process, the same prompts, settings and seeds for every arm.

Arms (each decodes every prompt of a workload, ``max_new_tokens`` tokens, EOS ignored):

* ``plain``: plain decoding of the target through the same engine (the baseline);
* ``draft g=K``: speculative decoding with the draft model at fixed gamma K;
* ``adaptive``: the draft model with :class:`exactspec.decoding.policy.AdaptiveGamma`, started as
  ``generate --gamma auto`` starts it: calibrated call costs and the draft's shipped acceptance prior
  (never the per-pair cache, so that runs are comparable);
* ``lookup``: prompt-lookup drafting (no draft model), gamma ``lookup_gamma``;
* ``hf plain`` / ``hf assisted g=K``: Hugging Face ``generate`` on the same weights,
  plain and with ``assistant_model`` (constant ``num_assistant_tokens``, no
  confidence early stop, no top-k unless asked).

Arms are interleaved inside each repetition, so drift of a shared machine hits
all alike; each figure is the median over repetitions of tokens per second,
with the min-max spread. Next to the measured speedup it reports the cost
model's inputs measured on the same models (alpha: maximum-likelihood
acceptance; c: draft call over target call; verify cost: a (gamma+1)-token
target call over a 1-token one) and its prediction
``costmodel.speedup(alpha, gamma, c, verify_cost)`` (Leviathan et al. 2023, Thm 3.8).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from exactspec.bench.report import Column, add_ratios, format_rows, groups, rate_row, write_report
from exactspec.bench.workloads import WORKLOADS, workload_prompts
from exactspec.decoding import costmodel
from exactspec.decoding.decoder import SpeculativeDecoder
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma, PolicyPriors
from exactspec.decoding.sampling import GREEDY, SamplingParams
from exactspec.decoding.stats import GenerationStats, RoundRecord
from exactspec.loading import model_capacity
from exactspec.models.base import LanguageModel
from exactspec.proposers import DraftModelProposer, PromptLookupProposer
from exactspec.tokenizer import TextTokenizer
from exactspec.tuning.calibration import calibrate, measure_call_ms
from exactspec.tuning.priors import mode_key

__all__ = ["BenchConfig", "run_bench", "format_table", "write_outputs"]

MODES = {"greedy": GREEDY, "sample": SamplingParams()}


@dataclass(frozen=True)
class BenchConfig:
    workloads: tuple[str, ...] = WORKLOADS
    modes: tuple[str, ...] = ("greedy", "sample")
    gammas: tuple[int, ...] = (2, 4, 6, 8)
    lookup_gamma: int = 8
    hf_gamma: int = 4
    num_prompts: int = 6
    prompt_lines: int = 30
    max_new_tokens: int = 96
    repeats: int = 3
    seed: int = 0
    hf: bool = True

    def __post_init__(self) -> None:
        if not self.gammas or min(self.gammas) < 1:
            raise ValueError(f"gammas must be integers >= 1, got {self.gammas}")
        for name in ("num_prompts", "prompt_lines", "max_new_tokens", "repeats", "lookup_gamma", "hf_gamma"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.seed <= 2**64 - 1 - self.num_prompts:
            raise ValueError(f"seed must be in [0, 2^64 - 1 - prompts] (prompt i uses seed + i), got {self.seed}")
        unknown = set(self.workloads) - set(WORKLOADS) or set(self.modes) - set(MODES)
        if unknown:
            raise ValueError(f"unknown workload or mode: {', '.join(sorted(unknown))}")


# An arm decodes one prompt: (prompt ids, seed) -> (generated token count, the engine's rounds after the
# prefill or None, seconds spent in the prefill or None). Engine arms report their prefill separately.
Arm = Callable[[list[int], int], tuple[int, list[RoundRecord] | None, float | None]]


@dataclass
class ArmRecord:
    name: str
    gamma: int | None
    tokens_per_second: list[float] = field(default_factory=list)  # end to end, prefill included
    decode_tokens_per_second: list[float] = field(default_factory=list)  # prefill excluded (engine arms)
    rounds: list[RoundRecord] = field(default_factory=list)  # every round after the prefill, all repetitions

    def totals(self) -> tuple[int, int, int, float, float]:
        """drafted, accepted, committed tokens; per-step draft seconds (one-off setup excluded), target seconds."""
        r = self.rounds
        return (
            sum(x.drafted for x in r),
            sum(x.accepted for x in r),
            sum(x.committed for x in r),
            sum(x.draft_seconds - x.draft_setup_seconds for x in r),
            sum(x.target_seconds for x in r),
        )


def _engine_arm(decoder: SpeculativeDecoder, gamma: int | str, max_new_tokens: int) -> Arm:
    def run(prompt: list[int], seed: int):
        generation = decoder.generate(prompt, max_new_tokens=max_new_tokens, gamma=gamma, seed=seed)
        rounds = generation.stats.rounds
        return len(generation.tokens), rounds[1:], rounds[0].target_seconds

    return run


def _hf_arm(model, assistant, params: SamplingParams, gamma: int, max_new_tokens: int) -> Arm:
    """Hugging Face generate, configured to be exact and comparable: the same sampling law, no early stops."""
    options = dict(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens, do_sample=not params.greedy)
    if not params.greedy:
        options.update(temperature=params.temperature, top_k=params.top_k or None, top_p=params.top_p)
    if assistant is not None:
        options.update(
            assistant_model=assistant,
            num_assistant_tokens=gamma,
            num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )

    def run(prompt: list[int], seed: int):
        torch.manual_seed(seed)  # transformers samples from the global generator
        input_ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), pad_token_id=0, **options)
        return out.shape[1] - len(prompt), None, None

    return run


def _arms(
    target, draft, hf_models, params: SamplingParams, config: BenchConfig, priors: PolicyPriors
) -> list[tuple[ArmRecord, Arm]]:
    n = config.max_new_tokens
    plain = SpeculativeDecoder(target, None, params)
    speculative = SpeculativeDecoder(target, draft, params)
    arms = [(ArmRecord("plain", 0), _engine_arm(plain, 0, n))]
    arms += [(ArmRecord(f"draft g={g}", g), _engine_arm(speculative, g, n)) for g in config.gammas]
    arms.append(
        (
            ArmRecord("adaptive", None),
            _engine_arm(SpeculativeDecoder(target, draft, params, AdaptiveGamma(priors=priors)), "auto", n),
        )
    )
    arms.append(
        (
            ArmRecord("lookup", config.lookup_gamma),
            _engine_arm(SpeculativeDecoder(target, PromptLookupProposer(), params), config.lookup_gamma, n),
        )
    )
    if hf_models is not None:
        hf_target, hf_draft = hf_models
        arms.append((ArmRecord("hf plain", None), _hf_arm(hf_target, None, params, 0, n)))
        arms.append(
            (
                ArmRecord(f"hf assisted g={config.hf_gamma}", None),
                _hf_arm(hf_target, hf_draft, params, config.hf_gamma, n),
            )
        )
    return arms


def _summarise(mode: str, workload: str, records: list[ArmRecord], hf_assisted: str) -> list[dict]:
    """Per arm: speed, acceptance, and the cost model's prediction from costs measured inside the loop.

    c is the mean time of one draft step over the mean time of plain decoding's one-token target
    call, and the verify cost the mean time of this arm's target calls over that same call, all
    measured in the decoding runs themselves, so measured / predicted isolates the engine's own
    overhead (proposing, verifying, bookkeeping) from the cost of the models.
    """
    plain = records[0]
    decode_baseline = statistics.median(plain.decode_tokens_per_second)
    plain_target_s = plain.totals()[4] / len(plain.rounds)
    rows = []
    for record in records:
        drafted, accepted, committed, draft_s, target_s = record.totals()
        rounds = len(record.rounds)
        alpha = costmodel.estimate_alpha((r.drafted, r.accepted) for r in record.rounds) if drafted else None
        cost_ratio = draft_s / drafted / plain_target_s if drafted else None
        verify_cost = target_s / rounds / plain_target_s if rounds else None
        predicted = None
        if alpha is not None and record.gamma and record.name.startswith("draft"):
            predicted = costmodel.speedup(alpha, record.gamma, cost_ratio, verify_cost)
        decode_speedup = (
            statistics.median(record.decode_tokens_per_second) / decode_baseline
            if record.decode_tokens_per_second
            else None
        )
        rows.append(
            rate_row(
                mode,
                workload,
                record.name,
                record.tokens_per_second,
                gamma=record.gamma,
                repeats=len(record.tokens_per_second),
                decode_speedup=decode_speedup,
                alpha=alpha,
                tokens_per_round=committed / rounds if rounds else None,
                acceptance_by_position=GenerationStats(record.rounds).acceptance_by_position(),
                mean_gamma=drafted / rounds if rounds else None,
                cost_ratio_in_loop=cost_ratio,
                verify_cost_in_loop=verify_cost,
                predicted_speedup=predicted,
                efficiency=decode_speedup / predicted if predicted else None,
            )
        )
    add_ratios(rows, "speedup", "plain")
    add_ratios(rows, "vs_hf_assisted", hf_assisted)
    return rows


def run_bench(
    target: LanguageModel,
    draft: LanguageModel,
    tokenizer: TextTokenizer,
    config: BenchConfig,
    hf_models=None,
    progress: bool = True,
    acceptance_priors: dict[str, tuple[float, ...]] | None = None,  # mode key -> the draft's shipped prior
) -> dict:
    """Run every (workload, mode, arm) ``config.repeats`` times; returns a JSON-ready report."""
    from tqdm import tqdm

    capacity = model_capacity(target) or 4096
    keep = min(
        768, capacity - config.max_new_tokens - max(*config.gammas, config.lookup_gamma) - 2
    )  # prompt tokens kept
    prompts = {
        w: [
            tokenizer.encode_prompt(text)[-keep:]
            for text in workload_prompts(w, config.num_prompts, config.prompt_lines)
        ]
        for w in config.workloads
    }
    context = prompts[config.workloads[0]][0]
    target_ms = measure_call_ms(target, context, 1)
    draft_ms = measure_call_ms(draft, context, 1)
    # verify_costs[g]: a call on g + 1 tokens over a call on 1 token
    verify_costs = [
        measure_call_ms(target, context, g + 1) / target_ms for g in range(max(*config.gammas, config.lookup_gamma) + 1)
    ]
    call_ms = {"target": target_ms, "draft": draft_ms}  # on the backend the arms use
    if hf_models is not None:  # the per-call overhead the lean backend saves
        from exactspec.models.hf import HFModel

        call_ms["hf target"], call_ms["hf draft"] = (measure_call_ms(HFModel(m), context, 1) for m in hf_models)
    arms_per_run = 3 + len(config.gammas) + (2 if hf_models else 0)
    bar = tqdm(
        total=len(config.workloads) * len(config.modes) * config.repeats * arms_per_run,
        desc="bench",
        disable=not progress,
    )
    results, interrupted = [], False
    try:
        for mode in config.modes:
            # the adaptive arm starts as `generate --gamma auto` does: calibrated costs and the draft's shipped prior
            calibration = calibrate(
                target, DraftModelProposer(draft), context[:64], AdaptiveConfig().max_gamma, params=MODES[mode]
            )
            acceptance = (acceptance_priors or {}).get(mode_key(MODES[mode]), ())
            priors = PolicyPriors(calibration.target_ms, calibration.draft_step_ms, acceptance)
            for workload in config.workloads:
                arms = _arms(target, draft, hf_models, MODES[mode], config, priors)
                try:
                    _run_arms(arms, prompts[workload][:1], config.seed, warmup=True)
                    for _ in range(config.repeats):
                        for arm in arms:
                            _run_arm(arm, prompts[workload], config.seed)
                            bar.update()
                finally:  # also on Ctrl-C: keep every arm with at least one finished repetition
                    finished = [record for record, _ in arms if record.tokens_per_second]
                    if finished and finished[0].name == "plain":
                        results += _summarise(mode, workload, finished, f"hf assisted g={config.hf_gamma}")
    except KeyboardInterrupt:
        interrupted = True
    bar.close()
    return {
        "config": asdict(config),
        "interrupted": interrupted,
        "target_ms": target_ms,
        "draft_ms": draft_ms,
        "cost_ratio": draft_ms / target_ms,
        "verify_cost": verify_costs,
        "call_ms": call_ms,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "results": results,
    }


def _run_arms(arms: list[tuple[ArmRecord, Arm]], prompts: list[list[int]], seed: int, warmup: bool = False) -> None:
    for arm in arms:
        _run_arm(arm, prompts, seed, warmup)


def _run_arm(arm: tuple[ArmRecord, Arm], prompts: list[list[int]], seed: int, warmup: bool = False) -> None:
    """One repetition of one arm over the prompts; the record changes only once it is complete."""
    record, run = arm
    tokens, seconds, prefill_seconds, rounds = 0, 0.0, 0.0, []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        count, arm_rounds, prefill = run(prompt, seed + i)
        seconds += time.perf_counter() - start
        tokens += count
        if arm_rounds is not None:
            rounds += arm_rounds
            prefill_seconds += prefill
    if warmup:
        return
    record.rounds += rounds
    record.tokens_per_second.append(tokens / seconds)
    if rounds:  # the first token comes from the prefill: decode rate counts the rest
        record.decode_tokens_per_second.append((tokens - len(prompts)) / (seconds - prefill_seconds))


COLUMNS = (
    Column("arm", "arm", "s", 18),
    Column("tok/s", "tokens_per_second", ".1f"),
    Column("min-max", "spread", "spread", 10),
    Column("speedup", "speedup", suffix="x", width=9),
    Column("decode", "decode_speedup", suffix="x"),
    Column("vs HF", "vs_hf_assisted", suffix="x", width=7),
    Column("alpha", "alpha", ".3f", 7),
    Column("tok/rnd", "tokens_per_round"),
    Column("c", "cost_ratio_in_loop", ".3f", 7),
    Column("verify", "verify_cost_in_loop", width=7),
    Column("pred", "predicted_speedup", suffix="x", width=7),
    Column("meas/pred", "efficiency", width=10),
)


def format_table(report: dict) -> str:
    header = [
        (
            f"target call {report['target_ms']:.2f} ms, draft call {report['draft_ms']:.2f} ms, c "
            f"= {report['cost_ratio']:.3f}; verify cost (gamma: cost of gamma+1 tokens over 1) "
        )
        + ", ".join(f"{g}: {v:.2f}" for g, v in enumerate(report["verify_cost"]) if g),
        "one-token call, ms: " + ", ".join(f"{name} {ms:.2f}" for name, ms in report["call_ms"].items()),
    ]
    wanted = report["config"]["repeats"]
    notes = {
        key: f" (interrupted after {group[0]['repeats']} of {wanted} repetitions)"
        for key, group in groups(report["results"]).items()
        if group[0]["repeats"] < wanted
    }
    return format_rows(header, report["results"], COLUMNS, notes)


def _plot_speedup(rows: list[dict], path: Path, plt) -> None:
    """Measured speedup (decoding alone, and with the prefill) and the cost model's prediction against gamma."""
    grouped = groups(rows)
    figure, axes = plt.subplots(1, len(grouped), figsize=(4.2 * len(grouped), 3.4), squeeze=False)
    for axis, ((mode, workload), group) in zip(axes[0], grouped.items()):
        draft_rows = [r for r in group if r["arm"].startswith("draft")]
        if not draft_rows:  # an interrupted run may have none
            continue
        gammas = [r["gamma"] for r in draft_rows]
        axis.plot(gammas, [r["decode_speedup"] for r in draft_rows], "o-", label="measured, decoding")
        axis.plot(gammas, [r["speedup"] for r in draft_rows], "o:", label="measured, with prefill")
        axis.plot(
            gammas, [r["predicted_speedup"] for r in draft_rows], "s--", label="cost model (measured alpha, c, verify)"
        )
        for row in group:
            if not row["arm"].startswith("draft") and row["arm"] != "plain":
                axis.axhline(row["speedup"], linestyle=":", linewidth=1, color="grey")
                axis.annotate(row["arm"], (max(gammas), row["speedup"]), fontsize=7, ha="right", va="bottom")
        axis.axhline(1.0, color="black", linewidth=0.8)
        axis.set(title=f"{workload} / {mode}", xlabel="gamma", ylabel="speedup over plain")
        axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def _plot_acceptance(rows: list[dict], path: Path, plt) -> None:
    """Acceptance by draft position of the longest fixed-gamma arm."""
    grouped = groups(rows)
    figure, axes = plt.subplots(1, len(grouped), figsize=(4.2 * len(grouped), 3.0), squeeze=False)
    for axis, ((mode, workload), group) in zip(axes[0], grouped.items()):
        row = max((r for r in group if r["arm"].startswith("draft")), key=lambda r: r["gamma"], default=None)
        if row is None:
            continue
        axis.bar(range(1, len(row["acceptance_by_position"]) + 1), row["acceptance_by_position"])
        axis.set(
            title=f"{workload} / {mode} ({row['arm']})",
            xlabel="draft position",
            ylabel="P(accepted | reached)",
            ylim=(0, 1),
        )
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_outputs(report: dict, directory: str | Path) -> list[Path]:
    """report.json, report.txt, report.png (tokens/s per arm), speedup.png and acceptance.png."""
    return write_report(
        report, directory, "report", format_table(report), {"speedup": _plot_speedup, "acceptance": _plot_acceptance}
    )
