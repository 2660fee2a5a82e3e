"""The decoding loop (exactspec.decoding.engine): greedy equivalence, caches, stops, streaming, seeds, statistics."""

from __future__ import annotations

import pytest
import torch

from exactspec import GREEDY, MarkovLM, SamplingParams, SpeculativeDecoder
from exactspec.decoding.sampling import block_probs
from exactspec.proposers import Draft, DraftRequest
from exactspec.proposers.base import processed_q


def pair(vocab=6, order=2, noise=0.7):
    target = MarkovLM.random(vocab, order, seed=21)
    draft = MarkovLM(target.table + MarkovLM.random(vocab, order, seed=22, scale=noise).table, order)
    return target, draft


class RecordingModel(MarkovLM):
    """A MarkovLM that records the size of every target call."""

    def __init__(self, base: MarkovLM):
        super().__init__(base.table, base.order)
        self.calls: list[int] = []  # tokens per forward call after the prefill
        self.after_rollback: list[list[int]] = []  # cache contents right after each rollback

    def prefill(self, token_ids):
        logits = super().prefill(token_ids)
        self.calls = []
        return logits

    def forward(self, token_ids):
        self.calls.append(len(token_ids))
        return super().forward(token_ids)

    def rollback(self, length):
        super().rollback(length)
        self.after_rollback.append(list(self._tokens))


@pytest.mark.parametrize("gamma", [1, 2, 4, 7])
@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(temperature=0, repetition_penalty=1.3, banned_token_ids=frozenset({5}))]
)
def test_speculative_greedy_equals_plain_greedy(gamma, params):
    target, draft = pair()
    accepted = 0
    for prompt in ([0], [1, 2, 3], [5, 5, 4, 1]):
        config = dict(max_new_tokens=40, gamma=gamma)
        plain = SpeculativeDecoder(target, None, params).generate(prompt, **config)
        speculative = SpeculativeDecoder(target, draft, params).generate(prompt, **config)
        assert speculative.tokens == plain.tokens
        accepted += speculative.stats.accepted
    assert accepted > 0  # the comparison exercised accepted blocks, not only rejections


def test_target_cache_holds_exactly_the_committed_history_minus_the_newest_token():
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, SamplingParams())
    prompt = [1, 2]
    emitted: list[int] = []
    for token in decoder.stream(prompt, max_new_tokens=30, gamma=3, seed=4):
        emitted.append(token)
    assert target._tokens == prompt + emitted[:-1]


def test_each_round_is_one_target_call_of_gamma_plus_one_tokens():
    base, draft = pair()
    target = RecordingModel(base)
    result = SpeculativeDecoder(target, draft, SamplingParams()).generate([1], max_new_tokens=50, gamma=4, seed=1)
    rounds = result.stats.rounds[1:]  # the first token comes from the prefill
    assert target.calls == [r.drafted + 1 for r in rounds]
    assert sum(r.committed for r in result.stats.rounds) == len(result.tokens)
    assert all(1 <= r.committed <= r.drafted + 1 for r in rounds)


def test_rejected_tokens_never_stay_in_the_caches():
    """After every rollback, each cache holds a prefix of the final committed history: no stale drafts. Every round
    that rejected a draft token rolls the target back (a fully accepted round has nothing to drop)."""
    base_target, base_draft = pair(noise=2.0)
    target, draft = RecordingModel(base_target), RecordingModel(base_draft)
    prompt = [3]
    result = SpeculativeDecoder(target, draft, SamplingParams()).generate(prompt, max_new_tokens=60, gamma=3, seed=2)
    history = prompt + result.tokens
    assert 0 < result.stats.acceptance_rate < 1
    rejected = sum(r.accepted < r.drafted for r in result.stats.rounds)
    assert len(target.after_rollback) == rejected > 0 and draft.after_rollback
    for snapshot in target.after_rollback + draft.after_rollback:
        assert snapshot == history[: len(snapshot)]


def test_max_new_tokens_is_exact_and_drafting_stops_at_the_budget():
    target, draft = pair()
    for budget in (1, 2, 5, 13):
        result = SpeculativeDecoder(target, draft, SamplingParams()).generate([0], max_new_tokens=budget, gamma=6)
        assert len(result.tokens) == budget and result.finish_reason == "length"
        assert all(r.drafted <= budget for r in result.stats.rounds)


def test_tokens_after_a_stop_token_inside_an_accepted_block_are_dropped():
    target, draft = MarkovLM.random(4, 1, seed=0), None
    target = MarkovLM(
        torch.tensor([[0.0, 9.0, 0.0, 0.0], [0.0, 0.0, 9.0, 0.0], [0.0, 0.0, 0.0, 9.0], [9.0, 0.0, 0.0, 0.0]]), 1
    )
    draft = MarkovLM(target.table.clone(), 1)  # perfect draft: whole blocks accepted
    result = SpeculativeDecoder(target, draft, GREEDY).generate(
        [0], max_new_tokens=20, gamma=5, stop_token_ids=frozenset({3})
    )
    assert result.tokens == [1, 2, 3]
    assert result.finish_reason == "stop"
    assert result.stats.rounds[-1].accepted == 5  # the stop came inside a fully accepted block


def test_streaming_yields_the_same_tokens_as_generate():
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, SamplingParams(temperature=0.9))
    config = dict(max_new_tokens=25, gamma=3, seed=7)
    assert list(decoder.stream([2], **config)) == decoder.generate([2], **config).tokens


def test_same_seed_same_output_different_seed_different_output():
    target, draft = pair()
    decoder = SpeculativeDecoder(target, draft, SamplingParams())
    runs = [decoder.generate([1, 2], max_new_tokens=30, gamma=3, seed=s).tokens for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_statistics_are_consistent():
    target, draft = pair()
    stats = SpeculativeDecoder(target, draft, SamplingParams()).generate([0], max_new_tokens=80, gamma=4, seed=3).stats
    summary = stats.summary()
    assert summary["tokens"] == 80
    assert summary["accepted"] == sum(r.accepted for r in stats.rounds) and 0 < stats.acceptance_rate < 1
    by_position = stats.acceptance_by_position()
    reached = [[r for r in stats.rounds if r.drafted > i and r.accepted >= i] for i in range(4)]
    assert by_position == [sum(r.accepted > i for r in rounds) / len(rounds) for i, rounds in enumerate(reached)]
    # conditional, not the survival P(accepted > i): these differ whenever a later position is ever rejected
    assert by_position[1] > sum(r.accepted > 1 for r in stats.rounds if r.drafted > 1) / sum(
        r.drafted > 1 for r in stats.rounds
    )
    assert stats.tokens_per_round == pytest.approx(80 / len(stats.rounds))
    assert stats.draft_seconds > 0 and stats.target_seconds > 0 and stats.verify_seconds > 0


class FixedProposer:
    """A deterministic proposer (point masses) that always proposes the same tokens."""

    def __init__(self, tokens):
        self.tokens = tokens

    def reset(self, prompt):
        pass

    def propose(self, context, gamma, generator):
        return Draft(self.tokens[:gamma], None)


def test_deterministic_proposals_are_verified_with_the_point_mass_rule(monkeypatch):
    import exactspec.decoding.engine as engine_module

    drafted_sizes = []
    real = engine_module.verify_point_mass
    monkeypatch.setattr(
        engine_module, "verify_point_mass", lambda t, *a: drafted_sizes.append(t.shape[1]) or real(t, *a)
    )
    monkeypatch.setattr(engine_module, "verify_stochastic", None)  # must not be reached
    target, _ = pair()
    SpeculativeDecoder(target, FixedProposer([1, 2, 3]), SamplingParams()).generate([0], max_new_tokens=10, gamma=3)
    assert max(drafted_sizes) == 3  # rounds with drafts, not only the prefill's sample


def test_bad_inputs_raise_clear_errors():
    target, _ = pair()
    decoder = SpeculativeDecoder(target, None)
    with pytest.raises(ValueError, match="at least one token"):
        decoder.generate([])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        decoder.generate([99])
    with pytest.raises(ValueError, match="max_new_tokens"):
        decoder.generate([0], max_new_tokens=0)
    with pytest.raises(ValueError, match="gamma"):
        decoder.generate([0], gamma=-1)
    with pytest.raises(ValueError, match="vocabulary size"):
        SpeculativeDecoder(target, MarkovLM.random(5, 1))


def test_draft_probabilities_are_exactly_the_float64_rows_the_tokens_were_sampled_from():
    """Guards against sampling the draft in one precision and checking it in another."""
    target, draft = pair()
    params = SamplingParams(temperature=0.8, top_k=4, repetition_penalty=1.2)
    proposer = SpeculativeDecoder(target, draft, params).proposer
    proposer.start(0, [1, 2])
    request = DraftRequest(0, [1, 2, 3], 2, 3, params, torch.Generator().manual_seed(0))
    (proposed,) = proposer.propose([request], processed_q)
    assert proposed.probs.dtype == torch.float64
    prefix = [1, 2, 3]
    for token, row in zip(proposed.tokens, proposed.probs):
        expected = block_probs(draft.next_logits(prefix).unsqueeze(0), prefix, [], 2, params)[0]
        assert torch.equal(row, expected) and row[token] > 0
        prefix.append(token)


def test_generation_never_touches_the_global_random_generator():
    target, draft = pair()
    torch.manual_seed(123)
    state = torch.get_rng_state()
    SpeculativeDecoder(target, draft, SamplingParams()).generate([1], max_new_tokens=30, gamma=3)
    assert torch.equal(torch.get_rng_state(), state)


def test_two_decoders_with_their_own_models_interleave_like_separate_runs():
    config = dict(max_new_tokens=25, gamma=3, seed=9)
    alone = SpeculativeDecoder(*pair(), SamplingParams()).generate([1], **config).tokens
    first, second = SpeculativeDecoder(*pair(), SamplingParams()), SpeculativeDecoder(*pair(), SamplingParams())
    together = [(a, b) for a, b in zip(first.stream([1], **config), second.stream([1], **config))]
    assert [a for a, _ in together] == alone == [b for _, b in together]


def test_sharing_a_cache_is_refused_instead_of_corrupting_the_law():
    target, draft = pair()
    with pytest.raises(ValueError, match="different object"):
        SpeculativeDecoder(target, target)
    config = dict(max_new_tokens=20, gamma=3)
    first, second = (
        SpeculativeDecoder(target, draft, SamplingParams()),
        SpeculativeDecoder(target, MarkovLM(draft.table, draft.order), SamplingParams()),
    )
    with pytest.raises(RuntimeError, match="changed outside this engine"):
        for _ in zip(first.stream([1], **config), second.stream([2], **config)):
            pass


def test_two_streams_of_one_decoder_queue_for_its_slot_and_each_keeps_its_own_law():
    """A decoder is one slot: a second stream waits for the first (stepping it on), it never mixes the caches."""
    decoder = SpeculativeDecoder(*pair(), SamplingParams())
    config = dict(max_new_tokens=20, gamma=3, seed=4)
    alone = [decoder.generate(prompt, **config).tokens for prompt in ([1], [2])]
    together = list(zip(decoder.stream([1], **config), decoder.stream([2], **config)))
    assert [a for a, _ in together] == alone[0] and [b for _, b in together] == alone[1]
