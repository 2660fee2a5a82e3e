"""The ``exactspec`` command's entry point. Ctrl-C while the library loads (torch and ONNX Runtime take a second or
more, partly in C++, where a KeyboardInterrupt can abort the process) is held until the imports finish, then answered
as it is once the command runs: one line and exit code 130."""

import signal
import sys


def main() -> int:
    held: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda number, frame: held.append(number))
    try:
        from exactspec.cli import main as run
    finally:
        signal.signal(signal.SIGINT, previous)
    if held:
        print("\nexactspec: interrupted", file=sys.stderr)
        return 130
    return run()
