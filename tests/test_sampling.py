"""The logits -> probabilities pipeline (exactspec.decoding.sampling), each processor against a hand computation."""

from __future__ import annotations

import pytest
import torch

from exactspec.decoding.sampling import GREEDY, MAX_MAGNITUDE, SamplingParams, block_probs, full_width

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # (1, 4)


def probs(params: SamplingParams, logits=LOGITS, prefix=(), block=(), prompt_length=0) -> torch.Tensor:
    return block_probs(logits, list(prefix), list(block), prompt_length, params)


def softmax(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64).softmax(-1)


def test_default_is_plain_softmax_in_float64():
    out = probs(SamplingParams())
    assert out.dtype == torch.float64
    assert torch.allclose(out[0], softmax([2.0, 1.0, 0.0, -1.0]), atol=1e-15)


def test_temperature_scales_logits():
    assert torch.allclose(probs(SamplingParams(temperature=0.5))[0], softmax([4.0, 2.0, 0.0, -2.0]))


def test_temperature_zero_is_one_hot_argmax_with_lowest_id_on_ties():
    assert probs(GREEDY)[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    tied = torch.tensor([[0.0, 3.0, 3.0, 1.0]])
    assert probs(GREEDY, tied)[0].tolist() == [0.0, 1.0, 0.0, 0.0]


def test_top_k_keeps_the_k_most_likely():
    out = probs(SamplingParams(top_k=2))[0]
    assert torch.allclose(out, torch.cat([softmax([2.0, 1.0]), torch.zeros(2, dtype=torch.float64)]))


def test_top_p_keeps_smallest_set_reaching_the_mass():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (probs(SamplingParams(top_p=0.8), logits)[0] > 0).tolist() == [True, True, False, False]
    assert (probs(SamplingParams(top_p=0.81), logits)[0] > 0).tolist() == [True, True, True, False]
    assert (probs(SamplingParams(top_p=0.01), logits)[0] > 0).tolist() == [True, False, False, False]


def test_min_p_drops_tokens_below_fraction_of_the_best():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert (probs(SamplingParams(min_p=0.25), logits)[0] > 0).tolist() == [True, True, True, False]


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    out = probs(SamplingParams(repetition_penalty=2.0), prefix=[0, 3, 3], prompt_length=3)[0]
    assert torch.allclose(out, softmax([1.0, 1.0, 0.0, -2.0]))


def test_presence_and_frequency_count_generated_tokens_only():
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    # prompt [1, 1]; generated [0, 0, 2]
    out = probs(params, prefix=[1, 1, 0, 0, 2], prompt_length=2)[0]
    assert torch.allclose(out, softmax([2.0 - 0.5 - 0.5, 1.0, 0.0 - 0.5 - 0.25, -1.0]))


def test_logit_bias_and_allowed_and_banned_sets():
    out = probs(SamplingParams(logit_bias={3: 3.0}))[0]
    assert torch.allclose(out, softmax([2.0, 1.0, 0.0, 2.0]))
    out = probs(SamplingParams(banned_token_ids=frozenset({0, 2})))[0]
    assert torch.allclose(out, torch.tensor([0.0, *softmax([1.0, -1.0]).tolist()], dtype=torch.float64)[[0, 1, 0, 2]])
    out = probs(SamplingParams(allowed_token_ids=frozenset({2, 3})))[0]
    assert torch.allclose(out, torch.tensor([0.0, 0.0, *softmax([0.0, -1.0]).tolist()], dtype=torch.float64))


def test_each_block_row_is_processed_with_its_own_prefix():
    """Row j conditions on prefix + block[:j]: a penalty sees the block's earlier tokens."""
    params = SamplingParams(repetition_penalty=1.5, frequency_penalty=0.3, top_p=0.95, temperature=0.8)
    logits = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    prefix, block = [5, 1, 1, 2], [0, 0, 4]
    out = block_probs(logits, prefix, block, 2, params)
    for j in range(4):
        alone = block_probs(logits[j : j + 1], prefix + block[:j], [], 2, params)[0]
        assert torch.equal(out[j], alone)
    assert not torch.allclose(out[1], block_probs(logits[1:2], prefix, [], 2, params)[0])


def _full_width_penalties(logits, prefix, block, prompt_length, params):  # (n, V) float64
    """The penalties by their definition, over the whole vocabulary for every row."""
    rows = []
    for j in range(logits.shape[0]):
        context = prefix + block[:j]
        row = logits[j].clone()
        counts = torch.bincount(torch.tensor(context), minlength=row.numel()).to(torch.float64)
        generated = torch.bincount(
            torch.tensor(context[prompt_length:], dtype=torch.int64), minlength=row.numel()
        ).double()
        penalised = torch.where(row > 0, row / params.repetition_penalty, row * params.repetition_penalty)
        row = torch.where(counts > 0, penalised, row)
        row = row - params.presence_penalty * (generated > 0).to(torch.float64) - params.frequency_penalty * generated
        rows.append(row)
    return torch.stack(rows)


def test_penalties_touch_only_seen_columns_and_equal_the_full_width_formula_bit_for_bit():
    """block_probs works on the columns of tokens seen (O(n x m), not O(n x V)); the result must be
    the one the definition gives over the whole vocabulary, to the last bit, and the input is left alone."""
    params = SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3)
    generator = torch.Generator().manual_seed(3)
    vocab = 5000
    logits = (3 * torch.randn(4, vocab, generator=generator)).to(torch.float64)
    before = logits.clone()
    prefix = torch.randint(vocab, (40,), generator=generator).tolist() + [7, 7, 9]
    block = [9, 11, 7]  # repeats a prompt token, a generated one, and a new one
    for prompt_length in (0, 20, len(prefix)):
        expected = _full_width_penalties(logits, prefix, block, prompt_length, params).softmax(-1)
        assert torch.equal(block_probs(logits, prefix, block, prompt_length, params), expected), prompt_length
    assert torch.equal(logits, before)


def test_a_vocabulary_subset_gives_the_full_vocabularys_law_of_logits_that_are_minus_infinity_outside_it():
    """A feature draft's q is computed on its subset S's columns only (token_ids); under every processor it must
    be the full-vocabulary result for logits -inf outside S: penalties, bias and masks naming tokens inside and
    outside S, top-k wider than S, ties (greedy picks the lowest id), and a setting that excludes all of S."""
    vocab, generator = 300, torch.Generator().manual_seed(5)
    token_ids = torch.randperm(vocab, generator=generator)[:120].sort().values  # S, ascending
    outside = sorted(set(range(vocab)) - set(token_ids.tolist()))
    inside = token_ids.tolist()
    logits = 2 * torch.randn(3, vocab, generator=generator, dtype=torch.float64)
    logits[:, inside[40]] = logits[:, inside[7]] = logits.max() + 1  # a tie at the top, for greedy
    masked = torch.full_like(logits, -torch.inf).index_copy(1, token_ids, logits[:, token_ids])
    prefix, block = [inside[3], outside[0], inside[3], outside[5], inside[9]], [inside[9], outside[2]]
    settings = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_k=20),
        SamplingParams(top_k=200),
        SamplingParams(top_p=0.8),
        SamplingParams(temperature=1.3, min_p=0.1),
        GREEDY,
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3),
        SamplingParams(logit_bias={inside[11]: 4.0, outside[1]: 50.0, inside[3]: -2.0}),
        SamplingParams(
            banned_token_ids=frozenset({inside[7], outside[3]}), allowed_token_ids=frozenset(inside[:60] + outside[:9])
        ),
    ]
    for params in settings:
        expected = block_probs(masked, prefix, block, 2, params)
        subset = block_probs(logits[:, token_ids], prefix, block, 2, params, token_ids=token_ids)
        assert subset.shape == (3, len(token_ids))
        torch.testing.assert_close(full_width(subset, token_ids, vocab), expected, rtol=0, atol=1e-15, msg=str(params))
    with pytest.raises(ValueError, match="every token is excluded"):
        block_probs(
            logits[:1, token_ids],
            prefix,
            [],
            2,
            SamplingParams(allowed_token_ids=frozenset(outside)),
            token_ids=token_ids,
        )


def test_everything_banned_is_an_error():
    with pytest.raises(ValueError, match="every token is excluded"):
        probs(SamplingParams(allowed_token_ids=frozenset({7})))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be an integer >= 0"),
        ({"top_k": 2.5}, "top_k must be an integer >= 0"),
        ({"min_p": 1.5}, r"min_p must be in \[0, 1\]"),
        ({"repetition_penalty": 0.0}, r"repetition_penalty must be in \[1e-30, 1e\+30\]"),
        ({"repetition_penalty": 1e31}, r"repetition_penalty must be in \[1e-30, 1e\+30\]"),
        ({"presence_penalty": 1e39}, r"presence_penalty must be within \+-1e\+30, got 1e\+39"),
        ({"frequency_penalty": -1e31}, r"frequency_penalty must be within \+-1e\+30"),
        ({"logit_bias": {1: 1e31}}, r"logit_bias\[1\] must be within \+-1e\+30"),
        ({"temperature": 1e-31}, r"temperature must be 0 \(greedy\) or in \[1e-30, 1e\+30\]"),
        ({"presence_penalty": float("inf")}, "presence_penalty must be a finite number"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be a finite number"),
        ({"logit_bias": {1: float("inf")}}, r"logit_bias\[1\] must be a finite number"),
        ({"logit_bias": {-1: 1.0}}, "not a token id"),
        ({"banned_token_ids": frozenset({"a"})}, "not a token id"),
        ({"allowed_token_ids": frozenset()}, "allowed_token_ids is empty"),
    ],
)
def test_invalid_parameters_raise_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_logit_bias_outside_vocabulary_is_an_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        probs(SamplingParams(logit_bias={10: 1.0}))


def test_too_few_block_tokens_is_an_error():
    with pytest.raises(ValueError, match="block tokens"):
        block_probs(torch.zeros(3, 4), [0], [1], 0, SamplingParams())


def test_processors_compute_in_float64():
    """presence 0.2 must subtract the float64 0.2, not float32's 0.2000000030 (a bool mask times 0.2 is float32)."""
    logits = torch.tensor([[0.5, 0.25, -0.125, 1.0]], dtype=torch.float64)
    params = SamplingParams(presence_penalty=0.2, frequency_penalty=0.1, logit_bias={1: 0.3})
    out = probs(params, logits, prefix=[9, 0, 0], prompt_length=1)[0]
    expected = torch.tensor([0.5 - 0.2 - 0.1 * 2, 0.25 + 0.3, -0.125, 1.0], dtype=torch.float64).softmax(-1)
    assert torch.equal(out, expected)


def test_extreme_settings_at_the_bounds_stay_finite():
    """At the accepted bounds, float32-extreme logits still give a valid distribution (no inf - inf)."""
    logits = torch.tensor([[3.4e38, -3.4e38, 0.0, 1.0, -1.0]])
    for params in (
        SamplingParams(
            temperature=1 / MAX_MAGNITUDE,
            repetition_penalty=MAX_MAGNITUDE,
            presence_penalty=-MAX_MAGNITUDE,
            frequency_penalty=MAX_MAGNITUDE,
            logit_bias={1: MAX_MAGNITUDE, 2: -MAX_MAGNITUDE},
        ),
        SamplingParams(
            temperature=MAX_MAGNITUDE,
            repetition_penalty=1 / MAX_MAGNITUDE,
            presence_penalty=MAX_MAGNITUDE,
            frequency_penalty=-MAX_MAGNITUDE,
            top_p=0.5,
            min_p=0.1,
        ),
    ):
        out = probs(params, logits, prefix=[0, 1, 3, 3, 4], prompt_length=2)
        assert torch.isfinite(out).all() and float(out.sum()) == pytest.approx(1.0)


def _bias_after_penalty(logits, prefix, bias, penalty):
    """The previous (wrong) order: repetition penalty first, then the bias."""
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
    seen[list(prefix)] = True
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    scores = torch.where(seen, penalised, logits)
    for token, value in bias.items():
        scores[:, token] += value
    return scores.softmax(-1)


def test_order_matches_transformers_logits_processors_on_random_logits():
    """Bias, repetition penalty, banned tokens, temperature, top-k, top-p, min-p: Hugging Face's order and results."""
    pytest.importorskip("transformers")
    from transformers.generation import logits_process as hf

    generator = torch.Generator().manual_seed(0)
    vocab, mismatched_with_old_order = 50, 0
    for trial in range(40):
        logits = 3 * torch.randn(1, vocab, dtype=torch.float64, generator=generator)
        prefix = torch.randint(vocab, (12,), generator=generator).tolist()
        bias = {prefix[0]: 2.5, prefix[1]: -1.5, (prefix[2] + 1) % vocab: 1.0}
        banned = [t for t in range(3) if t not in bias]
        params = SamplingParams(
            temperature=0.7,
            top_k=20,
            top_p=0.9,
            min_p=0.02,
            repetition_penalty=1.8,
            logit_bias=bias,
            banned_token_ids=frozenset(banned),
        )
        ours = block_probs(logits, prefix, [], len(prefix), params)[0]
        processors = hf.LogitsProcessorList(
            [
                hf.SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
                hf.RepetitionPenaltyLogitsProcessor(1.8),
                hf.SuppressTokensLogitsProcessor(banned),
                hf.TemperatureLogitsWarper(0.7),
                hf.TopKLogitsWarper(20),
                hf.TopPLogitsWarper(0.9),
                hf.MinPLogitsWarper(0.02),
            ]
        )
        theirs = processors(torch.tensor([prefix]), logits.clone()).softmax(-1)[0]
        assert torch.allclose(ours, theirs, atol=1e-12), trial
        plain = SamplingParams(repetition_penalty=1.8, logit_bias=bias)
        old = _bias_after_penalty(logits.clone(), prefix, bias, 1.8)[0]
        mismatched_with_old_order += not torch.allclose(
            block_probs(logits, prefix, [], len(prefix), plain)[0], old, atol=1e-6
        )
    assert mismatched_with_old_order >= 30  # the test tells the two orders apart
