"""``exactspec serve``: the OpenAI-compatible server over the batch engine."""

from __future__ import annotations

import argparse
import os
import sys

from exactspec.cli.common import CliError, add_model_arguments, integer, run_plan
from exactspec.decoding.sampling import SamplingParams
from exactspec.tuning.priors import PolicyCache, acceptance_prior


def run(args: argparse.Namespace) -> dict:
    try:
        from exactspec.decoding.engine import BatchEngine, EngineConfig
        from exactspec.serving.api import ServerSettings, create_app
        from exactspec.serving.server import run_server
        from exactspec.speculator import build_engine
    except ImportError as error:
        raise CliError(
            f"serve needs the server extras ({error.name} is missing): pip install 'exactspec[serve]'"
        ) from None
    if args.backend == "hf":
        raise CliError("serve runs the lean or llamacpp backend; --backend hf is for generate and bench")
    api_key = args.api_key or os.environ.get("EXACTSPEC_API_KEY")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        raise CliError(f"--host {args.host} exposes the server beyond this machine: give it an --api-key")
    plan = run_plan(args)
    pair = plan.load()
    engine_class = BatchEngine
    if args.lossy_for_tests:
        from exactspec.certification.mutants import MUTANTS

        print(
            (
                f"exactspec: WARNING: lossy mode {args.lossy_for_tests}: this server's "
                "output does NOT follow the target's law (for testing audits only)"
            ),
            file=sys.stderr,
        )
        engine_class = MUTANTS[args.lossy_for_tests]
    target_dir, draft_dir = plan.dirs
    # The policy starts from the acceptance of sampled requests (OpenAI's default temperature is 1) and learns the mix.
    acceptance, prior_source = acceptance_prior(
        target_dir, draft_dir, SamplingParams(temperature=1.0), PolicyCache(), "block"
    )
    try:
        engine = build_engine(
            pair,
            args.max_batch,
            args.max_model_len,
            EngineConfig(gamma=args.gamma),
            engine_class=engine_class,
            acceptance=acceptance,
        )
    except ValueError as error:
        raise CliError(str(error)) from None
    name = args.model_name or (args.target or "exactspec-default")
    from exactspec.jobs.records import run_record

    proposal = "the draft per request's speculation field: draft model or trained feature draft, prompt lookup, or off"
    record_base = run_record(
        "serve",
        args.argv,
        target_dir,
        draft_dir,
        None,
        proposal,
        f"fixed {args.gamma} for draft, lookup and seeded auto requests",
        None,
        plan.precision,
        {"acceptance_prior": list(acceptance), "prior_source": prior_source},
    )
    settings = ServerSettings(
        name, api_key, args.max_request_bytes, args.max_tokens, args.max_n, args.max_sequences, record_base
    )
    run_server(create_app(engine, pair.tokenizer, settings), args.host, args.port)
    return {}


def add(add_command) -> None:
    """The ``serve`` command: its flags, run and show."""
    serve = add_command(
        "serve",
        help="an OpenAI-compatible HTTP server with continuous batching (default: the shipped pair, on 127.0.0.1:8000)",
    )
    add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback needs --api-key)")
    serve.add_argument("--port", type=integer(1, 65535), default=8000, help="port to bind")
    serve.add_argument(
        "--api-key", help="require Authorization: Bearer KEY on every request but /health (default: $EXACTSPEC_API_KEY)"
    )
    serve.add_argument("--model-name", help="the model id clients send (default: --target, or exactspec-default)")
    serve.add_argument("--max-batch", type=integer(1, 256), default=16, help="sequences decoded together")
    serve.add_argument(
        "--max-model-len", type=integer(16), default=2048, help="prompt + completion tokens per sequence"
    )
    serve.add_argument("--max-tokens", type=integer(1), default=1024, help="largest max_tokens a request may ask for")
    serve.add_argument("--max-n", type=integer(1), default=8, help="largest n (choices per request)")
    serve.add_argument(
        "--max-sequences", type=integer(1), default=64, help="sequences queued or running at once; more get HTTP 429"
    )
    serve.add_argument("--max-request-bytes", type=integer(1), default=1 << 20, help="largest request body")
    serve.add_argument(
        "--gamma",
        type=integer(1),
        default=4,
        help="draft tokens per round of draft and lookup requests (and seeded auto ones)",
    )
    from exactspec.certification.mutants import MUTANTS

    serve.add_argument(
        "--lossy-for-tests", choices=tuple(MUTANTS), help=argparse.SUPPRESS
    )  # a known-wrong verifier, to test audits
    serve.set_defaults(run=run, show=lambda result: None, json=False)
