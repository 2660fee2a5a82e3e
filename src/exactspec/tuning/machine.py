"""The runtime, precision and threads that run a pair fastest on this machine: measured once, then cached.

Which runtime is fastest depends on the CPU and the file: llama.cpp's kernels beat torch's 4-bit path by 2-4x on
AVX2 CPUs for SmolLM2's Q4_1 file, while the cost of a verification block of n tokens, c(n), and so what speculation
can gain, differs from CPU to CPU and format to format. So ``--backend auto`` (the CLI's default) measures instead of
guessing:

1. :func:`candidates`: every way exactspec can run the target's weights *as stored* (a requantized file changes the
   model's numbers, so it is only ever run when the user names it): llama.cpp's runtime on a GGUF file (when
   llama-cpp-python is installed); ONNX Runtime's on a Llama GGUF file or directory (the file's own 4- and 8-bit
   blocks, float32 activations, or int8 ones where ``--int8-activations`` asks: :mod:`exactspec.models.onnx_runtime`);
   the lean runtime with a GGUF file's 4-bit weights kept (bfloat16 activations, CPU); the lean runtime dense in
   float32, and in bfloat16 where the device computes it natively; each at
   1, 2, 4, ... threads up to the cores this process may use (one thread for a target under
   :data:`exactspec.loading.SMALL_MODEL_PARAMETERS`, whose calls are too short to share).
2. :func:`measure`: per candidate, the target's call costs c(1..max_gamma+1) and one draft step
   (:func:`exactspec.tuning.calibration.calibrate`, on a fixed context).
3. :func:`predicted_ms_per_token`: the cost model with the draft's acceptance prior a_1..a_K (the policy cache's,
   else the shipped one): ``min over gamma of (gamma d + c(gamma + 1)) / E_gamma`` with ``E_gamma = 1 + sum_{k <=
   gamma} prod_{i <= k} a_i`` (:func:`exactspec.decoding.costmodel.expected_tokens_by_gamma`); plain decoding (or
   no prior) is ``c(1)``. The fastest prediction wins. Where the shipped draft's best gamma on the winner is 0 (it
   would never draft, yet its feature capture costs every call), prompt lookup drafts instead; a draft the user
   names is kept.

The measurements are cached per machine signature (CPU model, its vector flags, usable cores, device, the versions
of exactspec, torch and llama-cpp-python) and pair fingerprint, in ``$EXACTSPEC_CACHE_DIR/machine`` (default
``~/.cache/exactspec``); the prediction is made again each run, since the acceptance prior learns. ``--backend``,
``--dtype``, ``--weights`` and ``--threads`` given explicitly narrow the candidates; a single candidate is taken
without measuring. The chosen candidate's own costs also serve as the gamma policy's calibration, so a cached
machine starts generating without timing anything again.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from exactspec.cache_files import CacheDirectory, default_cache_dir, read_json_object, write_json_atomically
from exactspec.decoding.costmodel import expected_tokens_by_gamma
from exactspec.decoding.decoder import SpeculativeDecoder
from exactspec.decoding.policy import AdaptiveConfig
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.stats import GenerationStats
from exactspec.loading import LOOKUP, SMALL_MODEL_PARAMETERS, PairSpec, native_bfloat16
from exactspec.models.base import check_local_checkpoint, is_gguf
from exactspec.models.gguf import read_gguf
from exactspec.models.llamacpp import llama_cpp_available
from exactspec.proposers import LookupOrDraft
from exactspec.tuning.calibration import Calibration, calibrate
from exactspec.tuning.priors import PolicyCache, acceptance_prior, fingerprint

__all__ = [
    "AUTO",
    "Candidate",
    "MachineCache",
    "Measurement",
    "RuntimeChoice",
    "candidates",
    "choose",
    "machine_signature",
    "observed_call_ms",
    "recheck",
    "measure",
    "ms_per_token_by_gamma",
    "predicted_ms_per_token",
]

#: ``--backend auto``: the runtime (and precision and threads) chosen by measuring this machine.
AUTO = "auto"
#: The context the call costs are measured after (calibration re-feeds its last tokens).
CONTEXT_TOKENS = 64
#: How far (either way) a run's calls may cost from the cached measurement before it is taken again (:func:`recheck`).
DRIFT_FACTOR = 3.0
#: The CPU flags the kernels' speed depends on (a machine signature keeps only these).
_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "neon", "asimd")


@dataclass(frozen=True)
class Candidate:
    """One way to run the pair: a backend, the target's weights, the precision and the threads."""

    backend: str  # lean, llamacpp or onnx
    weights: str  # lean: q4 (a GGUF file's 4-bit blocks kept) or dense; llamacpp, onnx: auto (the file as stored)
    dtype: str  # lean: the target's activations; llamacpp, onnx: the feature draft's
    threads: int
    int8_activations: bool = False  # onnx: the 4-bit products on int8 blocks of activations (as llama.cpp's)

    @property
    def label(self) -> str:
        if self.backend in ("llamacpp", "onnx"):
            int8 = ", int8 activations" if self.int8_activations else ""
            return f"{self.backend} (file as stored{int8}), {self.threads} threads"
        return f"lean {self.weights} {self.dtype}, {self.threads} threads"


@dataclass(frozen=True)
class Measurement:
    candidate: Candidate
    target_ms: dict[int, float]  # call size in tokens -> ms
    draft_step_ms: float | None  # None without a draft model


@dataclass(frozen=True)
class RuntimeChoice:
    chosen: Candidate
    measurements: tuple[Measurement, ...]
    predicted_ms: tuple[float, ...]  # per measurement: ms per token the cost model predicts
    acceptance_prior: tuple[float, ...]
    source: str  # "measured now", "cached" or "only candidate"
    seconds: float  # spent measuring in this run
    draft_dropped: bool = False  # the shipped draft's best gamma on the chosen runtime is 0: prompt lookup runs instead
    cache_file: str | None = None  # where the measurements are kept (None: nothing measured)

    @property
    def calibration(self) -> Calibration | None:
        """The chosen candidate's measured costs, as the gamma policy's calibration (None: nothing measured, or
        measured with the draft that was dropped, whose feature capture and steps lookup does not pay for)."""
        for m in self.measurements:
            if m.candidate == self.chosen and not self.draft_dropped:
                return Calibration(m.target_ms, m.draft_step_ms, 0.0)
        return None

    @property
    def drafting(self) -> str | None:
        """In words, where the choice changed what drafts (None where it did not)."""
        if not self.draft_dropped:
            return None
        c = next(m.target_ms for m in self.measurements if m.candidate == self.chosen)
        return (
            f"prompt lookup: the shipped draft does not pay on {self.chosen.label} (best gamma 0 with its prior "
            f"acceptance {self.acceptance_prior[0]:.2f} at the first position and c(2)/c(1) = {c[2] / c[1]:.2f})"
        )

    def as_dict(self) -> dict:
        return {
            "chosen": self.chosen.label,
            "source": self.source,
            "seconds": round(self.seconds, 2),
            "acceptance_prior": list(self.acceptance_prior),
            "drafting": self.drafting,
            "candidates": [
                {
                    "runtime": m.candidate.label,
                    **asdict(m.candidate),
                    "target_ms": m.target_ms,
                    "draft_step_ms": m.draft_step_ms,
                    "predicted_ms_per_token": ms,
                }
                for m, ms in zip(self.measurements, self.predicted_ms)
            ],
        }


def usable_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_counts(cores: int) -> list[int]:
    """1, 2, 4, ... and the core count itself."""
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return counts + [cores]


def candidates(
    spec: PairSpec, cores: int | None = None, llama_cpp: bool | None = None, onnx: bool | None = None
) -> list[Candidate]:
    """The candidates for ``spec`` (see the module docstring); ``spec``'s explicit backend, dtype, weights and threads
    narrow them (``auto`` and None leave a choice open; a dtype or weights named rules out llama.cpp, whose
    precision is the file's)."""
    cores = cores or usable_cores()
    cpu = torch.device(spec.device).type == "cpu"
    native = native_bfloat16(spec.device)
    gguf = spec.target is not None and is_gguf(spec.target)
    llama_cpp = llama_cpp_available() if llama_cpp is None else llama_cpp
    onnx = onnx_available() if onnx is None else onnx
    small = _weight_bytes(spec.target) < SMALL_MODEL_PARAMETERS * 2 if spec.target is not None else True
    threads = [spec.threads] if spec.threads else thread_counts(cores) if cpu and not small else [1]
    dense_dtypes = ["float32"] + (["bfloat16"] if native else [])
    options = []
    if gguf and llama_cpp and not spec.invariant and (spec.backend == "llamacpp" or spec.dtype == spec.weights == AUTO):
        # llama.cpp's precision is the file's: a --dtype or --weights named asks for torch's runtime, unless llama.cpp
        # is named too (the dtype is then the torch side's: the draft's)
        options.append(
            Candidate("llamacpp", "auto", spec.dtype if spec.dtype != AUTO else "bfloat16" if native else "float32", 0)
        )
    if cpu and onnx and not spec.invariant and spec.dtype == spec.weights == AUTO and _onnx_runs(spec.target):
        # ONNX Runtime's 4-bit kernels on the file's own blocks, float32 activations; int8 activations, a coarser
        # precision (docs/runtimes.md), only where --int8-activations asks for them; named dtypes ask for torch's
        draft_dtype = "bfloat16" if native else "float32"
        options.append(Candidate("onnx", "auto", draft_dtype, 0, spec.int8_activations))
    if gguf and cpu and any(t.type_name in ("Q4_0", "Q4_1") for t in read_gguf(spec.target).tensors.values()):
        options.append(Candidate("lean", "q4", "bfloat16", 0))  # torch's int4 kernel on the file's own 4-bit blocks
    options += [Candidate("lean", "dense", dtype, 0) for dtype in dense_dtypes]
    chosen = [
        replace(c, threads=t)
        for c in options
        for t in threads
        if spec.backend in (AUTO, c.backend)
        and spec.dtype in (AUTO, c.dtype)
        and spec.weights in (AUTO, c.weights)
        and c.int8_activations >= spec.int8_activations  # asked for: the onnx candidate that has them
    ]
    if not chosen:
        if spec.weights == "q4" and not gguf:
            raise ValueError(f"--weights q4 keeps a GGUF file's 4-bit weights, and {spec.target} is not a .gguf file")
        if spec.backend == "llamacpp":
            raise ValueError(
                f"--backend llamacpp runs .gguf files; {spec.target} is not one"
                if not gguf
                else "--backend llamacpp needs llama-cpp-python: pip install 'exactspec[llamacpp]'"
            )
        raise ValueError(
            f"no runtime runs {spec.target} with --dtype {spec.dtype} and --weights {spec.weights} on {spec.device}"
        )
    return chosen


def onnx_available() -> bool:
    """Whether ONNX Runtime and onnx import here (without importing them)."""
    from importlib.util import find_spec

    return find_spec("onnxruntime") is not None and find_spec("onnx") is not None


def _onnx_runs(checkpoint: str | Path | None) -> bool:
    """Whether ``checkpoint`` is a Llama model that the ONNX graph builder reads and ONNX Runtime runs."""
    from exactspec.models.onnx_runtime import checkpoint_unsupported

    return checkpoint is not None and checkpoint_unsupported(checkpoint) is None


def _weight_bytes(checkpoint: str | Path) -> int:
    """The size of a checkpoint's weight files: a target under SMALL_MODEL_PARAMETERS (about 2 bytes each at most)
    runs calls too short for a second thread to pay, so only one is tried (the shipped toy pair)."""
    path = Path(checkpoint)
    files = (
        [path]
        if path.is_file()
        else [f for f in path.iterdir() if f.suffix in (".safetensors", ".bin", ".gguf")]
        if path.is_dir()
        else []
    )
    return sum(f.stat().st_size for f in files)


def machine_signature(device: str = "cpu") -> dict:
    """What the measured costs depend on besides the pair: the CPU and its vector flags, usable cores, device and
    the versions of the libraries that run the models."""
    from exactspec.version import __version__

    flags: set[str] = set()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("model name", "Model") and model in (platform.processor(), platform.machine()):
                model = value.strip()
            if key.strip() in ("flags", "Features") and not flags:
                flags = set(value.split())
    except OSError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    def installed(package: str, available: bool) -> str | None:
        try:
            return version(package) if available else None
        except PackageNotFoundError:  # importable without package metadata (a source build on the path)
            return "unknown"

    return {
        "cpu": model,
        "flags": sorted(flags & set(_FLAGS)),
        "cores": usable_cores(),
        "device": str(device),
        "exactspec": __version__,
        "torch": torch.__version__,
        "llama_cpp_python": installed("llama_cpp_python", llama_cpp_available()),
        "onnxruntime": installed("onnxruntime", onnx_available()),
        "python": f"{sys.version_info.major}.{sys.version_info.minor}",
    }


class MachineCache(CacheDirectory):
    """Measured costs per candidate, one JSON file per (machine signature, pair fingerprint)."""

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir() / "machine"

    def file(self, signature: dict, pair: str) -> Path:
        key = hashlib.sha256(json.dumps(signature, sort_keys=True).encode()).hexdigest()[:16]
        return self.directory / f"{key}-{pair}.json"


def measure(
    spec: PairSpec, candidate: Candidate, max_gamma: int, params: SamplingParams, repeats: int = 2
) -> Measurement:
    """The target's call costs and one draft step of ``spec``'s pair run as ``candidate`` (its own load), each the
    median of ``repeats`` timed calls."""
    pair = replace(
        spec,
        backend=candidate.backend,
        dtype=candidate.dtype,
        weights=candidate.weights,
        threads=candidate.threads,
        int8_activations=candidate.int8_activations,
    ).load()
    drafting = None
    if spec.speculate and not spec.lookup:  # the proposer a generation's cold start times, built the same way
        drafting = SpeculativeDecoder(pair.target, pair.proposer(), params).proposer
        drafting = drafting.draft if isinstance(drafting, LookupOrDraft) else drafting
    vocab = pair.target.vocab_size
    context = [(100 + i) % vocab for i in range(CONTEXT_TOKENS)]
    calibration = calibrate(pair.target, drafting, context, max_gamma, repeats, params)
    return Measurement(candidate, calibration.target_ms, calibration.draft_step_ms)


def ms_per_token_by_gamma(
    measurement: Measurement, acceptance: tuple[float, ...], speculate: bool, max_gamma: int
) -> dict[int, float]:
    """gamma -> the cost model's ms per committed token, ``(gamma d + c(gamma + 1)) / E_gamma`` (module docstring,
    step 3); only gamma 0, ``c(1)``, for plain decoding or without a prior or a draft cost."""
    c, d = measurement.target_ms, measurement.draft_step_ms
    if not speculate or not acceptance or d is None:
        return {0: c[1]}
    rates = list(acceptance[:max_gamma]) + [acceptance[-1]] * (max_gamma - len(acceptance))
    expected = expected_tokens_by_gamma(rates)
    return {g: (g * d + c[g + 1]) / expected[g] for g in range(max_gamma + 1) if g + 1 in c}


def predicted_ms_per_token(
    measurement: Measurement, acceptance: tuple[float, ...], speculate: bool, max_gamma: int
) -> float:
    """The cost model's ms per committed token at the best gamma."""
    return min(ms_per_token_by_gamma(measurement, acceptance, speculate, max_gamma).values())


def choose(
    spec: PairSpec,
    params: SamplingParams = SamplingParams(),
    rule: str = "block",
    cache: MachineCache | None = None,
    policy_cache: PolicyCache | None = None,
    progress: Callable[[str], None] | None = None,
    may_drop_draft: bool = False,
) -> tuple[PairSpec, RuntimeChoice]:
    """``spec`` (resolved: local paths) with its backend, dtype, weights and threads chosen as the module docstring
    says, and the choice's record. ``progress`` receives a line before a measurement starts. ``may_drop_draft``: the
    draft is the shipped one, not named by the user, and gives way to prompt lookup where it would never draft."""
    max_gamma = AdaptiveConfig().max_gamma
    target_dir, draft_dir = spec.dirs()
    check_local_checkpoint(target_dir)  # the draft is checked where it loads (a feature draft is not a checkpoint)
    options = candidates(spec)
    acceptance, _ = (
        acceptance_prior(target_dir, draft_dir, params, policy_cache, rule) if spec.speculate else ((), "none")
    )
    began, source, measured = time.perf_counter(), "only candidate", ()
    if len(options) > 1:
        file = (cache or MachineCache()).file(machine_signature(spec.device), fingerprint(target_dir, draft_dir))
        cached = {
            label: entry for label, entry in read_json_object(file).items() if _well_formed(entry)
        }  # the rest: measured again
        missing = [c for c in options if c.label not in cached]
        if missing and progress:
            progress(
                f"measuring {len(missing)} ways to run {Path(str(target_dir)).name} "
                f"on this machine (once; cached in {file.parent})"
            )
        for candidate in missing:
            m = measure(spec, candidate, max_gamma, params)
            cached[candidate.label] = {"target_ms": m.target_ms, "draft_step_ms": m.draft_step_ms}
        if missing:
            try:
                write_json_atomically(file, cached)
            except OSError:  # an unwritable cache costs a measurement next time, never the run
                pass
        measured = tuple(
            Measurement(
                c, {int(n): ms for n, ms in cached[c.label]["target_ms"].items()}, cached[c.label]["draft_step_ms"]
            )
            for c in options
        )
        source = "measured now" if missing else "cached"
    predicted = tuple(predicted_ms_per_token(m, acceptance, spec.speculate, max_gamma) for m in measured)
    best = min(range(len(measured)), key=predicted.__getitem__) if measured else None
    chosen = measured[best].candidate if measured else options[0]
    # A shipped draft whose best gamma here is 0 never drafts, yet its feature capture and catch-up cost every
    # call: prompt lookup instead. A draft the user named is kept.
    dropped = (
        may_drop_draft
        and best is not None
        and spec.speculate
        and not spec.lookup
        and measured[best].draft_step_ms is not None
        and bool(acceptance)
        and _best_gamma(measured[best], acceptance, max_gamma) == 0
    )
    choice = RuntimeChoice(
        chosen,
        measured,
        predicted,
        tuple(acceptance),
        source,
        time.perf_counter() - began,
        dropped,
        str(file) if measured else None,
    )
    return replace(
        spec,
        backend=chosen.backend,
        dtype=chosen.dtype,
        weights=chosen.weights,
        threads=chosen.threads or None,
        int8_activations=chosen.int8_activations,
        draft=LOOKUP if dropped else spec.draft,
    ), choice


def observed_call_ms(stats: GenerationStats) -> dict[int, float]:
    """The median ms of a run's verification calls by the tokens each fed (drafted + 1); the prompt's prefill (the
    first record) left out."""
    by_size: dict[int, list[float]] = {}
    for record in stats.rounds[1:]:
        by_size.setdefault(record.drafted + 1, []).append(record.target_seconds * 1000)
    return {n: statistics.median(ms) for n, ms in by_size.items()}


def recheck(choice: RuntimeChoice, observed_ms: dict[int, float]) -> str | None:
    """A cached choice held against the calls a run made (:func:`observed_call_ms`): where the run's calls cost more
    than :data:`DRIFT_FACTOR` times the cached ones, or less than their share, the cached measurements of this
    machine and pair are forgotten, so the next run measures again; returns the line that says so, else None. One
    measurement taken while something else ran must not decide every later run."""
    if choice.source != "cached" or choice.cache_file is None:
        return None
    cached = next(m.target_ms for m in choice.measurements if m.candidate == choice.chosen)
    ratios = [ms / cached[n] for n, ms in observed_ms.items() if cached.get(n, 0) > 0]
    if not ratios:
        return None
    ratio = statistics.median(ratios)
    if 1 / DRIFT_FACTOR <= ratio <= DRIFT_FACTOR:
        return None
    Path(choice.cache_file).unlink(missing_ok=True)
    return (
        f"this run's calls on {choice.chosen.label} cost {ratio:.2g}x what this machine's cached measurement says "
        f"(c(1) {cached[1]:.1f} ms): it was forgotten, and the next run measures again"
    )


def _well_formed(entry) -> bool:
    """A cached measurement: call costs for 1.. tokens as positive numbers, and a draft step that is a number or
    null."""
    try:
        costs = {int(n): float(ms) for n, ms in entry["target_ms"].items()}
        step = entry["draft_step_ms"]
        return 1 in costs and all(ms > 0 for ms in costs.values()) and (step is None or float(step) >= 0)
    except (TypeError, KeyError, ValueError, AttributeError):
        return False


def _best_gamma(measurement: Measurement, acceptance: tuple[float, ...], max_gamma: int) -> int:
    by_gamma = ms_per_token_by_gamma(measurement, acceptance, True, max_gamma)
    return min(by_gamma, key=by_gamma.__getitem__)
