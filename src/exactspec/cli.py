"""Command-line interface: parse flags, call the library, print.

Exit codes: 0 done; 2 a user error, printed as one line; 130 interrupted by
Ctrl-C (what was generated or measured so far is kept and summarised); 141 the
reader of stdout went away (``| head``), as for a process ended by SIGPIPE.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Callable, Sequence

import torch

from exactspec import __version__, costmodel, verify
from exactspec.chat import chat_messages
from exactspec.loading import LOOKUP, PACKAGED_MODELS, SMALL_MODEL_PARAMETERS, PairSpec, resolve_checkpoint
from exactspec.priors import PolicyCache, shipped_prior
from exactspec.sampling import SamplingParams
from exactspec.speculator import Completion, Speculator
from exactspec.tokenizer import stream_text
from exactspec.peers import PEER_WORKLOADS
from exactspec.workloads import WORKLOADS

__all__ = ["main"]


class CliError(Exception):
    """A user error: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(message)


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


#: Seeds are unsigned 64-bit integers (torch.Generator's range); -1 asks for a random one.
MAX_SEED = 2**64 - 1


def _integer(minimum: int, maximum: int | None = None, expected: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum], else an error that says what is expected."""
    expected = expected or f"an integer >= {minimum}"

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


_seed_argument = _integer(-1, MAX_SEED, "an integer in [0, 2^64 - 1], or -1 for a random seed")


def _list_of(item: Callable[[str], object], what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            values = tuple(item(part.strip()) for part in text.split(","))
        except (ValueError, argparse.ArgumentTypeError):
            values = ()
        if not values:
            raise argparse.ArgumentTypeError(f"must be comma-separated {what}, got {text!r}")
        return values

    return parse


def _one_of(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def _distribution(text: str, name: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",")]
    except ValueError:
        raise CliError(f"--{name} must be comma-separated numbers, got {text!r}") from None
    if any(not math.isfinite(v) for v in values):
        raise CliError(f"--{name} contains a value that is not finite")
    if any(v < 0 for v in values):
        raise CliError(f"--{name} contains a negative probability")
    if abs(sum(values) - 1) > 1e-6:
        raise CliError(f"--{name} sums to {sum(values):.6g}, not 1")
    return values


def _positive(name: str, value: float, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise CliError(f"--{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value}")
    return value


def _explain(args: argparse.Namespace) -> dict:
    target = _distribution(args.target, "target")
    draft = _distribution(args.draft, "draft")
    if len(target) != len(draft):
        raise CliError(f"--target has {len(target)} entries but --draft has {len(draft)}")
    labels = args.labels.split(",") if args.labels else [str(i) for i in range(len(target))]
    if len(labels) != len(target):
        raise CliError(f"--labels has {len(labels)} entries for {len(target)} tokens")
    p = torch.tensor(target, dtype=torch.float64)
    q = torch.tensor(draft, dtype=torch.float64)
    return {
        "tokens": labels,
        "target": target,
        "draft": draft,
        "acceptance_probability": verify.acceptance_probabilities(p, q).tolist(),
        "accepted_mass": verify.accepted_mass(p, q).tolist(),
        "acceptance_rate": float(verify.accepted_mass(p, q).sum()),
        "rejection_probability": float(verify.rejection_probability(p, q)),
        "residual": verify.residual_distribution(p, q).tolist(),
        "final_law": verify.output_law(p, q).tolist(),
        "naive_law": verify.naive_output_law(p, q).tolist(),
        "independent_match_rate": float(verify.independent_match_rate(p, q)),
    }


def _print_explain(r: dict) -> None:
    columns = [
        ("token", "tokens", "{}"),
        ("p (target)", "target", "{:.4f}"),
        ("q (draft)", "draft", "{:.4f}"),
        ("min(1,p/q)", "acceptance_probability", "{:.4f}"),
        ("min(p,q)", "accepted_mass", "{:.4f}"),
        ("residual", "residual", "{:.4f}"),
        ("final law", "final_law", "{:.4f}"),
        ("naive law", "naive_law", "{:.4f}"),
    ]
    print("  ".join(f"{title:>11}" for title, _, _ in columns))
    for i in range(len(r["tokens"])):
        print("  ".join(f"{fmt.format(r[key][i]):>11}" for _, key, fmt in columns))
    print()
    print(f"acceptance rate   sum min(p,q)          = {r['acceptance_rate']:.4f}")
    print(f"rejection         sum max(0,p-q)        = {r['rejection_probability']:.4f}")
    print("final law         min(p,q) + rejection * residual: equals p (exact)")
    print("naive law         min(p,q) + rejection * p: the law if the replacement is drawn from p (wrong)")
    print(f"independent draws sum p*q (match rate)  = {r['independent_match_rate']:.4f}")


def _cost(args: argparse.Namespace) -> dict:
    _positive("target-ms", args.target_ms)
    _positive("draft-ms", args.draft_ms, allow_zero=True)
    _positive("verify-cost", args.verify_cost)
    if not 0 <= args.alpha <= 1:
        raise CliError(f"--alpha must be in [0, 1], got {args.alpha}")
    c = args.draft_ms / args.target_ms
    gamma = costmodel.best_gamma(args.alpha, c, args.max_gamma, args.verify_cost).gamma if args.best_gamma else args.gamma
    return {
        "gamma": gamma,
        "alpha": args.alpha,
        "cost_ratio": c,
        "verify_cost": args.verify_cost,
        "tokens_per_round": costmodel.expected_tokens_per_round(args.alpha, gamma),
        "ms_per_token": costmodel.ms_per_token(args.alpha, gamma, args.target_ms, args.draft_ms, args.verify_cost),
        "baseline_ms_per_token": args.target_ms,
        "speedup": costmodel.speedup(args.alpha, gamma, c, args.verify_cost),
    }


def _print_cost(r: dict) -> None:
    print(f"gamma {r['gamma']}, alpha {r['alpha']}, cost ratio c {r['cost_ratio']:.4g}, verify cost {r['verify_cost']:.4g}")
    print(f"tokens per round  {r['tokens_per_round']:.4f}")
    print(f"ms per token      {r['ms_per_token']:.2f}  (plain decoding: {r['baseline_ms_per_token']:.2f})")
    print(f"speedup           {r['speedup']:.4f}x")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    try:
        return SamplingParams(
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            min_p=args.min_p,
            repetition_penalty=args.repetition_penalty,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
        )
    except ValueError as error:  # name the flag, not the field: "--top-p must be in (0, 1]"
        message = str(error)
        field = message.split()[0]
        raise CliError(f"--{field.replace('_', '-')}{message[len(field):]}" if hasattr(args, field) else message) from None


def _pair_spec(args: argparse.Namespace, with_draft: bool = True) -> PairSpec:
    """The pair the model flags name (see :class:`exactspec.loading.PairSpec`)."""
    if args.target is None and args.draft not in (None, LOOKUP):
        raise CliError("--draft needs --target (give neither for the shipped default pair)")
    try:
        return PairSpec(args.target, args.draft, with_draft, args.backend, args.dtype, args.weights, args.invariant, args.device,
                        args.download, args.threads)
    except ValueError as error:
        raise CliError(str(error)) from None


def _resolved_spec(args: argparse.Namespace, with_draft: bool = True) -> PairSpec:
    """The pair resolved to local paths (a hub id is fetched, with --download, here and only here)."""
    try:
        return _pair_spec(args, with_draft).resolved()
    except FileNotFoundError as error:
        raise CliError(str(error)) from None


def _pair_dirs(args: argparse.Namespace, with_draft: bool = True) -> tuple[Path, Path | None]:
    """The target checkpoint and the draft model's (None for plain decoding or prompt lookup)."""
    return _resolved_spec(args, with_draft).dirs()


def _load(args: argparse.Namespace, with_draft: bool, spec: PairSpec | None = None):
    try:
        return (spec or _pair_spec(args, with_draft)).load()
    except (OSError, ValueError) as error:
        raise CliError(str(error)) from None


def _generate(args: argparse.Namespace) -> dict:
    params = _sampling(args)
    _check_record_path(args.record)
    text = _prompt_text(args)
    spec = _resolved_spec(args, not args.no_speculation)
    speculator = Speculator(spec, _load(args, not args.no_speculation, spec), None if args.no_policy_cache else PolicyCache())
    try:  # before anything is printed
        prompt = speculator.encode(_prompt_ids(args, text, speculator.tokenizer))
        speculator.check_room(prompt, args.max_new_tokens)
    except ValueError as error:
        raise CliError(str(error).replace("max_new_tokens", "--max-new-tokens")) from None
    completion = Completion(prompt, args.seed if args.seed >= 0 else secrets.randbits(64))
    tokens = speculator.stream(prompt, args.max_new_tokens, params, args.gamma, completion.seed, not args.ignore_eos, completion)
    stops = frozenset() if args.ignore_eos else speculator.tokenizer.eos_token_ids
    pieces = []
    try:
        for piece in stream_text(speculator.tokenizer, (t for t in tokens if t not in stops)):  # stop: not printed
            pieces.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: keep what was generated and summarise it
        completion.generation.stop_reason = "interrupted"
    generation, stats = completion.generation, completion.generation.stats
    if args.record:
        _write_generate_record(args, speculator, params, completion)
    return {
        "prompt": text,
        "threads": torch.get_num_threads(),
        "text": "".join(pieces),
        "token_ids": list(generation.tokens),
        "mode": "plain" if args.no_speculation else f"speculative ({speculator.proposal}), gamma {args.gamma}",
        "gammas_used": sorted({r.drafted for r in stats.rounds[1:]}),
        "seed": completion.seed,
        "sampling": "greedy" if params.greedy else "sampled",
        "stop_reason": generation.stop_reason,
        "tokens_per_second": stats.committed / stats.total_seconds if stats.total_seconds else 0.0,
        "policy": completion.policy,
        **stats.summary(),
    }


def _precision(args: argparse.Namespace) -> str:
    return _pair_spec(args).precision


def _write_generate_record(args: argparse.Namespace, speculator: Speculator, params: SamplingParams, completion: Completion) -> None:
    from exactspec.records import run_record

    generation = completion.generation
    figures = {"token_ids": list(generation.tokens), "stop_reason": generation.stop_reason,
               "sampling": "greedy" if params.greedy else "sampled", **generation.stats.summary()}
    record = run_record("generate", args.argv, *speculator.dirs, params, speculator.proposal, f"{args.gamma}" if args.gamma == "auto" else f"fixed {args.gamma}",
                        completion.seed, _precision(args), figures)
    _write(record, args.record)


def _check_record_path(path: str | None, flag: str = "--record") -> None:
    """Before the run: a file that could not be written fails first, not after the work."""
    if path is not None and not Path(path).resolve().parent.is_dir():
        raise CliError(f"{flag} {path}: the directory {Path(path).resolve().parent} does not exist")


def _write(record: dict, path: str) -> None:
    from exactspec.records import write_record

    try:
        write_record(record, path)
    except OSError as error:
        raise CliError(f"--record {path}: {error}") from None


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt (or the user's chat turn) from the argument, standard input (``-``), ``--prompt-file`` or ``--user``:
    exactly one of them."""
    given = [args.prompt is not None, args.prompt_file is not None, args.user is not None]
    if sum(given) != 1:
        raise CliError("give the prompt as an argument, as - (standard input), with --prompt-file or with --user, exactly one of them")
    if args.user is not None:
        return args.user
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise CliError(f"--prompt-file {args.prompt_file}: {error}") from None
    if args.prompt == "-":
        try:
            return sys.stdin.read()
        except UnicodeDecodeError as error:
            raise CliError(f"standard input is not text: {error}") from None
    return args.prompt


def _prompt_ids(args: argparse.Namespace, text: str, tokenizer) -> list[int]:
    """Plain text as it is, or (with --chat, --system or --user) one user turn in the model's chat template."""
    if not (args.chat or args.system is not None or args.user is not None):
        return tokenizer.encode_prompt(text)
    try:
        return tokenizer.encode_chat(chat_messages(text, args.system))
    except ValueError as error:
        raise CliError(str(error)) from None


def _print_generate(r: dict) -> None:
    print()
    print(
        f"[{r['tokens']} tokens, {r['tokens_per_second']:.1f} tokens/s, "
        f"acceptance {r['acceptance_rate']:.2f} of {r['drafted']} drafted, "
        f"{r['tokens_per_round']:.2f} tokens/round, {r['mode']}, "
        f"{'greedy' if r['sampling'] == 'greedy' else 'seed ' + str(r['seed'])}, stop: {r['stop_reason']}"
        + (f", calibration {r['policy']['calibration']['seconds']:.2f} s, prior: {r['policy']['prior_source']}" if r["policy"] else "")
        + "]",
        file=sys.stderr,
    )


def _gamma_argument(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}")
    return value


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", help=f"target checkpoint: a directory, a .gguf file, a packaged model ({', '.join(PACKAGED_MODELS)}), or a hub id (org/name) in the local Hugging Face cache (default: the shipped target)")
    parser.add_argument("--draft", help=f"draft checkpoint, as --target, or '{LOOKUP}' for prompt-lookup drafting (default: the shipped draft; with --target alone, {LOOKUP})")
    parser.add_argument("--download", action="store_true", help="fetch a hub id (org/name) that is not in the local Hugging Face cache; the only time exactspec uses the network")
    parser.add_argument("--threads", type=_integer(1), help=f"CPU threads for torch (default: 1 for targets under {SMALL_MODEL_PARAMETERS // 10**6}M parameters, whose calls are too short to share, else torch's own choice)")
    parser.add_argument("--backend", choices=["lean", "hf"], default="lean", help="lean (Llama-family, fast) or hf (any causal LM)")
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:N or mps")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16", help="bfloat16: faster, flat verify cost; float32: closer to the checkpoint's own numbers")
    parser.add_argument("--weights", choices=["auto", "dense", "q4"], default="auto", help="dense: dequantize every weight to --dtype; q4: keep a GGUF file's 4-bit projections and run torch's int4 CPU kernel (bfloat16, CPU, lean backend; faster one-token calls); auto: q4 where it can run, else dense")
    parser.add_argument("--invariant", action="store_true", help="call-size-invariant numerics (lean backend): a position's logits are the same bits whether computed alone or in a block of up to 17, so speculative output follows exactly the law of plain decoding in this precision; costs time (see README)")


def _add_sampling_arguments(parser: argparse.ArgumentParser, default_temperature: float = 1.0) -> None:
    parser.add_argument("--temperature", type=float, default=default_temperature, help="0 means greedy")
    parser.add_argument("--top-k", type=_integer(0), default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set of tokens with this mass (1: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability (0: off)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="divide positive / multiply negative logits of seen tokens (1: off)")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from the logits of generated tokens")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract this times the count of each generated token")


def _bench(args: argparse.Namespace) -> dict:
    from exactspec.models.eagle import FeatureDraft

    _check_writable_directory(Path(args.output_dir), "--output-dir")
    _check_record_path(args.record)
    draft_dir = _pair_dirs(args)[1]
    peers_only = draft_dir is None or FeatureDraft.is_feature_draft(draft_dir)
    report = _bench_against_peers(args, draft_dir) if peers_only else _bench_arms(args)
    if args.record:
        from exactspec.records import run_record

        arms = "exactspec and llama.cpp arms (see figures)" if peers_only else "plain, fixed gammas, adaptive, lookup and Hugging Face arms (see figures)"
        _write(run_record("bench", args.argv, *_pair_dirs(args), None, arms, f"fixed {', '.join(map(str, args.gammas))} and auto",
                          args.seed, _precision(args), {"results": report.get("results")}), args.record)
    return report


def _bench_arms(args: argparse.Namespace) -> dict:
    """A target with a draft model: every exactspec arm and Hugging Face's assisted generation."""
    from exactspec import bench

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
    pair = _load(args, with_draft=True)
    hf_models = None
    if config.hf:
        from exactspec.loading import DTYPES, load_model

        try:
            hf_models = tuple(load_model(d, "hf", DTYPES[args.dtype], device=args.device).model for d in _pair_dirs(args))
        except (OSError, ValueError) as error:
            raise CliError(f"{error} (or pass --no-hf)") from None
    target_dir, draft_dir = _pair_dirs(args)
    shipped = {mode: shipped_prior(draft_dir, target_dir, mode) or () for mode in ("greedy", "sampled")}
    report = bench.run_bench(pair.target, pair.draft, pair.tokenizer, config, hf_models, progress=not args.json, acceptance_priors=shipped)
    report.update(backend=args.backend, dtype=args.dtype)
    if report["results"]:
        report["outputs"] = [str(p) for p in bench.write_outputs(report, args.output_dir)]
    return report


def _bench_against_peers(args: argparse.Namespace, draft: Path | None) -> dict:
    """A target alone or with a trained feature-level draft: exactspec plain, prompt lookup (and the draft) against
    llama.cpp plain and prompt lookup on the same GGUF file."""
    from exactspec.models.base import is_gguf
    from exactspec import peers

    target = _pair_dirs(args)[0]
    skipped = None if is_gguf(target) else "the target is not a .gguf file"
    if skipped is None and not peers.llama_cpp_available():
        skipped = "llama_cpp is not installed (pip install llama-cpp-python; see the README for build flags)"
    flags = ["--backend", args.backend, "--device", args.device, "--dtype", args.dtype, "--weights", args.weights,
             *(["--invariant"] if args.invariant else [])]
    try:
        config = peers.PeerBenchConfig(target, args.threads or torch.get_num_threads(), args.prompts, args.max_new_tokens,
                                       args.repeats, args.llama_cpp_lookup, tuple(flags), llama_cpp=skipped is None,
                                       draft=draft, modes=tuple(args.modes), workloads=tuple(args.workloads or PEER_WORKLOADS))
        report = peers.run_peer_bench(config, progress=not args.json)
    except (ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None
    report["llama_cpp_skipped"] = skipped
    report["outputs"] = [str(p) for p in peers.write_peer_outputs(report, args.output_dir)]
    return report


def _serve(args: argparse.Namespace) -> dict:
    try:
        from exactspec.serving.api import ServerSettings, create_app
        from exactspec.engine import BatchEngine, EngineConfig
        from exactspec.serving.server import build_engine, run_server
    except ImportError as error:
        raise CliError(f"serve needs the server extras ({error.name} is missing): pip install 'exactspec[serve]'") from None
    if args.backend != "lean":
        raise CliError("serve runs the lean backend (Llama-family checkpoints); --backend hf is for generate and bench")
    api_key = args.api_key or os.environ.get("EXACTSPEC_API_KEY")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        raise CliError(f"--host {args.host} exposes the server beyond this machine: give it an --api-key")
    pair = _load(args, with_draft=True)
    engine_class = BatchEngine
    if args.lossy_for_tests:
        from exactspec.certification.mutants import MUTANTS

        print(f"exactspec: WARNING: lossy mode {args.lossy_for_tests}: this server's output does NOT follow the target's law (for testing audits only)", file=sys.stderr)
        engine_class = MUTANTS[args.lossy_for_tests]
    try:
        engine = build_engine(pair, args.max_batch, args.max_model_len, EngineConfig(gamma=args.gamma), engine_class=engine_class)
    except ValueError as error:
        raise CliError(str(error)) from None
    name = args.model_name or (args.target or "exactspec-default")
    from exactspec.records import run_record

    proposal = "the draft per request's speculation field: draft model or trained feature draft, prompt lookup, or off"
    record_base = run_record("serve", args.argv, *_pair_dirs(args), None, proposal, f"fixed {args.gamma} for draft, lookup and seeded auto requests",
                             None, _precision(args), {})
    settings = ServerSettings(name, api_key, args.max_request_bytes, args.max_tokens, args.max_n, args.max_sequences, record_base)
    run_server(create_app(engine, pair.tokenizer, settings), args.host, args.port)
    return {}


def _train_draft(args: argparse.Namespace) -> dict:
    from exactspec.training.feature_draft import TrainDraftArgs, train_draft

    _check_writable_directory(Path(args.out), "--out")
    try:
        from exactspec.models.base import check_local_checkpoint

        target = check_local_checkpoint(resolve_checkpoint(args.target))
        config = TrainDraftArgs(target, Path(args.out), args.minutes, args.vocab_subset, args.ttt_steps,
                                answers_per_prompt=args.answers_per_prompt, seed=args.seed, threads=args.threads)
        return train_draft(config)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        raise CliError(str(error)) from None


def _print_train_draft(card: dict) -> None:
    acceptance = card["held_out_acceptance_by_position"]
    print(f"draft written to {card['out']}; held-out acceptance by position: T=1 "
          f"{', '.join(f'{a:.2f}' for a in acceptance['sampled'])}; greedy {', '.join(f'{a:.2f}' for a in acceptance['greedy'])}")


def _check_writable_directory(directory: Path, flag: str) -> None:
    """Before a long run: the directory exists and is writable, or can be created where it should be."""
    existing = directory
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise CliError(f"{flag} {directory}: {existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CliError(f"{flag} {directory}: {existing} is not writable")


def _cache(args: argparse.Namespace) -> dict:
    cache = PolicyCache()
    entries = [str(p) for p in cache.entries()]
    removed = cache.clear() if args.clear else 0
    return {"directory": str(cache.directory), "entries": [] if args.clear else entries, "removed": removed}


def _print_cache(r: dict) -> None:
    if r["removed"]:
        print(f"removed {r['removed']} entries from {r['directory']}")
    else:
        print(f"{r['directory']}: {len(r['entries'])} pair(s)" + "".join(f"\n  {e}" for e in r["entries"]))


def _print_bench(report: dict) -> None:
    from exactspec.bench import format_table
    from exactspec.peers import format_peer_table

    if "llama_cpp_skipped" in report:
        print(format_peer_table(report))
        if report["llama_cpp_skipped"]:
            print(f"[llama.cpp arms skipped: {report['llama_cpp_skipped']}]", file=sys.stderr)
    elif report["results"]:
        print(format_table(report))
    if report.get("interrupted"):
        kept = f"the arms finished so far are in {Path(report['outputs'][0]).parent}" if report.get("outputs") else "no arm had finished"
        print(f"[bench interrupted: {kept}]", file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="exactspec", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    add = lambda name, **kw: commands.add_parser(name, formatter_class=_HelpFormatter, **kw)  # noqa: E731

    explain = add("explain", help="the exact law of one verification step for a (p, q) pair")
    explain.add_argument("--target", required=True, help="target distribution p, e.g. 0.6,0.3,0.1")
    explain.add_argument("--draft", required=True, help="draft distribution q, e.g. 0.5,0.25,0.25")
    explain.add_argument("--labels", help="token labels, e.g. A,B,C")
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.set_defaults(run=_explain, show=_print_explain)

    cost = add("cost", help="expected speedup from the cost model (Leviathan et al. 2023, Thm 3.8)")
    cost.add_argument("--gamma", type=_integer(0), default=4, help="draft tokens per round")
    cost.add_argument("--alpha", type=float, required=True, help="acceptance rate in [0, 1]")
    cost.add_argument("--target-ms", type=float, required=True, help="time of one target call")
    cost.add_argument("--draft-ms", type=float, required=True, help="time of one draft call")
    cost.add_argument("--verify-cost", type=float, default=1.0, help="cost of verifying gamma+1 tokens relative to one")
    cost.add_argument("--best-gamma", action="store_true", help="search gamma in 0..--max-gamma instead of using --gamma")
    cost.add_argument("--max-gamma", type=_integer(0), default=16, help="largest gamma --best-gamma tries")
    cost.add_argument("--json", action="store_true", help="print JSON")
    cost.set_defaults(run=_cost, show=_print_cost)

    generate = add("generate", help="generate text with speculative decoding (default: the shipped pair)")
    generate.add_argument("prompt", nargs="?", help="text to continue; - reads it from standard input")
    generate.add_argument("--prompt-file", help="read the prompt from this file (UTF-8)")
    generate.add_argument("--chat", action="store_true", help="send the prompt as a user turn through the model's chat template; stops at its end-of-turn token")
    generate.add_argument("--system", help="system message of the chat (implies --chat)")
    generate.add_argument("--user", help="the user's message (implies --chat; instead of the prompt argument)")
    _add_model_arguments(generate)
    generate.add_argument("--gamma", type=_gamma_argument, default="auto", help="draft tokens per round, or auto: chosen per round by the cost model")
    generate.add_argument("--max-new-tokens", type=_integer(1), default=128, help="stop after this many new tokens")
    generate.add_argument("--seed", type=_seed_argument, default=0, help="seed of the run's random generator, 0 to 2^64-1; -1 picks a random one (printed in the summary)")
    generate.add_argument("--no-speculation", action="store_true", help="plain decoding of the target (the baseline)")
    generate.add_argument("--no-policy-cache", action="store_true", help="with --gamma auto: neither read nor write the acceptance remembered from the last run of this pair (see `exactspec cache`)")
    generate.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    _add_sampling_arguments(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    generate.add_argument("--record", help="write the run record (models' hashes, sampling, mechanism, environment, tokens) to this JSON file")
    generate.set_defaults(run=_generate, show=_print_generate)

    from exactspec import cli_jobs

    cli_jobs.add_batch_commands(add)

    bench = add("bench", help="side-by-side speed benchmark: plain, draft, adaptive, lookup, Hugging Face; a target without a draft model against llama.cpp")
    _add_model_arguments(bench)
    names = tuple(dict.fromkeys(WORKLOADS + tuple(PEER_WORKLOADS)))
    bench.add_argument("--workloads", type=_list_of(_one_of(names), f"names from {', '.join(names)}"), help=f"comma-separated workloads (default: {', '.join(WORKLOADS)} for a draft model; {', '.join(PEER_WORKLOADS)} against llama.cpp)")
    bench.add_argument("--modes", type=_list_of(_one_of(("greedy", "sample")), "names from greedy (T=0), sample (T=1)"), default="greedy,sample", help="comma-separated sampling modes: greedy (T=0), sample (T=1)")
    bench.add_argument("--gammas", type=_list_of(_integer(1), "integers >= 1"), default="2,4,6,8", help="fixed gamma values of the draft arms")
    bench.add_argument("--hf-gamma", type=_integer(1), default=4, help="gamma of Hugging Face assisted generation")
    bench.add_argument("--lookup-gamma", type=_integer(1), default=8, help="gamma of the prompt-lookup arm")
    bench.add_argument("--prompts", type=_integer(1), default=6, help="prompts per workload")
    bench.add_argument("--max-new-tokens", type=_integer(1), default=96, help="new tokens per prompt")
    bench.add_argument("--repeats", type=_integer(1), default=3, help="repetitions; medians are reported")
    bench.add_argument("--seed", type=_integer(0), default=0, help="seed of the first prompt (prompt i uses seed + i)")
    bench.add_argument("--no-hf", action="store_true", help="skip the Hugging Face arms")
    bench.add_argument("--llama-cpp-lookup", type=_integer(1), default=2, help="tokens per llama.cpp prompt-lookup draft (a target without a draft model; 2 is llama-cpp-python's advice for CPUs)")
    bench.add_argument("--output-dir", default="bench_out", help="where report.json, report.txt and the plots go")
    bench.add_argument("--json", action="store_true", help="print the report as JSON")
    bench.add_argument("--record", help="write the run record (models' hashes, environment, measured figures) to this JSON file")
    bench.set_defaults(run=_bench, show=_print_bench)

    cache = add("cache", help="the adaptive policy's memory of each model pair's acceptance (--gamma auto starts from it)")
    cache.add_argument("--clear", action="store_true", help="remove every entry")
    cache.add_argument("--json", action="store_true", help="print JSON")
    cache.set_defaults(run=_cache, show=_print_cache)
    serve = add("serve", help="an OpenAI-compatible HTTP server with continuous batching (default: the shipped pair, on 127.0.0.1:8000)")
    _add_model_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (anything but loopback needs --api-key)")
    serve.add_argument("--port", type=_integer(1, 65535), default=8000, help="port to bind")
    serve.add_argument("--api-key", help="require Authorization: Bearer KEY on every request but /health (default: $EXACTSPEC_API_KEY)")
    serve.add_argument("--model-name", help="the model id clients send (default: --target, or exactspec-default)")
    serve.add_argument("--max-batch", type=_integer(1, 256), default=16, help="sequences decoded together")
    serve.add_argument("--max-model-len", type=_integer(16), default=2048, help="prompt + completion tokens per sequence")
    serve.add_argument("--max-tokens", type=_integer(1), default=1024, help="largest max_tokens a request may ask for")
    serve.add_argument("--max-n", type=_integer(1), default=8, help="largest n (choices per request)")
    serve.add_argument("--max-sequences", type=_integer(1), default=64, help="sequences queued or running at once; more get HTTP 429")
    serve.add_argument("--max-request-bytes", type=_integer(1), default=1 << 20, help="largest request body")
    serve.add_argument("--gamma", type=_integer(1), default=4, help="draft tokens per round of draft and lookup requests (and seeded auto ones)")
    from exactspec.certification.mutants import MUTANTS

    serve.add_argument("--lossy-for-tests", choices=tuple(MUTANTS), help=argparse.SUPPRESS)  # a known-wrong verifier, to test audits
    serve.set_defaults(run=_serve, show=lambda result: None, json=False)

    cli_jobs.add_check_commands(add)

    train = add("train-draft", help="train a feature-level (EAGLE-style) draft for a Llama-family target on the CPU, within a time budget; rerun to resume")
    train.add_argument("--target", required=True, help="the target: a .gguf file, a Llama directory or a packaged model's name")
    train.add_argument("--out", required=True, help="the run's directory (data, checkpoints; the draft lands in OUT/draft)")
    train.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget for every phase together")
    train.add_argument("--vocab-subset", type=_integer(16), default=8192, help="tokens the draft's head covers (the most frequent in its data)")
    train.add_argument("--answers-per-prompt", type=_integer(1), default=4, help="the target's answers per training prompt, each sampled with its own seed, as time allows: every prompt once before any twice")
    train.add_argument("--ttt-steps", type=_integer(1), default=3, help="training-time-test depth: steps trained on the draft's own features")
    train.add_argument("--threads", type=_integer(1), help="CPU threads for torch (default: torch's choice)")
    train.add_argument("--seed", type=_integer(0), default=0, help="seed of the prompts, data order and initialisation")
    train.add_argument("--json", action="store_true", help="print the model card as JSON")
    train.set_defaults(run=_train_draft, show=_print_train_draft)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        result = args.run(args)
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            args.show(result)
        sys.stdout.flush()
    except CliError as error:
        print(f"exactspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nexactspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    interrupted = result.get("stop_reason") == "interrupted" or result.get("interrupted")
    return 130 if interrupted else 1 if result.get("passed") is False else 0
