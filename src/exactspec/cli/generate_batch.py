"""``exactspec generate-batch``: JSONL requests in, JSONL results out, resumable, locally or on Ray."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactspec.cli.common import (
    CliError,
    add_model_arguments,
    integer,
    require_ray,
    run_plan,
)
from exactspec.cli.files import check_record_path
from exactspec.decoding.block import RULES


def run(args: argparse.Namespace) -> dict:
    from exactspec.jobs import batch
    from exactspec.jobs.records import run_record

    output = Path(args.output)
    check_record_path(str(output), "--output")
    if args.ray is not None:
        require_ray()
    try:
        config = batch.BatchJobConfig(
            args.max_tokens,
            max_tokens_limit=max(args.max_tokens, 4096),
            seed=args.seed,
            gamma=args.gamma,
            slots=args.max_batch,
            max_len=args.max_model_len,
            verify=args.verify,
        )
        requests = batch.read_requests(Path(args.input))
    except (OSError, ValueError) as error:
        raise CliError(f"--input {args.input}: {error}") from None
    try:
        done = batch.completed_lines(output)
    except (OSError, ValueError) as error:
        raise CliError(f"--output {args.output}: {error}") from None
    if done > len(requests):
        raise CliError(
            f"{output} holds {done} results but {args.input} has {len(requests)} requests; give a new --output"
        )
    plan = run_plan(args)
    pair = plan.load()
    if pair.draft is None:
        raise CliError(
            "generate-batch drafts with a draft model or a trained feature "
            "draft: give --draft DIR (or use a target that ships one)"
        )
    try:
        for line, obj in enumerate(requests):  # every line checked before any work
            batch.parse_request(obj, line, pair.tokenizer, config)
    except ValueError as error:
        raise CliError(f"{args.input} {error}") from None
    from exactspec.models.eagle import FeatureDraft

    target_dir, draft_dir = plan.dirs
    proposal = "trained feature draft" if FeatureDraft.is_feature_draft(draft_dir) else "draft model"
    record = run_record(
        "generate-batch",
        args.argv,
        target_dir,
        draft_dir,
        None,
        proposal,
        f"fixed {args.gamma}",
        args.seed,
        plan.precision,
        {"input": str(Path(args.input).resolve())},
        args.verify,
    )
    if args.ray is None:

        def produce(remaining, first):
            return batch.generate_batch(pair, remaining, config, first)

    else:
        from exactspec.jobs.distributed import ray_results

        def produce(remaining, first):  # the plan's pair, loaded by each actor (one torch thread unless --threads)
            return ray_results(plan.spec, remaining, config, first, args.ray or None, args.workers, args.shard_size)

    try:
        return batch.run_job(requests, output, record, produce, progress=not args.json)
    except (ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None


def show(r: dict) -> None:
    print(
        f"{r['written']} results written to {r['output']} ({r['already_done']} were there "
        f"already, {r['requests']} requests); {r['tokens']} tokens; run record {r['record_id']}"
    )


def add(add_command) -> None:
    """The ``generate-batch`` command: its flags, run and show."""
    batch = add_command(
        "generate-batch",
        help="exact batch generation: JSONL requests in, JSONL results out, in order; resumable; local or on Ray",
    )
    batch.add_argument(
        "--input",
        required=True,
        help="one JSON request per line: prompt or messages, and optionally id, max_tokens, seed and sampling fields",
    )
    batch.add_argument(
        "--output",
        required=True,
        help="results, one JSON line per request in input order; a rerun appends what is missing",
    )
    add_model_arguments(batch)
    batch.add_argument("--max-tokens", type=integer(1), default=128, help="max_tokens of a request that gives none")
    batch.add_argument(
        "--seed", type=integer(0), default=0, help="a request without a seed uses this plus its line number"
    )
    batch.add_argument("--gamma", type=integer(1), default=4, help="draft tokens per round")
    batch.add_argument(
        "--verify",
        choices=RULES,
        default="block",
        help="verification of sampled drafts of a request that names none: block (default) or token",
    )
    batch.add_argument("--max-batch", type=integer(1, 256), default=16, help="sequences decoded together (per worker)")
    batch.add_argument(
        "--max-model-len", type=integer(16), default=2048, help="prompt + completion tokens per sequence"
    )
    batch.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on Ray: a cluster's address, or none for a local one",
    )
    batch.add_argument("--workers", type=integer(1), default=2, help="with --ray: engine replicas (Ray actors)")
    batch.add_argument("--shard-size", type=integer(1), default=32, help="with --ray: requests per task")
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")
    batch.set_defaults(run=run, show=show, dtype="float32")
