"""``exactspec train-draft``: train a feature-level draft for a Llama-family target."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactspec.cli.common import CliError, integer
from exactspec.cli.files import check_record_path, prepare_output_dir
from exactspec.loading import resolve_checkpoint
from exactspec.training.draft_data import ANSWER_TEMPERATURE


def run(args: argparse.Namespace) -> dict:
    from exactspec.training.feature_draft import TrainDraftArgs, train_draft

    if args.answers and not Path(args.answers).is_file():
        raise CliError(f"--answers {args.answers}: no such file")
    if args.init_from and not Path(args.init_from).is_dir():
        raise CliError(f"--init-from {args.init_from}: no such directory")
    out_is_new = not Path(args.out).exists()
    try:
        from exactspec.models.base import check_local_checkpoint

        target = resolve_checkpoint(args.target)
        config = TrainDraftArgs(
            target,
            Path(args.out),
            args.minutes,
            args.vocab_subset,
            args.ttt_steps,
            answers_per_prompt=args.answers_per_prompt,
            seed=args.seed,
            threads=args.threads,
            backend=args.backend,
            layout=args.layout,
            answers=args.answers and Path(args.answers),
            keep_answers=args.keep_answers and Path(args.keep_answers),
            init_from=args.init_from and Path(args.init_from),
            mlp_units=args.mlp_units,
            train_dtype=args.train_dtype,
            tv_weight=args.tv_weight,
            lr=args.lr,
            answer_temperature=args.answer_temperature,
        )
        # the flags are refused first (a refused run leaves no directory), then the output is tried, then the target
        check_record_path(args.keep_answers, "--keep-answers")
        prepare_output_dir(Path(args.out), "--out")
        check_local_checkpoint(target)
        return train_draft(config)
    except (FileNotFoundError, ValueError, RuntimeError) as error:
        if out_is_new and Path(args.out).is_dir() and not any(Path(args.out).iterdir()):
            Path(args.out).rmdir()  # refused before any work (a starting draft of another shape): leave nothing behind
        raise CliError(str(error)) from None


def show(card: dict) -> None:
    acceptance = card["held_out_acceptance_by_position"]
    print(
        f"draft written to {card['out']}; held-out acceptance by position: "
        f"T=1 {', '.join(f'{a:.2f}' for a in acceptance['sampled'])}; "
        f"greedy {', '.join(f'{a:.2f}' for a in acceptance['greedy'])}"
    )


def add(add_command) -> None:
    """The ``train-draft`` command: its flags, run and show."""
    train = add_command(
        "train-draft",
        help=(
            "train a feature-level (EAGLE-style) draft for a Llama-family "
            "target on the CPU, within a time budget; rerun to resume"
        ),
    )
    train.add_argument(
        "--target", required=True, help="the target: a .gguf file, a Llama directory or a packaged model's name"
    )
    train.add_argument(
        "--out", required=True, help="the run's directory (data, checkpoints; the draft lands in OUT/draft)"
    )
    train.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget for every phase together")
    train.add_argument(
        "--vocab-subset",
        type=integer(16),
        default=8192,
        help="tokens the draft's head covers (the most frequent in its data)",
    )
    train.add_argument(
        "--answers-per-prompt",
        type=integer(1),
        default=4,
        help=(
            "the target's answers per training prompt, each sampled with its "
            "own seed, as time allows: every prompt once before any twice"
        ),
    )
    train.add_argument(
        "--ttt-steps",
        type=integer(1),
        default=3,
        help="training-time-test depth: steps trained on the draft's own features",
    )
    train.add_argument(
        "--threads", type=integer(1), help="CPU threads for torch and llama.cpp (default: torch's choice)"
    )
    train.add_argument(
        "--backend",
        choices=["auto", "lean", "llamacpp"],
        default="auto",
        help=(
            "the runtime of the answers and teacher phases: auto times one call of "
            "each on this machine where both can run the target (a .gguf file with "
            "llama-cpp-python installed) and takes the faster, else lean (torch)"
        ),
    )
    train.add_argument(
        "--layout",
        choices=["eagle3", "exactspec"],
        default="eagle3",
        help=(
            "the draft's layer: EAGLE-3's (the default: the layout llama.cpp, vLLM and SGLang load; "
            "`exactspec export-eagle3` writes it), or exactspec's first (w_in, then a Llama layer)"
        ),
    )
    train.add_argument(
        "--answers",
        help="start from these answers of the target (an earlier run's answers.jsonl, or gzipped: "
        "the costly part of the data); rows whose prompt this target's chat template encodes differently are refused",
    )
    train.add_argument(
        "--keep-answers",
        metavar="FILE",
        help=(
            "after the answers phase, write every answer the run has (taken and new) gzipped to FILE, "
            "where the run's machine going away does not take them (data/smollm2/answers.jsonl.gz for "
            "the shipped draft; it may be the --answers file itself)"
        ),
    )
    train.add_argument(
        "--init-from",
        metavar="DRAFT",
        help=(
            "start training from this draft's weights and vocabulary subset (one of the same layout for this target, "
            "such as the shipped one) instead of from scratch; a rerun of the same --out resumes its own checkpoint"
        ),
    )
    train.add_argument(
        "--mlp-units",
        type=integer(1),
        default=0,
        metavar="N",
        help=(
            "the draft's MLP width (default: the target's, as EAGLE-3 drafts have it); "
            "an --init-from draft with fewer units is widened to N computing what it "
            "computed (its new units start silent); EAGLE-3's format records the width"
        ),
    )
    train.add_argument(
        "--train-dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help=(
            "the training steps' arithmetic: bfloat16 autocast (float32 weights and loss), or float32; "
            "auto takes bfloat16 where the CPU computes it natively (AVX-512 BF16, AMX), float32 elsewhere"
        ),
    )
    train.add_argument(
        "--tv-weight",
        type=float,
        default=4.0,
        help=(
            "weight of a total-variation term (the T=1 rejection probability against the teacher's top-k) beside "
            "the cross-entropy loss (4, the best measured: docs/smollm2.md); 0 trains on the cross-entropy alone"
        ),
    )
    train.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help=(
            "peak learning rate: 50 steps of warm-up, then a cosine to a tenth of it over "
            "the run's budget (a lower one, 3e-4 say, for carrying an --init-from draft on)"
        ),
    )
    train.add_argument(
        "--answer-temperature",
        type=float,
        default=ANSWER_TEMPERATURE,
        help=(
            "the temperature the target's new answers are sampled at (each answer records its own; with "
            "--answers-per-prompt above the run's earlier count, a rerun adds answers at another temperature)"
        ),
    )
    train.add_argument("--seed", type=integer(0), default=0, help="seed of the prompts, data order and initialisation")
    train.add_argument("--json", action="store_true", help="print the model card as JSON")
    train.set_defaults(run=run, show=show)
