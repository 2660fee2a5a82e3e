"""Proposers: where draft tokens come from."""

from exactspec.proposers.base import Draft, DraftRequest, OneSequence, Proposer, SequenceProposer
from exactspec.proposers.combined import LookupOrDraft
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer

__all__ = [
    "Draft",
    "DraftRequest",
    "DraftModelProposer",
    "LookupOrDraft",
    "OneSequence",
    "PromptLookupProposer",
    "Proposer",
    "SequenceProposer",
]
