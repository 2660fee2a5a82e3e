"""Per-sample random streams: the seed a request's ``index``-th sample draws from.

Sample 0 draws from the request's own seed (so one sample is what ``exactspec generate --seed`` gives); sample
``i > 0`` from the first 63 bits of sha256("exactspec-sample:{seed}:{i}"). With ``seed + i`` instead, sample 1 of
seed 5 was sample 0 of seed 6, and a sweep over seeds returned the same draws twice.
"""

from __future__ import annotations

import hashlib

__all__ = ["sample_seed"]


def sample_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` (>= 0) of a request seeded with ``seed``, in [0, 2^63)."""
    if index < 0:
        raise ValueError(f"a sample index is >= 0, got {index}")
    if index == 0:
        return seed
    digest = hashlib.sha256(f"exactspec-sample:{seed}:{index}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1
