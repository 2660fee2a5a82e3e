"""Prompt-lookup drafting: the n-gram search, and that its proposals go through the point-mass rule."""

from __future__ import annotations

import pytest
import torch

from exactspec import GREEDY, MarkovLM, SamplingParams, SpeculativeDecoder
from exactspec.proposers import PromptLookupProposer
from exactspec.proposers.prompt_lookup import find_continuation


def test_longest_ngram_first_and_most_recent_match():
    context = [1, 2, 3, 4, 1, 2, 3, 9, 1, 2]
    assert find_continuation(context, 3, 1, 4) == [3, 9, 1]  # suffix [1, 2]: latest match at index 4
    assert find_continuation([7, 1, 2, 5, 8, 2, 6, 1, 2], 2, 1, 4) == [5, 8]  # [1, 2] beats the later [2]
    assert find_continuation([7, 1, 2, 5, 8, 2, 6, 1, 2], 2, 1, 1) == [6, 1]  # only unigrams: latest [2]


def test_no_match_and_short_tails():
    assert find_continuation([1, 2, 3], 3, 1, 4) == []
    assert find_continuation([1], 3, 1, 4) == []
    assert find_continuation([5, 6, 5], 4, 1, 2) == [6, 5]  # fewer than gamma tokens follow the match


def test_bad_ngram_range_is_an_error():
    with pytest.raises(ValueError, match="min_ngram <= max_ngram"):
        PromptLookupProposer(min_ngram=3, max_ngram=2)
    with pytest.raises(ValueError, match="1 <= min_ngram"):
        PromptLookupProposer(min_ngram=0)


def test_repetitive_target_commits_several_tokens_per_call_and_greedy_is_unchanged():
    # a target that loops 0 -> 1 -> 2 -> 3 -> 0 with high probability
    table = torch.full((4, 4), -4.0)
    table[torch.arange(4), (torch.arange(4) + 1) % 4] = 4.0
    target = MarkovLM(table, 1)
    config = dict(max_new_tokens=40, gamma=5)
    lookup = SpeculativeDecoder(target, PromptLookupProposer(), GREEDY).generate([0, 1, 2, 3, 0], **config)
    plain = SpeculativeDecoder(target, None, GREEDY).generate([0, 1, 2, 3, 0], **config)
    assert lookup.tokens == plain.tokens
    assert lookup.stats.tokens_per_round > 4
    sampled = SpeculativeDecoder(target, PromptLookupProposer(), SamplingParams()).generate([0, 1, 2, 3, 0], **config)
    assert sampled.stats.acceptance_rate > 0.8
