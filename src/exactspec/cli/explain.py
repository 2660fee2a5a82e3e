"""``exactspec explain``: the exact law of one verification step for a (p, q) pair; with ``--block``, a two-token
block verified token-wise and by the block rule side by side."""

from __future__ import annotations

import argparse
import itertools
import math

import torch

from exactspec.cli.common import CliError
from exactspec.decoding import verify
from exactspec.decoding.block import block_thresholds


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
    if args.block:
        return {"tokens": labels, "target": target, "draft": draft, **two_token_block(p, q)}
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


def two_token_block(p: torch.Tensor, q: torch.Tensor) -> dict:
    """Every two-token draft (x1, x2) from q (the same p and q at every position): the law of the accepted length
    under each rule (token-wise: min(1, p/q) per position; block: P(tau = i) = h_i prod_{j > i} (1 - h_j)), the
    expected accepted lengths, and the law of the round's first two output tokens under each rule, which is p x p."""
    vocab = p.shape[0]
    accept = verify.acceptance_probabilities(p, q)  # (V,)
    rows, laws = (
        [],
        {
            "token": torch.zeros(vocab, vocab, dtype=torch.float64),
            "block": torch.zeros(vocab, vocab, dtype=torch.float64),
        },
    )
    expected = {"token": 0.0, "block": 0.0}
    for x1, x2 in itertools.product(range(vocab), repeat=2):
        drafted = float(q[x1] * q[x2])
        if drafted == 0:
            continue
        a1, a2 = float(accept[x1]), float(accept[x2])
        token = [1 - a1, a1 * (1 - a2), a1 * a2]
        w, h = block_thresholds(torch.tensor([[x1, x2]]), q.expand(1, 2, vocab), p.expand(1, 3, vocab))
        h1, h2 = (
            min(1.0, float(h[0, 1])),
            min(1.0, float(h[0, 2])),
        )  # rounding can put h a unit in the last place above 1
        block = [(1 - h1) * (1 - h2), h1 * (1 - h2), h2]
        rows.append({"draft": [x1, x2], "q": drafted, "token": token, "block": block})
        for rule, law in (("token", token), ("block", block)):
            expected[rule] += drafted * (law[1] + 2 * law[2])
            weights = [1.0, 1.0, 1.0] if rule == "token" else w[0].tolist()
            for tau, prob in enumerate(law):
                if tau == 2:  # both kept: the bonus token is the third, the first two are the draft
                    laws[rule][x1, x2] += drafted * prob
                    continue
                residual = (weights[tau] * p - q).clamp(min=0)
                residual = residual / residual.sum() if residual.sum() > 0 else p
                if tau == 0:  # the replacement is the first token, the second comes from p
                    laws[rule] += drafted * prob * torch.outer(residual, p)
                else:
                    laws[rule][x1] += drafted * prob * residual
    truth = torch.outer(p, p)
    return {
        "block_rows": rows,
        "expected_accepted": expected,
        "max_law_error": {rule: float((law - truth).abs().max()) for rule, law in laws.items()},
    }


def _show_block(r: dict) -> None:
    labels = r["tokens"]
    print(f"{'draft':>8} {'q(draft)':>9}   {'token-wise P(0, 1, 2 kept)':>28}   {'block P(0, 1, 2 kept)':>26}")
    for row in r["block_rows"]:
        draft = " ".join(labels[t] for t in row["draft"])
        print(
            f"{draft:>8} {row['q']:>9.4f}   "
            + " ".join(f"{x:>8.4f}" for x in row["token"])
            + "   "
            + " ".join(f"{x:>8.4f}" for x in row["block"])
        )
    print()
    e = r["expected_accepted"]
    print(f"expected kept draft tokens: token-wise {e['token']:.4f}, block {e['block']:.4f}")
    errors = r["max_law_error"]
    print(
        "law of the first two output tokens against p x p: largest error token-wise "
        f"{errors['token']:.1e}, block {errors['block']:.1e} (both exact)"
    )


def show(r: dict) -> None:
    if "block_rows" in r:
        _show_block(r)
        return
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
    explain.add_argument(
        "--block",
        action="store_true",
        help="a two-token block (same p and q at both positions): token-wise and block verification side by side",
    )
    explain.add_argument("--json", action="store_true", help="print JSON")
    explain.set_defaults(run=run, show=show)
