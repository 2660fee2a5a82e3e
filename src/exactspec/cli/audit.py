"""``exactspec audit``: a black-box check of a server's sampling law."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from exactspec.bench.llama_server import AUDIT_MODES, DRAFT_FREE_MODES, DRAFT_MODES
from exactspec.certification.certify import AUDIT_CONFIGS
from exactspec.cli.common import CliError, integer, json_object, list_of, one_of, read_prompts
from exactspec.cli.files import check_record_path, write_after, write_record_file
from exactspec.loading import resolve_checkpoint


def run(args: argparse.Namespace) -> dict:
    from exactspec.certification.audit import AuditConfig, audit
    from exactspec.loading import DTYPES, load_pair

    check_record_path(args.record)
    check_record_path(args.output, "--output")
    if (args.llama_server is None) == (args.endpoint is None):
        raise CliError("give either --endpoint (with --model) or --llama-server")
    if args.llama_server_draft and args.llama_server is None:
        raise CliError("--llama-server-draft is a draft for llama-server: give --llama-server too")
    if args.llama_server_draft and not Path(args.llama_server_draft).is_file():
        raise CliError(
            f"--llama-server-draft: {args.llama_server_draft} is not a file (an EAGLE-3 GGUF from export-eagle3 --gguf)"
        )
    if args.llama_server is not None and args.baseline is not None:
        raise CliError("--llama-server audits every mode against llama-server plain: leave out --baseline")
    if args.endpoint is not None and args.model is None:
        raise CliError("--endpoint needs --model: the model id the server expects")
    try:
        config = AuditConfig(
            args.endpoint or "http://127.0.0.1",
            args.model or "gguf",
            args.api_key or os.environ.get("EXACTSPEC_API_KEY"),
            args.baseline,
            args.configs,
            args.requests,
            args.max_tokens,
            args.alpha,
            args.seed,
            args.concurrency,
            extra_body=args.extra_body,
            baseline_extra_body=args.baseline_extra_body,
            text_mode=args.text_mode,
            api="llama-server" if args.llama_server is not None else "openai",
        )
        if args.threads:
            torch.set_num_threads(args.threads)  # before loading: llama.cpp's runtime takes torch's count
        backend = args.backend or ("llamacpp" if args.llama_server is not None else "lean")
        weights = "auto" if backend == "llamacpp" else args.weights  # llama.cpp runs the file as stored
        pair = load_pair(
            resolve_checkpoint(args.target_weights), None, backend, DTYPES[args.dtype], weights, device=args.device
        )
    except (OSError, ValueError) as error:
        raise CliError(str(error)) from None
    try:
        if args.llama_server is not None and not args.prompts_file:
            from exactspec.certification.llama_server_audit import audit_prompts

            prompts = audit_prompts(pair.tokenizer)
        else:
            prompts = read_prompts(args.prompts_file, pair.tokenizer)
        if args.llama_server is not None:
            report = _audit_llama_server(args, pair, prompts, config)
        else:
            report = audit(pair, prompts, config, progress=not args.json)
    except (OSError, ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None
    if args.output:
        write_after("--output", args.output, lambda: Path(args.output).write_text(json.dumps(report, indent=2)), report)
    if args.record:
        from exactspec.jobs.records import run_record

        if "modes" in report:
            kept = ("passed", "detectable_tv", "speculation", "error")
            figures = {
                "passed": report["passed"],
                "modes": {row["mode"]: {k: row[k] for k in kept if k in row} for row in report["modes"]},
            }
            what = f"black box: llama-server {report['llama_server']}"
        else:
            figures = {"passed": report["passed"], "tokens": report["tokens"], "detectable_tv": report["detectable_tv"]}
            what = f"black box: the server at {args.endpoint}"
        write_record_file(
            run_record(
                "audit",
                args.argv,
                resolve_checkpoint(args.target_weights),
                None,
                None,
                what,
                "the server's",
                args.seed,
                report["precision"],
                figures,
            ),
            args.record,
            report,
        )
    return report


def _audit_llama_server(args: argparse.Namespace, pair, prompts: list[list[int]], config) -> dict:
    """Every mode in --llama-server-modes, each against the exact law and against llama-server plain."""
    from exactspec.bench.llama_server import LlamaServerConfig, find_llama_server
    from exactspec.certification.llama_server_audit import LlamaServerAudit, audit_llama_server
    from exactspec.models.base import is_gguf

    model = resolve_checkpoint(args.target_weights)
    if not is_gguf(model):
        raise CliError(f"--llama-server runs the target's .gguf file; {args.target_weights} is not one")
    server = LlamaServerConfig(
        find_llama_server(args.llama_server or None),
        model,
        args.threads or torch.get_num_threads(),
        parallel=args.concurrency,
    )
    draft = Path(args.llama_server_draft) if args.llama_server_draft else None
    modes = (*(args.llama_server_modes or AUDIT_MODES), *(DRAFT_MODES if draft else ()))
    return audit_llama_server(pair, prompts, LlamaServerAudit(server, config, modes, draft), progress=not args.json)


def show(report: dict) -> None:
    from exactspec.certification.audit import format_audit_table
    from exactspec.certification.llama_server_audit import format_llama_server_table

    print(format_llama_server_table(report) if "modes" in report else format_audit_table(report))


def add(add_command) -> None:
    """The ``audit`` command: its flags, run and show."""
    audit = add_command(
        "audit",
        help=(
            "black-box check of an OpenAI-compatible server's sampling "
            "law, scored with a local copy of the target's weights"
        ),
    )
    audit.add_argument(
        "--endpoint",
        help="the server's base URL, e.g. http://127.0.0.1:8000 (the only address the audit talks to, with --baseline)",
    )
    audit.add_argument("--model", help="the model id the server expects (with --endpoint)")
    audit.add_argument(
        "--llama-server",
        nargs="?",
        const="",
        metavar="PATH",
        help=(
            "instead of --endpoint: start llama-server (this binary, or the one found as bench finds it) on loopback "
            "on the --target-weights .gguf file, plain and in each of --llama-server-modes, and audit every mode"
        ),
    )
    audit.add_argument(
        "--llama-server-draft",
        help=(
            "with --llama-server: an EAGLE-3 draft's GGUF file (export-eagle3 --gguf); llama-server's "
            "draft-eagle3 mode (its argmax drafted, kept where the target's own sample matches) is audited too"
        ),
    )
    audit.add_argument(
        "--llama-server-modes",
        type=list_of(one_of(DRAFT_FREE_MODES), f"names from {', '.join(DRAFT_FREE_MODES)}"),
        help=(
            "with --llama-server: the modes audited, comma-separated (plain is also "
            f"every other mode's baseline; unless given: {' '.join(AUDIT_MODES)})"
        ),
    )
    audit.add_argument(
        "--target-weights",
        required=True,
        help="the same target's weights here: a directory, a .gguf file or a packaged model's name",
    )
    audit.add_argument(
        "--baseline",
        help="a server of the same model with speculation off: its samples are compared with the endpoint's",
    )
    audit.add_argument("--api-key", help="sent as Authorization: Bearer KEY (default: $EXACTSPEC_API_KEY)")
    audit.add_argument(
        "--configs",
        type=list_of(one_of(tuple(AUDIT_CONFIGS)), f"names from {', '.join(AUDIT_CONFIGS)}"),
        default=("T=1",),
        help="comma-separated sampling configurations",
    )
    audit.add_argument(
        "--requests", type=integer(1), default=400, help="requests per configuration and server (one choice each)"
    )
    audit.add_argument("--max-tokens", type=integer(1), default=48, help="max_tokens of each request")
    audit.add_argument(
        "--alpha", type=float, default=1e-3, help="family-wise false-positive rate (Holm over every test)"
    )
    audit.add_argument(
        "--seed", type=integer(0), default=0, help="seed of the first request (request i sends seed + i)"
    )
    audit.add_argument("--concurrency", type=integer(1), default=8, help="requests in flight at once")
    audit.add_argument(
        "--extra-body",
        type=json_object,
        default={},
        help='JSON fields added to every request to the endpoint, e.g. \'{"speculation": "draft"}\'',
    )
    audit.add_argument(
        "--baseline-extra-body", type=json_object, default={}, help="JSON fields added to every request to the baseline"
    )
    audit.add_argument(
        "--text-mode",
        action="store_true",
        help=(
            "for a server that takes and returns only text: completions are re-tokenized, "
            "so only the comparison with --baseline is valid (and required)"
        ),
    )
    audit.add_argument(
        "--prompts-file",
        help=(
            "prompts, one per line; default: chat questions in the model's template, "
            "or code openings (with --llama-server: the bench's grounded chat "
            "prompts, answers that copy their prompt, where n-gram modes draft)"
        ),
    )
    audit.add_argument(
        "--backend",
        choices=["lean", "llamacpp"],
        help=(
            "the local scoring's runtime: lean (torch, --dtype and --weights apply) "
            "or llamacpp (a .gguf file as llama.cpp runs it: the numbers a llama.cpp "
            "server computes); default: llamacpp with --llama-server, else lean"
        ),
    )
    audit.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="precision of the local scoring"
    )
    audit.add_argument(
        "--weights", choices=["auto", "dense", "q4"], default="dense", help="the local target's weights (see generate)"
    )
    audit.add_argument("--device", default="cpu", help="where the local scoring runs")
    audit.add_argument("--threads", type=integer(1), help="CPU threads for the local scoring")
    audit.add_argument("--output", help="also write the report to this JSON file")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument(
        "--record", help="write the run record (weights' hashes, environment, verdict) to this JSON file"
    )
    audit.set_defaults(run=run, show=show)
