"""Where speculation stops paying on this machine: the cost model's profile of a pair on each runtime.

Per committed token, speculative decoding at chain length gamma costs ``(gamma d + c'(gamma + 1)) / E_gamma`` against
plain decoding's ``c(1)`` (Leviathan et al. 2023, Thm 3.8, with acceptance by draft position):

* ``c(n)``: a target call of n tokens as plain decoding makes it; ``c'(n)`` the same with the draft's needs on (a
  feature draft's capture of the target's hidden states), so ``c'(1) - c(1)`` is what a draft costs every call;
* ``d``: one draft step; ``E_gamma = 1 + sum_{k <= gamma} prod_{i <= k} a_i`` with ``a_k`` the acceptance at draft
  position k (the draft's acceptance prior: its model card's held-out estimate, or the policy cache's).

For each runtime it measures ``c``, ``c'`` and ``d`` (:func:`exactspec.tuning.machine.measure`) and sets the
predicted speedup at the best gamma beside the ceilings with one cost taken away: every draft token accepted
(acceptance), a free draft step (draft cost), no capture (``c' = c``), a flat verification (``c'(n) = c'(1)``);
and with both the draft's and the verification's costs taken away (acceptance alone limits it); and the acceptance,
the same at every position, at which speculation breaks even. The ceiling that rises most names what stops it;
where none of the one-cost ceilings rises and the last does, two costs stop it at once.

    python -m exactspec.bench.ceiling --target smollm2 --threads 2

Prints a table per sampling mode (T=1 and greedy) and writes the figures as JSON with ``--output``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path

from exactspec.decoding import costmodel
from exactspec.decoding.sampling import GREEDY, SamplingParams

__all__ = ["profile", "break_even_acceptance", "measure_profiles", "format_profiles", "main"]

MODES = {"sampled": SamplingParams(), "greedy": GREEDY}
#: The ceilings: the prediction with one cost taken away, then with both the draft's and the verification's.
CEILINGS = (
    "every draft token accepted",
    "free draft step",
    "no capture (c' = c)",
    "flat verification (c'(n) = c'(1))",
    "free draft step and flat verification",
)


def _best(acceptance: Sequence[float], draft_ms: float, capture_ms: Mapping[int, float], plain_ms: float) -> dict:
    best = costmodel.chain_speedup(acceptance, draft_ms, capture_ms, plain_ms)
    return {"gamma": best.gamma, "speedup": best.speedup}


def break_even_acceptance(
    positions: int, draft_ms: float, capture_ms: Mapping[int, float], plain_ms: float
) -> float | None:
    """The smallest acceptance ``a``, the same at every draft position, at which the best chain length's speedup
    reaches 1 (None: not even ``a = 1`` pays). The speedup at any gamma rises with ``a``, so bisection finds it."""

    def pays(a: float) -> bool:  # the best of gamma 0..positions drafts
        return costmodel.chain_speedup([a] * positions, draft_ms, capture_ms, plain_ms).gamma > 0

    if not pays(1.0):
        return None
    low, high = 0.0, 1.0
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (low, middle) if pays(middle) else (middle, high)
    return high


def profile(
    plain_ms: Mapping[int, float], capture_ms: Mapping[int, float], draft_ms: float, acceptance: Sequence[float]
) -> dict:
    """The prediction and the ceilings of the module docstring, from measured costs (ms by call size n = 1..K+1, K =
    ``len(acceptance)``; ``plain_ms`` without the draft's needs, ``capture_ms`` with them) and acceptance by
    position."""
    base = plain_ms[1]
    flat = {n: capture_ms[1] for n in capture_ms}
    return {
        "acceptance": list(acceptance),
        "predicted": _best(acceptance, draft_ms, capture_ms, base),
        "ceilings": dict(
            zip(
                CEILINGS,
                (
                    _best([1.0] * len(acceptance), draft_ms, capture_ms, base),
                    _best(acceptance, 0.0, capture_ms, base),
                    _best(acceptance, draft_ms, plain_ms, base),
                    _best(acceptance, draft_ms, flat, base),
                    _best(acceptance, 0.0, flat, base),
                ),
            )
        ),
        "break_even_acceptance": break_even_acceptance(len(acceptance), draft_ms, capture_ms, base),
        "capture_ms": capture_ms[1] - base,
        "verify_ratio": capture_ms[len(acceptance) + 1] / capture_ms[1],  # c'(K + 1) / c'(1)
    }


def measure_profiles(target: str, draft: str | None, backend: str, threads: int | None, repeats: int) -> dict:
    """Measure every runtime candidate of ``backend`` (auto: all) and ``threads`` (None: all) that
    :func:`exactspec.tuning.machine.candidates` lists, with and without the draft, and profile each in both sampling
    modes."""
    from exactspec.loading import PairSpec
    from exactspec.models.base import check_local_checkpoint
    from exactspec.tuning import machine
    from exactspec.tuning.priors import acceptance_prior

    spec = PairSpec(target, draft, backend="auto", dtype="auto", weights="auto", threads=threads).resolved()
    target_dir, draft_dir = spec.dirs()
    check_local_checkpoint(target_dir)
    if draft_dir is None:
        raise ValueError(f"{target} has no trained draft to profile: give --draft")
    priors = {
        mode: acceptance_prior(target_dir, draft_dir, params, None, "block" if not params.greedy else "token")[0]
        for mode, params in MODES.items()
    }
    if not all(priors.values()):
        raise ValueError(
            f"{draft_dir} has no acceptance prior for this target (acceptance_prior.json, which train-draft writes)"
        )
    positions = max(len(rates) for rates in priors.values())
    runtimes = []
    for candidate in [c for c in machine.candidates(spec) if backend in ("auto", c.backend)]:
        print(f"measuring {candidate.label}", file=sys.stderr, flush=True)
        plain = machine.measure(replace(spec, speculate=False), candidate, positions, GREEDY, repeats)
        drafted = machine.measure(spec, candidate, positions, MODES["sampled"], repeats)
        runtimes.append(
            {
                "runtime": candidate.label,
                "candidate": asdict(candidate),
                "plain_ms": plain.target_ms,
                "capture_ms": drafted.target_ms,
                "draft_step_ms": drafted.draft_step_ms,
                "modes": {
                    mode: profile(plain.target_ms, drafted.target_ms, drafted.draft_step_ms, rates)
                    for mode, rates in priors.items()
                },
            }
        )
    return {
        "target": str(target_dir),
        "draft": str(draft_dir),
        "machine": machine.machine_signature(spec.device),
        "runtimes": runtimes,
    }


def format_profiles(report: dict) -> str:
    lines = [
        f"{Path(report['target']).name} with {report['draft']}; {report['machine']['cpu']} "
        f"({', '.join(report['machine']['flags'])}), {report['machine']['cores']} cores"
    ]
    for runtime in report["runtimes"]:
        c, cap = runtime["plain_ms"], runtime["capture_ms"]
        lines += [
            "",
            f"== {runtime['runtime']} ==",
            (
                f"c(n) plain: {', '.join(f'{ms:.1f}' for ms in c.values())} ms; "
                f"with capture: {', '.join(f'{ms:.1f}' for ms in cap.values())} ms "
                f"(n = 1..{len(cap)}); draft step {runtime['draft_step_ms']:.2f} ms"
            ),
        ]
        for mode, p in runtime["modes"].items():
            even = p["break_even_acceptance"]
            lines.append(
                f"  {mode}: acceptance {' / '.join(f'{a:.2f}' for a in p['acceptance'])} -> predicted "
                f"{p['predicted']['speedup']:.2f}x (gamma {p['predicted']['gamma']}); break-even acceptance "
                f"{'none pays' if even is None else f'{even:.2f}'}"
            )
            lines += [
                f"    ceiling, {name}: {figure['speedup']:.2f}x (gamma {figure['gamma']})"
                for name, figure in p["ceilings"].items()
            ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2", help="a checkpoint, a .gguf file or a packaged model's name")
    parser.add_argument("--draft", help="a trained feature draft's directory (default: the target's shipped draft)")
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "lean", "llamacpp"), help="auto: every runtime this machine has"
    )
    parser.add_argument(
        "--threads", type=int, help="the threads to measure (default: 1, 2, 4, ... up to the usable cores)"
    )
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per cost (their median)")
    parser.add_argument("--output", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    try:
        if args.repeats < 1 or (args.threads is not None and args.threads < 1):
            raise ValueError("--repeats and --threads must be >= 1")
        report = measure_profiles(args.target, args.draft, args.backend, args.threads, args.repeats)
        print(format_profiles(report))
        if args.output:
            Path(args.output).write_text(json.dumps(report, indent=2))
    except (OSError, ValueError, RuntimeError) as error:
        raise SystemExit(f"ceiling: {error}") from None


if __name__ == "__main__":
    main()
