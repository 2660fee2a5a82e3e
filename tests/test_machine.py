"""--backend auto (exactspec.tuning.machine): the candidates, the cost model's choice among measured costs, the cache.

The choice is checked against costs made up here (so it is the rule that is tested, not this machine's speed):
a runtime with the cheaper one-token call but a steep c(n) wins plain decoding and loses speculation with a good
draft to one whose c(n) is flat; and a real measurement on tiny files (torch and, where installed, llama.cpp)
fills every call size the policy uses.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from test_gguf import random_hf_weights, write_llama_gguf

from exactspec.cli import main
from exactspec.loading import PairSpec
from exactspec.tuning import machine
from exactspec.tuning.machine import Candidate, MachineCache, Measurement, candidates, choose, predicted_ms_per_token

MAX_GAMMA = 8


@pytest.fixture(scope="module")
def gguf(tmp_path_factory):
    return write_llama_gguf(tmp_path_factory.mktemp("machine") / "target.gguf", random_hf_weights(tie=False, seed=0))


def costs(one: float, per_token: float) -> dict[int, float]:
    return {n: one + per_token * (n - 1) for n in range(1, MAX_GAMMA + 2)}


def test_candidates_are_every_runtime_of_the_stored_weights_narrowed_by_the_flags(gguf, monkeypatch):
    monkeypatch.setattr(machine, "SMALL_MODEL_PARAMETERS", 0)  # the tiny file counts as large: threads are tried
    monkeypatch.setattr(machine, "native_bfloat16", lambda device: False)
    auto = PairSpec(gguf, backend="auto", dtype="auto")
    found = candidates(auto, cores=4, llama_cpp=True, onnx=False)
    assert {(c.backend, c.weights, c.dtype) for c in found} == {
        ("llamacpp", "auto", "float32"),
        ("lean", "dense", "float32"),
    }
    with_onnx = {(c.backend, c.weights, c.dtype) for c in candidates(auto, cores=4, llama_cpp=True, onnx=True)}
    assert with_onnx == {(c.backend, c.weights, c.dtype) for c in found} | {("onnx", "auto", "float32")}
    int8 = candidates(replace(auto, int8_activations=True), cores=4, llama_cpp=True, onnx=True)
    assert {c.int8_activations for c in candidates(auto, cores=4, llama_cpp=True, onnx=True)} == {False}
    assert {(c.backend, c.int8_activations) for c in int8} == {("onnx", True)}  # asked for: the onnx form only
    # (no emulated bfloat16 dense; no q4: the file stores no 4-bit blocks, see the next test)
    assert sorted({c.threads for c in found}) == [1, 2, 4]
    assert {c.backend for c in candidates(auto, cores=4, llama_cpp=False, onnx=False)} == {"lean"}
    named = PairSpec(gguf, backend="auto", dtype="float32", threads=2)  # a dtype named: torch's runtime, that dtype
    assert candidates(named, cores=4, llama_cpp=True, onnx=True) == [Candidate("lean", "dense", "float32", 2)]
    monkeypatch.setattr(machine, "native_bfloat16", lambda device: True)
    assert ("lean", "dense", "bfloat16") in {
        (c.backend, c.weights, c.dtype) for c in candidates(auto, cores=1, llama_cpp=True)
    }
    for dtype in ("float32", "bfloat16"):  # llama.cpp named with a dtype: the dtype of its torch side, on any CPU
        both = PairSpec(gguf, backend="llamacpp", dtype=dtype, threads=2)
        assert candidates(both, cores=4, llama_cpp=True) == [Candidate("llamacpp", "auto", dtype, 2)]


def test_a_q4_file_adds_torchs_int4_path():
    from exactspec.loading import PACKAGED_MODELS

    try:
        smollm2 = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    found = candidates(PairSpec(smollm2, backend="auto", dtype="auto", threads=1), llama_cpp=False)
    assert Candidate("lean", "q4", "bfloat16", 1) in found


def test_a_small_target_is_tried_on_one_thread_and_impossible_flags_are_named(gguf, tmp_path):
    assert {c.threads for c in candidates(PairSpec(gguf, backend="auto", dtype="auto"), cores=8, llama_cpp=True)} == {1}
    directory = tmp_path / "checkpoint"
    directory.mkdir()
    with pytest.raises(ValueError, match="--weights q4 keeps a GGUF file's 4-bit weights"):
        candidates(PairSpec(directory, backend="auto", dtype="auto", weights="q4"), cores=2, llama_cpp=True)
    with pytest.raises(ValueError, match="--backend llamacpp runs .gguf files"):
        candidates(PairSpec(directory, backend="llamacpp", dtype="float32"), cores=2, llama_cpp=True)


def test_the_cost_model_prices_plain_and_speculative_decoding():
    measured = Measurement(Candidate("lean", "q4", "bfloat16", 2), costs(10.0, 2.0), 1.0)
    assert predicted_ms_per_token(measured, (0.8,), speculate=False, max_gamma=MAX_GAMMA) == 10.0
    assert predicted_ms_per_token(measured, (), speculate=True, max_gamma=MAX_GAMMA) == 10.0  # no prior: plain
    # gamma 1: (1 + 12) / 1.8; gamma 2: (2 + 14) / 2.44; ... the best over gamma 0..8, by hand:
    best = min((g * 1.0 + 10.0 + 2.0 * g) / sum(0.8**k for k in range(g + 1)) for g in range(MAX_GAMMA + 1))
    assert predicted_ms_per_token(measured, (0.8,), True, MAX_GAMMA) == pytest.approx(best) and best < 10.0 * 0.7


def test_the_choice_follows_the_measured_costs(gguf, monkeypatch, tmp_path):
    """Steep (cheap one-token calls, a block costs nearly its length: llama.cpp on Q4_1 on an AVX2 CPU) against flat
    (dearer one-token calls, blocks nearly free): plain decoding picks steep; speculation with a good draft picks flat,
    with a useless one steep again. Then the cache: a second choice measures nothing, another machine measures again."""
    monkeypatch.setattr(machine, "SMALL_MODEL_PARAMETERS", 0)
    table = {("llamacpp", 2): costs(10.0, 9.0), ("lean", 2): costs(14.0, 0.5)}
    calls = []

    def fake_measure(spec, candidate, max_gamma, params):
        calls.append(candidate)
        return Measurement(candidate, table.get((candidate.backend, candidate.threads), costs(50.0, 50.0)), 1.0)

    monkeypatch.setattr(machine, "measure", fake_measure)
    monkeypatch.setattr(machine, "llama_cpp_available", lambda: True)
    cache = MachineCache(tmp_path / "machine")
    prior = {"good": (0.9,) * 8, "useless": (0.05,) * 8}
    picked = {}
    for name, rates in prior.items():
        monkeypatch.setattr(machine, "acceptance_prior", lambda *args, rates=rates: (rates, "test"))
        for speculate in (False, True):
            spec = PairSpec(
                gguf, "lookup" if not speculate else None, speculate, backend="auto", dtype="auto"
            ).resolved()
            chosen, choice = choose(spec, cache=cache)
            picked[name, speculate] = (chosen.backend, chosen.threads)
            assert choice.chosen.backend == chosen.backend and len(choice.measurements) == len(choice.predicted_ms)
    assert picked["good", False] == picked["useless", False] == ("llamacpp", 2)
    assert picked["good", True] == ("lean", 2) and picked["useless", True] == ("llamacpp", 2)
    measured_once = len(calls)
    assert measured_once == len(
        candidates(PairSpec(gguf, backend="auto", dtype="auto"))
    )  # then every choice from the cache
    assert choose(spec, cache=cache)[1].source == "cached" and len(calls) == measured_once
    file = cache.entries()[0]
    damaged = json.loads(file.read_text())
    damaged[next(iter(damaged))] = (
        "not a measurement"  # a hand-edited or truncated entry is measured again, not a crash
    )
    file.write_text(json.dumps(damaged))
    assert choose(spec, cache=cache)[1].source == "measured now" and len(calls) == measured_once + 1
    monkeypatch.setattr(machine, "machine_signature", lambda device: {"cpu": "another"})
    assert choose(spec, cache=cache)[1].source == "measured now" and len(calls) == 2 * measured_once + 1
    assert len(cache.entries()) == 2


def test_a_shipped_draft_that_would_never_draft_gives_way_to_prompt_lookup(gguf, monkeypatch, tmp_path):
    """On a runtime whose c(n) is steep a poor draft's best gamma is 0: it would never draft, yet it costs every call
    (llama.cpp's feature capture), so prompt lookup runs instead, and the cold start measures lookup's own costs.
    A good draft, or one the user named, is kept."""
    monkeypatch.setattr(
        machine, "measure", lambda spec, candidate, max_gamma, params: Measurement(candidate, costs(10.0, 4.0), 1.0)
    )
    monkeypatch.setattr(machine, "llama_cpp_available", lambda: True)
    draft = tmp_path / "draft"
    draft.mkdir()
    (draft / "feature_draft.json").write_text("{}")
    spec = PairSpec(gguf, draft, backend="auto", dtype="auto").resolved()
    outcomes = {}
    for name, rates in {"poor": (0.36, 0.3), "good": (0.95,) * 8}.items():
        monkeypatch.setattr(machine, "acceptance_prior", lambda *args, rates=rates: (rates, "test"))
        for may_drop in (True, False):
            chosen, choice = choose(
                spec, cache=MachineCache(tmp_path / f"cache-{name}-{may_drop}"), may_drop_draft=may_drop
            )
            outcomes[name, may_drop] = chosen.draft, choice
    dropped_spec, dropped = outcomes["poor", True]
    assert dropped_spec == "lookup" and dropped.draft_dropped and dropped.calibration is None
    assert "best gamma 0" in dropped.as_dict()["drafting"] and "c(2)/c(1) = 1.40" in dropped.drafting
    for kept in (("poor", False), ("good", True), ("good", False)):
        kept_spec, choice = outcomes[kept]
        assert (
            kept_spec == draft
            and not choice.draft_dropped
            and choice.calibration is not None
            and choice.drafting is None
        )


def test_a_real_measurement_fills_every_call_size():
    """The shipped target on torch, and SmolLM2 on llama.cpp where both are installed; one thread, plain: costs for
    1..max_gamma + 1 tokens."""
    from exactspec.loading import PACKAGED_MODELS, default_pair_dirs

    specs = [PairSpec(default_pair_dirs()[0], speculate=False, backend="auto", dtype="auto", threads=1)]
    try:
        if machine.llama_cpp_available():
            specs.append(
                PairSpec(
                    PACKAGED_MODELS["smollm2"].path(), speculate=False, backend="llamacpp", dtype="float32", threads=1
                )
            )
    except FileNotFoundError:
        pass
    for spec in specs:
        for candidate in candidates(spec):
            measured = machine.measure(spec, candidate, MAX_GAMMA, machine.SamplingParams())
            assert sorted(measured.target_ms) == list(range(1, MAX_GAMMA + 2)) and min(measured.target_ms.values()) > 0


def test_generate_reports_the_choice_and_starts_from_it(capsys, monkeypatch):
    """The shipped pair (its threads tried as a large model's): the first run measures, the second starts from the
    cache without calibrating; `exactspec cache --clear` forgets it."""
    monkeypatch.setattr(machine, "SMALL_MODEL_PARAMETERS", 0)
    MachineCache().clear()
    runs = []
    for _ in range(2):
        assert main(["generate", "Once upon a time", "--max-new-tokens", "8", "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert [r["runtime_choice"]["source"] for r in runs] == ["measured now", "cached"]
    assert runs[0]["runtime_choice"]["chosen"] == runs[1]["runtime_choice"]["chosen"]
    assert runs[1]["policy"]["calibration"]["seconds"] == 0.0  # the cached costs, not timed again
    assert main(["cache", "--clear"]) == 0 and not MachineCache().entries()


def test_a_cached_measurement_far_from_a_runs_own_calls_is_measured_again(gguf, monkeypatch, tmp_path):
    """A measurement taken on a busy machine (injected: every call ten times its cost) is cached; a later run whose
    calls cost a tenth of it says so in one line and forgets it, so the next choice measures again. A run within
    DRIFT_FACTOR of the cache keeps it."""
    monkeypatch.setattr(machine, "llama_cpp_available", lambda: False)
    monkeypatch.setattr(machine, "acceptance_prior", lambda *args: ((0.6,) * 8, "test"))
    slow = {"factor": 10.0}

    def measure(spec, candidate, max_gamma, params):
        return Measurement(candidate, costs(slow["factor"] * 10.0, slow["factor"] * 1.0), 1.0)

    monkeypatch.setattr(machine, "measure", measure)
    cache = MachineCache(tmp_path / "machine")
    spec = PairSpec(gguf, "lookup", backend="auto", dtype="auto").resolved()
    assert choose(spec, cache=cache)[1].source == "measured now"
    _, choice = choose(spec, cache=cache)
    assert choice.source == "cached" and choice.cache_file is not None
    near = {1: 95.0, 3: 130.0}  # within DRIFT_FACTOR of the cached 100 and 120 ms
    assert machine.recheck(choice, near) is None and choose(spec, cache=cache)[1].source == "cached"
    quiet = {1: 10.5, 2: 11.2, 4: 13.1}  # what the calls really cost
    line = machine.recheck(choice, quiet)
    assert "0.1x" in line and "measures again" in line and "\n" not in line
    slow["factor"] = 1.0
    _, again = choose(spec, cache=cache)
    assert again.source == "measured now" and again.measurements[0].target_ms[1] == 10.0
    assert machine.recheck(again, quiet) is None  # measured now: nothing to hold it against


def test_a_runs_call_costs_come_from_its_rounds():
    from exactspec.decoding.stats import GenerationStats, RoundRecord

    rounds = [RoundRecord(0, 0, 1, 0.0, 0.5, 0.0)]  # the prefill: left out
    rounds += [RoundRecord(d, 0, 1, 0.0, s, 0.0) for d, s in ((0, 0.010), (0, 0.012), (0, 0.020), (2, 0.015))]
    assert machine.observed_call_ms(GenerationStats(rounds)) == {1: pytest.approx(12.0), 3: pytest.approx(15.0)}
