"""exactspec: exact speculative decoding.

A cheap draft proposes several tokens, the target checks them in one call, and
the acceptance rule ``min(1, p/q)`` with the residual ``max(0, p - q)`` makes the
output follow the target's sampling law exactly (Leviathan et al. 2023;
Chen et al. 2023).

The names below are imported when first used, so that ``import exactspec`` (and the command line's start, which
must answer Ctrl-C with one line) does not load torch before it is needed.
"""

from importlib import import_module

from exactspec.version import __version__

_HOMES = {
    "Generation": "exactspec.decoding.decoder",
    "SpeculativeDecoder": "exactspec.decoding.decoder",
    "GREEDY": "exactspec.decoding.sampling",
    "SamplingParams": "exactspec.decoding.sampling",
    "GenerationStats": "exactspec.decoding.stats",
    "RoundRecord": "exactspec.decoding.stats",
    "MarkovLM": "exactspec.models.markov",
    "SequenceRequest": "exactspec.decoding.engine",
    "TokenStream": "exactspec.decoding.decoder",
    "Speculator": "exactspec.speculator",
}

__all__ = [
    "GREEDY",
    "Generation",
    "GenerationStats",
    "MarkovLM",
    "RoundRecord",
    "SamplingParams",
    "SequenceRequest",
    "SpeculativeDecoder",
    "Speculator",
    "TokenStream",
    "__version__",
]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'exactspec' has no attribute {name!r}")
    value = getattr(import_module(_HOMES[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
