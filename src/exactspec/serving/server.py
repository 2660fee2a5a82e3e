"""Building the served engine from loaded models, and running the HTTP server (``exactspec serve``)."""

from __future__ import annotations

import sys

from exactspec.loading import LoadedPair, _unwrapped
from exactspec.models.batched import BatchedLean
from exactspec.models.lean import LeanModel
from exactspec.serving.batching import BatchEngine, EngineConfig, calibrate

__all__ = ["build_engine", "run_server"]


def build_engine(pair: LoadedPair, slots: int, max_len: int, config: EngineConfig = EngineConfig(), calibrated: bool = True,
                 engine_class: type[BatchEngine] = BatchEngine) -> BatchEngine:
    """A batch engine over the pair's lean models, with ``slots`` sequences of up to ``max_len`` positions. A draft
    model is batched like the target; a feature-level draft gets one runner (its own cache) per slot."""
    from exactspec.models.eagle import FeatureDraft, FeatureDraftRunner
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    target = _unwrapped(pair.target)
    if not isinstance(target, LeanModel):
        raise ValueError("serve runs the lean backend (Llama-family checkpoints); --backend hf is for generate and bench")
    batched = BatchedLean.like(target, slots, max_len, pair.target.vocab_size)
    draft, feature_proposer = None, None
    if isinstance(pair.draft, FeatureDraft):
        batched.capture_features(pair.draft.cfg.feature_layers)
        runners = [FeatureDraftRunner(pair.draft, batched.max_len, target.device, target.dtype) for _ in range(slots)]
        feature_proposer = lambda slot, params: FeatureDraftProposer(runners[slot], pair.target.vocab_size, params)  # noqa: E731
    elif pair.draft is not None:
        draft = BatchedLean.like(_unwrapped(pair.draft), slots, max_len, pair.draft.vocab_size)
    engine = engine_class(batched, draft, config, feature_proposer=feature_proposer)
    if calibrated:
        calibrate(engine)
    return engine


def run_server(app, host: str, port: int) -> None:
    import uvicorn

    print(f"exactspec serving on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
