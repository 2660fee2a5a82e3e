"""``exactspec cost``: the expected speedup of the cost model (Leviathan et al. 2023, Thm 3.8)."""

from __future__ import annotations

import argparse

from exactspec.cli.common import CliError, integer, positive
from exactspec.decoding import costmodel


def run(args: argparse.Namespace) -> dict:
    positive("target-ms", args.target_ms)
    positive("draft-ms", args.draft_ms, allow_zero=True)
    positive("verify-cost", args.verify_cost)
    if not 0 <= args.alpha <= 1:
        raise CliError(f"--alpha must be in [0, 1], got {args.alpha}")
    c = args.draft_ms / args.target_ms
    gamma = (
        costmodel.best_gamma(args.alpha, c, args.max_gamma, args.verify_cost).gamma if args.best_gamma else args.gamma
    )
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


def show(r: dict) -> None:
    print(
        f"gamma {r['gamma']}, alpha {r['alpha']}, cost ratio c "
        f"{r['cost_ratio']:.4g}, verify cost {r['verify_cost']:.4g}"
    )
    print(f"tokens per round  {r['tokens_per_round']:.4f}")
    print(f"ms per token      {r['ms_per_token']:.2f}  (plain decoding: {r['baseline_ms_per_token']:.2f})")
    print(f"speedup           {r['speedup']:.4f}x")


def add(add_command) -> None:
    """The ``cost`` command: its flags, run and show."""
    cost = add_command("cost", help="expected speedup from the cost model (Leviathan et al. 2023, Thm 3.8)")
    cost.add_argument("--gamma", type=integer(0), default=4, help="draft tokens per round")
    cost.add_argument("--alpha", type=float, required=True, help="acceptance rate in [0, 1]")
    cost.add_argument("--target-ms", type=float, required=True, help="time of one target call")
    cost.add_argument("--draft-ms", type=float, required=True, help="time of one draft call")
    cost.add_argument("--verify-cost", type=float, default=1.0, help="cost of verifying gamma+1 tokens relative to one")
    cost.add_argument(
        "--best-gamma", action="store_true", help="search gamma in 0..--max-gamma instead of using --gamma"
    )
    cost.add_argument("--max-gamma", type=integer(0), default=16, help="largest gamma --best-gamma tries")
    cost.add_argument("--json", action="store_true", help="print JSON")
    cost.set_defaults(run=run, show=show)
