"""``exactspec cache``: what exactspec remembers between runs: each pair's acceptance (the adaptive policy's start),
this machine's measured call costs (``--backend auto``'s choice) and the ONNX graphs built from checkpoints."""

from __future__ import annotations

import argparse

from exactspec.tuning.machine import MachineCache
from exactspec.tuning.priors import PolicyCache


def run(args: argparse.Namespace) -> dict:
    from exactspec.models.onnx_runtime import GraphCache

    caches = {"policy": PolicyCache(), "machine": MachineCache(), "onnx": GraphCache()}
    result = {}
    for name, cache in caches.items():
        entries = [str(p) for p in cache.entries()]
        removed = cache.clear() if args.clear else 0
        result[name] = {"directory": str(cache.directory), "entries": [] if args.clear else entries, "removed": removed}
    return result


def show(r: dict) -> None:
    kinds = (
        ("policy", "pair(s)' acceptance"),
        ("machine", "measured runtime choice(s)"),
        ("onnx", "graph(s) built for ONNX Runtime"),
    )
    for name, what in kinds:
        c = r[name]
        if c["removed"]:
            print(f"removed {c['removed']} entries from {c['directory']}")
        else:
            print(f"{c['directory']}: {len(c['entries'])} {what}" + "".join(f"\n  {e}" for e in c["entries"]))


def add(add_command) -> None:
    """The ``cache`` command: its flags, run and show."""
    cache = add_command(
        "cache",
        help="what exactspec remembers: each model pair's acceptance (--gamma auto starts from it), "
        "this machine's measured call costs (--backend auto chooses from them) and the graphs built for ONNX Runtime",
    )
    cache.add_argument("--clear", action="store_true", help="remove every entry (the next run measures again)")
    cache.add_argument("--json", action="store_true", help="print JSON")
    cache.set_defaults(run=run, show=show)
