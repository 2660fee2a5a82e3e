"""The command-line interface: one module per command, each parsing its flags, calling the library and printing.

Every command module has ``add(add_command)`` (its parser, with ``run`` and ``show`` as defaults), ``run(args) ->
dict`` and ``show(result)``; :mod:`.common` holds the flags and helpers they share and :mod:`.files` the checks
of the files they write. Exit codes: 0 done; 1 a check that ran and failed (``certify``, ``audit``); 2 a user
error, printed as one line (a warning too); 130 interrupted by Ctrl-C (what was generated or measured so far is kept and
summarised); 141 the reader of stdout went away (``| head``), as for a process ended by SIGPIPE.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Sequence

from exactspec.cli import (
    audit,
    bench,
    cache,
    certify,
    cost,
    explain,
    export_eagle3,
    generate,
    generate_batch,
    replay,
    serve,
    train_draft,
)
from exactspec.cli.common import CliError, HelpFormatter, Parser
from exactspec.version import __version__

__all__ = ["build_parser", "main"]

COMMANDS = (
    explain,
    cost,
    generate,
    generate_batch,
    replay,
    bench,
    cache,
    serve,
    certify,
    audit,
    train_draft,
    export_eagle3,
)  # in --help order


def build_parser() -> Parser:
    parser = Parser(prog="exactspec", description="Exact speculative decoding.")
    parser.add_argument("--version", action="version", version=f"exactspec {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS:
        command.add(lambda name, **kw: commands.add_parser(name, formatter_class=HelpFormatter, **kw))
    return parser


def _show(args, result: dict) -> None:
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        args.show(result)
    sys.stdout.flush()


def _one_line(message, category, filename, lineno, line=None) -> str:
    return f"exactspec: warning: {message}\n"


def main(argv: Sequence[str] | None = None) -> int:
    args = None
    warnings.formatwarning = (
        _one_line  # the library's warnings, as one line each (not the source line that raised them)
    )
    try:
        args = build_parser().parse_args(argv)
        args.argv = list(sys.argv[1:] if argv is None else argv)
        result = args.run(args)
        _show(args, result)
    except CliError as error:
        if error.result is not None and args is not None:  # the work was done: show it, then say what failed
            _show(args, error.result)
        print(f"exactspec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nexactspec: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`| head`): stop quietly, as a SIGPIPE would
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 141
    interrupted = result.get("stop_reason") == "interrupted" or result.get("interrupted")
    return 130 if interrupted else 1 if result.get("passed") is False else 0
