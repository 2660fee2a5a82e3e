"""Whether llama.cpp's Intel AMX kernels run in an exactspec process: probed once, in a child process that may crash.

ggml's CPU backend multiplies quantized weights with AMX tiles where the CPU has them and llama.cpp was compiled for
them (``-march=native`` on such a CPU; llama.cpp's system info then reports ``AMX_INT8 = 1``). Two things kill a
process that uses them, both seen with llama-cpp-python 0.3.36 on an Intel Xeon with AMX:

* **A GCC 12 build** (Debian 12's): that compiler's ``_tile_loadconfig`` declares a read of 8 bytes of the 64-byte
  tile configuration, so the stores that fill in the rest are dropped as dead, and ``ldtilecfg`` faults on the
  garbage (SIGSEGV) in every call of more than one token (one-token calls take a kernel without tiles).
* **torch beside it**: a build whose configuration is right (clang) loads it once per thread and assumes it stays;
  torch's own AMX kernels (oneDNN's, for bfloat16 products) release the tiles after each product, so llama.cpp's
  next tile load in that thread is an illegal instruction (SIGILL). exactspec runs torch beside llama.cpp: the
  runtime choice measures both, and drafts and sampling run in torch.

The AMX kernels come with llama.cpp's extra weight buffers (``use_extra_bufts``, which also hold the repacked
layouts of other CPUs). Where the CPU has AMX and the build uses it, a child process loads the model that way,
decodes a batch, runs a torch bfloat16 product and decodes again; if a signal kills it, the weights are loaded
without extra buffers (llama.cpp's plain kernels: correct, and slower than the AMX kernels run alone, as llama-server
runs them: docs/runtimes.md) and a warning says why. The verdict is cached per llama.cpp
library and model file in ``$EXACTSPEC_CACHE_DIR/llamacpp/tiles.json``.
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

from exactspec.cache_files import default_cache_dir, read_json_object, write_json_atomically

__all__ = ["cached_verdict", "cpu_has_amx", "extra_buffers_work", "probe_command", "survives"]

PROBE_TOKENS = 32  # a batch past one token: the tile kernels, not the one-token kernel
PROBE_SECONDS = 300


def cpu_has_amx(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    """Whether the CPU reports AMX's 8-bit matrix instructions (Linux's flags; False where they cannot be read)."""
    try:
        return any(line.startswith("flags") and "amx_int8" in line.split() for line in cpuinfo.read_text().splitlines())
    except OSError:
        return False


def survives(command: Sequence[str], timeout: float = PROBE_SECONDS) -> bool | None:
    """Whether ``command`` ends on its own (whatever its exit status) rather than killed by a signal; None where it
    ran past ``timeout`` (no verdict)."""
    try:
        done = subprocess.run(list(command), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None
    return done.returncode >= 0


def _file_key(path: Path) -> str:
    """What names a file (or a directory: a reinstall makes it anew) and changes when it is replaced."""
    stat = path.stat()
    return f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"


def cached_verdict(files: Sequence[Path], probe: Callable[[], bool | None], warning: str) -> bool:
    """``probe()``'s answer for these ``files`` (a program and the model it runs), asked once and cached in
    ``$EXACTSPEC_CACHE_DIR/llamacpp/tiles.json``; a None answer (no verdict) counts as True and is asked again next
    time. ``warning`` is issued wherever the answer is False."""
    cache = default_cache_dir() / "llamacpp" / "tiles.json"
    key = "|".join(map(_file_key, files))
    verdicts = read_json_object(cache)
    if key not in verdicts:
        verdict = probe()
        if verdict is None:
            return True
        verdicts[key] = verdict
        try:
            write_json_atomically(cache, verdicts)
        except OSError:
            pass  # a cache is never fatal: the probe runs again next time
    if not verdicts[key]:
        warnings.warn(warning, RuntimeWarning, stacklevel=3)
    return bool(verdicts[key])


def extra_buffers_work(model: Path, library: Path, system_info: str) -> bool:
    """Whether llama.cpp (its shared ``library`` or their directory, reporting ``system_info``) can decode ``model``
    with its extra weight buffers in this process: True without a probe unless the CPU has AMX and the build uses
    it (see the module docstring)."""
    if "AMX_INT8 = 1" not in system_info or not cpu_has_amx() or not model.is_file():
        return True  # (a file that is not there: the load itself says so)
    return cached_verdict(
        [library, model],
        lambda: survives(probe_command(model)),
        "llama.cpp's AMX kernels crash in this process (a GCC 12 build, or torch's own AMX kernels beside "
        "them): llama.cpp runs without them, slower on this CPU (docs/runtimes.md)",
    )


def probe_command(model: Path) -> list[str]:
    """The child process that decodes batches of ``model`` with llama.cpp's defaults around a torch bfloat16 product
    (exit status 0 when it did)."""
    return [
        sys.executable,
        "-c",
        "import sys; from exactspec.models.llamacpp import probe_extra_buffers; probe_extra_buffers(sys.argv[1])",
        str(model),
    ]
