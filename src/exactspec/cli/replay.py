"""``exactspec replay``: rerun a generate record and compare its tokens."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from exactspec.cli import generate
from exactspec.cli.common import CliError, Parser


def run(args: argparse.Namespace) -> dict:
    from exactspec.jobs.records import replay_verdict

    try:
        record = json.loads(Path(args.record_file).read_text())
        kind, argv = record["kind"], list(record["argv"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise CliError(f"{args.record_file} is not a run record: {error}") from None
    if kind != "generate":
        raise CliError(f"{args.record_file} records a {kind} run; replay reruns generate records")
    if "--record" in argv:  # do not overwrite the record being replayed
        at = argv.index("--record")
        del argv[at : at + 2]
    parser = Parser(prog="exactspec")  # the recorded command line, parsed by the generate command alone
    generate.add(parser.add_subparsers(dest="command", required=True, parser_class=Parser).add_parser)
    rerun = parser.parse_args([*argv, "--json"])
    rerun.argv = argv
    result = generate.run(rerun)
    return {"record": args.record_file, **replay_verdict(record, result["token_ids"])}


def show(result: dict) -> None:
    if result["identical"]:
        print(f"identical: the rerun produced the same {result['tokens']} tokens")
    else:
        print(f"different from token {result['first_difference']}: {result['reason']}")


def add(add_command) -> None:
    """The ``replay`` command: its flags, run and show."""
    replay = add_command("replay", help="rerun a generate record and confirm it gives the same tokens (or say why not)")
    replay.add_argument("record_file", metavar="RECORD", help="a JSON file written by generate --record")
    replay.add_argument("--json", action="store_true", help="print JSON")
    replay.set_defaults(run=run, show=show)
