"""Vocabulary checks of a target/draft pair (exactspec.vocab) and the cut to the real vocabulary that each runtime
makes (its ``vocab_size``): padding rows are never a token, in plain decoding and in speculation alike."""

from __future__ import annotations

import pytest
import torch

from exactspec import GREEDY, MarkovLM, SpeculativeDecoder
from exactspec.models.lean import LeanModel
from exactspec.models.llama import LlamaDecoder
from exactspec.models.llama_config import LlamaConfig
from exactspec.vocab import real_vocabulary_size, shared_vocabulary_size

VOCAB = {"a": 0, "b": 1, "c": 2, "<eos>": 3}


def cut(model: MarkovLM, size: int) -> MarkovLM:
    """An order-1 table model cut to its first ``size`` ids, as a runtime's ``vocab_size`` cuts a neural one."""
    return MarkovLM(model.table[:size, :size], 1)


def test_identical_tokenizers_pass_and_padding_is_restricted_to_the_real_vocabulary():
    assert shared_vocabulary_size(VOCAB, dict(VOCAB), 4, 4) == 4
    assert shared_vocabulary_size(VOCAB, dict(VOCAB), 64, 8) == 4
    assert real_vocabulary_size(VOCAB, dict(VOCAB)) == real_vocabulary_size(VOCAB) == 4
    decoder = LlamaDecoder(
        LlamaConfig(
            vocab_size=8,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=16,
        )
    )
    decoder.init_weights(torch.Generator().manual_seed(0))
    padded, restricted = LeanModel(decoder), LeanModel(decoder, vocab_size=4)  # 4 real tokens, 8 rows
    assert restricted.vocab_size == 4 and torch.equal(restricted.prefill([1, 2]), padded.prefill([1, 2])[:, :4])
    with pytest.raises(ValueError, match="has 8 output rows but its tokenizer uses ids up to 8"):
        LeanModel(decoder, vocab_size=9)


def test_padded_pair_decodes_like_the_target_restricted_to_its_real_vocabulary():
    target = MarkovLM.random(8, 1, seed=0)
    draft = MarkovLM(torch.cat([target.table[:6, :6] + 0.3, torch.zeros(0, 6)]), 1)
    size = real_vocabulary_size(VOCAB, VOCAB)
    config = dict(max_new_tokens=30, gamma=3)
    plain = SpeculativeDecoder(cut(target, size), None, GREEDY).generate([1], **config)
    speculative = SpeculativeDecoder(cut(target, size), cut(draft, size), GREEDY).generate([1], **config)
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


def _padded(seed: int, rows: int, padding_logit: float = 3.0) -> MarkovLM:
    """A model over VOCAB's 4 real tokens whose padding rows have high logits (so unrestricted sampling emits them)."""
    table = MarkovLM.random(rows, 1, seed=seed).table
    table[:, 4:] = padding_logit
    return MarkovLM(table, 1)


def test_padding_ids_are_never_sampled_whatever_the_padding_and_in_plain_decoding():
    target, equal_draft = _padded(0, 8), _padded(1, 8)
    other_draft = MarkovLM(equal_draft.table[:6, :6], 1)  # the same draft padded to 6 rows instead of 8

    def runs(decoder):
        return [decoder.generate([1], max_new_tokens=10, gamma=3, seed=s).tokens for s in range(200)]

    unrestricted = runs(SpeculativeDecoder(target, equal_draft))
    assert sum(max(tokens) >= 4 for tokens in unrestricted) > 150  # without the restriction padding ids come out
    size = real_vocabulary_size(VOCAB, VOCAB)
    equal = runs(SpeculativeDecoder(cut(target, size), cut(equal_draft, size)))
    different = runs(SpeculativeDecoder(cut(target, size), cut(other_draft, size)))
    plain = runs(SpeculativeDecoder(cut(target, size)))
    assert all(max(tokens) < 4 for tokens in equal + different + plain)
    assert equal == different  # the law (here: every seeded sample) does not depend on how the draft is padded


def test_loaded_models_are_restricted_with_equal_padding_and_alone(tmp_path):
    pytest.importorskip("transformers")
    from conftest import save_tiny_checkpoint, tiny_tokenizer_json

    from exactspec.loading import load_model, load_pair

    tokenizer = tiny_tokenizer_json()
    target = save_tiny_checkpoint(tmp_path / "target", vocab_rows=320, layers=1, seed=0, tokenizer_json=tokenizer)
    draft = save_tiny_checkpoint(tmp_path / "draft", vocab_rows=320, layers=1, seed=1, tokenizer_json=tokenizer)
    pair = load_pair(target, draft)
    real = len(pair.tokenizer.vocabulary())
    assert real < 320 and pair.target.vocab_size == pair.draft.vocab_size == real
    alone = load_pair(target, None).target
    assert alone.vocab_size == real and alone.prefill([0, 5]).shape == (2, real)
    whole = load_model(target)  # no tokenizer: every row of the head
    assert torch.equal(alone.prefill([0, 5]), whole.prefill([0, 5])[:, :real])
