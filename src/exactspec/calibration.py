"""Call costs measured at load, so that the adaptive policy's first round already knows them.

In a fresh process the first target call of every new size is slow (the CPU
kernels for that shape are built on first use: about 1.6x a warm call here), and
so are the first draft steps; a policy that learns costs from its first rounds
mistakes that warm-up for the price of long drafts and backs off. Calibration
makes one untimed warm-up call per size, then times ``repeats`` more, for every
target call size the policy may use (1 to ``max_gamma + 1`` tokens) and for
draft steps made through the proposer itself (the per-step cost the policy
observes in the loop: model call, processors and sampling). When one call is
slow (a real model: tens of milliseconds), only a few sizes are timed and the
others interpolated linearly, which keeps calibration near half a second.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from exactspec.models.base import LanguageModel
from exactspec.proposers import Proposer

__all__ = ["Calibration", "calibrate", "measure_call_ms", "SLOW_CALL_MS"]

SLOW_CALL_MS = 5.0  # a one-token call slower than this: time a few call sizes and interpolate the rest


def measure_call_ms(model: LanguageModel, context: Sequence[int], new_tokens: int, repeats: int = 30, warmup: int = 0) -> float:
    """Median milliseconds of one ``forward`` of ``new_tokens`` tokens after ``context`` (rolled back each time)."""
    model.prefill(list(context))
    return _median_call_ms(model, list(context), new_tokens, repeats, warmup)


def _median_call_ms(model: LanguageModel, context: list[int], new_tokens: int, repeats: int, warmup: int) -> float:
    """As :func:`measure_call_ms` on a model whose state already holds ``context``."""
    times = []
    for call in range(warmup + repeats):
        start = time.perf_counter()
        model.forward(context[-new_tokens:])
        if call >= warmup:
            times.append(time.perf_counter() - start)
        model.rollback(len(context))
    return 1000 * statistics.median(times)


@dataclass(frozen=True)
class Calibration:
    target_ms: dict[int, float]  # call size in tokens -> ms
    draft_step_ms: float | None  # None without a proposer
    seconds: float  # wall time the calibration took, warm-up included

    def as_dict(self) -> dict:
        return {"target_ms": self.target_ms, "draft_step_ms": self.draft_step_ms, "seconds": self.seconds}


def calibrate(
    target: LanguageModel,
    proposer: Proposer | None,
    context: Sequence[int],  # a few dozen tokens are enough: the prompt's start
    max_gamma: int,
    repeats: int = 2,
) -> Calibration:
    """Median cost of target calls of 1..max_gamma+1 tokens and of one draft step, after warm-up calls.

    Leaves the target's and the proposer's state undefined: a generation starts
    with a prefill and a proposer reset, so nothing carries over.
    """
    if len(context) < 1 or max_gamma < 0 or repeats < 1:
        raise ValueError("calibration needs a non-empty context, max_gamma >= 0 and repeats >= 1")
    start = time.perf_counter()
    context = list(context)
    while len(context) < max_gamma + 2:  # the timed calls re-feed the context's last tokens
        context = context + context
    target.prefill(context)
    target_ms = {1: _median_call_ms(target, context, 1, repeats, warmup=1)}
    largest = max_gamma + 1
    sizes = range(2, largest + 1) if target_ms[1] < SLOW_CALL_MS else sorted({n for n in (2, 3, 5, largest) if 1 < n <= largest})
    target_ms.update({n: _median_call_ms(target, context, n, repeats, warmup=1) for n in sizes})
    target_ms = _interpolated(target_ms, largest)
    draft_step_ms = None
    if proposer is not None and max_gamma > 0:
        generator = torch.Generator().manual_seed(0)  # never the generation's own
        proposer.reset(context)
        if getattr(proposer, "reads_target_features", False):  # it drafts from the target's features of the context
            target.prefill(context[:-1])
            proposer.observe_target(target.last_features)
        steps = []
        for _ in range(repeats + 1):  # the first proposal includes the lazy prefill and the warm-up
            began = time.perf_counter()
            draft = proposer.propose(context, max_gamma, generator)
            spent = time.perf_counter() - began - draft.setup_seconds
            steps.append(1000 * spent / max(1, len(draft.tokens)))
        draft_step_ms = statistics.median(steps[1:])
    return Calibration(target_ms, draft_step_ms, time.perf_counter() - start)


def _interpolated(measured: dict[int, float], largest: int) -> dict[int, float]:
    """Every size 1..largest: measured ones as they are, the others on the line between their measured neighbours."""
    known = sorted(measured)
    out = {}
    for n in range(1, largest + 1):
        below = max(k for k in known if k <= n)
        above = min((k for k in known if k >= n), default=below)
        weight = 0.0 if above == below else (n - below) / (above - below)
        out[n] = measured[below] + weight * (measured[above] - measured[below])
    return out
