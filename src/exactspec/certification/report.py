"""What ``exactspec certify`` writes: a table, ``certify.json`` and ``certify.png`` (PIT histogram and QQ plot
with the Kolmogorov-Smirnov band of each configuration, and the acceptance rate by draft position)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from exactspec.certification.pit import ks_critical_value

__all__ = ["format_certify_table", "write_certify_outputs"]


def format_certify_table(report: dict) -> str:
    config = report["config"]
    lines = [
        (
            f"certify: {report['tokens']} sampled tokens in {report['seconds']:.0f} s "
            f"({report['precision']}, gamma {config['gamma']}); family-wise false-positive "
            f"rate {config['alpha']:g} (Holm over {len(report['tests'])} tests)"
        ),
        f"verdict: {'PASS' if report['passed'] else 'FAIL'}: the speculative law "
        f"{'is indistinguishable from' if report['passed'] else 'differs from'} the target's",
        f"smallest per-token total-variation shift the KS tests detect: about {report['detectable_tv']:.4f}",
    ]
    worst = sorted(report["tests"], key=lambda t: t["adjusted_p"])[:5]
    lines.append("smallest adjusted p-values:")
    lines += [f"  {t['adjusted_p']:10.3g}  {t['name']} (n={t['n']})" for t in worst]
    for name, c in report["per_config"].items():
        rates = " ".join(f"{r:.2f}" for r in c["acceptance_by_position"])
        lines.append(f"{name:>20}: {c['tokens']} tokens, acceptance by draft position {rates}")
    greedy = report["greedy"]
    lines.append(f"greedy: speculative equals plain on {greedy['equal']} of {greedy['prompts']} prompts")
    lines.append(
        "numerics: largest logit difference, a position alone vs "
        f"in a block: {report['numerics_max_logit_difference']:.3g}"
    )
    draws = report["draws"]
    lines.append(
        f"draw replay: {draws['mismatched']} of {draws['replayed']} sampled "
        "draft tokens are not the draw of the q the verifier was given"
    )
    for name, m in report.get("self_check", {}).items():
        if not m["applies"]:
            lines.append(f"self-check {name:>28}: {m['by']}")
            continue
        lines.append(
            f"self-check {name:>28}: {'rejected' if m['rejected'] else 'NOT rejected'} "
            f"(adjusted p {m['smallest_adjusted_p']:.3g}, by {m['by']})"
        )
    return "\n".join(lines)


def write_certify_outputs(report: dict, directory: str | Path) -> list[Path]:
    """certify.json (without the raw PIT values), certify.txt and certify.png."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = list(report["per_config"])
    figure, axes = plt.subplots(3, len(configs), figsize=(4 * len(configs), 10), squeeze=False)
    band_alpha = report["config"]["alpha"]
    for column, name in enumerate(configs):
        pit = np.sort(np.asarray(report["per_config"][name]["pit"]))
        n = len(pit)
        axes[0, column].hist(pit, bins=40, range=(0, 1), color="tab:blue")
        axes[0, column].axhline(n / 40, color="black", lw=1)
        axes[0, column].set(title=f"{name}: PIT (token id order)", xlabel="u")
        band = ks_critical_value(n, band_alpha)
        expected = (np.arange(n) + 0.5) / n
        axes[1, column].plot(expected, pit - expected, lw=1)
        axes[1, column].fill_between(
            [0, 1], -band, band, color="gray", alpha=0.3, label=f"KS band, alpha {band_alpha:g}"
        )
        axes[1, column].set(xlabel="uniform quantile", ylabel="PIT quantile - uniform quantile")
        axes[1, column].legend(fontsize=7)
        rates = report["per_config"][name]["acceptance_by_position"]
        axes[2, column].bar(range(len(rates)), rates)
        axes[2, column].set(xlabel="draft position", ylabel="P(accepted | reached)", ylim=(0, 1))
    figure.tight_layout()
    figure.savefig(directory / "certify.png", dpi=100)
    plt.close("all")
    slim = {
        **report,
        "per_config": {k: {f: v for f, v in c.items() if f != "pit"} for k, c in report["per_config"].items()},
    }
    (directory / "certify.json").write_text(json.dumps(slim, indent=2))
    (directory / "certify.txt").write_text(format_certify_table(slim) + "\n")
    return [directory / "certify.json", directory / "certify.txt", directory / "certify.png"]
