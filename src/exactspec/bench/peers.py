"""``exactspec bench`` for a target without a draft model: exactspec against llama.cpp on the same GGUF file.

Arms: exactspec plain (``--no-speculation``), exactspec with prompt lookup, exactspec with a trained draft (when one
is given or shipped), all three on the torch runtime unless ``--backend`` names another; exactspec as a user runs it
(``--backend auto``: the runtime this machine's measurement chose, the default drafting); the same three again on
exactspec's llama.cpp runtime (``--backend llamacpp``, when llama-cpp-python is installed: the same kernels as the
llama.cpp arms, so the difference is the method) and on its ONNX Runtime runtime with int8 activations (``--backend
onnx --int8-activations``, where ONNX Runtime can run the checkpoint), llama.cpp plain and llama.cpp with prompt
lookup (llama-cpp-python's ``LlamaPromptLookupDecoding``); llama-server (llama.cpp's own server, a newer llama.cpp
than llama-cpp-python's) plain and in each of its draft-free speculative modes
(:mod:`exactspec.bench.llama_server`), when it is installed. Same chat prompts, greedy (T=0) and/or sampled (T=1, no
truncation: llama.cpp's default top-k, top-p and min-p are switched off), the same thread count, and exactly
``max_new_tokens`` new tokens in every arm (end-of-sequence tokens are never chosen: ``--ignore-eos`` here, a -inf
logit bias in llama.cpp), so that no arm's rate is a different mix of prompt processing and decoding.

Every run is its own process (exactspec: ``exactspec generate --json``; llama.cpp: ``python -m exactspec.bench.peers``),
so no arm's threads compete with another's (llama.cpp's workers spin while idle) and each starts as a user's
run would. A rate is new tokens over the generation's wall time, prompt processing included, loading (and
exactspec's calibration) excluded. Arms interleave inside each repetition, so drift of a shared machine hits all
alike; a prompt's figure is the median over repetitions, an arm's the median over prompts, and every arm is also
given as a ratio to llama.cpp plain measured in the same run. An exactspec arm whose call costs were measured before
it ran (the cold start's calibration, or the machine measurement of ``--backend auto``) also reports ``vs model``:
what the cost model predicts for the rounds it ran, from those costs, over its wall time (the median over runs;
below 1 is the loop's own time beyond the modelled calls).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from exactspec.bench.llama_server import (
    DRAFT_FREE_MODES,
    DRAFT_MODES,
    LlamaServerConfig,
    llama_server_version,
    repack_works,
)
from exactspec.bench.report import Column, add_ratios, format_rows, groups, rate_row, write_report
from exactspec.bench.workloads import CHAT_WORKLOADS
from exactspec.chat import chat_messages
from exactspec.models.llamacpp import llama_cpp_available, llama_cpp_version
from exactspec.models.llamacpp_tiles import survives
from exactspec.models.onnx_runtime import checkpoint_unsupported
from exactspec.tokenizer import TextTokenizer

__all__ = ["PeerBenchConfig", "run_peer_bench", "format_peer_table", "llama_cpp_available", "write_peer_outputs"]

BASELINE = "llama.cpp plain"
EXACTSPEC_PLAIN = "exactspec plain"
DEFAULT_ARM = "exactspec default (--backend auto, shipped draft or lookup)"
HF_ASSISTED_SKIPPED = (
    "transformers' assisted generation takes a standalone draft model; exactspec's trained draft reads the "
    "target's hidden states, and no standalone model shares SmolLM2's tokenizer offline"
)
MODES = {"greedy": 0.0, "sample": 1.0}  # temperature
#: The arms by group, for --arms: exactspec on the torch runtime (plain, lookup, the draft), exactspec's default,
#: exactspec on its llama.cpp runtime (plain, lookup, the draft), llama.cpp itself (plain, lookup), llama-server
#: (plain and its speculative modes).
ARM_GROUPS = ("torch", "default", "llamacpp-runtime", "onnx-runtime", "llama.cpp", "llama-server")
#: With an exported draft (--llama-server-draft) and the same draft as exactspec's (--draft), both tools draft this many
#: tokens a round from it (llama-server's default length), and the report sets their tokens per target call side by
#: side.
CROSS_CHECK_GAMMA = 3
CROSS_CHECK_ARM = f"exactspec trained draft (llama.cpp runtime, gamma {CROSS_CHECK_GAMMA}, no lookup)"


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
    workloads: tuple[str, ...] = ("chat",)  # keys of CHAT_WORKLOADS; num_prompts of each
    arm_groups: tuple[str, ...] = ARM_GROUPS  # which arms run
    llama_server: Path | None = None  # llama-server's binary: its arms run when given (and a .gguf target)
    llama_server_modes: tuple[str, ...] = DRAFT_FREE_MODES  # plain and its speculative modes without a draft model
    llama_server_draft: Path | None = None  # an EAGLE-3 GGUF draft: the draft-eagle3 arms run when given

    def __post_init__(self) -> None:
        for name in ("threads", "num_prompts", "max_new_tokens", "repeats", "lookup_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not self.modes or set(self.modes) - set(MODES):
            raise ValueError(f"modes must be among {', '.join(MODES)}, got {self.modes}")
        if not self.workloads or set(self.workloads) - set(CHAT_WORKLOADS):
            raise ValueError(
                "--workloads: against llama.cpp the workloads are "
                f"{', '.join(CHAT_WORKLOADS)}, got {', '.join(self.workloads)}"
            )
        if not self.arm_groups or set(self.arm_groups) - set(ARM_GROUPS):
            raise ValueError(f"--arms must be among {', '.join(ARM_GROUPS)}, got {', '.join(self.arm_groups)}")
        if not self.llama_server_modes or set(self.llama_server_modes) - set(DRAFT_FREE_MODES):
            raise ValueError(
                f"llama-server modes must be among {', '.join(DRAFT_FREE_MODES)}, "
                f"got {', '.join(self.llama_server_modes)}"
            )
        fewest = min(len(CHAT_WORKLOADS[w]) for w in self.workloads)
        if self.num_prompts > fewest:
            raise ValueError(f"--prompts: these workloads have {fewest} prompts each at most, got {self.num_prompts}")


@dataclass
class PeerArm:
    name: str
    command: list[str]  # without the prompt, which goes last
    group: str  # one of ARM_GROUPS
    per_prompt: list[list[float]] = field(default_factory=list)  # tokens/s, one list of repetitions per prompt
    tokens_per_call: list[float] = field(default_factory=list)  # exactspec arms: new tokens per target call, every run
    efficiency: list[float] = field(default_factory=list)  # exactspec arms with measured costs: cost model / wall time


def _arms(config: PeerBenchConfig, mode: str, llama_cpp_flags: Sequence[str] = ()) -> list[PeerArm]:
    temperature = str(MODES[mode])
    defaults = [
        sys.executable,
        "-m",
        "exactspec",
        "generate",
        "--target",
        str(config.target),
        "--json",
        "--ignore-eos",
        "--temperature",
        temperature,
        "--max-new-tokens",
        str(config.max_new_tokens),
        "--threads",
        str(config.threads),
    ]
    generate = [*defaults, *config.generate_flags]
    chat = TextTokenizer.from_path(config.target).chat_template is not None  # else the prompt is plain text
    prompt_flag = ["--user"] if chat else ["--"]
    arms = [
        PeerArm(EXACTSPEC_PLAIN, [*generate, "--no-speculation", *prompt_flag], "torch"),
        PeerArm("exactspec prompt lookup (auto gamma)", [*generate, "--draft", "lookup", *prompt_flag], "torch"),
    ]
    if config.draft is not None:
        arms.append(
            PeerArm(
                "exactspec trained draft + lookup (auto gamma)",
                [*generate, "--draft", str(config.draft), *prompt_flag],
                "torch",
            )
        )
    arms.append(
        PeerArm(DEFAULT_ARM, [*defaults, *prompt_flag], "default")
    )  # what a user's run gets: --backend auto, the shipped draft
    if (
        config.llama_cpp and "--invariant" not in config.generate_flags
    ):  # the same file on exactspec's llama.cpp runtime
        on_llama = [*generate, "--backend", "llamacpp"]
        arms += _runtime_arms(on_llama, prompt_flag, config.draft, "llama.cpp runtime", "llamacpp-runtime")
        if (
            config.draft is not None and config.llama_server_draft is not None
        ):  # the cross-check's partner of draft-eagle3
            arms.append(
                PeerArm(
                    CROSS_CHECK_ARM,
                    [
                        *on_llama,
                        "--draft",
                        str(config.draft),
                        "--gamma",
                        str(CROSS_CHECK_GAMMA),
                        "--no-lookup-routing",
                        *prompt_flag,
                    ],
                    "llamacpp-runtime",
                )
            )
    if "--invariant" not in config.generate_flags and checkpoint_unsupported(config.target) is None:
        # the file on exactspec's ONNX Runtime runtime, int8 activations (its fast form; the record names it)
        on_onnx = [*generate, "--backend", "onnx", "--int8-activations"]
        arms += _runtime_arms(on_onnx, prompt_flag, config.draft, "ONNX Runtime, int8 activations", "onnx-runtime")
    if config.llama_cpp:
        child = [
            sys.executable,
            "-m",
            "exactspec.bench.peers",
            "--target",
            str(config.target),
            "--threads",
            str(config.threads),
            "--max-new-tokens",
            str(config.max_new_tokens),
            "--temperature",
            temperature,
            *(["--chat"] if chat else []),
            *llama_cpp_flags,
        ]
        arms += [
            PeerArm(BASELINE, [*child, "--prompt"], "llama.cpp"),
            PeerArm(
                f"llama.cpp prompt lookup ({config.lookup_tokens} tokens)",
                [*child, "--lookup-tokens", str(config.lookup_tokens), "--prompt"],
                "llama.cpp",
            ),
        ]
    if config.llama_server is not None:
        server = [
            sys.executable,
            "-m",
            "exactspec.bench.llama_server",
            "--binary",
            str(config.llama_server),
            "--target",
            str(config.target),
            "--threads",
            str(config.threads),
            "--max-new-tokens",
            str(config.max_new_tokens),
            "--temperature",
            temperature,
            *(["--chat"] if chat else []),
        ]
        arms += [
            PeerArm(f"llama-server {mode}", [*server, "--mode", mode, "--prompt"], "llama-server")
            for mode in config.llama_server_modes
        ]
        if config.llama_server_draft is not None:
            arms += [
                PeerArm(
                    f"llama-server {mode} ({config.llama_server_draft.name}, {CROSS_CHECK_GAMMA} drafted)",
                    [
                        *server,
                        "--mode",
                        mode,
                        "--draft-model",
                        str(config.llama_server_draft),
                        "--draft-tokens",
                        str(CROSS_CHECK_GAMMA),
                        "--prompt",
                    ],
                    "llama-server",
                )
                for mode in DRAFT_MODES
            ]
    return [arm for arm in arms if arm.group in config.arm_groups]


def _runtime_arms(
    generate: list[str], prompt_flag: list[str], draft: Path | None, runtime: str, group: str
) -> list[PeerArm]:
    """exactspec plain, with prompt lookup and with the trained draft (when given) on one named runtime."""
    arms = [
        PeerArm(f"{EXACTSPEC_PLAIN} ({runtime})", [*generate, "--no-speculation", *prompt_flag], group),
        PeerArm(
            f"exactspec prompt lookup ({runtime}, auto gamma)", [*generate, "--draft", "lookup", *prompt_flag], group
        ),
    ]
    if draft is not None:
        arms.append(
            PeerArm(
                f"exactspec trained draft + lookup ({runtime}, auto gamma)",
                [*generate, "--draft", str(draft), *prompt_flag],
                group,
            )
        )
    return arms


def llama_cpp_alone_survives(config: PeerBenchConfig) -> bool:
    """Whether llama.cpp alone, as the llama.cpp arms run it, survives a short generation with its extra weight buffers
    (its AMX kernels die in a GCC 12 build: docs/runtimes.md). Where it is killed, those arms run without them, as
    a user of that build would have to, and the report says so."""
    command = [
        sys.executable,
        "-m",
        "exactspec.bench.peers",
        "--target",
        str(config.target),
        "--threads",
        str(config.threads),
        "--max-new-tokens",
        "4",
        "--prompt",
        "Say hello in three languages.",
    ]
    return survives(command) is not False


def _run(arm: PeerArm, prompt: str) -> dict:
    """One run of ``arm`` on ``prompt``: its JSON result (tokens_per_second, and tokens_per_round for exactspec)."""
    done = subprocess.run([*arm.command, prompt], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise RuntimeError(f"{arm.name} failed: {last}")
    try:
        result = json.loads(done.stdout[done.stdout.index("{") :])
        float(result["tokens_per_second"])
        return result
    except (ValueError, KeyError):
        raise RuntimeError(f"{arm.name} printed no tokens_per_second: {done.stdout.strip()[-200:]!r}") from None


def run_peer_bench(config: PeerBenchConfig, progress: bool = True) -> dict:
    """Run every arm on every prompt ``repeats`` times per mode and workload, interleaved; the report of
    :func:`format_peer_table`. Per arm: the median over prompts of each prompt's median over repetitions, the
    spread (lowest and highest prompt median), tokens per target call (exactspec) and ratios to llama.cpp plain
    (``vs_llama_cpp_plain``) and to exactspec plain (``speedup``) of the same run."""
    results = []
    extra_buffers = not config.llama_cpp or llama_cpp_alone_survives(config)
    for mode in config.modes:
        for workload in config.workloads:
            arms = _arms(config, mode, [] if extra_buffers else ["--no-extra-buffers"])
            prompts = CHAT_WORKLOADS[workload][: config.num_prompts]
            for i, prompt in enumerate(prompts):
                runs = {arm.name: [] for arm in arms}
                for r in range(config.repeats):
                    for arm in arms:
                        if progress:
                            print(
                                (
                                    f"\r[{mode}, {workload} {i + 1}/{len(prompts)}, "
                                    f"repetition {r + 1}/{config.repeats}] {arm.name:48s}"
                                ),
                                end="",
                                file=sys.stderr,
                                flush=True,
                            )
                        result = _run(arm, prompt)
                        runs[arm.name].append(float(result["tokens_per_second"]))
                        if "tokens_per_round" in result:
                            arm.tokens_per_call.append(float(result["tokens_per_round"]))
                        if result.get("cost_model"):
                            arm.efficiency.append(float(result["cost_model"]["efficiency"]))
                for arm in arms:
                    arm.per_prompt.append(runs[arm.name])
            rows = [
                rate_row(
                    mode,
                    workload,
                    arm.name,
                    [statistics.median(v) for v in arm.per_prompt],
                    tokens_per_call=statistics.mean(arm.tokens_per_call) if arm.tokens_per_call else None,
                    vs_cost_model=statistics.median(arm.efficiency) if arm.efficiency else None,
                    per_prompt=arm.per_prompt,
                )
                for arm in arms
            ]
            add_ratios(rows, "speedup", EXACTSPEC_PLAIN)
            add_ratios(rows, "vs_llama_cpp_plain", BASELINE)
            results += rows
    if progress:
        print(file=sys.stderr)
    build = {**llama_cpp_version(), "extra_buffers": extra_buffers} if config.llama_cpp else None
    server = llama_server_version(config.llama_server) if config.llama_server is not None else None
    repack = (
        repack_works(LlamaServerConfig(config.llama_server, config.target, config.threads)) if server else None
    )  # cached by its arms
    return {
        "config": {
            **asdict(config),
            "target": str(config.target),
            "draft": config.draft and str(config.draft),
            "llama_server": server and str(config.llama_server),
            "llama_server_draft": config.llama_server_draft and str(config.llama_server_draft),
        },
        "llama_cpp": build,
        "llama_server": server,
        "llama_server_repack": repack,
        "hf_assisted": HF_ASSISTED_SKIPPED,
        "results": results,
        "cross_check": cross_check(results),
    }


COLUMNS = (
    Column("arm", "arm", "s", 46),
    Column("tokens/s", "tokens_per_second", ".1f", 9),
    Column("spread", "spread", "spread", 11),
    Column("tok/call", "tokens_per_call"),
    Column("vs plain", "speedup"),
    Column("vs llama.cpp", "vs_llama_cpp_plain", width=13),
    Column("vs model", "vs_cost_model"),
)


def format_peer_table(report: dict) -> str:
    c = report["config"]
    header = [
        (
            f"{Path(c['target']).name}: {c['max_new_tokens']} new tokens, {c['threads']} threads, "
            f"{c['num_prompts']} prompts per workload x {c['repeats']} repetitions (medians; spread: "
            "lowest-highest prompt median), each run its own process; greedy: T=0, sample: T=1"
        )
    ]
    if report.get("llama_cpp"):
        header.append(f"llama-cpp-python {report['llama_cpp']['version']}: {report['llama_cpp']['system_info']}")
        if report["llama_cpp"].get("extra_buffers") is False:
            header.append(
                "llama.cpp's arms ran without its extra weight buffers: with them (its AMX kernels) this build "
                "crashed (docs/runtimes.md)"
            )
    if report.get("llama_server"):
        header.append(
            (
                f"llama-server ({report['config']['llama_server']}): "
                f"{report['llama_server']}; its own defaults for each mode"
            )
            + (
                "; --no-repack: with its repacked weights (its AMX kernels) this build crashed (docs/runtimes.md)"
                if report.get("llama_server_repack") is False
                else ""
            )
        )
    header.append(f"HF assisted generation: not run ({report.get('hf_assisted', HF_ASSISTED_SKIPPED)})")
    notes = {
        (row["mode"], row["workload"]): (
            f"\ncross-check, {CROSS_CHECK_GAMMA} drafted a round from the same draft: tokens per target call, "
            f"exactspec {row['exactspec']:.3f}, llama-server draft-eagle3 {row['llama_server']:.3f} "
            f"(ratio {row['ratio']:.3f}; {row['expect']})"
        )
        for row in cross_check(report["results"])
    }
    return format_rows(header, report["results"], COLUMNS, notes)


def cross_check(rows: list[dict]) -> list[dict]:
    """Per (mode, workload) where both ran: tokens per target call of exactspec's trained draft at fixed gamma
    (:data:`CROSS_CHECK_ARM`) and of llama-server's draft-eagle3 with the same draft exported (its argmax drafted,
    kept where the target's own sample matches). At greedy the two keep a drafted token on the same condition (the
    target's argmax equals the draft's), so equal figures check the export and both tools' accounting; at T > 0
    exactspec samples its proposals from the draft's law and verifies the block jointly, which is what it gains."""
    checks = []
    for (mode, workload), group in groups(rows).items():
        ours = next((r["tokens_per_call"] for r in group if r["arm"] == CROSS_CHECK_ARM), None)
        theirs = next(
            (r["tokens_per_call"] for r in group if r["arm"].startswith(f"llama-server {DRAFT_MODES[0]} (")), None
        )
        if ours and theirs:
            expect = (
                "equal when the export is right"
                if mode == "greedy"
                else "exactspec samples proposals and verifies the block"
            )
            checks.append(
                {
                    "mode": mode,
                    "workload": workload,
                    "exactspec": ours,
                    "llama_server": theirs,
                    "ratio": ours / theirs,
                    "expect": expect,
                }
            )
    return checks


def write_peer_outputs(report: dict, directory: str | Path) -> list[Path]:
    """peers.json, peers.txt and peers.png (tokens/s of every arm, with its spread, per mode and workload)."""
    return write_report(report, directory, "peers", format_peer_table(report))


def _llama_cpp_run(argv: list[str] | None = None) -> None:
    """One llama.cpp greedy generation (a child of :func:`run_peer_bench`); prints ``{"tokens_per_second": ...}``."""
    parser = argparse.ArgumentParser(description="one llama.cpp greedy chat generation, timed")
    parser.add_argument("--target", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument("--lookup-tokens", type=int, default=0, help="0: plain decoding")
    parser.add_argument("--chat", action="store_true", help="the prompt is a user turn in the file's chat template")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else plain sampling at this temperature"
    )
    parser.add_argument("--prompt", required=True)
    parser.add_argument(
        "--no-extra-buffers",
        action="store_true",
        help="load without llama.cpp's extra weight buffers (its AMX kernels)",
    )
    args = parser.parse_args(argv)
    import llama_cpp.llama_cpp as bindings
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if args.no_extra_buffers:  # Llama() takes no such argument: its default parameters, one field changed
        defaults = bindings.llama_model_default_params

        def without_extra_buffers():
            params = defaults()
            params.use_extra_bufts = False
            return params

        bindings.llama_model_default_params = without_extra_buffers

    lookup = (
        {"draft_model": LlamaPromptLookupDecoding(num_pred_tokens=args.lookup_tokens)} if args.lookup_tokens else {}
    )
    model = Llama(
        model_path=args.target,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        n_ctx=2048,
        verbose=False,
        **lookup,
    )
    tokenizer = TextTokenizer.from_path(args.target)
    ids = tokenizer.encode_chat(chat_messages(args.prompt)) if args.chat else tokenizer.encode_prompt(args.prompt)
    never = {token: float("-inf") for token in tokenizer.eos_token_ids}  # every arm makes max_new_tokens tokens
    start = time.perf_counter()
    sampling = (
        {"temperature": 0.0, "top_k": 1}
        if args.temperature == 0
        else {"temperature": args.temperature, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    )
    out = model.create_completion(ids, max_tokens=args.max_new_tokens, logit_bias=never, **sampling)
    if out["usage"]["completion_tokens"] != args.max_new_tokens:
        raise SystemExit(f"llama.cpp stopped after {out['usage']['completion_tokens']} of {args.max_new_tokens} tokens")
    print(json.dumps({"tokens_per_second": out["usage"]["completion_tokens"] / (time.perf_counter() - start)}))


if __name__ == "__main__":
    _llama_cpp_run()
