"""The command-line side of the jobs over many sequences: ``certify``, ``audit``, ``generate-batch`` and ``replay``
(registered by :func:`exactspec.cli.build_parser`; the shared flags and helpers live in :mod:`exactspec.cli`)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch

from exactspec.cli import (
    CliError, _add_model_arguments, _check_record_path, _check_writable_directory, _generate, _integer, _list_of, _load, _one_of,
    _pair_dirs, _precision, _resolved_spec, _write, build_parser,
)
from exactspec.loading import resolve_checkpoint

__all__ = ["add_batch_commands", "add_check_commands"]


def _replay(args: argparse.Namespace) -> dict:
    from exactspec.records import replay_verdict

    try:
        record = json.loads(Path(args.record_file).read_text())
        kind, argv = record["kind"], list(record["argv"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CliError(f"{args.record_file} is not a run record: {error}") from None
    if kind != "generate":
        raise CliError(f"{args.record_file} records a {kind} run; replay reruns generate records")
    if "--record" in argv:  # do not overwrite the record being replayed
        at = argv.index("--record")
        del argv[at : at + 2]
    rerun = build_parser().parse_args([*argv, "--json"])
    rerun.argv = argv
    result = _generate(rerun)
    return {"record": args.record_file, **replay_verdict(record, result["token_ids"])}


def _print_replay(result: dict) -> None:
    if result["identical"]:
        print(f"identical: the rerun produced the same {result['tokens']} tokens")
    else:
        print(f"different from token {result['first_difference']}: {result['reason']}")


def _certify(args: argparse.Namespace) -> dict:
    from exactspec.certification.certify import CertifyConfig, certify
    from exactspec.certification.report import write_certify_outputs

    _check_writable_directory(Path(args.output_dir), "--output-dir")
    _check_record_path(args.record)
    if args.ray is not None:
        _require_ray()
    try:
        config = CertifyConfig(configs=args.configs, sequences=args.sequences, max_tokens=args.max_tokens, gamma=args.gamma,
                               alpha=args.alpha, seed=args.seed, slots=args.slots, self_check=args.self_check,
                               mutants=args.mutants)
    except ValueError as error:
        raise CliError(str(error)) from None
    pair = _load(args, with_draft=True)
    prompts = _read_prompts(args.prompts_file, pair.tokenizer)
    sampler = None
    if args.ray is not None:
        from exactspec.distributed import RaySampler

        sampler = RaySampler(_resolved_spec(args), prompts, config, args.ray or None, args.workers)
    try:
        report = certify(pair, prompts, config, progress=not args.json, sampler=sampler)
    except ValueError as error:
        raise CliError(str(error)) from None
    finally:
        if sampler is not None:
            sampler.close()
    report["outputs"] = [str(p) for p in write_certify_outputs(report, args.output_dir)]
    for c in report["per_config"].values():
        c.pop("pit")
    if args.record:
        from exactspec.records import run_record

        figures = {key: report[key] for key in ("passed", "tokens", "detectable_tv", "greedy", "numerics_max_logit_difference", "seconds")}
        figures["self_check"] = {name: m["rejected"] for name, m in report.get("self_check", {}).items()}
        _write(run_record("certify", args.argv, *_pair_dirs(args), None, "the pair's draft through the batch engine",
                          f"fixed {args.gamma}", args.seed, report["precision"], figures), args.record)
    return report


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def _read_prompts(path: str | None, tokenizer) -> list[list[int]]:
    """Prompts from a file, one per line (a literal \\n is a newline inside one), or the default set."""
    from exactspec.certification.certify import default_prompts

    if not path:
        return default_prompts(tokenizer)
    try:
        lines = [line for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]
    except (OSError, UnicodeDecodeError) as error:
        raise CliError(f"--prompts-file {path}: {error}") from None
    if not lines:
        raise CliError(f"--prompts-file {path} has no prompt (one per line)")
    return [tokenizer.encode_prompt(line.replace("\\n", "\n")) for line in lines]


def _audit(args: argparse.Namespace) -> dict:
    from exactspec.certification.audit import AuditConfig, audit
    from exactspec.loading import DTYPES, load_pair

    _check_record_path(args.record)
    try:
        config = AuditConfig(args.endpoint, args.model, args.api_key or os.environ.get("EXACTSPEC_API_KEY"), args.baseline,
                             args.configs, args.requests, args.max_tokens, args.alpha, args.seed, args.concurrency,
                             extra_body=args.extra_body, baseline_extra_body=args.baseline_extra_body, text_mode=args.text_mode)
        pair = load_pair(resolve_checkpoint(args.target_weights), None, "lean", DTYPES[args.dtype], args.weights, device=args.device)
    except (OSError, ValueError) as error:
        raise CliError(str(error)) from None
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        report = audit(pair, _read_prompts(args.prompts_file, pair.tokenizer), config, progress=not args.json)
    except RuntimeError as error:
        raise CliError(str(error)) from None
    if args.output:
        Path(args.output).write_text(json.dumps(report, indent=2))
    if args.record:
        from exactspec.records import run_record

        figures = {"passed": report["passed"], "tokens": report["tokens"], "detectable_tv": report["detectable_tv"]}
        _write(run_record("audit", args.argv, resolve_checkpoint(args.target_weights), None, None, f"black box: the server at {args.endpoint}",
                          "the server's", args.seed, report["precision"], figures), args.record)
    return report


def _require_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise CliError("--ray needs Ray: pip install 'exactspec[ray]'") from None


def _generate_batch(args: argparse.Namespace) -> dict:
    from exactspec import batch
    from exactspec.records import run_record

    output = Path(args.output)
    _check_record_path(str(output), "--output")
    if args.ray is not None:
        _require_ray()
    try:
        config = batch.BatchJobConfig(args.max_tokens, max_tokens_limit=max(args.max_tokens, 4096), seed=args.seed, gamma=args.gamma,
                                      slots=args.max_batch, max_len=args.max_model_len)
        requests = batch.read_requests(Path(args.input))
    except (OSError, ValueError) as error:
        raise CliError(f"--input {args.input}: {error}") from None
    try:
        done = batch.completed_lines(output)
    except (OSError, ValueError) as error:
        raise CliError(f"--output {args.output}: {error}") from None
    if done > len(requests):
        raise CliError(f"{output} holds {done} results but {args.input} has {len(requests)} requests; give a new --output")
    pair = _load(args, with_draft=True)
    if pair.draft is None:
        raise CliError("generate-batch drafts with a draft model or a trained feature draft: give --draft DIR (or use a target that ships one)")
    try:
        for line, obj in enumerate(requests):  # every line checked before any work
            batch.parse_request(obj, line, pair.tokenizer, config)
    except ValueError as error:
        raise CliError(f"{args.input} {error}") from None
    from exactspec.models.eagle import FeatureDraft

    target_dir, draft_dir = _pair_dirs(args)
    proposal = "trained feature draft" if FeatureDraft.is_feature_draft(draft_dir) else "draft model"
    record = run_record("generate-batch", args.argv, target_dir, draft_dir, None, proposal,
                        f"fixed {args.gamma}", args.seed, _precision(args), {"input": str(Path(args.input).resolve())})
    if args.ray is None:
        produce = lambda remaining, first: batch.generate_batch(pair, remaining, config, first)  # noqa: E731
    else:
        from exactspec.distributed import ray_results

        spec = _resolved_spec(args)  # resolved here, loaded by each actor (one torch thread unless --threads)
        produce = lambda remaining, first: ray_results(spec, remaining, config, first, args.ray or None, args.workers, args.shard_size)  # noqa: E731
    try:
        return batch.run_job(requests, output, record, produce, progress=not args.json)
    except (ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None


def _print_generate_batch(r: dict) -> None:
    print(f"{r['written']} results written to {r['output']} ({r['already_done']} were there already, {r['requests']} requests); "
          f"{r['tokens']} tokens; run record {r['record_id']}")


def _print_audit(report: dict) -> None:
    from exactspec.certification.audit import format_audit_table

    print(format_audit_table(report))


def _print_certify(report: dict) -> None:
    from exactspec.certification.report import format_certify_table

    print(format_certify_table(report))
    print(f"outputs: {', '.join(report['outputs'])}")


def add_batch_commands(add) -> None:
    """generate-batch and replay."""
    batch = add("generate-batch", help="exact batch generation: JSONL requests in, JSONL results out, in order; resumable; local or on Ray")
    batch.add_argument("--input", required=True, help="one JSON request per line: prompt or messages, and optionally id, max_tokens, seed and sampling fields")
    batch.add_argument("--output", required=True, help="results, one JSON line per request in input order; a rerun appends what is missing")
    _add_model_arguments(batch)
    batch.add_argument("--max-tokens", type=_integer(1), default=128, help="max_tokens of a request that gives none")
    batch.add_argument("--seed", type=_integer(0), default=0, help="a request without a seed uses this plus its line number")
    batch.add_argument("--gamma", type=_integer(1), default=4, help="draft tokens per round")
    batch.add_argument("--max-batch", type=_integer(1, 256), default=16, help="sequences decoded together (per worker)")
    batch.add_argument("--max-model-len", type=_integer(16), default=2048, help="prompt + completion tokens per sequence")
    batch.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help="run on Ray: a cluster's address, or none for a local one")
    batch.add_argument("--workers", type=_integer(1), default=2, help="with --ray: engine replicas (Ray actors)")
    batch.add_argument("--shard-size", type=_integer(1), default=32, help="with --ray: requests per task")
    batch.add_argument("--json", action="store_true", help="print the summary as JSON")
    batch.set_defaults(run=_generate_batch, show=_print_generate_batch, dtype="float32")

    replay = add("replay", help="rerun a generate record and confirm it gives the same tokens (or say why not)")
    replay.add_argument("record_file", metavar="RECORD", help="a JSON file written by generate --record")
    replay.add_argument("--json", action="store_true", help="print JSON")
    replay.set_defaults(run=_replay, show=_print_replay)


def add_check_commands(add) -> None:
    """certify and audit."""
    certify = add("certify", help="a statistical test that the pair's speculative output follows the target's sampling law, on its real vocabulary")
    _add_model_arguments(certify)
    from exactspec.certification.certify import CONFIGS, MUTANT_CONFIG, CertifyConfig

    defaults = CertifyConfig()
    certify.add_argument("--configs", type=_list_of(_one_of(tuple(CONFIGS)), f"names from {', '.join(CONFIGS)}"), default=defaults.configs,
                         help=f"comma-separated sampling configurations (default: all: {', '.join(CONFIGS)}); greedy is always checked apart")
    certify.add_argument("--sequences", type=_integer(1), default=defaults.sequences, help="continuations per configuration (prompts are cycled)")
    certify.add_argument("--max-tokens", type=_integer(1), default=defaults.max_tokens, help="tokens per continuation")
    certify.add_argument("--gamma", type=_integer(1), default=defaults.gamma, help="draft tokens per round")
    certify.add_argument("--alpha", type=float, default=defaults.alpha, help="family-wise false-positive rate (Holm over every test)")
    certify.add_argument("--seed", type=_integer(0), default=defaults.seed, help="seed of the first sequence")
    certify.add_argument("--slots", type=_integer(1, 256), default=defaults.slots, help="sequences sampled together")
    certify.add_argument("--self-check", action="store_true", help="also run the known-wrong samplers and report whether each is rejected (the tests' power)")
    certify.add_argument("--mutants", type=_list_of(_one_of(tuple(MUTANT_CONFIG)), f"names from {', '.join(MUTANT_CONFIG)}"), default=defaults.mutants,
                         help="comma-separated known-wrong samplers --self-check runs, each in its own configuration (default: all)")
    certify.add_argument("--prompts-file", help="prompts, one per line (\\n for a newline inside one); default: chat questions in the model's template, or code openings")
    certify.add_argument("--output-dir", default="certify_out", help="where certify.json, certify.txt and certify.png go")
    certify.add_argument("--json", action="store_true", help="print the report as JSON")
    certify.add_argument("--record", help="write the run record (models' hashes, mechanism, environment, verdict) to this JSON file")
    certify.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS", help="sample and score on Ray: a cluster's address, or none for a local one")
    certify.add_argument("--workers", type=_integer(1), default=2, help="with --ray: sampler replicas (Ray actors), each with --slots sequences")
    certify.set_defaults(run=_certify, show=_print_certify, dtype="float32")

    audit = add("audit", help="black-box check of an OpenAI-compatible server's sampling law, scored with a local copy of the target's weights")
    audit.add_argument("--endpoint", required=True, help="the server's base URL, e.g. http://127.0.0.1:8000 (the only address the audit talks to, with --baseline)")
    audit.add_argument("--model", required=True, help="the model id the server expects")
    audit.add_argument("--target-weights", required=True, help="the same target's weights here: a directory, a .gguf file or a packaged model's name")
    audit.add_argument("--baseline", help="a server of the same model with speculation off: its samples are compared with the endpoint's")
    audit.add_argument("--api-key", help="sent as Authorization: Bearer KEY (default: $EXACTSPEC_API_KEY)")
    audit.add_argument("--configs", type=_list_of(_one_of(tuple(CONFIGS)), f"names from {', '.join(CONFIGS)}"), default=("T=1",), help="comma-separated sampling configurations")
    audit.add_argument("--requests", type=_integer(1), default=400, help="requests per configuration and server (one choice each)")
    audit.add_argument("--max-tokens", type=_integer(1), default=48, help="max_tokens of each request")
    audit.add_argument("--alpha", type=float, default=1e-3, help="family-wise false-positive rate (Holm over every test)")
    audit.add_argument("--seed", type=_integer(0), default=0, help="seed of the first request (request i sends seed + i)")
    audit.add_argument("--concurrency", type=_integer(1), default=8, help="requests in flight at once")
    audit.add_argument("--extra-body", type=_json_object, default={}, help='JSON fields added to every request to the endpoint, e.g. \'{"speculation": "draft"}\'')
    audit.add_argument("--baseline-extra-body", type=_json_object, default={}, help="JSON fields added to every request to the baseline")
    audit.add_argument("--text-mode", action="store_true", help="for a server that takes and returns only text: completions are re-tokenized, so only the comparison with --baseline is valid (and required)")
    audit.add_argument("--prompts-file", help="prompts, one per line; default: chat questions in the model's template, or code openings")
    audit.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="precision of the local scoring")
    audit.add_argument("--weights", choices=["auto", "dense", "q4"], default="dense", help="the local target's weights (see generate)")
    audit.add_argument("--device", default="cpu", help="where the local scoring runs")
    audit.add_argument("--threads", type=_integer(1), help="CPU threads for the local scoring")
    audit.add_argument("--output", help="also write the report to this JSON file")
    audit.add_argument("--json", action="store_true", help="print the report as JSON")
    audit.add_argument("--record", help="write the run record (weights' hashes, environment, verdict) to this JSON file")
    audit.set_defaults(run=_audit, show=_print_audit)
