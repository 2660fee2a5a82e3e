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
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from exactspec.decoding.sampling import SamplingParams
from exactspec.models.base import LanguageModel
from exactspec.models.runtime import Runtime, SequenceSlots
from exactspec.proposers.base import DraftRequest, Proposer, processed_q
from exactspec.proposers.combined import LookupOrDraft

__all__ = ["Calibration", "calibrate", "calibrate_engine", "draft_step_seconds", "measure_call_ms", "SLOW_CALL_MS"]

SLOW_CALL_MS = 5.0  # a one-token call slower than this: time a few call sizes and interpolate the rest


def measure_call_ms(
    model: LanguageModel, context: Sequence[int], new_tokens: int, repeats: int = 30, warmup: int = 0
) -> float:
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
    params: SamplingParams = SamplingParams(),  # the settings the draft's q is built with
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
    sizes = (
        range(2, largest + 1)
        if target_ms[1] < SLOW_CALL_MS
        else sorted({n for n in (2, 3, 5, largest) if 1 < n <= largest})
    )
    target_ms.update({n: _median_call_ms(target, context, n, repeats, warmup=1) for n in sizes})
    target_ms = _interpolated(target_ms, largest)
    draft_step_ms = None
    if proposer is not None and max_gamma > 0:
        runtime = SequenceSlots([target])
        draft_step_ms = 1000 * draft_step_seconds(proposer, runtime, [0], context, max_gamma, repeats, params)
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


def draft_step_seconds(
    proposer: Proposer,
    target: Runtime,
    slots: list[int],
    context: Sequence[int],
    gamma: int,
    repeats: int = 2,
    params: SamplingParams = SamplingParams(),
) -> float:
    """Median seconds of one draft step of ``proposer`` for ``slots`` drafting together after ``context``: the
    difference between proposals of ``gamma`` and of 1 token over ``gamma - 1``, so that the first step's catch-up
    on the context (each proposal starts the slots afresh) cancels out. A feature-reading proposer is handed the
    target's features of the context first, untimed. The first repeat is an untimed warm-up."""
    if gamma < 2:
        raise ValueError(f"timing a draft step needs gamma >= 2, got {gamma}")
    context = list(context)
    generator = torch.Generator().manual_seed(0)  # never a generation's own
    times: dict[int, list[float]] = {1: [], gamma: []}
    if proposer.feature_layers:
        target.capture_features(proposer.feature_layers)
    for repeat in range(repeats + 1):
        for tokens in times:
            for slot in slots:
                proposer.start(slot, context)
                if proposer.feature_layers:
                    target.rollback(slot, 0)
                    target.forward([(slot, context[:-1])])
                    proposer.observe(slot, target.last_features[0])
            began = time.perf_counter()
            proposer.propose(
                [DraftRequest(slot, context, len(context), tokens, params, generator) for slot in slots], processed_q
            )
            if repeat:
                times[tokens].append(time.perf_counter() - began)
    return max(0.0, (statistics.median(times[gamma]) - statistics.median(times[1])) / (gamma - 1))


def calibrate_engine(engine, repeats: int = 2) -> None:
    """Give a :class:`exactspec.decoding.engine.BatchEngine`'s gamma policy call costs before the first request: target
    calls of 1 and ``max_gamma + 1`` tokens per row, and draft steps of its proposer, for one sequence and for a full
    batch (each after an untimed warm-up). Leaves every slot empty."""
    target, history = engine.target, [0] * 8  # a short history, as in a running batch
    drafting = (
        engine.proposer.draft if isinstance(engine.proposer, LookupOrDraft) else engine.proposer
    )  # [0] * 8 routes to lookup

    def timed(rows: list[tuple[int, list[int]]]) -> float:
        for slot, _ in rows:
            target.rollback(slot, 0)
        target.forward([(slot, history) for slot, _ in rows])
        times = []
        for call in range(repeats + 1):
            began = time.perf_counter()
            target.forward(rows)
            if call:
                times.append(time.perf_counter() - began)
            for slot, _ in rows:
                target.rollback(slot, len(history))
        return statistics.median(times)

    for batch in sorted({1, target.slots}):
        for tokens in (1, engine.config.max_gamma + 1):
            engine.policy.observe_target(batch * tokens, timed([(slot, [0] * tokens) for slot in range(batch)]))
        if drafting is not None:
            slots = list(range(batch))
            engine.policy.observe_draft(
                ["draft"] * batch, draft_step_seconds(drafting, target, slots, history, 3, repeats)
            )
    for slot in range(target.slots):
        target.rollback(slot, 0)
