"""Shared fixtures and helpers for the test suite."""

from __future__ import annotations

import torch


def random_distribution(generator: torch.Generator, vocab: int, kind: str = "dense") -> torch.Tensor:  # (V,)
    """A float64 distribution of a given kind: dense, sparse (some exact zeros), one-hot or near-zero entries."""
    if kind == "dense":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator) + 1e-3
    elif kind == "sparse":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator)
        weights[torch.rand(vocab, generator=generator) < 0.5] = 0
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    elif kind == "one_hot":
        weights = torch.zeros(vocab, dtype=torch.float64)
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    elif kind == "tiny":
        weights = torch.rand(vocab, dtype=torch.float64, generator=generator)
        weights[torch.rand(vocab, generator=generator) < 0.5] *= 1e-13
        weights[torch.randint(vocab, (1,), generator=generator)] = 1.0
    else:
        raise ValueError(kind)
    return weights / weights.sum()


def disjoint_pair(generator: torch.Generator, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two distributions with disjoint supports (vocab >= 2)."""
    split = int(torch.randint(1, vocab, (1,), generator=generator))
    p = torch.zeros(vocab, dtype=torch.float64)
    q = torch.zeros(vocab, dtype=torch.float64)
    p[:split] = torch.rand(split, dtype=torch.float64, generator=generator) + 0.1
    q[split:] = torch.rand(vocab - split, dtype=torch.float64, generator=generator) + 0.1
    return p / p.sum(), q / q.sum()


# The suite's tensors are tiny: one thread avoids oversubscription on a 2-core machine.
torch.set_num_threads(1)
