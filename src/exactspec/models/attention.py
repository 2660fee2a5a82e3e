"""Attention over a KV cache, as pure functions: the fixed-shape one of the invariant mode and the ragged one of a
batched call.

* :func:`chunked_attention`: one sequence's queries against its cache, in fixed-shape key chunks, so a query's
  result never depends on how many queries or keys its call has (the invariant mode, :mod:`exactspec.models.lean`);
* :func:`grouped_attention` with :func:`ragged_causal_mask`: several sequences' right-padded rows, each against its
  own slot of the cache and only up to its own position.

Both compute softmax(q k^T / sqrt(hd)) v with grouped-query heads (query head h reads key/value head
h // (nh / nkv)).
"""

from __future__ import annotations

import math

import torch

from .kv_cache import ATTENTION_CHUNK

__all__ = ["causal_mask", "chunked_attention", "grouped_attention", "ragged_causal_mask"]


def chunked_attention(
    q: torch.Tensor,  # (1, nh, R, hd): queries at positions pos, pos + 1, ...
    k_cache: torch.Tensor,  # (1, nkv, max_len, hd)
    v_cache: torch.Tensor,  # (1, nkv, max_len, hd)
    pos: int,
    end: int,  # keys [0, end) hold the history and the call's tokens
) -> torch.Tensor:  # (1, nh, R, hd)
    """Causal softmax attention (softmax(q k^T / sqrt(hd)) v) whose result for a query depends only on its position
    and the keys it sees, never on the number of queries or keys in the call.

    Keys are cut into chunks of ``ATTENTION_CHUNK`` absolute positions; scores and weighted values are computed
    per chunk with fixed-shape batched matmuls; a query's masked keys contribute exact zeros; chunks are combined
    by ``cumsum``, a strict left-to-right sum, so trailing all-masked chunks add exact zeros. The row maximum is
    exact in any order. Computed in float32.
    """
    _, nh, rows, hd = q.shape
    nkv, group = k_cache.shape[1], nh // k_cache.shape[1]
    chunks = -(-end // ATTENTION_CHUNK)
    keys = chunks * ATTENTION_CHUNK
    k = k_cache[0, :, :keys].float().reshape(nkv, chunks, ATTENTION_CHUNK, hd)
    v = v_cache[0, :, :keys].float().reshape(nkv, chunks, ATTENTION_CHUNK, hd)
    queries = (q[0].float() / math.sqrt(hd)).reshape(nkv, 1, group * rows, hd)  # query head h reads kv head h // group
    scores = queries @ k.transpose(-1, -2)  # (nkv, chunks, group R, chunk)
    key_pos = torch.arange(keys, device=q.device).reshape(chunks, 1, ATTENTION_CHUNK)
    query_pos = (pos + torch.arange(rows, device=q.device)).repeat(group).reshape(1, group * rows, 1)
    scores = scores.masked_fill(key_pos > query_pos, float("-inf"))
    weights = torch.exp(scores - scores.amax(dim=(1, 3), keepdim=True))  # masked keys: exactly 0
    total = weights.sum(-1).cumsum(1)[:, -1]  # (nkv, group R)
    out = (weights @ v).cumsum(1)[:, -1] / total.unsqueeze(-1)  # (nkv, group R, hd)
    return out.reshape(1, nh, rows, hd).to(q.dtype)


def ragged_causal_mask(positions: torch.Tensor, end: int) -> torch.Tensor:  # (B, T) -> (B, 1, T, end) bool
    """Query (b, i) at position ``positions[b, i]`` sees its own sequence's keys at positions up to its own."""
    return (torch.arange(end, device=positions.device)[None, None, :] <= positions[:, :, None]).unsqueeze(1)


def causal_mask(pos: int, t: int, device: torch.device) -> torch.Tensor:  # (t, pos + t) bool
    """One sequence's causal mask: query i (at position pos + i) sees keys 0..pos + i."""
    return torch.ones(t, pos + t, dtype=torch.bool, device=device).tril(pos)


def grouped_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(hd)) v`` over the keys ``mask`` lets each query see, query head h reading key/value head
    ``h // (nh / nkv)`` (grouped-query attention), as two batched matmuls. For the few queries per row of a decoding
    call this is 1.4-1.7x faster on CPU than the fused kernel (B = 32, T = 3, 63-300 keys, float32 and bfloat16).

    q ``(B, nh, T, hd)``; keys, values ``(B, nkv, L, hd)``; mask ``(B, 1, T, L)`` bool. Returns ``(B, nh, T, hd)``."""
    batch, heads, width, head_dim = q.shape
    groups = heads // keys.shape[1]
    grouped = q.reshape(batch, keys.shape[1], groups * width, head_dim)  # row g * T + t: head h = kv * groups + g
    scores = torch.matmul(grouped, keys.transpose(-1, -2)) * head_dim**-0.5  # (B, nkv, g T, L)
    scores = scores.float().masked_fill(~mask.repeat(1, 1, groups, 1), -math.inf)
    return torch.matmul(scores.softmax(-1).to(values.dtype), values).reshape(batch, heads, width, head_dim)
