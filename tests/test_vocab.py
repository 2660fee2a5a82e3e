"""Vocabulary checks of a target/draft pair (exactspec.vocab)."""

from __future__ import annotations

import pytest
import torch

from exactspec import GREEDY, GenerationConfig, MarkovLM, SpeculativeDecoder
from exactspec.vocab import RestrictedVocabulary, align_pair, shared_vocabulary_size

VOCAB = {"a": 0, "b": 1, "c": 2, "<eos>": 3}


def test_identical_tokenizers_pass_and_padding_is_restricted_to_the_real_vocabulary():
    assert shared_vocabulary_size(VOCAB, dict(VOCAB), 4, 4) == 4
    assert shared_vocabulary_size(VOCAB, dict(VOCAB), 64, 8) == 4
    target = MarkovLM.random(8, 1, seed=0)  # 4 real tokens, padded to 8 rows
    draft = MarkovLM.random(6, 1, seed=1)  # padded to 6 rows
    target_aligned, draft_aligned = align_pair(target, draft, VOCAB, VOCAB)
    assert target_aligned.vocab_size == draft_aligned.vocab_size == 4
    assert torch.equal(target_aligned.prefill([1, 2]), target.table[[1, 2], :4])


def test_padded_pair_decodes_like_the_target_restricted_to_its_real_vocabulary():
    target = MarkovLM.random(8, 1, seed=0)
    draft = MarkovLM(torch.cat([target.table[:6, :6] + 0.3, torch.zeros(0, 6)]), 1)
    target_aligned, draft_aligned = align_pair(target, draft, VOCAB, VOCAB)
    config = GenerationConfig(max_new_tokens=30, gamma=3)
    plain = SpeculativeDecoder(RestrictedVocabulary(target, 4), None, GREEDY).generate([1], config)
    speculative = SpeculativeDecoder(target_aligned, draft_aligned, GREEDY).generate([1], config)
    assert speculative.tokens == plain.tokens and max(plain.tokens) < 4


def test_a_real_mismatch_names_the_differing_tokens():
    other = {"a": 0, "x": 1, "c": 2, "<eos>": 3}
    with pytest.raises(ValueError, match=r"differ at 1 ids \(id 1: target 'b' vs draft 'x'\)"):
        shared_vocabulary_size(VOCAB, other, 4, 4)
    with pytest.raises(ValueError, match="id 4: target '<none>' vs draft 'd'"):
        shared_vocabulary_size(VOCAB, {**VOCAB, "d": 4}, 8, 8)


def test_a_model_smaller_than_its_tokenizer_is_refused():
    with pytest.raises(ValueError, match="the draft model has 3 output rows"):
        shared_vocabulary_size(VOCAB, VOCAB, 4, 3)
