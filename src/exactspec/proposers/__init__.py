"""Proposers: where draft tokens come from."""

from exactspec.proposers.base import Draft, Proposer
from exactspec.proposers.draft_model import DraftModelProposer

__all__ = ["Draft", "Proposer", "DraftModelProposer"]
