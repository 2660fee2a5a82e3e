"""The one report every bench writes: rows of (mode, workload, arm), each a rate with its spread and its ratios to the
run's baselines; one table writer and one plot writer over them.

A row is a dict with at least ``mode``, ``workload``, ``arm``, ``tokens_per_second`` (a median) and ``spread``
(``[lowest, highest]``). :func:`add_ratios` adds ``speedup`` (over exactspec's plain decoding of the same run) and a
peer's ratio (``vs_hf_assisted``, ``vs_llama_cpp_plain``), always within one (mode, workload) group: arms are only
compared where they ran on the same prompts, interleaved.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Column", "rate_row", "add_ratios", "groups", "format_rows", "write_report"]


def rate_row(mode: str, workload: str, arm: str, rates: list[float], **figures) -> dict:
    """A row: the median of ``rates`` (tokens/s, one per repetition or per prompt) and their spread."""
    return {
        "mode": mode,
        "workload": workload,
        "arm": arm,
        "tokens_per_second": statistics.median(rates),
        "spread": [min(rates), max(rates)],
        **figures,
    }


def groups(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """Rows by (mode, workload), in the order they first appear."""
    grouped: dict[tuple[str, str], list[dict]] = {}
    for row in rows:
        grouped.setdefault((row["mode"], row["workload"]), []).append(row)
    return grouped


def add_ratios(rows: list[dict], key: str, baseline: str | None) -> None:
    """Set ``row[key]``: the row's rate over the rate of arm ``baseline`` in its group (None where that arm is
    absent)."""
    for group in groups(rows).values():
        base = next((r["tokens_per_second"] for r in group if r["arm"] == baseline), None)
        for row in group:
            row[key] = row["tokens_per_second"] / base if base else None


@dataclass(frozen=True)
class Column:
    title: str
    key: str
    spec: str = ".2f"  # a format spec for the value; "spread" prints [low, high] as low-high
    width: int = 8
    suffix: str = ""


def _text(row: dict, column: Column) -> str:
    value = row.get(column.key)
    if value is None:
        return "-"
    if column.spec == "spread":
        return f"{value[0]:.0f}-{value[1]:.0f}"
    return f"{value:{column.spec}}{column.suffix}"


def _aligned(text: str, column: Column, width: int) -> str:
    return f"{text:<{width}}" if column.spec == "s" else f"{text:>{width}}"


def format_rows(header: list[str], rows: list[dict], columns: tuple[Column, ...], notes: dict | None = None) -> str:
    """``header`` lines, then one titled table per (mode, workload); ``notes[(mode, workload)]`` follows its title.
    A column is as wide as its width, or its longest title or cell plus a space where that is wider."""
    widths = [max(c.width, *(len(x) + 1 for x in [c.title, *(_text(row, c) for row in rows)])) for c in columns]
    lines = list(header)
    titles = "".join(_aligned(c.title, c, w) for c, w in zip(columns, widths))
    for (mode, workload), group in groups(rows).items():
        lines += ["", f"== {workload} / {mode} =={(notes or {}).get((mode, workload), '')}", titles]
        lines += ["".join(_aligned(_text(row, c), c, w) for c, w in zip(columns, widths)) for row in group]
    return "\n".join(lines)


def plot_rates(rows: list[dict], path: Path, plt) -> None:
    """Tokens/s of every arm with its spread as error bars, one panel per (mode, workload); exactspec's arms blue."""
    grouped = groups(rows)
    figure, axes = plt.subplots(1, len(grouped), figsize=(4.5 * len(grouped), 4.2), squeeze=False)
    for axis, ((mode, workload), group) in zip(axes[0], grouped.items()):
        rates = [r["tokens_per_second"] for r in group]
        errors = [
            [rate - r["spread"][0] for rate, r in zip(rates, group)],
            [r["spread"][1] - rate for rate, r in zip(rates, group)],
        ]
        peer = ("hf ", "llama.cpp", "llama-server")
        axis.bar(
            range(len(group)),
            rates,
            yerr=errors,
            capsize=3,
            color=["tab:orange" if r["arm"].startswith(peer) else "tab:blue" for r in group],
        )
        axis.set_xticks(
            range(len(group)), [r["arm"].replace(" (", "\n(") for r in group], rotation=60, ha="right", fontsize=7
        )
        axis.set(title=f"{workload} / {mode}", ylabel="tokens/s (median; bars: spread)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def write_report(
    report: dict, directory: str | Path, stem: str, table: str, plots: dict[str, Callable] | None = None
) -> list[Path]:
    """STEM.json (the report), STEM.txt (``table``), STEM.png (:func:`plot_rates`) and one PNG per ``plots`` entry
    (name -> function(rows, path, pyplot)); returns the paths written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    written = [directory / f"{stem}.json", directory / f"{stem}.txt"]
    written[0].write_text(json.dumps(report, indent=2))
    written[1].write_text(table + "\n")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, plot in {stem: plot_rates, **(plots or {})}.items():
        written.append(directory / f"{name}.png")
        plot(report["results"], written[-1], plt)
    plt.close("all")
    return written
