"""The adaptive policy's cold start: call costs measured at load and an acceptance prior, before the first round.

:func:`cold_start` gives a :class:`exactspec.decoding.engine.SpeculativeDecoder` the policy that ``generate --gamma
auto`` runs: :class:`exactspec.decoding.policy.AdaptiveGamma` started from
:func:`exactspec.tuning.calibration.calibrate` (the target at every call size the policy may use, one draft step) and
from :func:`exactspec.tuning.priors.acceptance_prior` (the policy cache's entry for the pair and sampling mode, else
the draft's shipped prior). A draft combined with prompt lookup is one policy with estimates per source: lookup's steps
cost next to nothing and its acceptance is learnt.
:meth:`ColdStart.remember` adds a finished run's acceptance to the cache, where the next run of the pair starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from exactspec.decoding.decoder import SpeculativeDecoder
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma, PolicyPriors
from exactspec.decoding.sampling import SamplingParams
from exactspec.decoding.stats import GenerationStats
from exactspec.proposers import LookupOrDraft
from exactspec.tuning.calibration import Calibration, calibrate
from exactspec.tuning.priors import PolicyCache, acceptance_prior, fingerprint, mode_key

__all__ = ["CALIBRATION_TOKENS", "ColdStart", "cold_start"]

#: Prompt tokens the load-time calibration runs on (call costs barely depend on the context here).
CALIBRATION_TOKENS = 64


@dataclass(frozen=True)
class ColdStart:
    record: dict  # the calibration, the acceptance prior and where it came from: a run's "policy" figures
    cache: PolicyCache | None  # None: the policy cache is neither read nor written
    pair: str  # the pair's fingerprint, the cache's key
    params: SamplingParams
    routed: bool  # lookup or draft: the run's rounds mix two sources
    rule: str = "block"  # the verification rule of sampled drafts, which the cache keeps apart

    def remember(self, stats: GenerationStats) -> None:
        """Add the run's acceptance by draft position to the cache (not for lookup-or-draft: its rounds mix
        lookup's and the draft's acceptance)."""
        if self.cache is not None and not self.routed:
            self.cache.save(self.pair, mode_key(self.params, self.rule), *stats.position_counts())


def cold_start(
    decoder: SpeculativeDecoder,
    prompt: Sequence[int],
    params: SamplingParams,
    target_dir: str | Path,
    draft_dir: str | Path | None,
    cache: PolicyCache | None = None,
    config: AdaptiveConfig = AdaptiveConfig(),
    rule: str = "block",
    calibration: Calibration | None = None,
) -> ColdStart:
    """Give ``decoder`` (which has a proposer) an adaptive policy that starts from measured costs and an acceptance
    prior (see the module docstring). ``target_dir`` and ``draft_dir`` name the pair for the prior and the cache."""
    if decoder.proposer is None:
        raise ValueError("a cold start needs a decoder with a proposer: plain decoding has no gamma to choose")
    routed = isinstance(decoder.proposer, LookupOrDraft)
    drafting = decoder.proposer.draft if routed else decoder.proposer
    if calibration is None or calibration.draft_step_ms is None or max(calibration.target_ms) < config.max_gamma + 1:
        calibration = calibrate(
            decoder.target, drafting, list(prompt)[:CALIBRATION_TOKENS], config.max_gamma, params=decoder.params
        )
    acceptance, source = acceptance_prior(target_dir, draft_dir, params, cache, rule)
    decoder.policy = AdaptiveGamma(
        config, PolicyPriors(calibration.target_ms, calibration.draft_step_ms, acceptance, source=source)
    )
    record = {"calibration": calibration.as_dict(), "acceptance_prior": list(acceptance), "prior_source": source}
    return ColdStart(record, cache, fingerprint(target_dir, draft_dir), params, routed, rule)
