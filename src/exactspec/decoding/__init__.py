"""The one decoding loop and everything it decides with.

* :mod:`~exactspec.decoding.verify`: the verification rules as pure functions on tensors (stochastic, point mass,
  greedy) and the exact-law helpers;
* :mod:`~exactspec.decoding.sampling`: :class:`SamplingParams` and the one logits -> probabilities pipeline, used for
  the target's p and the draft's q alike;
* :mod:`~exactspec.decoding.engine`: a round over a batch of slots (one generation is a batch of one);
  :mod:`~exactspec.decoding.decoder` is that loop for one sequence (:class:`SpeculativeDecoder`);
* :mod:`~exactspec.decoding.policy`: the one gamma policy; :mod:`~exactspec.decoding.costmodel` its expected-tokens
  and speedup formulas; :mod:`~exactspec.decoding.stats` per-round records.

Nothing here knows about HTTP, files, caches, this machine's timings or the command line (those belong to
:mod:`exactspec.tuning` and the tools above it); models are reached only through the runtime interface
(:mod:`exactspec.models.runtime`).
"""
