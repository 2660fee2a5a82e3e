"""Acceptance-by-position priors for the adaptive policy: shipped with a draft, or remembered per pair.

Two sources, best first:

* the **policy cache**: after a ``generate`` run with ``--gamma auto``, the
  policy's final acceptance estimates are stored under a fingerprint of the
  (target, draft) pair and the sampling mode (greedy or sampled), so the next
  run with the same pair starts where the last one ended. The cache lives in
  ``$EXACTSPEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/exactspec``, else
  ``~/.cache/exactspec``; ``exactspec cache --clear`` empties it and
  ``--no-policy-cache`` neither reads nor writes it;
* the draft's **shipped prior** ``acceptance_prior.json`` in its directory:
  acceptance by position measured on held-out prompts with the target it was
  made for (``python -m exactspec.bench.priors`` writes one), used only when the
  fingerprint of the pair (both models' config and weights) matches.

A prior only sets where the policy starts; gamma never depends on the current
round's random numbers, so the output law is the target's whatever the prior.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

from exactspec.cache_files import CacheDirectory, default_cache_dir, read_json_object, write_json_atomically
from exactspec.decoding.sampling import SamplingParams

__all__ = [
    "PRIOR_FILE",
    "PolicyCache",
    "acceptance_prior",
    "fingerprint",
    "mode_key",
    "shipped_prior",
    "write_shipped_prior",
]

PRIOR_FILE = "acceptance_prior.json"
_SAMPLE_BYTES = 1 << 20  # of each weights file's head and tail, hashed with its size


def mode_key(params: SamplingParams, rule: str = "token") -> str:
    """The acceptance regime a prior belongs to: greedy decoding and sampling differ a lot, and sampled drafts
    verified by the block rule keep more than token-wise ("sampled-block")."""
    return "greedy" if params.greedy else "sampled" if rule == "token" else "sampled-block"


def fingerprint(*checkpoints: str | Path | None) -> str:
    """A short hash of checkpoints (directories or single files; None for a model-free proposer such as prompt
    lookup): config.json, and each weights file's size, head and tail (fast on big files)."""
    digest = hashlib.sha256()
    for checkpoint in checkpoints:
        if checkpoint is None:
            digest.update(b"<no draft model>")
            continue
        checkpoint = Path(checkpoint)
        for file in [checkpoint] if checkpoint.is_file() else sorted(checkpoint.iterdir()):
            if file.name == "config.json" or file.suffix in (".safetensors", ".gguf", ".bin"):
                size = file.stat().st_size
                digest.update(f"{file.name}:{size}".encode())
                with file.open("rb") as handle:
                    digest.update(handle.read(_SAMPLE_BYTES))
                    handle.seek(max(0, size - _SAMPLE_BYTES))
                    digest.update(handle.read(_SAMPLE_BYTES))
    return digest.hexdigest()[:16]


def _rates(value: object) -> tuple[float, ...] | None:
    """A valid list of acceptance rates, or None (a damaged or foreign file is ignored, never fatal)."""
    if not isinstance(value, list) or not value:
        return None
    if not all(isinstance(v, (int, float)) and 0 <= v <= 1 for v in value):
        return None
    return tuple(float(v) for v in value)


def shipped_prior(draft_dir: str | Path, target_dir: str | Path, mode: str) -> tuple[float, ...] | None:
    """The draft's shipped acceptance by position for ``mode``, if it was measured with this very pair
    (a draft retrained in place, or paired with another target, does not inherit it)."""
    record = read_json_object(Path(draft_dir) / PRIOR_FILE)
    if record.get("pair_fingerprint") != fingerprint(target_dir, draft_dir):
        return None
    return _rates(record.get("acceptance_by_position", {}).get(mode))


def write_shipped_prior(
    draft_dir: str | Path, target_dir: str | Path, by_mode: dict[str, Sequence[float]], how: str
) -> Path:
    file = Path(draft_dir) / PRIOR_FILE
    write_json_atomically(
        file,
        {
            "pair_fingerprint": fingerprint(target_dir, draft_dir),
            "acceptance_by_position": {mode: [round(r, 4) for r in rates] for mode, rates in by_mode.items()},
            "measured": how,
        },
    )
    return file


def acceptance_prior(
    target_dir: str | Path,
    draft_dir: str | Path | None,
    params: SamplingParams,
    cache: PolicyCache | None,
    rule: str = "token",
) -> tuple[tuple[float, ...], str]:
    """``(rates, source)``: the cache's entry for this pair, mode and verification rule, else the draft's shipped
    prior for them, else none. Under the block rule a token-wise prior stands in for a missing block one (source
    "... token-wise"): the block rule keeps at least as much on average, so it errs towards shorter drafts."""
    own, token_wise = mode_key(params, rule), mode_key(params)
    for mode, suffix in [(own, "")] + ([(token_wise, " token-wise")] if own != token_wise else []):
        rates = cache.load(fingerprint(target_dir, draft_dir), mode) if cache is not None else None
        if rates:
            return rates, "cache" + suffix
        rates = None if draft_dir is None else shipped_prior(draft_dir, target_dir, mode)
        if rates:
            return rates, "shipped" + suffix
    return (), "none"


class PolicyCache(CacheDirectory):
    """Acceptance counts by draft position per (pair fingerprint, mode), one small JSON file per pair.

    Counts add up over runs; once a position has ``MAX_COUNT`` observations both of its counts are scaled
    down, so the estimate follows a pair whose behaviour drifts. A rate is served only for the leading
    positions with at least ``MIN_COUNT`` observations (the policy repeats the last one beyond).
    """

    MIN_COUNT = 8
    MAX_COUNT = 256

    def __init__(self, directory: str | Path | None = None) -> None:
        self.directory = Path(directory) if directory is not None else default_cache_dir() / "policy"

    def _file(self, pair: str) -> Path:
        return self.directory / f"{pair}.json"

    def _counts(self, pair: str, mode: str) -> tuple[list[float], list[float]]:
        entry = read_json_object(self._file(pair)).get(mode)
        try:
            reached, accepted = [float(n) for n in entry["reached"]], [float(a) for a in entry["accepted"]]
        except (TypeError, KeyError, ValueError):
            return [], []  # absent or damaged: start afresh
        if len(reached) != len(accepted) or any(not 0 <= a <= n for n, a in zip(reached, accepted)):
            return [], []
        return reached, accepted

    def load(self, pair: str, mode: str) -> tuple[float, ...] | None:
        rates = []
        for n, a in zip(*self._counts(pair, mode)):
            if n < self.MIN_COUNT:
                break
            rates.append(a / n)
        return tuple(rates) or None

    def save(self, pair: str, mode: str, reached: Sequence[int], accepted: Sequence[int]) -> None:
        """Add one run's counts. Best effort: a cache that cannot be written (read-only home) never fails a run."""
        old_reached, old_accepted = self._counts(pair, mode)
        size = max(len(old_reached), len(reached))
        pad = lambda values: list(values) + [0] * (size - len(values))  # noqa: E731
        new_reached = [n + m for n, m in zip(pad(old_reached), pad(reached))]
        new_accepted = [a + b for a, b in zip(pad(old_accepted), pad(accepted))]
        for i, n in enumerate(new_reached):
            if n > self.MAX_COUNT:
                new_reached[i], new_accepted[i] = self.MAX_COUNT, new_accepted[i] * self.MAX_COUNT / n
        record = read_json_object(self._file(pair))
        record[mode] = {"reached": new_reached, "accepted": [round(a, 3) for a in new_accepted]}
        try:
            write_json_atomically(self._file(pair), record)
        except OSError:
            pass


def measure_acceptance(decoder, prompts: Sequence[Sequence[int]], gamma: int, max_new_tokens: int) -> list[float]:
    """Acceptance by draft position (conditional on reaching it) over fixed-gamma runs of ``decoder`` on ``prompts``."""
    from exactspec.decoding.stats import GenerationStats

    rounds = []
    for seed, prompt in enumerate(prompts):
        rounds += decoder.generate(list(prompt), max_new_tokens=max_new_tokens, gamma=gamma, seed=seed).stats.rounds[1:]
    return GenerationStats(rounds).acceptance_by_position()
