"""Building the served engine from loaded models, and running the HTTP server (``exactspec serve``)."""

from __future__ import annotations

import sys
from typing import Sequence

from exactspec.loading import LoadedPair, unwrapped
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.calibration import calibrate_engine
from exactspec.engine import BatchEngine, EngineConfig
from exactspec.policy import AdaptiveConfig, AdaptiveGamma, PolicyPriors

__all__ = ["build_engine", "run_server"]


def build_engine(pair: LoadedPair, slots: int, max_len: int, config: EngineConfig = EngineConfig(), calibrated: bool = True,
                 engine_class: type[BatchEngine] = BatchEngine, acceptance: Sequence[float] = ()) -> BatchEngine:
    """A batch engine over the pair's lean models, with ``slots`` sequences of up to ``max_len`` positions. A draft
    model is batched like the target, and so is a feature-level draft (its one layer's slot cache). The gamma policy
    starts from ``acceptance`` (the draft's by position: :func:`exactspec.priors.acceptance_prior`) and, with
    ``calibrated``, from call costs measured now."""
    from exactspec.models.feature_runtime import FeatureDraftRuntime
    from exactspec.models.eagle import FeatureDraft
    from exactspec.proposers import DraftModelProposer
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    target = unwrapped(pair.target)
    if not isinstance(target, LeanModel):
        raise ValueError("serve runs the lean backend (Llama-family checkpoints); --backend hf is for generate and bench")
    batched = LeanRuntime.like(target, slots, max_len, pair.target.vocab_size)
    proposer = None
    if isinstance(pair.draft, FeatureDraft):
        proposer = FeatureDraftProposer(FeatureDraftRuntime(pair.draft, slots, batched.max_len, target.device, target.dtype, target.invariant),
                                        pair.target.vocab_size)
    elif pair.draft is not None:
        proposer = DraftModelProposer(LeanRuntime.like(unwrapped(pair.draft), slots, max_len, pair.draft.vocab_size))
    engine = engine_class(batched, proposer, config, AdaptiveGamma(AdaptiveConfig.up_to(config.max_gamma), PolicyPriors(acceptance=acceptance)))
    if calibrated:
        calibrate_engine(engine)
    return engine


def run_server(app, host: str, port: int) -> None:
    import uvicorn

    print(f"exactspec serving on http://{host}:{port}/v1 (Ctrl-C or SIGTERM to stop)", file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=30)
