"""exactspec: exact speculative decoding.

A cheap draft proposes several tokens, the target checks them in one call, and
the acceptance rule ``min(1, p/q)`` with the residual ``max(0, p - q)`` makes the
output follow the target's sampling law exactly (Leviathan et al. 2023;
Chen et al. 2023).
"""

from exactspec.decoding.decoder import Generation, GenerationConfig, SpeculativeDecoder
from exactspec.decoding.sampling import GREEDY, SamplingParams
from exactspec.decoding.stats import GenerationStats, RoundRecord
from exactspec.models.markov import MarkovLM
from exactspec.speculator import Completion, Speculator
from exactspec.version import __version__

__all__ = [
    "GREEDY",
    "Completion",
    "Generation",
    "GenerationConfig",
    "GenerationStats",
    "MarkovLM",
    "RoundRecord",
    "SamplingParams",
    "SpeculativeDecoder",
    "Speculator",
    "__version__",
]
