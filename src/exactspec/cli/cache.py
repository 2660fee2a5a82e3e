"""``exactspec cache``: the adaptive policy's memory of each pair's acceptance."""

from __future__ import annotations

import argparse

from exactspec.decoding.priors import PolicyCache


def run(args: argparse.Namespace) -> dict:
    cache = PolicyCache()
    entries = [str(p) for p in cache.entries()]
    removed = cache.clear() if args.clear else 0
    return {"directory": str(cache.directory), "entries": [] if args.clear else entries, "removed": removed}


def show(r: dict) -> None:
    if r["removed"]:
        print(f"removed {r['removed']} entries from {r['directory']}")
    else:
        print(f"{r['directory']}: {len(r['entries'])} pair(s)" + "".join(f"\n  {e}" for e in r["entries"]))


def add(add_command) -> None:
    """The ``cache`` command: its flags, run and show."""
    cache = add_command("cache", help="the adaptive policy's memory of each model pair's acceptance (--gamma auto starts from it)")
    cache.add_argument("--clear", action="store_true", help="remove every entry")
    cache.add_argument("--json", action="store_true", help="print JSON")
    cache.set_defaults(run=run, show=show)
