"""Run records: what a claim of unchanged sampling has to name, written beside a run as one JSON file.

A record holds the target's and draft's identity (path and SHA-256 of config, weights and tokenizer), the effective
sampling configuration in the order the processors run (:func:`exactspec.decoding.sampling.block_probs`), the proposal
mechanism, acceptance criterion, residual rule, cache and rollback method, gamma policy, seed and the version of the
order of random draws, the precision mode and whether it is call-size invariant, the package version and source
revision, library versions, threads, hardware, and the run's own figures. ``exactspec replay`` reruns a generate
record and compares its tokens (:func:`replay_verdict` says why they may differ).
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import torch

from exactspec.decoding.sampling import SamplingParams, processor_order
from exactspec.version import __version__

__all__ = [
    "RECORD_VERSION",
    "DRAW_ORDER_VERSION",
    "model_identity",
    "redacted",
    "environment",
    "run_record",
    "write_record",
    "replay_verdict",
]

RECORD_VERSION = 1
#: Version of the order in which a round consumes its generator: one uniform per drafted token (draft sampling),
#: then one per verified position, then one for the replacement or bonus token. Version 1: the position uniforms
#: are token-wise acceptance draws; version 2: the block rule's u_1 .. u_g (exactspec.decoding.block). A change bumps
#: it.
DRAW_ORDER_VERSIONS = {"token": 1, "block": 2}
DRAW_ORDER_VERSION = DRAW_ORDER_VERSIONS["block"]
ACCEPTANCE = {
    "token": (
        "accept draft token x with probability min(1, p(x) / q(x)); "
        "q is a point mass for deterministic drafts (lookup, greedy)"
    ),
    "block": (
        "sampled drafts: the block rule (Sun et al. 2025), the last position i with u_i < h_i, h from capped "
        "running weights w_i = min(1, w_(i-1) p(x_i) / q(x_i)); point-mass drafts (lookup) token-wise, min(1, p(x))"
    ),
}
RESIDUAL = {
    "token": (
        "at the first rejection a token from normalize(max(0, p - q)); "
        "when every draft is accepted a bonus token from p"
    ),
    "block": (
        "after the accepted block a token from normalize(max(0, w_tau p - q)) (token-wise "
        "for point masses); when every draft is accepted a bonus token from p"
    ),
}
CACHE = "per-sequence KV cache truncated to the accepted prefix after each round (the target's and the draft's)"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _digest_of(paths: list[Path]) -> str | None:
    if not paths:
        return None
    digest = hashlib.sha256()
    for path in sorted(paths):
        digest.update(path.name.encode() + b"\0" + _sha256(path).encode())
    return digest.hexdigest()


def model_identity(path: str | Path | None) -> dict | None:
    """Path and SHA-256 of a checkpoint's config, weights and tokenizer (a GGUF file holds all three)."""
    if path is None:
        return None
    path = Path(path)
    if path.is_file():
        weights = _sha256(path)
        return {
            "path": str(path.resolve()),
            "config_sha256": weights,
            "weights_sha256": weights,
            "tokenizer_sha256": weights,
        }
    files = [p for p in path.iterdir() if p.is_file()]
    return {
        "path": str(path.resolve()),
        "config_sha256": _digest_of([p for p in files if p.name == "config.json"]),
        "weights_sha256": _digest_of([p for p in files if p.suffix in WEIGHT_SUFFIXES]),
        "tokenizer_sha256": _digest_of(
            [p for p in files if p.name.startswith("tokenizer") or p.name == "chat_template.jinja"]
        ),
    }


def _source_revision() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        revision = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{revision}{'+modified' if dirty else ''}" if revision else None


def environment() -> dict:
    versions = {}
    for package in ("torch", "numpy", "transformers", "safetensors", "gguf", "scipy"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "exactspec": __version__,
        "source_revision": _source_revision(),
        "python": platform.python_version(),
        "libraries": versions,
        "threads": torch.get_num_threads(),
        "hardware": {
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "cpus": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        },
        "platform": platform.platform(),
    }


SECRET_FLAGS = ("--api-key",)


def redacted(argv: list[str]) -> list[str]:
    """``argv`` with the values of secret flags (an API key) replaced by ``***``."""
    out, hide = [], False
    for arg in argv:
        flag = arg.split("=", 1)[0]
        out.append("***" if hide else f"{flag}=***" if flag in SECRET_FLAGS and "=" in arg else arg)
        hide = arg in SECRET_FLAGS
    return out


def run_record(
    kind: str,
    argv: list[str],
    target: str | Path | None,
    draft: str | Path | None,
    params: SamplingParams | None,
    proposal: str,
    gamma_policy: str,
    seed: int | None,
    precision: str,
    figures: dict,
    verify: str = "block",
) -> dict:
    return {
        "record_version": RECORD_VERSION,
        "kind": kind,
        "argv": redacted(argv),
        "target": model_identity(target),
        "draft": model_identity(draft),
        "sampling": None if params is None else processor_order(params),
        "proposal": proposal,
        "verify": verify,
        "acceptance": ACCEPTANCE[verify],
        "residual": RESIDUAL[verify],
        "cache": CACHE,
        "gamma_policy": gamma_policy,
        "seed": seed,
        "draw_order_version": DRAW_ORDER_VERSIONS[verify],
        "precision": precision,
        "environment": environment(),
        "figures": figures,
    }


def write_record(record: dict, path: str | Path) -> Path:
    """Written whole or not at all (a temporary file renamed into place)."""
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(record, indent=2))
    partial.replace(path)
    return path


def replay_verdict(record: dict, tokens: list[int]) -> dict:
    """Compare a rerun's tokens with the record's and explain a difference."""
    recorded = record["figures"]["token_ids"]
    if tokens == recorded:
        return {"identical": True, "tokens": len(tokens), "reason": "same tokens"}
    first = next((i for i, (a, b) in enumerate(zip(tokens, recorded)) if a != b), min(len(tokens), len(recorded)))
    now = environment()
    changed = [
        key
        for key in ("exactspec", "source_revision", "libraries", "hardware")
        if now[key] != record["environment"][key]
    ]
    if record["gamma_policy"].startswith("auto") and record["figures"].get("sampling") == "sampled":
        reason = (
            "gamma auto picks each round's gamma from measured call costs and the acceptance remembered from earlier "
            "runs, so rounds split differently and the random draws fall elsewhere: the law is the same, the tokens "
            "are not; record with a fixed --gamma to replay"
        )
    elif "call-size invariant" not in record["precision"] and not record["precision"].startswith("float32"):
        reason = f"{record['precision']}: logits move with the call size, which can flip a token"
    elif changed:
        reason = f"the environment changed ({', '.join(changed)})"
    else:
        reason = "same settings, precision and environment: this difference is unexpected (please report it)"
    return {"identical": False, "tokens": len(tokens), "first_difference": first, "reason": reason}
