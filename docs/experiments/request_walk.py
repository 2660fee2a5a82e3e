"""A one-off measurement, not part of the package: the files a real `exactspec generate` request passes through, in
the order the interpreter enters them (function calls traced with sys.setprofile, from generate's handler on), and how
often the path climbs back to a higher layer of tests/test_architecture.py's LAYERS.

    python docs/experiments/request_walk.py --target smollm2 --backend onnx --int8-activations --user "Hi" \
        --max-new-tokens 8 --json [--all]

Orchestration files are those outside the maths of a round (decoding/ but the decoder and the engine, models/,
proposers/ and the tokenizer); --all lists every file entered.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_architecture import _layer  # noqa: E402

PACKAGE = str(Path(__file__).resolve().parents[2] / "src" / "exactspec") + "/"
ROUND = ("decoding/", "models/", "proposers/", "tokenizer.py", "chat.py", "vocab.py", "cache_files.py", "version.py")
KEPT = ("decoding/decoder.py", "decoding/engine.py")


def main() -> None:
    show_all = "--all" in sys.argv
    argv = [a for a in sys.argv[1:] if a != "--all"]
    from exactspec.cli import main as cli_main

    path: list[str] = []

    def profile(frame, event, arg):  # from the request's handler on: parsing the command line is not the request
        if event != "call":
            return
        file = frame.f_code.co_filename
        if not file.startswith(PACKAGE):
            return
        if not path and not (file.endswith("cli/generate.py") and frame.f_code.co_name == "run"):
            return
        name = file[len(PACKAGE) :]
        if not show_all and name.startswith(ROUND) and name not in KEPT:
            return
        if not path or path[-1] != name:
            path.append(name)

    sys.setprofile(profile)
    try:
        cli_main(["generate", *argv])
    finally:
        sys.setprofile(None)
    seen, entered_twice, climbs = [], set(), 0
    for previous, name in zip([None, *path], path):
        if name in seen and previous != name:
            entered_twice.add(name)
        if name not in seen:
            seen.append(name)
        if previous is not None:
            up, down = _layer(f"exactspec/{name}"), _layer(f"exactspec/{previous}")
            climbs += up is not None and down is not None and up > down
    print(f"\n{len(seen)} files: {' -> '.join(seen)}", file=sys.stderr)
    print(
        f"{len(path)} entries in all; entered again: {sorted(entered_twice) or 'none'}; climbs: {climbs}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
