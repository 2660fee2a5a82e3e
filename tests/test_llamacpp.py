"""The llama.cpp runtime (exactspec.models.llamacpp) on tiny GGUF files written here, and the engine on it.

The files: a random 2-layer Llama (64 wide, 256 tokens: a SentencePiece vocabulary of three control tokens and
byte tokens, which llama.cpp needs to load a model) written with test_gguf's writer, as F32; the draft is the same
model with noise (0.15 of the weights' scale) added to every matrix (acceptance 0.87 at T=1 over 4 allowed tokens).

* The runtime against exactspec's own torch decoder on the same file: logits agree to ATOL_TORCH (llama.cpp keeps
  a float16 cache), so positions, rows and the cache are fed as llama.cpp means them; and SmolLM2 requantized to
  Q4_K_M by llama.cpp reads in torch (K-quants through the gguf package) as llama.cpp runs it.
* The runtime's operations: a ragged call, a rollback and a copied prefix give the logits of a fresh call.
* Target features (the eval callback): the outputs of the asked layers, for ragged rows spanning several of
  llama.cpp's micro-batches, equal the torch decoder's to FEATURE_RTOL of their spread, in the rows' order (a
  position or a layer out of place is off by more than the spread).
* Exactness through the engine: greedy speculative equals plain greedy (a draft model, and a feature-level draft
  reading llama.cpp's features); a seeded request draws the same tokens alone and among others; and a G-test of the law
  of 4 new tokens over 4 allowed tokens (256 outcomes) against the law computed from the runtime's own single-prefix
  logits, with the same false-positive rate as test_exactness (ALPHA = 1e-3, N_QUICK and N sizes). Power: the same test
  rejects the engine with the replacement drawn from p instead of the residual (test_exactness.replacement_from_target).
  Measured at N = 2,000 (seeds 0..1999): the correct engine p = 0.38 with acceptance 0.87; the mutant p = 4.5e-22, so
  the test asserts p < 1e-12, far below ALPHA.

llama.cpp's numerics are call-size dependent (its kernels tile by batch size): the measured largest logit
difference of a position computed alone and inside a block or beside other rows is printed by
test_a_block_and_a_batch_give_the_logits_of_calls_alone and bounded there by ATOL.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")
pytest.importorskip("transformers")

from conftest import sequence_law  # noqa: E402
from test_exactness import ALPHA, SIZES, g_test_p_value, replacement_from_target  # noqa: E402
from test_gguf import VOCAB, llama_metadata, random_hf_weights, write_llama_gguf  # noqa: E402

import exactspec.decoding.engine as engine_module  # noqa: E402
from exactspec import SamplingParams, SpeculativeDecoder  # noqa: E402
from exactspec.decoding.engine import SequenceRequest  # noqa: E402
from exactspec.decoding.sampling import GREEDY, block_probs  # noqa: E402
from exactspec.loading import LoadedPair  # noqa: E402
from exactspec.models.lean import LeanModel  # noqa: E402
from exactspec.models.llamacpp import LlamaCppModel, LlamaCppRuntime  # noqa: E402
from exactspec.speculator import build_engine  # noqa: E402

#: llama.cpp against itself (the same kernels and float16 KV cache, another call shape).
ATOL = 1e-3
#: llama.cpp against exactspec's float32 torch decoder: llama.cpp keeps keys and values in float16 (its default
#: cache type), so logits of std ~2 differ by up to about 2e-2 (measured 0.018); a position fed one place off
#: or a wrong rotary layout differs by O(1).
ATOL_TORCH = 0.05
#: llama.cpp's layer outputs against the torch decoder's, as a fraction of their standard deviation (measured
#: 0.008-0.03: the float16 cache again); a position or a layer out of place differs by more than one deviation.
FEATURE_RTOL = 0.05
PROMPT, NEW_TOKENS, GAMMA = [1, 7, 9], 4, 3
ALLOWED = frozenset({3, 4, 5, 6})
PARAMS = SamplingParams(allowed_token_ids=ALLOWED)


def spm_metadata(writer, arch):
    """The tiny Llama's hyperparameters and a SentencePiece vocabulary llama.cpp accepts: <unk>, <s>, </s>, bytes."""
    llama_metadata(writer, arch)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(VOCAB - 3)]
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3] + [6] * (VOCAB - 3))
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    directory = tmp_path_factory.mktemp("llamacpp")
    target = random_hf_weights(tie=False, seed=0)
    noise = random_hf_weights(tie=False, seed=1)
    draft = {name: w + 0.15 * noise[name] if w.dim() == 2 else w for name, w in target.items()}
    return (
        write_llama_gguf(directory / "target.gguf", target, metadata=spm_metadata),
        write_llama_gguf(directory / "draft.gguf", draft, metadata=spm_metadata),
    )


@pytest.fixture(scope="module")
def target(files):
    return LlamaCppModel.from_file(files[0], max_len=64, threads=1)


@pytest.fixture(scope="module")
def draft(files):
    return LlamaCppModel.from_file(files[1], max_len=64, threads=1)


def test_logits_equal_exactspecs_torch_decoder_on_the_same_file(files, target):
    ids = torch.randint(0, VOCAB, (24,), generator=torch.Generator().manual_seed(3)).tolist()
    lean = LeanModel.from_pretrained(files[0], dtype=torch.float32, weights="dense")
    expected = lean.prefill(ids)
    got = target.prefill(ids)
    assert got.shape == (24, VOCAB) and got.dtype == torch.float32
    assert (got - expected).abs().max() < ATOL_TORCH and expected.std() > 1.0  # far from uniform: the check has teeth
    shifted = target.prefill([0] + ids)[1:]  # the same tokens one position later: the check sees positions
    assert (shifted - expected).abs().max() > 10 * ATOL_TORCH


def test_a_block_and_a_batch_give_the_logits_of_calls_alone(files):
    runtime = LlamaCppRuntime(files[0], slots=3, max_len=64, threads=1)
    alone = runtime.forward([(0, PROMPT + [11, 12, 13, 14])])[0]  # (7, V)
    runtime.rollback(0, 0)
    one_by_one = torch.cat([runtime.forward([(0, [token])])[0] for token in PROMPT + [11, 12, 13, 14]])
    runtime.rollback(0, 3)
    ragged = runtime.forward([(0, [11, 12]), (1, PROMPT + [11]), (2, [5])])
    differences = [
        (alone - one_by_one).abs().max(),
        (ragged[0] - alone[3:5]).abs().max(),
        (ragged[1] - alone[:4]).abs().max(),
    ]
    print(
        "llama.cpp, largest logit difference, block vs one token at a time, ragged vs alone:",
        [f"{d:.1e}" for d in differences],
    )
    assert max(differences) < ATOL
    assert [len(r) for r in ragged] == [2, 4, 1] and runtime.lengths == [5, 4, 1]


def test_outputs_give_the_last_positions_logits_and_features_stay_whole(files):
    """llama.cpp computes logits only for the positions asked for (and its last layer only for them), so the
    tail asked for must be the full call's tail; with features captured every position's layer outputs remain."""
    rows = [(0, PROMPT + [11, 12]), (1, [5, 6, 7]), (2, [9])]
    full = LlamaCppRuntime(files[0], slots=3, max_len=64, threads=1).forward(rows)
    part = LlamaCppRuntime(files[0], slots=3, max_len=64, threads=1)
    got = part.forward(rows, [1, 0, 1])
    assert [len(g) for g in got] == [1, 0, 1] and part.lengths == [5, 3, 1]
    assert (got[0] - full[0][-1:]).abs().max() < ATOL and (got[2] - full[2]).abs().max() < ATOL
    assert (got[0] - full[0][:1]).abs().max() > 10 * ATOL  # the last position, not the first
    assert (
        part.forward([(1, [8])], [0])[0].shape == (0, VOCAB) and part.lengths[1] == 4
    )  # no logits at all is a call too
    captured = LlamaCppRuntime(files[0], slots=1, max_len=64, threads=1)
    captured.capture_features([0, 1])
    last = captured.forward([(0, PROMPT + [11, 12])], [2])[0]
    assert last.shape[0] == 2 and (last - full[0][-2:]).abs().max() < ATOL
    assert captured.last_features[0].shape[0] == 5  # the last layer's output at every position, not only the asked ones


def test_logits_are_computed_at_every_position_only_while_the_last_layer_is_captured(files, monkeypatch):
    """A feature of the last layer needs that layer at every position, and llama.cpp computes it only where logits
    are asked for; an earlier layer (EAGLE-3's) has every position anyway, so only the asked logits are computed."""
    import llama_cpp

    asked, decode = [], llama_cpp.llama_decode
    monkeypatch.setattr(
        llama_cpp,
        "llama_decode",
        lambda ctx, batch: asked.append(sum(batch.logits[i] for i in range(batch.n_tokens))) or decode(ctx, batch),
    )
    full = LlamaCppRuntime(files[0], slots=1, max_len=64, threads=1).forward([(0, PROMPT + [11, 12])])[0]
    features = {}
    for layers in ([0], [0, 1]):
        runtime = LlamaCppRuntime(files[0], slots=1, max_len=64, threads=1)
        runtime.capture_features(layers)
        last = runtime.forward([(0, PROMPT + [11, 12])], [1])[0]
        assert (last - full[-1:]).abs().max() < ATOL
        features[len(layers)] = runtime.last_features[0]
    assert asked == [5, 1, 5]  # all for the plain call; one with layer 0 alone; every position with the last layer
    assert (
        features[1].shape == (5, features[2].shape[1] // 2)
        and (features[1] - features[2][:, : features[1].shape[1]]).abs().max() < ATOL
    )


def test_rollback_and_a_copied_prefix_continue_as_a_fresh_call(files):
    runtime = LlamaCppRuntime(files[0], slots=2, max_len=64, threads=1)
    fresh = runtime.forward([(0, [1, 20, 21, 22, 23])])[0]
    runtime.rollback(0, 2)
    again = runtime.forward([(0, [21, 22])])[0]
    runtime.copy_prefix(0, 1, 3)
    copied = runtime.forward([(1, [22, 23])])[0]
    assert (again - fresh[2:4]).abs().max() < ATOL and (copied - fresh[3:5]).abs().max() < ATOL
    assert runtime.lengths == [4, 5]


def test_a_failed_decode_leaves_nothing_in_its_slots(files, monkeypatch):
    """llama_decode writes a slot's cells, then reports a failure: the cells past each slot's length are freed before
    the error, so the slot (at length 0 here, where a rollback has nothing to cut) continues as a fresh call."""
    import llama_cpp

    runtime = LlamaCppRuntime(files[0], slots=2, max_len=64, threads=1)
    fresh = runtime.forward([(0, [1, 20, 21, 22, 23])])[0]
    decode = llama_cpp.llama_decode
    monkeypatch.setattr(llama_cpp, "llama_decode", lambda ctx, batch: decode(ctx, batch) or 1)
    with pytest.raises(RuntimeError, match="llama_decode failed with status 1"):
        runtime.forward([(1, [1, 30, 31, 32])])
    monkeypatch.undo()
    assert runtime.lengths == [5, 0]
    assert (runtime.forward([(1, [1, 20, 21, 22, 23])])[0] - fresh).abs().max() < ATOL


def test_a_split_cache_gives_the_unified_caches_logits_in_any_slot_order(files):
    """Rows of a split cache go to llama.cpp in slot order (llama.cpp computes consecutive slots together) and come
    back in the caller's order; a copied prefix is the source's stream cut to its length."""
    rows = [(2, [5, 6]), (0, PROMPT + [11, 12]), (3, [9])]  # slot 1 idle: not consecutive
    unified = LlamaCppRuntime(files[0], slots=4, max_len=64, threads=1).forward(rows)
    split = LlamaCppRuntime(files[0], slots=4, max_len=64, threads=1, split_cache=True)
    got = split.forward(rows)
    assert [len(g) for g in got] == [2, 5, 1] and split.lengths == [5, 0, 2, 1]
    assert max((g - u).abs().max() for g, u in zip(got, unified)) < ATOL
    assert (got[0] - unified[1][:2]).abs().max() > 10 * ATOL  # each row's own logits, not a neighbour's
    split.copy_prefix(0, 1, 3)  # PROMPT only, though slot 0 holds 5 positions
    copied = split.forward([(1, [11, 12])])[0]
    assert (copied - unified[1][3:]).abs().max() < ATOL and split.lengths == [5, 5, 2, 1]
    split.copy_prefix(1, 1, 4)  # a slot cut to a shorter prefix of itself
    assert split.lengths[1] == 4 and (split.forward([(1, [12])])[0] - unified[1][4:]).abs().max() < ATOL
    with pytest.raises(ValueError, match="unified cache"):
        split.capture_features([0])


def test_bad_calls_are_clear_errors(files):
    runtime = LlamaCppRuntime(files[0], slots=2, max_len=8, threads=1)
    with pytest.raises(ValueError, match="exceeds 8 positions"):
        runtime.forward([(0, list(range(3, 12)))])
    with pytest.raises(ValueError, match="distinct slots"):
        runtime.forward([(0, [3]), (0, [4])])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        runtime.forward([(1, [VOCAB])])
    with pytest.raises(ValueError, match="cannot roll back to length 2"):
        runtime.rollback(1, 2)
    with pytest.raises(ValueError, match=r"feature layers \[5\] do not exist in a 2-layer target"):
        runtime.capture_features([5])
    assert runtime.lengths == [0, 0]  # nothing half-done


def test_a_file_llama_cpp_cannot_load_or_requantize_is_a_clear_error(tmp_path, files):
    from exactspec.models.llamacpp import requantize

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ValueError, match="llama.cpp could not load"):
        LlamaCppModel.from_file(bad)
    with pytest.raises(ValueError, match="could not requantize"):
        requantize(bad, tmp_path / "out.gguf", "Q8_0")
    with pytest.raises(ValueError, match="unknown llama.cpp file type 'Q9_9'; choose one of .*Q8_0"):
        requantize(files[0], tmp_path / "out.gguf", "Q9_9")
    assert not (tmp_path / "out.gguf").exists()


def test_captured_features_are_the_torch_decoders_layer_outputs(files):
    """Six ragged rows, 575 tokens: more than one of llama.cpp's 512-token micro-batches, so the chunks are joined."""
    lean = LeanModel.from_pretrained(files[0], dtype=torch.float32, weights="dense")
    runtime = LlamaCppRuntime(files[0], slots=6, max_len=128, threads=1)
    runtime.capture_features([0, 1])
    generator = torch.Generator().manual_seed(0)
    rows = [
        (slot, torch.randint(3, VOCAB, (n,), generator=generator).tolist())
        for slot, n in enumerate([120, 5, 120, 120, 100, 110])
    ]
    runtime.forward(rows)
    assert [f.shape for f in runtime.last_features] == [(len(ids), 2 * 64) for _, ids in rows]
    for (_, ids), got in zip(rows, runtime.last_features):
        _, expected = lean.decoder.forward_train(torch.tensor([ids]), feature_layers=[0, 1])
        expected, scale = expected[0].detach(), expected.std().item()
        assert (got - expected).abs().max() < FEATURE_RTOL * scale
        assert (got[1:] - expected[:-1]).abs().max() > scale  # one position off
        assert (got[:, :64] - expected[:, 64:]).abs().max() > scale  # the layers swapped
    continued = runtime.forward([(1, [5, 6, 7]), (0, [9])])  # continuing rows: features of the new positions only
    assert [f.shape[0] for f in runtime.last_features] == [3, 1]
    runtime.rollback(1, 5)
    runtime.rollback(0, 120)
    runtime.capture_features([1])  # a new context, which keeps what the slots held
    again = runtime.forward([(1, [5, 6, 7]), (0, [9])])
    assert all((a - b).abs().max() < ATOL for a, b in zip(again, continued))
    assert [f.shape for f in runtime.last_features] == [(3, 64), (1, 64)]


@pytest.fixture(scope="module")
def feature_draft_pair(files, tmp_path_factory):
    """The target on llama.cpp with a random feature-level draft (all tokens in its subset), loaded as generate loads
    one (the tiny file's byte vocabulary is not one exactspec's tokenizer rebuilds, and no text is read here)."""
    from exactspec import loading
    from exactspec.models.eagle import FeatureDraft, FeatureDraftConfig
    from exactspec.models.gguf import llama_config, read_gguf

    torch.manual_seed(0)
    draft = FeatureDraft(FeatureDraftConfig.for_target(llama_config(read_gguf(files[0])), VOCAB))
    with torch.no_grad():
        draft.vocab_ids.copy_(torch.arange(VOCAB))
    directory = tmp_path_factory.mktemp("feature_draft")
    draft.save(directory)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loading.TextTokenizer, "from_path", lambda path: SimpleNamespace(vocabulary=dict))
        return loading.load_pair(files[0], directory, backend="llamacpp")


def test_a_feature_draft_on_llama_cpp_keeps_greedy_and_the_seeded_draws(feature_draft_pair):
    pair = feature_draft_pair
    config = dict(max_new_tokens=24, gamma=GAMMA)
    for prompt in ([1, 7, 9], [1, 40, 41, 42]):
        plain = SpeculativeDecoder(pair.target, None, GREEDY).generate(prompt, **config).tokens
        speculative = SpeculativeDecoder(pair.target, pair.proposer(), GREEDY).generate(prompt, **config)
        assert speculative.tokens == plain and speculative.stats.drafted > 0
    mine = SequenceRequest(
        prompt=tuple(PROMPT), params=SamplingParams(), max_new_tokens=20, seed=77, speculation="draft", gamma=GAMMA
    )
    other = SequenceRequest(
        prompt=(1, 50, 60), params=SamplingParams(top_p=0.9), max_new_tokens=16, seed=1, speculation="draft", gamma=2
    )
    alone = _run(build_engine(pair, slots=2, max_len=64, calibrated=False), [mine])[0]
    crowded = _run(build_engine(pair, slots=2, max_len=64, calibrated=False), [other, mine])[1]
    assert alone == crowded


def test_greedy_speculative_equals_plain_greedy(target, draft):
    config = dict(max_new_tokens=24, gamma=GAMMA)
    for prompt in ([1, 7, 9], [1, 40, 41, 42], [1, 100]):
        plain = SpeculativeDecoder(target, None, GREEDY).generate(prompt, **config).tokens
        speculative = SpeculativeDecoder(target, draft, GREEDY).generate(prompt, **config)
        assert speculative.tokens == plain and speculative.stats.acceptance_rate > 0


def _run(engine, requests):
    results = [[] for _ in requests]
    handles = [
        engine.submit(r, lambda events, out=out: out.extend(e.token for e in events), lambda h: None)
        for r, out in zip(requests, results)
    ]
    while any(h.finish_reason is None for h in handles):
        engine.step()
    return results


def test_a_seeded_request_draws_the_same_tokens_alone_and_among_others(target, draft):
    pair = LoadedPair(target, draft, tokenizer=None)  # build_engine reads no text
    mine = SequenceRequest(
        prompt=tuple(PROMPT), params=SamplingParams(), max_new_tokens=20, seed=77, speculation="draft", gamma=GAMMA
    )
    others = [
        SequenceRequest(
            prompt=(1, 50 + i, 60 + i),
            params=SamplingParams(top_p=0.9),
            max_new_tokens=16 + i,
            seed=i,
            speculation="draft",
            gamma=2,
        )
        for i in range(3)
    ]
    alone = _run(build_engine(pair, slots=4, max_len=64, calibrated=False), [mine])[0]
    crowded = _run(build_engine(pair, slots=4, max_len=64, calibrated=False), others[:2] + [mine] + others[2:])[2]
    solo = SpeculativeDecoder(target, draft, SamplingParams()).generate(PROMPT, max_new_tokens=20, gamma=GAMMA, seed=77)
    assert alone == crowded == solo.tokens


def exact_law(model: LlamaCppModel) -> dict[tuple[int, ...], float]:
    """P(new tokens = s) from the runtime's logits of each prefix computed alone, through the pipeline."""
    return sequence_law(
        lambda prefix: block_probs(model.prefill(prefix)[-1:], prefix, [], len(PROMPT), PARAMS)[0], PROMPT, NEW_TOKENS
    )


def sample_counts(
    decoder: SpeculativeDecoder, n: int, verify: str = "block"
) -> tuple[dict[tuple[int, ...], int], float]:
    """Outcome counts over seeds 0..n-1, and the acceptance rate over all their rounds."""
    counts: dict[tuple[int, ...], int] = {}
    accepted = drafted = 0
    for seed in range(n):
        generation = decoder.generate(PROMPT, max_new_tokens=NEW_TOKENS, gamma=GAMMA, seed=seed, verify=verify)
        counts[tuple(generation.tokens)] = counts.get(tuple(generation.tokens), 0) + 1
        accepted, drafted = accepted + generation.stats.accepted, drafted + generation.stats.drafted
    return counts, accepted / drafted


@pytest.fixture(scope="module")
def law(files):
    return exact_law(LlamaCppModel.from_file(files[0], max_len=64, threads=1))


@pytest.mark.parametrize("n", SIZES)
def test_speculative_sampling_on_llama_cpp_follows_the_target_law(target, draft, law, n):
    counts, acceptance = sample_counts(SpeculativeDecoder(target, draft, PARAMS), n)
    assert 0.5 < acceptance < 0.95  # rejections and replacements occur
    assert g_test_p_value(counts, law) > ALPHA


@pytest.mark.parametrize("n", SIZES)
def test_the_same_test_rejects_the_replacement_drawn_from_the_target(target, draft, law, monkeypatch, n):
    monkeypatch.setattr(engine_module, "verify_stochastic", replacement_from_target)
    counts, _ = sample_counts(SpeculativeDecoder(target, draft, PARAMS), n, verify="token")
    assert g_test_p_value(counts, law) < 1e-12


def test_certify_scores_with_llama_cpps_own_logits(files):
    """certify's scoring on llama.cpp (runtime_prompt_logits: the prompt once, shared by every slot) gives the
    cache-free torch forward's logits on the same file, the rows of continuations that end early included."""
    from exactspec.certification.certify import runtime_prompt_logits, shared_prompt_logits

    lean = LeanModel.from_pretrained(files[0], dtype=torch.float32, weights="dense")
    runtime = LlamaCppRuntime(files[0], slots=3, max_len=64, threads=1)
    continuations = [[5, 6, 7, 8], [9], []]
    got = runtime_prompt_logits(runtime, PROMPT, continuations)
    expected = shared_prompt_logits(lean.decoder, PROMPT, continuations)
    assert got.shape == expected.shape == (3, 5, VOCAB) and runtime.lengths == [0, 0, 0]
    for row, c in enumerate(continuations):
        assert (got[row, : 1 + len(c)] - expected[row, : 1 + len(c)]).abs().max() < ATOL_TORCH


def test_certify_runs_on_llama_cpp_and_its_self_check_rejects_the_residual_from_p(target, draft):
    """128 sequences of 12 tokens at T=1 over the whole vocabulary (acceptance 0.35-0.5): the correct sampler passes,
    and the self-check's residual-from-p sampler is rejected (measured at 64 sequences: adjusted p = 2e-8, at 200:
    2e-31; alpha 1e-3)."""
    from exactspec.certification.certify import CertifyConfig, certify

    config = CertifyConfig(
        configs=("T=1",), sequences=128, max_tokens=12, self_check=True, mutants=("residual_from_p",), slots=32
    )
    report = certify(LoadedPair(target, draft, tokenizer=None), [PROMPT, [1, 40, 41, 42]], config, progress=False)
    assert report["passed"] and report["precision"].startswith("llama.cpp") and report["greedy"]["equal"] == 2
    assert report["self_check"]["residual_from_p"]["rejected"]


def test_train_drafts_teacher_on_llama_cpp_reads_what_the_torch_teacher_reads(files):
    """train-draft's teacher phase on llama.cpp (runtime_teacher: each sequence in its own slot, emptied after each
    batch) gives the torch teacher's features and next-token logits, for sequences of mixed lengths."""
    from exactspec.training.teacher import lean_teacher, runtime_teacher

    generator = torch.Generator().manual_seed(1)
    batch = [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in (30, 4, 17)]
    runtime = LlamaCppRuntime(files[0], slots=3, max_len=64, threads=1)
    ours = runtime_teacher(runtime, (0, 1))(batch)
    theirs = lean_teacher(LeanModel.from_pretrained(files[0], dtype=torch.float32, weights="dense"), (0, 1))(batch)
    assert runtime.lengths == [0, 0, 0]
    for (logits, features), (expected_logits, expected_features), tokens in zip(ours, theirs, batch):
        assert logits.shape == (len(tokens), VOCAB) and features.shape == (len(tokens), 128)
        assert (logits - expected_logits).abs().max() < ATOL_TORCH
        assert (features - expected_features).abs().max() < FEATURE_RTOL * expected_features.std()


def test_train_drafts_answers_run_on_llama_cpp(tmp_path):
    """The answers phase on llama.cpp: SmolLM2's chat answers, the prompt's ids as the chat template gives them."""
    import time

    from exactspec.chat import chat_messages
    from exactspec.loading import PACKAGED_MODELS
    from exactspec.tokenizer import TextTokenizer
    from exactspec.training.draft_data import generate_answers, read_answers
    from exactspec.training.prompts import Prompt

    try:
        smollm2 = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    prompts, out = [Prompt.user("Name a colour."), Prompt.user("What is 2 + 2?")], tmp_path / "answers.jsonl"
    assert (
        generate_answers(smollm2, prompts, out, time.monotonic() + 600, slots=2, max_new_tokens=4, backend="llamacpp")
        == 2
    )
    tokenizer = TextTokenizer.from_path(smollm2)
    for row in read_answers(out):
        assert row["ids"][: row["answer_start"]] == tokenizer.encode_chat(chat_messages(row["prompt"]))
        assert 1 <= len(row["ids"]) - row["answer_start"] <= 4


def test_a_k_quant_file_reads_in_torch_as_llama_cpp_runs_it(tmp_path):
    """Any GGUF a llama.cpp user has: SmolLM2 requantized to Q4_K_M by llama.cpp's own quantizer (Q4_K and Q6_K
    blocks, with Q5_0 where a row is not a multiple of 256 weights) loads in exactspec's torch runtime, and on a
    real prompt its next-token distributions agree with llama.cpp's on the same file. Measured (21 positions): the
    same argmax everywhere, total variation median 0.042 (max 0.16, at the first position), the gap llama.cpp's
    8-bit activations and float16 cache leave; a misread block layout gives noise (TV near 1)."""
    from exactspec.loading import PACKAGED_MODELS
    from exactspec.models.gguf import read_gguf
    from exactspec.models.llamacpp import requantize
    from exactspec.tokenizer import TextTokenizer

    try:
        source = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    path = requantize(source, tmp_path / "smollm2-q4_k_m.gguf", "Q4_K_M")
    assert {"Q4_K", "Q6_K", "Q5_0"} <= {t.type_name for t in read_gguf(path).tensors.values()}
    ids = TextTokenizer.from_path(source).encode_prompt(
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci("
    )
    ours = LeanModel.from_pretrained(path, dtype=torch.float32, weights="dense", max_len=128).prefill(ids)
    theirs = LlamaCppModel.from_file(path, max_len=128).prefill(ids)
    agreement = (ours.argmax(-1) == theirs.argmax(-1)).float().mean()
    total_variation = 0.5 * (ours.softmax(-1) - theirs.softmax(-1)).abs().sum(-1)  # (T,)
    print(f"Q4_K_M: argmax agreement {agreement:.3f}, total variation median {total_variation.median():.3f}")
    assert agreement >= 0.95 and total_variation.median() < 0.1
