"""The one report format every bench writes (exactspec.bench.report): rows, ratios within a group, table, files."""

from __future__ import annotations

import json

import pytest

from exactspec.bench.report import Column, add_ratios, format_rows, rate_row, write_report


def _rows() -> list[dict]:
    return [
        rate_row("greedy", "code", "plain", [10.0, 12.0, 11.0]),
        rate_row("greedy", "code", "draft g=4", [30.0, 20.0, 22.0], alpha=0.5),
        rate_row("sample", "code", "draft g=4", [18.0]),  # its group has no plain arm
        rate_row("sample", "chat", "plain", [8.0, 9.0]),
    ]


def test_a_row_is_the_median_rate_and_its_spread():
    row = rate_row("greedy", "code", "plain", [12.0, 10.0, 11.0], tokens_per_call=1.0)
    assert row["tokens_per_second"] == 11.0 and row["spread"] == [10.0, 12.0] and row["tokens_per_call"] == 1.0


def test_ratios_are_taken_within_a_mode_and_workload_only():
    rows = _rows()
    add_ratios(rows, "speedup", "plain")
    assert [r["speedup"] for r in rows] == [1.0, pytest.approx(22.0 / 11.0), None, 1.0]
    add_ratios(rows, "vs_peer", "a peer that did not run")
    assert all(r["vs_peer"] is None for r in rows)


def test_the_table_has_one_titled_block_per_group_and_a_dash_for_missing_figures():
    rows = _rows()
    add_ratios(rows, "speedup", "plain")
    columns = (
        Column("arm", "arm", "s", 12),
        Column("tok/s", "tokens_per_second", ".1f"),
        Column("spread", "spread", "spread", 8),
        Column("speedup", "speedup", suffix="x", width=9),
    )
    table = format_rows(["header line"], rows, columns, notes={("sample", "code"): " (interrupted)"})
    lines = table.splitlines()
    assert lines[0] == "header line"
    assert [line for line in lines if line.startswith("==")] == [
        "== code / greedy ==",
        "== code / sample == (interrupted)",
        "== chat / sample ==",
    ]
    assert "draft g=4       22.0   20-30    2.00x" in lines
    assert lines[lines.index("== code / sample == (interrupted)") + 2].rstrip().endswith("-")


def test_write_report_writes_json_table_and_one_plot_per_entry(tmp_path):
    rows = _rows()
    report = {"results": rows}
    seen = []
    written = write_report(
        report,
        tmp_path / "new",
        "peers",
        "the table",
        {"extra": lambda r, path, plt: (seen.append(len(r)), path.write_bytes(b"png"))},
    )
    assert [p.name for p in written] == ["peers.json", "peers.txt", "peers.png", "extra.png"]
    assert json.loads(written[0].read_text()) == report and written[1].read_text() == "the table\n"
    assert written[2].stat().st_size > 1000 and seen == [4]
