"""The application layer as library code: :class:`Speculator` loads a pair and generates as ``exactspec generate`` does.

What ``generate`` does around the decoder lives here, so a library user gets all of it from two calls::

    speculator = Speculator.load()                      # the shipped pair; or Speculator.load("smollm2"), a path, ...
    generation = speculator.generate("def parse_args(", max_new_tokens=64)

* **Which pair and how.** :class:`exactspec.loading.PairSpec`: the shipped pair, a packaged model's name, a path, a
  hub id in the local cache; the target's shipped draft, a draft checkpoint, prompt lookup or none; backend, precision,
  device and torch's threads (one for a small target).
* **Gamma.** ``gamma="auto"`` runs :class:`exactspec.decoding.policy.AdaptiveGamma` from a cold start
  (:func:`exactspec.tuning.coldstart.cold_start`: call costs measured once per sampling setting, the acceptance prior
  from the policy cache or the draft's shipped figures) and adds each finished run's acceptance to the policy cache; the
  policy keeps learning across the object's calls. An integer fixes gamma (0: plain decoding).

:func:`build_engine` gives serve, batch jobs, certification and benches the same pair as a batch engine of many
slots on its runtime.

Every generation is the engine's exact round (:mod:`exactspec.decoding.engine`) whatever is chosen here: these choices
move speed, never the output law.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from pathlib import Path

from exactspec.decoding.decoder import Generation, SpeculativeDecoder, TokenStream
from exactspec.decoding.engine import BatchEngine, EngineConfig
from exactspec.decoding.policy import AdaptiveConfig, AdaptiveGamma, PolicyPriors
from exactspec.decoding.sampling import SamplingParams
from exactspec.loading import LoadedPair, PairSpec, model_capacity
from exactspec.models.eagle import FeatureDraft
from exactspec.models.runtime import OneSlot
from exactspec.proposers import PromptLookupProposer
from exactspec.tuning.calibration import Calibration, calibrate_engine
from exactspec.tuning.coldstart import ColdStart, cold_start
from exactspec.tuning.priors import PolicyCache

__all__ = ["Speculator", "build_engine"]


class Speculator:
    """A loaded pair that generates with the cold start, the policy cache and the thread choice of ``exactspec
    generate`` (see the module docstring). Build one with :meth:`load`."""

    def __init__(
        self,
        spec: PairSpec,
        pair: LoadedPair,
        policy_cache: PolicyCache | None = None,
        calibration: Calibration | None = None,
    ) -> None:
        """``pair`` as ``spec`` (best :meth:`exactspec.loading.PairSpec.resolved`) loads it. ``calibration``: the
        pair's call costs measured before on this machine (:class:`exactspec.tuning.machine.RuntimeChoice`), which the
        gamma policy then starts from instead of timing calls at the first generation."""
        self.spec, self.pair, self.policy_cache, self.calibration = spec, pair, policy_cache, calibration
        self.dirs = spec.dirs()
        self._decoders: dict[tuple[str, bool, str], tuple[SpeculativeDecoder, ColdStart | None]] = {}

    @classmethod
    def load(
        cls,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        *,
        policy_cache: PolicyCache | bool = True,
        **options,
    ) -> Speculator:
        """Load a pair (``options``: the other fields of :class:`exactspec.loading.PairSpec`). ``policy_cache`` True
        is the user's cache (:class:`exactspec.tuning.priors.PolicyCache`), False none, or a cache of one's own."""
        spec = PairSpec(target, draft, **options).resolved()
        return cls(spec, spec.load(), PolicyCache() if policy_cache is True else policy_cache or None)

    @property
    def tokenizer(self):
        return self.pair.tokenizer

    @property
    def proposal(self) -> str:
        """What drafts, in words."""
        if not self.spec.speculate:
            return "none (plain decoding)"
        if self.spec.lookup:
            return "prompt lookup"
        if isinstance(self.pair.draft, FeatureDraft):
            return "trained draft + prompt lookup" if self.spec.lookup_routing else "trained draft"
        return "draft model"

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of ``prompt`` (text is encoded as plain text, with the tokenizer's BOS where it has one)."""
        ids = self.tokenizer.encode_prompt(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty and the checkpoint has no BOS token to start from")
        return ids

    def check_room(self, prompt_ids: Sequence[int], max_new_tokens: int) -> None:
        """ValueError when the prompt and the new tokens do not fit a model's positions."""
        needed = len(prompt_ids) + max_new_tokens - 1  # drafts never run past the budget; the newest token is never fed
        for name, model in (("target", self.pair.target), ("draft", self.pair.draft)):
            capacity = model_capacity(model) if model is not None else None
            if capacity is not None and needed > capacity:
                raise ValueError(
                    f"prompt ({len(prompt_ids)} tokens) + max_new_tokens "
                    f"{max_new_tokens} exceeds the {name} model's {capacity} positions"
                )

    def _decoder(
        self, params: SamplingParams, auto: bool, prompt_ids: list[int], rule: str
    ) -> tuple[SpeculativeDecoder, ColdStart | None]:
        """One decoder per sampling setting, gamma mode and verification rule, so a policy keeps what earlier calls
        taught it."""
        key = (repr(params), auto, rule)  # SamplingParams holds a dict (logit bias), so its repr is the key
        if key not in self._decoders:
            proposer = (
                None
                if not self.spec.speculate
                else PromptLookupProposer()
                if self.spec.lookup
                else self.pair.proposer(self.spec.lookup_routing)
            )
            decoder = SpeculativeDecoder(self.pair.target, proposer, params)
            started = (
                cold_start(
                    decoder,
                    prompt_ids,
                    params,
                    *self.dirs,
                    cache=self.policy_cache,
                    rule=rule,
                    calibration=self.calibration,
                )
                if auto and proposer
                else None
            )
            self._decoders[key] = decoder, started
        return self._decoders[key]

    def stream(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 128,
        sampling: SamplingParams = SamplingParams(),
        gamma: int | str = "auto",
        seed: int | None = None,
        stop_at_eos: bool = True,
        verify: str = "block",
        compare_rules: bool = False,
    ) -> TokenStream:
        """The generated tokens as they are committed (the stop token included), and the :class:`Generation` they
        fill (``.generation``: prompt ids, seed, stop reason, stats and the policy's cold start). When the caller stops
        reading, what was committed is kept and the run's acceptance still reaches the policy cache."""
        prompt_ids = self.encode(prompt)
        self.check_room(prompt_ids, max_new_tokens)
        decoder, started = self._decoder(sampling, gamma == "auto", prompt_ids, verify)
        tokens = decoder.stream(
            prompt_ids,
            max_new_tokens=max_new_tokens,
            gamma=gamma,
            stop_token_ids=self.tokenizer.eos_token_ids if stop_at_eos else (),
            seed=secrets.randbits(64) if seed is None else seed,
            verify=verify,
            compare_rules=compare_rules,
        )
        tokens.generation.policy = started.record if started else None
        return TokenStream(self._remembered(tokens, started), tokens.generation)

    @staticmethod
    def _remembered(tokens: TokenStream, started: ColdStart | None) -> Iterator[int]:
        try:
            yield from tokens
        finally:
            tokens.close()
            if started is not None:
                started.remember(tokens.generation.stats)  # the next run of this pair starts here

    def generate(self, prompt: str | Sequence[int], **options: object) -> Generation:
        """The whole generation; ``options``: the keywords of :meth:`stream`."""
        tokens = self.stream(prompt, **options)
        for _ in tokens:
            pass
        return tokens.generation

    def text(self, generation: Generation) -> str:
        """The generation's text, its stop token left out."""
        return self.tokenizer.decode([t for t in generation.tokens if t not in self.tokenizer.eos_token_ids])


def build_engine(
    pair: LoadedPair,
    slots: int,
    max_len: int,
    config: EngineConfig = EngineConfig(),
    calibrated: bool = True,
    engine_class: type[BatchEngine] = BatchEngine,
    acceptance: Sequence[float] = (),
) -> BatchEngine:
    """A batch engine over the pair's models on their runtimes (torch's lean runtime, llama.cpp's or ONNX
    Runtime's), with ``slots`` sequences of up to ``max_len`` positions. A draft model is batched like the target,
    and so is a feature-level draft (its one layer's slot cache, where :meth:`LoadedPair.feature_draft_runtime` puts
    it). The gamma policy
    starts from ``acceptance`` (the draft's by position: :func:`exactspec.tuning.priors.acceptance_prior`) and, with
    ``calibrated``, from call costs measured now."""
    from exactspec.proposers import DraftModelProposer
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    target = pair.target
    batched = _batched(target, slots, max_len)
    proposer = None
    if isinstance(pair.draft, FeatureDraft):
        proposer = FeatureDraftProposer(
            pair.feature_draft_runtime(slots, batched.max_len),
            pair.target.vocab_size,
        )
    elif pair.draft is not None:
        proposer = DraftModelProposer(_batched(pair.draft, slots, max_len))
    engine = engine_class(
        batched,
        proposer,
        config,
        AdaptiveGamma(AdaptiveConfig.up_to(config.max_gamma), PolicyPriors(acceptance=acceptance)),
    )
    if calibrated:
        calibrate_engine(engine)
    return engine


def _batched(model, slots: int, max_len: int):
    """A runtime of ``slots`` slots over the weights ``model`` (one sequence) runs on."""
    if not isinstance(model, OneSlot):
        raise ValueError(
            "serving and batch jobs run the lean, llamacpp or onnx backend; --backend hf is for generate and bench"
        )
    return model.batched(slots, max_len)
