"""``exactspec certify``: a statistical test that the pair's output follows the target's law."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactspec.cli.common import (
    CliError,
    add_model_arguments,
    integer,
    list_of,
    one_of,
    read_prompts,
    require_ray,
    run_plan,
)
from exactspec.cli.files import check_record_path, prepare_output_dir, write_after, write_record_file
from exactspec.decoding.block import RULES


def run(args: argparse.Namespace) -> dict:
    from exactspec.certification.certify import CertifyConfig, certify
    from exactspec.certification.report import write_certify_outputs

    prepare_output_dir(Path(args.output_dir), "--output-dir")
    check_record_path(args.record)
    if args.ray is not None:
        require_ray()
    try:
        config = CertifyConfig(
            configs=args.configs,
            sequences=args.sequences,
            max_tokens=args.max_tokens,
            gamma=args.gamma,
            alpha=args.alpha,
            seed=args.seed,
            slots=args.slots,
            self_check=args.self_check,
            mutants=args.mutants,
            verify=args.verify,
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    plan = run_plan(args)
    pair = plan.load()
    prompts = read_prompts(args.prompts_file, pair.tokenizer)
    sampler = None
    if args.ray is not None:
        from exactspec.jobs.distributed import RaySampler

        sampler = RaySampler(plan.spec, prompts, config, args.ray or None, args.workers)
    try:
        report = certify(pair, prompts, config, progress=not args.json, sampler=sampler)
    except ValueError as error:
        raise CliError(str(error)) from None
    finally:
        if sampler is not None:
            sampler.close()
    report["outputs"] = [
        str(p)
        for p in write_after(
            "--output-dir", args.output_dir, lambda: write_certify_outputs(report, args.output_dir), report
        )
    ]
    for c in report["per_config"].values():
        c.pop("pit")
    if args.record:
        from exactspec.jobs.records import run_record

        figures = {
            key: report[key]
            for key in ("passed", "tokens", "detectable_tv", "greedy", "numerics_max_logit_difference", "seconds")
        }
        figures["self_check"] = {name: m["rejected"] for name, m in report.get("self_check", {}).items()}
        write_record_file(
            run_record(
                "certify",
                args.argv,
                *plan.dirs,
                None,
                "the pair's draft through the batch engine",
                f"fixed {args.gamma}",
                args.seed,
                report["precision"],
                figures,
                args.verify,
            ),
            args.record,
            report,
        )
    return report


def show(report: dict) -> None:
    from exactspec.certification.report import format_certify_table

    print(format_certify_table(report))
    print(f"outputs: {', '.join(report['outputs'])}")


def add(add_command) -> None:
    """The ``certify`` command: its flags, run and show."""
    certify = add_command(
        "certify",
        help=(
            "a statistical test that the pair's speculative output "
            "follows the target's sampling law, on its real vocabulary"
        ),
    )
    add_model_arguments(certify)
    from exactspec.certification.certify import CONFIGS, MUTANT_CONFIG, CertifyConfig

    defaults = CertifyConfig()
    certify.add_argument(
        "--configs",
        type=list_of(one_of(tuple(CONFIGS)), f"names from {', '.join(CONFIGS)}"),
        default=defaults.configs,
        help=(
            "comma-separated sampling configurations (default: all: "
            f"{', '.join(CONFIGS)}); greedy is always checked apart"
        ),
    )
    certify.add_argument(
        "--sequences",
        type=integer(1),
        default=defaults.sequences,
        help="continuations per configuration (prompts are cycled)",
    )
    certify.add_argument("--max-tokens", type=integer(1), default=defaults.max_tokens, help="tokens per continuation")
    certify.add_argument("--gamma", type=integer(1), default=defaults.gamma, help="draft tokens per round")
    certify.add_argument(
        "--verify",
        choices=RULES,
        default=defaults.verify,
        help="the rule for sampled drafts to certify: block (default) or token",
    )
    certify.add_argument(
        "--alpha", type=float, default=defaults.alpha, help="family-wise false-positive rate (Holm over every test)"
    )
    certify.add_argument("--seed", type=integer(0), default=defaults.seed, help="seed of the first sequence")
    certify.add_argument("--slots", type=integer(1, 256), default=defaults.slots, help="sequences sampled together")
    certify.add_argument(
        "--self-check",
        action="store_true",
        help="also run the known-wrong samplers and report whether each is rejected (the tests' power)",
    )
    certify.add_argument(
        "--mutants",
        type=list_of(one_of(tuple(MUTANT_CONFIG)), f"names from {', '.join(MUTANT_CONFIG)}"),
        default=defaults.mutants,
        help="comma-separated known-wrong samplers --self-check runs, each in its own configuration (default: all)",
    )
    certify.add_argument(
        "--prompts-file",
        help=(
            "prompts, one per line (\\n for a newline inside one); default: "
            "chat questions in the model's template, or code openings"
        ),
    )
    certify.add_argument(
        "--output-dir", default="certify_out", help="where certify.json, certify.txt and certify.png go"
    )
    certify.add_argument("--json", action="store_true", help="print the report as JSON")
    certify.add_argument(
        "--record", help="write the run record (models' hashes, mechanism, environment, verdict) to this JSON file"
    )
    certify.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="sample and score on Ray: a cluster's address, or none for a local one",
    )
    certify.add_argument(
        "--workers",
        type=integer(1),
        default=2,
        help="with --ray: sampler replicas (Ray actors), each with --slots sequences",
    )
    certify.set_defaults(run=run, show=show, dtype="float32")
