"""What every command shares: the one-line error, flag types, the model and sampling flags, and the run plan they
name (:class:`RunPlan`)."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from exactspec.decoding.sampling import SamplingParams
from exactspec.loading import LOOKUP, PACKAGED_MODELS, SMALL_MODEL_PARAMETERS, PairSpec, check_device, default_dtype
from exactspec.tuning.priors import PolicyCache

if TYPE_CHECKING:
    from exactspec.loading import LoadedPair
    from exactspec.tuning.machine import RuntimeChoice


class CliError(Exception):
    """A user error: printed as one line, exit code 2. ``result``: what the command had done by then (a file that
    could not be written after the work), shown before the error."""

    def __init__(self, message: str, result: dict | None = None) -> None:
        super().__init__(message)
        self.result = result


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line instead of usage + message
        raise CliError(message)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows every option's default, except for flags and options without one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


#: Seeds are unsigned 64-bit integers (torch.Generator's range); -1 asks for a random one.
MAX_SEED = 2**64 - 1


def integer(minimum: int, maximum: int | None = None, expected: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in [minimum, maximum], else an error that says what is expected."""
    expected = expected or (
        f"an integer >= {minimum}" if maximum is None else f"an integer from {minimum} to {maximum}"
    )

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            raise argparse.ArgumentTypeError(f"must be {expected}, got {text!r}")
        return value

    return parse


seed_argument = integer(-1, MAX_SEED, "an integer in [0, 2^64 - 1], or -1 for a random seed")


def list_of(item: Callable[[str], object], what: str) -> Callable[[str], tuple]:
    def parse(text: str) -> tuple:
        try:
            values = tuple(item(part.strip()) for part in text.split(","))
        except (ValueError, argparse.ArgumentTypeError):
            values = ()
        if not values:
            raise argparse.ArgumentTypeError(f"must be comma-separated {what}, got {text!r}")
        return values

    return parse


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        if text not in choices:
            raise ValueError(text)
        return text

    return parse


def positive(name: str, value: float, allow_zero: bool = False) -> float:
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise CliError(f"--{name} must be a {'non-negative' if allow_zero else 'positive'} number, got {value}")
    return value


def gamma_argument(text: str) -> str | int:
    if text == "auto":
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 'auto' or an integer >= 0, got {text!r}")
    return value


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r} ({error.msg})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text!r}")
    return value


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--target",
        help=(
            f"target checkpoint: a directory, a .gguf file, a packaged model ({', '.join(PACKAGED_MODELS)}), "
            "or a hub id (org/name) in the local Hugging Face cache (default: the shipped target)"
        ),
    )
    parser.add_argument(
        "--draft",
        help=(
            f"draft checkpoint, as --target, or '{LOOKUP}' for prompt-lookup "
            f"drafting (default: the shipped draft; with --target alone, {LOOKUP})"
        ),
    )
    parser.add_argument(
        "--download",
        action="store_true",
        help=(
            "fetch a hub id (org/name) that is not in the local Hugging "
            "Face cache; the only time exactspec uses the network"
        ),
    )
    parser.add_argument(
        "--threads",
        type=integer(1),
        help=(
            f"CPU threads for torch (default: 1 for targets under {SMALL_MODEL_PARAMETERS // 10**6}M "
            "parameters, whose calls are too short to share, else torch's own choice)"
        ),
    )
    parser.add_argument(
        "--backend",
        choices=["auto", "lean", "hf", "llamacpp", "onnx"],
        default="auto",
        help=(
            "auto: the runtime, precision and threads this machine runs the pair fastest with, measured "
            "the first time and cached (see docs/runtimes.md); lean (Llama-family, torch), hf (any causal "
            "LM), llamacpp (a .gguf file on llama.cpp's kernels: pip install 'exactspec[llamacpp]') or onnx "
            "(a Llama .gguf file or directory on ONNX Runtime's kernels, the file's weights as stored)"
        ),
    )
    parser.add_argument("--device", default="cpu", help="where the models run: cpu, cuda, cuda:N or mps")
    parser.add_argument(
        "--dtype",
        choices=["auto", "float32", "bfloat16"],
        default="auto",
        help=(
            "bfloat16: faster, flat verify cost, where the CPU (AVX-512 BF16, AMX) or "
            "GPU has it natively; float32: closer to the checkpoint's own numbers; "
            "auto: bfloat16 where native or for a GGUF file's q4 weights, else float32"
        ),
    )
    parser.add_argument(
        "--weights",
        choices=["auto", "dense", "q4"],
        default="auto",
        help=(
            "dense: dequantize every weight to --dtype; q4: keep a GGUF file's 4-bit projections and run torch's int4 "
            "CPU kernel (bfloat16, CPU, lean backend; faster one-token calls); auto: q4 where it can run, else dense"
        ),
    )
    parser.add_argument(
        "--int8-activations",
        action="store_true",
        help=(
            "onnx backend: multiply the file's 4-bit weights with int8 blocks of the activations, as llama.cpp does "
            "(faster verification blocks; the run record names this precision); default: float32 activations"
        ),
    )
    parser.add_argument(
        "--invariant",
        action="store_true",
        help=(
            "call-size-invariant numerics (lean backend): a position's logits are the same bits "
            "whether computed alone or in a block of up to 17, so speculative output follows exactly "
            "the law of plain decoding in this precision; costs time (see docs/precision.md)"
        ),
    )


def add_sampling_arguments(parser: argparse.ArgumentParser, default_temperature: float = 1.0) -> None:
    parser.add_argument("--temperature", type=float, default=default_temperature, help="0 means greedy")
    parser.add_argument("--top-k", type=integer(0), default=0, help="keep the k most likely tokens (0: off)")
    parser.add_argument(
        "--top-p", type=float, default=1.0, help="keep the smallest set of tokens with this mass (1: off)"
    )
    parser.add_argument(
        "--min-p", type=float, default=0.0, help="drop tokens below this fraction of the top probability (0: off)"
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="divide positive / multiply negative logits of seen tokens (1: off)",
    )
    parser.add_argument(
        "--presence-penalty", type=float, default=0.0, help="subtract from the logits of generated tokens"
    )
    parser.add_argument(
        "--frequency-penalty", type=float, default=0.0, help="subtract this times the count of each generated token"
    )


def sampling(args: argparse.Namespace) -> SamplingParams:
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
        raise CliError(
            f"--{field.replace('_', '-')}{message[len(field) :]}" if hasattr(args, field) else message
        ) from None


@dataclass(frozen=True)
class RunPlan:
    """What a command runs, resolved once at the command line's edge and passed down unchanged: the pair as local
    paths on a concrete runtime (``spec``), and how ``--backend auto`` chose that runtime (``choice``; None where the
    flags named it, or where only the paths were asked for). Nothing is written back into the parsed flags."""

    spec: PairSpec
    choice: RuntimeChoice | None = None

    @property
    def dirs(self) -> tuple[Path, Path | None]:
        """The target checkpoint and the draft model's (None for plain decoding or prompt lookup)."""
        return self.spec.dirs()

    @property
    def precision(self) -> str:
        return self.spec.precision

    def load(self) -> LoadedPair:
        try:
            return self.spec.load()
        except (OSError, ValueError) as error:
            raise CliError(str(error)) from None


def run_plan(args: argparse.Namespace, with_draft: bool = True, choose: bool = True) -> RunPlan:
    """The plan the model flags name (:class:`exactspec.loading.PairSpec`), resolved to local paths (a hub id is
    fetched, with --download, here and only here), with ``--backend auto`` made concrete by measuring this machine
    (:func:`exactspec.tuning.machine.choose`: once, then cached). ``choose`` False: the paths only, for a command
    that must look at them before it measures anything. Call it after the command has checked its own flags."""
    if args.target is None and args.draft not in (None, LOOKUP):
        raise CliError("--draft needs --target (give neither for the shipped default pair)")
    try:
        spec = PairSpec(
            args.target,
            args.draft,
            with_draft,
            args.backend,
            flag_dtype(args),
            args.weights,
            args.invariant,
            args.device,
            args.download,
            args.threads,
            lookup_routing=not getattr(args, "no_lookup_routing", False),
            int8_activations=args.int8_activations,
        )
        if spec.backend == "auto" and choose:
            return _chosen(args, spec)
        return RunPlan(spec.resolved())
    except (FileNotFoundError, ValueError) as error:  # a missing checkpoint, flags that contradict each other
        raise CliError(str(error)) from None


def flag_dtype(args: argparse.Namespace) -> str:
    """``--dtype`` as the flags give it, with ``auto`` made concrete where the runtime is named (with ``--backend
    auto`` the machine's measurement chooses it): :func:`exactspec.loading.default_dtype`."""
    if args.dtype != "auto" or getattr(args, "backend", "auto") == "auto":
        return args.dtype
    return default_dtype(
        args.device, getattr(args, "target", None), getattr(args, "backend", "lean"), getattr(args, "weights", "auto")
    )


def _note(line: str) -> None:
    """A progress note for a person at a terminal (scripts read the run's --json instead)."""
    print(f"exactspec: {line}", file=sys.stderr, flush=True)


def _chosen(args: argparse.Namespace, spec: PairSpec) -> RunPlan:
    """``--backend auto``: the runtime, precision and threads this machine runs the pair fastest with."""
    from exactspec.tuning.machine import choose

    params = sampling(args) if hasattr(args, "temperature") else SamplingParams()
    try:
        check_device(spec.device)
        chosen, choice = choose(
            spec.resolved(),
            params,
            getattr(args, "verify", "block"),
            policy_cache=None if getattr(args, "no_policy_cache", False) else PolicyCache(),
            progress=_note if sys.stderr.isatty() else None,
            may_drop_draft=spec.draft is None,
        )
    except (OSError, ValueError) as error:
        raise CliError(str(error)) from None
    return RunPlan(chosen, choice)


def read_prompts(path: str | None, tokenizer) -> list[list[int]]:
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


def require_ray() -> None:
    try:
        import ray  # noqa: F401  (only whether it imports)
    except ImportError:
        raise CliError("--ray needs Ray: pip install 'exactspec[ray]'") from None
