"""``exactspec generate``: one prompt through :class:`exactspec.Speculator`, streamed."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from exactspec.chat import chat_messages
from exactspec.cli.common import (
    CliError,
    RunPlan,
    add_model_arguments,
    add_sampling_arguments,
    gamma_argument,
    integer,
    run_plan,
    sampling,
    seed_argument,
)
from exactspec.cli.files import check_record_path, write_record_file
from exactspec.decoding.block import RULES
from exactspec.decoding.sampling import SamplingParams
from exactspec.speculator import Speculator
from exactspec.tokenizer import stream_text
from exactspec.tuning.priors import PolicyCache

if TYPE_CHECKING:
    from exactspec.decoding.decoder import Generation
    from exactspec.decoding.stats import GenerationStats
    from exactspec.tuning.machine import RuntimeChoice


def run(args: argparse.Namespace) -> dict:
    params = sampling(args)
    check_record_path(args.record)
    text = _prompt_text(args)
    plan = run_plan(args, not args.no_speculation)
    choice = plan.choice
    speculator = Speculator(
        plan.spec,
        plan.load(),
        None if args.no_policy_cache else PolicyCache(),
        choice.calibration if choice else None,
    )
    try:  # before anything is printed
        prompt = speculator.encode(_prompt_ids(args, text, speculator.tokenizer))
        speculator.check_room(prompt, args.max_new_tokens)
    except ValueError as error:
        raise CliError(str(error).replace("max_new_tokens", "--max-new-tokens")) from None
    tokens = speculator.stream(
        prompt,
        max_new_tokens=args.max_new_tokens,
        sampling=params,
        gamma=args.gamma,
        seed=args.seed if args.seed >= 0 else None,
        stop_at_eos=not args.ignore_eos,
        verify=args.verify,
        compare_rules=args.json,
    )
    generation, stats = tokens.generation, tokens.generation.stats
    stops = frozenset() if args.ignore_eos else speculator.tokenizer.eos_token_ids
    pieces = []
    try:
        for piece in stream_text(speculator.tokenizer, (t for t in tokens if t not in stops)):  # stop: not printed
            pieces.append(piece)
            if not args.json:
                print(piece, end="", flush=True)
    except KeyboardInterrupt:  # Ctrl-C: keep what was generated and summarise it
        tokens.close()
        generation.finish_reason = "interrupted"
    if choice is not None:
        from exactspec.tuning.machine import observed_call_ms, recheck

        drift = recheck(choice, observed_call_ms(stats))
        if drift:
            print(f"exactspec: {drift}", file=sys.stderr)
    result = {
        "prompt": text,
        "threads": getattr(speculator.pair.target, "threads", torch.get_num_threads()),  # llama.cpp's own, or torch's
        "runtime": plan.spec.backend,
        "precision": plan.precision,
        "runtime_choice": choice.as_dict() if choice else None,
        "text": "".join(pieces),
        "token_ids": list(generation.tokens),
        "mode": "plain" if args.no_speculation else f"speculative ({speculator.proposal}), gamma {args.gamma}",
        "verify_rule": args.verify,
        "gammas_used": sorted({r.drafted for r in stats.rounds[1:]}),
        "seed": generation.seed,
        "sampling": "greedy" if params.greedy else "sampled",
        "stop_reason": generation.finish_reason,
        "tokens_per_second": stats.committed / stats.wall_seconds if stats.wall_seconds else 0.0,
        "policy": generation.policy,
        "cost_model": _cost_model(stats, generation.policy, choice),
        **stats.summary(),
    }
    if args.record:
        _write_generate_record(args, plan, speculator, params, generation, result)
    return result


def _cost_model(stats: GenerationStats, policy: dict | None, choice: RuntimeChoice | None) -> dict | None:
    """The run's wall time against what the cost model predicts for its own rounds from the call costs measured
    before it (the cold start's calibration, else the machine measurement that chose the runtime): efficiency below
    1 is time the loop spent beyond the modelled calls."""
    calibration = (policy or {}).get("calibration") or (
        choice.calibration.as_dict() if choice and choice.calibration else None
    )
    if calibration is None or not stats.wall_seconds:
        return None
    predicted = stats.modelled_seconds(calibration["target_ms"], calibration["draft_step_ms"])
    if predicted is None:
        return None
    return {
        "predicted_seconds": predicted,
        "wall_seconds": stats.wall_seconds,
        "efficiency": predicted / stats.wall_seconds,
    }


def _write_generate_record(
    args: argparse.Namespace,
    plan: RunPlan,
    speculator: Speculator,
    params: SamplingParams,
    generation: Generation,
    result: dict,
) -> None:
    from exactspec.jobs.records import run_record

    figures = {
        "token_ids": list(generation.tokens),
        "stop_reason": generation.finish_reason,
        "sampling": "greedy" if params.greedy else "sampled",
        "runtime_choice": result["runtime_choice"],
        "cost_model": result["cost_model"],
        **generation.stats.summary(),
    }
    record = run_record(
        "generate",
        args.argv,
        *speculator.dirs,
        params,
        speculator.proposal,
        f"{args.gamma}" if args.gamma == "auto" else f"fixed {args.gamma}",
        generation.seed,
        plan.precision,
        figures,
        args.verify,
    )
    write_record_file(record, args.record, result)


def _prompt_text(args: argparse.Namespace) -> str:
    """The prompt (or the user's chat turn) from the argument, standard input (``-``), ``--prompt-file`` or ``--user``:
    exactly one of them."""
    given = [args.prompt is not None, args.prompt_file is not None, args.user is not None]
    if sum(given) != 1:
        raise CliError(
            "give the prompt as an argument, as - (standard input), "
            "with --prompt-file or with --user, exactly one of them"
        )
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


#: How the summary line says where --backend auto's choice came from.
CHOICE_WORDS = {
    "measured now": "chosen by measuring this machine",
    "cached": "chosen from this machine's cached measurement",
    "only candidate": "the only runtime for these flags",
}


def show(r: dict) -> None:
    print()
    print(
        f"[{r['tokens']} tokens, {r['tokens_per_second']:.1f} tokens/s, "
        f"acceptance {r['acceptance_rate']:.2f} of {r['drafted']} drafted, "
        f"{r['tokens_per_round']:.2f} tokens/round, {r['mode']}, "
        f"{'greedy' if r['sampling'] == 'greedy' else 'seed ' + str(r['seed'])}, stop: {r['stop_reason']}, "
        f"{r['runtime']} runtime, {r['threads']} threads"
        + (f" ({CHOICE_WORDS[r['runtime_choice']['source']]})" if r.get("runtime_choice") else "")
        + (
            f"; drafting by {r['runtime_choice']['drafting']}"
            if (r.get("runtime_choice") or {}).get("drafting")
            else ""
        )
        + (
            f", calibration {r['policy']['calibration']['seconds']:.2f} s, prior: {r['policy']['prior_source']}"
            if r["policy"]
            else ""
        )
        + "]",
        file=sys.stderr,
    )


def add(add_command) -> None:
    """The ``generate`` command: its flags, run and show."""
    generate = add_command("generate", help="generate text with speculative decoding (default: the shipped pair)")
    generate.add_argument("prompt", nargs="?", help="text to continue; - reads it from standard input")
    generate.add_argument("--prompt-file", help="read the prompt from this file (UTF-8)")
    generate.add_argument(
        "--chat",
        action="store_true",
        help="send the prompt as a user turn through the model's chat template; stops at its end-of-turn token",
    )
    generate.add_argument("--system", help="system message of the chat (implies --chat)")
    generate.add_argument("--user", help="the user's message (implies --chat; instead of the prompt argument)")
    add_model_arguments(generate)
    generate.add_argument(
        "--gamma",
        type=gamma_argument,
        default="auto",
        help="draft tokens per round, or auto: chosen per round by the cost model",
    )
    generate.add_argument("--max-new-tokens", type=integer(1), default=128, help="stop after this many new tokens")
    generate.add_argument(
        "--verify",
        choices=RULES,
        default="block",
        help=(
            "verification of sampled drafts: block (the optimal exact rule, default) or "
            "token (token-wise min(1, p/q)); greedy and lookup drafts are unaffected"
        ),
    )
    generate.add_argument(
        "--seed",
        type=seed_argument,
        default=0,
        help="seed of the run's random generator, 0 to 2^64-1; -1 picks a random one (printed in the summary)",
    )
    generate.add_argument("--no-speculation", action="store_true", help="plain decoding of the target (the baseline)")
    generate.add_argument(
        "--no-lookup-routing",
        action="store_true",
        help="a trained draft drafts every round (by default rounds where the context repeats go to prompt lookup)",
    )
    generate.add_argument(
        "--no-policy-cache",
        action="store_true",
        help=(
            "with --gamma auto: neither read nor write the acceptance "
            "remembered from the last run of this pair (see `exactspec cache`)"
        ),
    )
    generate.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    add_sampling_arguments(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object instead of streaming")
    generate.add_argument(
        "--record",
        help="write the run record (models' hashes, sampling, mechanism, environment, tokens) to this JSON file",
    )
    generate.set_defaults(run=run, show=show)
