"""Model backends behind one protocol (:mod:`exactspec.models.base`)."""

from exactspec.models.base import LanguageModel
from exactspec.models.markov import MarkovLM

__all__ = ["LanguageModel", "MarkovLM"]
