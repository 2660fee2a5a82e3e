"""Building the served engine from loaded models, and running the HTTP server (``exactspec serve``)."""

from __future__ import annotations

import sys

from exactspec.loading import LoadedPair, _unwrapped
from exactspec.models.batched import BatchedLean
from exactspec.models.lean import LeanModel
from exactspec.serving.batching import BatchEngine, EngineConfig, calibrate

__all__ = ["build_engine", "run_server"]


def build_engine(pair: LoadedPair, slots: int, max_len: int, config: EngineConfig = EngineConfig(), calibrated: bool = True) -> BatchEngine:
    """A batch engine over the pair's lean models (a feature-level draft is not batched yet: its requests use
    prompt lookup), with ``slots`` sequences of up to ``max_len`` positions."""
    target = _unwrapped(pair.target)
    if not isinstance(target, LeanModel):
        raise ValueError("serve runs the lean backend (Llama-family checkpoints); --backend hf is for generate and bench")
    if target.invariant:
        raise ValueError("serve does not batch in --invariant mode (its fixed-shape calls are per sequence)")
    draft = _unwrapped(pair.draft) if pair.draft is not None else None
    if not isinstance(draft, LeanModel):
        draft = None  # none, or a feature-level draft
    engine = BatchEngine(
        BatchedLean.like(target, slots, max_len, pair.target.vocab_size),
        BatchedLean.like(draft, slots, max_len, pair.draft.vocab_size) if draft is not None else None,
        config,
    )
    if calibrated:
        calibrate(engine)
    return engine


def run_server(app, host: str, port: int) -> None:
    import uvicorn

    print(f"exactspec serving on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
