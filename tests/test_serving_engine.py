"""Continuous batching with ragged speculative verification (exactspec.decoding.engine).

* Greedy: every sequence of a mixed batch (speculation off, draft, lookup, auto; different prompts, lengths and
  budgets, joining as slots free up) equals plain decoding of the same prompt alone (shipped pair, float32).
* Seeds: a seeded sampled sequence draws the same tokens alone, among 7 others, and as SpeculativeDecoder with
  the same seed and gamma (the same order of draws from its own generator).
* Law (G-test, N = 8000, ALPHA = 1e-3, fixed seeds): a sequence's output in batches whose neighbours have other
  prompts, modes and temperatures follows the target's law, on a tiny Llama target over 4 tokens. Power: the same
  test rejects an engine that hands each sequence its neighbour's target row.
* Faults: a sequence that raises ends with an error while the others finish; a cancelled one leaves and frees
  its slot.
"""

from __future__ import annotations

import pytest
import torch
from test_exactness import ALPHA, SIZES, g_test_p_value
from test_feature_draft import exact_law, tiny_target

from exactspec import GREEDY, SamplingParams, SpeculativeDecoder
from exactspec.bench.workloads import workload_prompts
from exactspec.decoding.engine import BatchEngine, EngineConfig, SequenceRequest
from exactspec.decoding.sampling import block_probs
from exactspec.loading import LoadedPair, default_pair_dirs, load_pair
from exactspec.models.lean import LeanModel, LeanRuntime
from exactspec.proposers import DraftModelProposer, PromptLookupProposer
from exactspec.speculator import build_engine


@pytest.fixture(scope="module")
def pair():
    return load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(pair):
    return [pair.tokenizer.encode_prompt(text)[-120:] for text in workload_prompts("heldout", 6, lines=8)]


def run(engine: BatchEngine, requests: list[SequenceRequest]) -> list[dict]:
    """Submit every request, step until all are done; each one's tokens and handle."""
    results = [{"tokens": []} for _ in requests]
    for result, request in zip(results, requests):
        result["handle"] = engine.submit(
            request, lambda events, r=result: r["tokens"].extend(e.token for e in events), lambda h: None
        )
    while any(r["handle"].finish_reason is None for r in results):
        engine.step()
    return results


def recording_fed_rows(engine: BatchEngine) -> list[tuple[int, ...]]:
    """Every row the engine feeds its target, in order."""
    calls, forward = [], engine.target.forward
    engine.target.forward = lambda rows, outputs=None: (
        calls.extend(tuple(tokens) for _, tokens in rows) or forward(rows, outputs)
    )
    return calls


def test_the_served_policy_starts_from_the_acceptance_prior_it_is_given(pair):
    """serve hands build_engine the pair's prior (policy cache, else shipped): the policy's first estimates are it."""
    given = build_engine(pair, slots=2, max_len=64, calibrated=False, acceptance=(0.9, 0.6, 0.3))
    assert given.policy.acceptance("draft", 4) == pytest.approx([0.9, 0.6, 0.3, 0.3])
    assert build_engine(pair, slots=2, max_len=64, calibrated=False).policy.acceptance("draft", 3) != pytest.approx(
        [0.9, 0.6, 0.3]
    )


def test_greedy_in_a_mixed_batch_equals_plain_decoding_alone(pair, prompts):
    engine = build_engine(pair, slots=4, max_len=256, calibrated=True)
    modes = ["off", "draft", "lookup", "auto", "draft", "auto"]
    requests = [
        SequenceRequest(prompt=tuple(p), params=GREEDY, max_new_tokens=20 + 3 * i, speculation=m)
        for i, (p, m) in enumerate(zip(prompts, modes))
    ]
    results = run(engine, requests)  # 6 sequences, 4 slots: two join as others leave
    for request, result in zip(requests, results):
        plain = SpeculativeDecoder(pair.target, None, GREEDY).generate(
            list(request.prompt), max_new_tokens=request.max_new_tokens
        )
        assert result["tokens"] == plain.tokens and result["handle"].finish_reason == "length"
    assert sum(r["handle"].accepted for r in results) > 0 and engine.metrics.target_calls < sum(
        len(r["tokens"]) for r in results
    )
    assert engine.batch_size == 0 and sorted(engine._free) == [0, 1, 2, 3]


def test_a_seeded_sequence_is_the_same_alone_among_others_and_as_the_decoder(pair, prompts):
    params = SamplingParams(temperature=0.9, top_p=0.95)
    mine = SequenceRequest(prompt=tuple(prompts[0]), params=params, max_new_tokens=24, seed=1234, speculation="draft")
    alone = run(build_engine(pair, slots=8, max_len=256, calibrated=False), [mine])[0]["tokens"]
    others = [
        SequenceRequest(
            prompt=tuple(p), params=SamplingParams(temperature=1.0), max_new_tokens=30, seed=s, speculation=m
        )
        for s, (p, m) in enumerate(zip(prompts[1:] * 2, ["auto", "lookup", "off", "draft", "auto", "draft", "lookup"]))
    ]
    crowded = run(build_engine(pair, slots=8, max_len=256, calibrated=False), others[:3] + [mine] + others[3:])[3][
        "tokens"
    ]
    decoder = SpeculativeDecoder(pair.target, pair.draft, params).generate(
        prompts[0], max_new_tokens=24, gamma=4, seed=1234
    )
    assert alone == crowded == decoder.tokens


def test_a_shared_prompt_is_prefilled_once_and_each_sequence_draws_as_alone(pair, prompts):
    """Four sequences of one prompt (as a request's n choices) and one of another, admitted together: two rows are
    prefilled, and each seeded sequence equals the single-sequence decoder (invariant mode: bit for bit)."""
    invariant = load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32, invariant=True)
    engine = build_engine(invariant, slots=5, max_len=256, calibrated=False)
    calls = recording_fed_rows(engine)
    params = SamplingParams(temperature=0.9)
    requests = [
        SequenceRequest(
            prompt=tuple(prompts[0 if i < 4 else 1]), params=params, max_new_tokens=12, seed=i, speculation="draft"
        )
        for i in range(5)
    ]
    results = run(engine, requests)
    assert sorted(row for row in calls if len(row) > 5) == sorted([tuple(prompts[0]), tuple(prompts[1])])  # prefills
    for request, result in zip(requests, results):
        reference = SpeculativeDecoder(invariant.target, invariant.draft, params).generate(
            list(request.prompt), max_new_tokens=12, gamma=4, seed=request.seed
        )
        assert result["tokens"] == reference.tokens
    assert len({tuple(r["tokens"]) for r in results[:4]}) > 1


def joining_run(invariant: bool, prompts) -> tuple[list, dict, list, list, LoadedPair]:
    """One sequence running, then two joining: one whose prompt opens with 80 of the running one's tokens, one with
    its whole prompt. Returns the rows fed in the joining step, each fed row's returned logits, the requests, their
    results and the pair."""
    pair = load_pair(*default_pair_dirs(), backend="lean", dtype=torch.float32, invariant=invariant)
    engine = build_engine(pair, slots=3, max_len=256, calibrated=False)
    fed, returned, forward = recording_fed_rows(engine), {}, engine.target.forward

    def recorded(rows, outputs=None):
        logits = forward(rows, outputs)
        returned.update({tuple(tokens): row for (_, tokens), row in zip(rows, logits)})
        return logits

    engine.target.forward = recorded
    params = SamplingParams(temperature=0.9)
    running = SequenceRequest(prompt=tuple(prompts[0]), params=params, max_new_tokens=30, seed=0, speculation="draft")
    joining = [
        SequenceRequest(
            prompt=tuple(prompts[0][:80] + prompts[1][:10]),
            params=params,
            max_new_tokens=12,
            seed=1,
            speculation="draft",
        ),
        SequenceRequest(prompt=tuple(prompts[0]), params=params, max_new_tokens=12, seed=2, speculation="draft"),
    ]
    results = [{"tokens": []} for _ in range(3)]
    results[0]["handle"] = engine.submit(
        running, lambda events: results[0]["tokens"].extend(e.token for e in events), lambda h: None
    )
    engine.step()
    engine.step()
    fed.clear()
    for result, request in zip(results[1:], joining):
        result["handle"] = engine.submit(
            request, lambda events, r=result: r["tokens"].extend(e.token for e in events), lambda h: None
        )
    engine.step()
    joined = list(fed)
    while any(r["handle"].finish_reason is None for r in results):
        engine.step()
    return joined, returned, [running, *joining], results, pair


def test_a_prompt_an_active_sequence_shares_is_copied_from_its_cache(prompts):
    """Joining while another sequence runs: the prompt opening with 80 of its tokens feeds only the rest, the same
    prompt feeds only its last token (the positions before are copied from the running sequence's cache, which its
    own prefill of more than 17 tokens built). In invariant mode the copy holds the bits the prompt's own prefill
    computes: the logits its first token is drawn from equal a solo prefill's bit for bit, and each seeded sequence
    equals the single-sequence decoder."""
    fed, returned, requests, results, pair = joining_run(True, prompts)
    assert fed[0] == tuple(prompts[1][:10]) and fed[-1] == tuple(prompts[0][-1:]) and len(fed) == 4
    assert len(requests[0].prompt) > 17  # longer than the invariant block: its prefill ran in pieces
    for prompt in (requests[1].prompt, requests[2].prompt):
        fed_rest = next(rest for rest in fed if prompt[-len(rest) :] == rest)
        assert torch.equal(returned[fed_rest][-1], pair.target.prefill(list(prompt), 1)[-1])
    for request, result in zip(requests, results):
        reference = SpeculativeDecoder(pair.target, pair.draft, request.params).generate(
            list(request.prompt), max_new_tokens=request.max_new_tokens, gamma=4, seed=request.seed
        )
        assert result["tokens"] == reference.tokens


def test_a_failing_sequence_ends_with_an_error_and_the_others_finish(pair, prompts, monkeypatch):
    import exactspec.decoding.engine as module

    real = module.block_probs

    def failing(logits, prefix, block, prompt_length, params, **columns):
        if params.top_k == 7:
            raise RuntimeError("injected fault")
        return real(logits, prefix, block, prompt_length, params, **columns)

    monkeypatch.setattr(module, "block_probs", failing)
    engine = build_engine(pair, slots=3, max_len=256, calibrated=False)
    requests = [
        SequenceRequest(prompt=tuple(prompts[0]), params=GREEDY, max_new_tokens=12),
        SequenceRequest(prompt=tuple(prompts[1]), params=SamplingParams(top_k=7), max_new_tokens=12),
        SequenceRequest(prompt=tuple(prompts[2]), params=GREEDY, max_new_tokens=12, speculation="lookup"),
    ]
    results = run(engine, requests)
    assert [r["handle"].finish_reason for r in results] == ["length", "error", "length"]
    assert "injected fault" in results[1]["handle"].error and len(results[0]["tokens"]) == 12


def test_a_cancelled_sequence_leaves_and_frees_its_slot(pair, prompts):
    engine = build_engine(pair, slots=2, max_len=256, calibrated=False)
    got = []
    first = engine.submit(
        SequenceRequest(prompt=tuple(prompts[0]), params=GREEDY, max_new_tokens=100),
        lambda events: got.extend(events),
        lambda h: None,
    )
    engine.submit(
        SequenceRequest(prompt=tuple(prompts[1]), params=GREEDY, max_new_tokens=100),
        lambda events: None,
        lambda h: None,
    )
    engine.step()
    engine.step()
    first.cancel()
    engine.step()
    assert first.finish_reason == "cancelled" and engine.batch_size == 1 and len(engine._free) == 1
    with pytest.raises(ValueError, match="exceeds the 256-position window"):
        engine.submit(
            SequenceRequest(prompt=tuple(prompts[0]), params=GREEDY, max_new_tokens=250), lambda e: None, lambda h: None
        )


# ---------------------------------------------------------------- the law in a batch

PROMPT, NEW_TOKENS, VOCAB = (1, 2), 5, 4
NEIGHBOURS = [((3, 0, 1), "lookup", 0.5), ((2,), "off", 1.0), ((0, 0, 3, 2), "draft", 1.5)]
#: Slots of the engines the law tests sample through: many sequences share each call (fewer calls for the same N).
LAW_SLOTS = 48


def tiny_engine(slots: int = 4) -> BatchEngine:
    target, draft = LeanModel(tiny_target(3)), LeanModel(tiny_target(11))
    return BatchEngine(
        LeanRuntime.like(target, slots, 32),
        DraftModelProposer(LeanRuntime.like(draft, slots, 32)),
        EngineConfig(gamma=3),
    )


def tiny_feature_engine(
    engine_class: type[BatchEngine] = BatchEngine, slots: int = 4, invariant: bool = False
) -> BatchEngine:
    """The tiny target with a trained-style feature-level draft (random weights, a vocabulary subset), batched."""
    from test_feature_draft import tiny_draft

    from exactspec.models.feature_runtime import FeatureDraftRuntime
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    decoder = tiny_target(3)
    proposer = FeatureDraftProposer(FeatureDraftRuntime(tiny_draft(decoder), slots, 32, invariant=invariant), VOCAB)
    return engine_class(
        LeanRuntime.like(LeanModel(decoder, invariant=invariant), slots, 32), proposer, EngineConfig(gamma=3)
    )


def solo_feature_decode(engine: BatchEngine, request: SequenceRequest, draft_probs=None) -> list[int]:
    """What the single-sequence decoder draws with the engine's target (invariant mode) and feature draft, the
    request's seed and gamma 3; ``draft_probs`` wraps its draft rule."""
    from exactspec.proposers.feature_draft import FeatureDraftProposer

    solo = FeatureDraftProposer.solo(engine.proposer.draft.draft, VOCAB, 32)
    decoder = SpeculativeDecoder(LeanModel(engine.target.decoder, invariant=True), solo, request.params)
    if draft_probs is not None:
        decoder.engine._draft_probs = draft_probs(decoder.engine._draft_probs)
    return decoder.generate(
        list(request.prompt), max_new_tokens=request.max_new_tokens, gamma=3, seed=request.seed
    ).tokens


def law_counts(engine: BatchEngine, n: int, params: SamplingParams = SamplingParams()) -> dict[tuple[int, ...], int]:
    """n sequences of PROMPT (draft mode), interleaved with neighbours of other prompts, modes, temperatures."""
    requests, mine = [], []
    for seed in range(n):
        prompt, mode, temperature = NEIGHBOURS[seed % len(NEIGHBOURS)]
        mine.append(len(requests))
        requests.append(
            SequenceRequest(prompt=PROMPT, params=params, max_new_tokens=NEW_TOKENS, seed=seed, speculation="draft")
        )
        requests.append(
            SequenceRequest(
                prompt=prompt,
                params=SamplingParams(temperature=temperature),
                max_new_tokens=1 + seed % 6,
                seed=n + seed,
                speculation=mode,
            )
        )
    results = run(engine, requests)
    errors = {r["handle"].error for r in results if r["handle"].finish_reason == "error"}
    assert not errors, f"a sequence ended with an error, not a draw: {errors}"  # a mutant must fail the law, not crash
    counts: dict[tuple[int, ...], int] = {}
    for i in mine:
        key = tuple(results[i]["tokens"])
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.parametrize("n", SIZES)
def test_a_sequences_law_is_unchanged_by_its_neighbours(n):
    counts = law_counts(tiny_engine(LAW_SLOTS), n)
    assert g_test_p_value(counts, exact_law(LeanModel(tiny_target(3)), SamplingParams())) > ALPHA


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("mutant", [None, "unprocessed_q"])
def test_a_batched_feature_draft_keeps_the_law_and_a_wrong_q_is_rejected(mutant, n):
    """The feature-level draft batched over the sequences (ragged rows, per-slot rollback) passes the G-test at
    T=0.7, top_k=3; the self-check's unprocessed-q engine, whose bug lives in the draft-q hook the feature draft
    shares with a draft model, fails it."""
    from exactspec.certification.mutants import MUTANTS

    params = SamplingParams(temperature=0.7, top_k=3)
    engine = tiny_feature_engine(MUTANTS[mutant] if mutant else BatchEngine, slots=LAW_SLOTS)
    p_value = g_test_p_value(law_counts(engine, n, params), exact_law(LeanModel(tiny_target(3)), params))
    assert engine.metrics.accepted > 0
    assert (p_value > ALPHA) if mutant is None else (p_value < ALPHA)


@pytest.mark.parametrize("n", SIZES)
def test_the_same_test_rejects_an_engine_that_mixes_up_rows(n):
    engine = tiny_engine(LAW_SLOTS)
    forward = engine.target.forward

    def rotated(rows, outputs=None):
        out = forward(rows, outputs)
        if len(out) < 2:
            return out
        widths = [len(o) for o in out]  # the neighbour's row, cut or padded to this row's length
        shifted = out[1:] + out[:1]
        return [torch.cat([s, s[-1:].expand(max(0, w - len(s)), -1)])[:w] for s, w in zip(shifted, widths)]

    engine.target.forward = rotated
    counts = law_counts(engine, n)
    assert g_test_p_value(counts, exact_law(LeanModel(tiny_target(3)), SamplingParams())) < ALPHA


def test_in_invariant_mode_batched_sequences_are_bit_identical_to_solo_runs(prompts):
    """--invariant: greedy in a batch equals plain greedy alone, and seeded sampled sequences equal the
    single-sequence decoder with the same seed and gamma, with no numerical caveat (bfloat16)."""
    invariant = load_pair(*default_pair_dirs(), backend="lean", dtype=torch.bfloat16, invariant=True)
    engine = build_engine(invariant, slots=4, max_len=256, calibrated=False)
    params = SamplingParams(temperature=1.0)
    requests = [
        SequenceRequest(prompt=tuple(p), params=GREEDY if i % 2 else params, max_new_tokens=24, seed=i, speculation=m)
        for i, (p, m) in enumerate(zip(prompts, ["draft", "lookup", "draft", "off", "draft", "auto"]))
    ]
    for request, result in zip(requests, run(engine, requests)):
        draft = invariant.draft if request.speculation in ("draft", "auto") else None
        proposer = PromptLookupProposer() if request.speculation == "lookup" else draft
        reference = SpeculativeDecoder(invariant.target, proposer, request.params).generate(
            list(request.prompt),
            max_new_tokens=24,
            gamma=0 if proposer is None else 4,
            seed=request.seed,
        )
        assert result["tokens"] == reference.tokens


def same_q_as_the_engine(engine_q: dict):
    """Wraps a solo decoder's draft rule: each q must equal, bit for bit, the engine's q after the same prefix."""

    def wrap(solo_rule):
        def rule(logits, prefix, *rest):
            q, reported = solo_rule(logits, prefix, *rest)
            assert torch.equal(q, engine_q[tuple(prefix)]), f"the engine's q after {prefix} differs"
            return q, reported

        return rule

    return wrap


def test_a_feature_draft_copies_the_slots_a_shared_prompt_built():
    """A sequence joining while another runs, its prompt opening with 6 of the other's tokens, gets 5 positions of
    the target's cache and 5 slots of the feature draft copied (a slot reads the next token, so one fewer), and
    feeds the other 2; its tokens and every draft q equal the single-sequence decoder's, and each token's
    log-probability equals that of a fresh forward of prompt and tokens (invariant mode: bit for bit)."""
    engine = tiny_feature_engine(slots=2, invariant=True)
    fed = recording_fed_rows(engine)
    draft_q = {}  # prefix -> the q the engine drew a draft token from after it
    engine_probs = engine._draft_probs

    def recorded(logits, prefix, *rest):
        q, reported = engine_probs(logits, prefix, *rest)
        draft_q[tuple(prefix)] = q
        return q, reported

    engine._draft_probs = recorded
    params = SamplingParams(temperature=1.0)
    requests = [
        SequenceRequest(prompt=(1, 2, 3, 0, 1, 2, 3, 0), params=params, max_new_tokens=12, seed=5, speculation="draft"),
        SequenceRequest(
            prompt=(1, 2, 3, 0, 1, 2, 0), params=params, max_new_tokens=8, seed=6, speculation="draft", top_logprobs=0
        ),
    ]
    results = [{"tokens": [], "logprobs": []} for _ in requests]
    for i, (result, request) in enumerate(zip(results, requests)):
        result["handle"] = engine.submit(
            request,
            lambda events, r=result: (
                r["tokens"].extend(e.token for e in events),
                r["logprobs"].extend(e.logprob for e in events),
            ),
            lambda h: None,
        )
        if i == 0:
            engine.step()
            engine.step()
            fed.clear()
    engine.step()  # one call: the running sequence's block and the joining one's last 2 prompt tokens
    assert len(fed) == 2 and fed[1] == (2, 0)
    while any(r["handle"].finish_reason is None for r in results):
        engine.step()
    for request, result in zip(requests, results):
        assert result["tokens"] == solo_feature_decode(engine, request, same_q_as_the_engine(draft_q))
    prompt, tokens = list(requests[1].prompt), results[1]["tokens"]
    fresh = LeanModel(engine.target.decoder, invariant=True).prefill(prompt + tokens[:-1])[len(prompt) - 1 :]
    fresh = block_probs(fresh, prompt, tokens, len(prompt), params)
    assert results[1]["logprobs"] == fresh[torch.arange(len(tokens)), tokens].log().tolist()


def test_a_feature_draft_in_a_batch_draws_what_it_draws_alone():
    """A trained feature-level draft batched over the sequences, fed the target's features from the batched calls:
    each seeded sequence equals the single-sequence decoder with the same draft, seed and gamma (invariant mode, so
    bit for bit); with that decoder's law G-tested in test_feature_draft.py, the batch keeps the law."""
    engine = tiny_feature_engine(slots=3, invariant=True)
    requests = [
        SequenceRequest(
            prompt=prompt, params=SamplingParams(temperature=t), max_new_tokens=8, seed=seed, speculation="draft"
        )
        for seed, (prompt, t) in enumerate(
            [((1, 2), 1.0), ((3, 0, 1), 0.7), ((2,), 1.0), ((0, 1), 1.3), ((1, 1, 2), 1.0)]
        )
    ]
    results = run(engine, requests)
    assert sum(r["handle"].drafted for r in results) > 0
    for request, result in zip(requests, results):
        assert result["tokens"] == solo_feature_decode(engine, request)
