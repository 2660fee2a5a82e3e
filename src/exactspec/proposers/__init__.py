"""Proposers: where draft tokens come from."""

from exactspec.proposers.base import Draft, Proposer
from exactspec.proposers.combined import LookupOrDraft
from exactspec.proposers.draft_model import DraftModelProposer
from exactspec.proposers.prompt_lookup import PromptLookupProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer", "LookupOrDraft", "PromptLookupProposer"]
