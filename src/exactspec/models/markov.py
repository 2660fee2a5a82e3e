"""A table-driven Markov language model: the engine's test bench.

``MarkovLM`` of order ``k`` over a vocabulary of ``V`` tokens looks up its next
token logits in a table indexed by the last ``k`` tokens (positions before the
start of the sequence count as token 0). Its sequence law can be computed
exactly, so the whole engine can be tested against it; and it implements the
same protocol (:mod:`exactspec.models.base`) as the neural backends.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from exactspec.models.base import check_rollback_length, check_token_ids

__all__ = ["MarkovLM"]


class MarkovLM:
    """Order-``k`` Markov model with explicit logits ``table`` of shape ``(V**k, V)``.

    Row index of a context ``(t_1, ..., t_k)`` (oldest first) is ``sum t_i * V**(k-i)``.
    """

    def __init__(self, table: torch.Tensor, order: int) -> None:  # table: (V**order, V)
        if order < 1:
            raise ValueError(f"order must be >= 1, got {order}")
        if table.dim() != 2 or table.shape[0] != table.shape[1] ** order:
            raise ValueError(f"table must have shape (V**order, V); got {tuple(table.shape)} for order {order}")
        if not torch.isfinite(table).all():
            raise ValueError("table contains NaN or infinite logits")
        self.table = table.to(torch.float32)
        self.order = order
        self._tokens: list[int] = []

    @classmethod
    def random(cls, vocab_size: int, order: int = 1, seed: int = 0, scale: float = 1.5) -> MarkovLM:
        """A model with i.i.d. normal logits of standard deviation ``scale``, reproducible from ``seed``."""
        generator = torch.Generator().manual_seed(seed)
        table = torch.randn((vocab_size**order, vocab_size), generator=generator) * scale
        return cls(table, order)

    @property
    def vocab_size(self) -> int:
        return self.table.shape[1]

    @property
    def length(self) -> int:
        return len(self._tokens)

    def state_index(self, prefix: Sequence[int]) -> int:
        """Table row used after ``prefix``."""
        index = 0
        context = [0] * max(0, self.order - len(prefix)) + list(prefix[-self.order :])
        for token in context:
            index = index * self.vocab_size + token
        return index

    def next_logits(self, prefix: Sequence[int]) -> torch.Tensor:  # (V,)
        """Logits of the token after ``prefix`` (pure: does not touch the state)."""
        return self.table[self.state_index(prefix)]

    def prefill(self, token_ids: Sequence[int]) -> torch.Tensor:  # (n, V)
        ids = check_token_ids(token_ids, self.vocab_size)
        self._tokens = []
        return self.forward(ids)

    def forward(self, token_ids: Sequence[int]) -> torch.Tensor:  # (n, V)
        ids = check_token_ids(token_ids, self.vocab_size)
        rows = []
        for token in ids:
            self._tokens.append(token)
            rows.append(self.state_index(self._tokens))
        return self.table[rows].clone()

    def rollback(self, length: int) -> None:
        check_rollback_length(length, self.length)
        del self._tokens[length:]
