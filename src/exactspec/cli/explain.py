"""``exactspec explain``: the exact law of one verification step for a (p, q) pair."""

from __future__ import annotations

import argparse
import math

import torch

from exactspec.decoding import verify
from exactspec.cli.common import CliError


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


def run(args: argparse.Namespace) -> dict:
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


def show(r: dict) -> None:
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


def add(add_command) -> None:
    """The ``explain`` command: its flags, run and show."""
    explain = add_command("explain", help="the exact law of one verification step for a (p, q) pair")
    explain.add_argument("--target", required=True, help="target distribution p, e.g. 0.6,0.3,0.1")
    explain.add_argument("--draft", required=True, help="draft distribution q, e.g. 0.5,0.25,0.25")
    explain.add_argument("--labels", help="token labels, e.g. A,B,C")
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.set_defaults(run=run, show=show)
