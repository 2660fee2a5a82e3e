"""The teacher's pass (exactspec.training.teacher): what a shard stores, resuming by sequence key, and the pool of
shards training draws from."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny_checkpoint, tiny_tokenizer_json

from exactspec.models.lean import LeanModel
from exactspec.training.teacher import (
    SHARD_SEQUENCES,
    TEACHER_BATCH,
    TOP_K,
    ShardPool,
    TeacherSequence,
    lean_teacher,
    load_shards,
    shard_paths,
    stored_keys,
    stored_layers,
    teacher_pass,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = save_tiny_checkpoint(
        tmp_path_factory.mktemp("teacher") / "target",
        vocab_rows=300,
        layers=2,
        seed=0,
        tokenizer_json=tiny_tokenizer_json(),
    )
    return LeanModel.from_pretrained(path, dtype=torch.float32)


def _sequences(lengths, seed=0, prefix="s"):
    generator = torch.Generator().manual_seed(seed)
    return [
        TeacherSequence(f"{prefix}{i}", torch.randint(1, 300, (n,), generator=generator).tolist(), n // 3, "docs")
        for i, n in enumerate(lengths)
    ]


def test_the_teacher_reads_sequences_in_padded_batches_as_it_reads_each_alone(model, tmp_path):
    lengths = [5, 40, 17, 3, 29, 40, 11, 23, 8, 35, 2, 19]  # more than one batch, lengths mixed across batches
    assert len(lengths) > TEACHER_BATCH
    sequences = _sequences(lengths)
    assert teacher_pass(lean_teacher(model, (0, 1)), (0, 1), sequences, tmp_path / "shards", float("inf")) == len(
        lengths
    )
    rows = load_shards(tmp_path / "shards")
    assert [r["ids"].tolist() for r in rows] == [s.ids for s in sequences]  # the shard keeps the input order
    for row, sequence in zip(rows, sequences):
        with torch.inference_mode():
            logits, features = model.decoder.forward_train(torch.tensor([sequence.ids]), (0, 1))
        top = logits[0].softmax(-1).topk(TOP_K)
        assert (row["key"], row["source"], row["loss_from"]) == (sequence.key, "docs", sequence.loss_from)
        assert row["features"].shape == (len(sequence.ids), 2 * model.cfg.hidden_size)
        torch.testing.assert_close(
            row["features"].float(), features[0].to(torch.bfloat16).float(), atol=0.02, rtol=0.01
        )
        torch.testing.assert_close(row["top_probs"].float(), top.values.half().float(), atol=1e-3, rtol=1e-3)
        assert (row["top_ids"][:, 0] == top.indices[:, 0]).all()  # the most likely token, position by position


def test_a_rerun_reads_only_new_sequences_and_rewrites_a_cut_shard(model, tmp_path):
    teacher, shards = lean_teacher(model, (0,)), tmp_path / "shards"
    calls = []
    counting = lambda batch: calls.append(len(batch)) or teacher(batch)  # noqa: E731
    first = _sequences([6] * (SHARD_SEQUENCES + 5))
    assert teacher_pass(counting, (0,), first, shards, float("inf")) == len(first) and len(shard_paths(shards)) == 2
    grown = _sequences([4] * 3, seed=1, prefix="new") + first  # new sequences, listed first
    calls.clear()
    assert teacher_pass(counting, (0,), grown, shards, float("inf")) == len(grown) and sum(calls) == 3
    assert stored_keys(shards) == {s.key for s in grown}
    last = shard_paths(shards)[-1]
    last.with_suffix(".keys.json").unlink()  # as if interrupted between the shard and its index
    assert len(stored_keys(shards)) == len(grown) - 3
    calls.clear()
    assert teacher_pass(counting, (0,), grown, shards, float("inf")) == len(grown) and sum(calls) == 3
    rows = load_shards(shards)
    assert sorted(r["key"] for r in rows) == sorted(s.key for s in grown)  # each once: the cut shard was replaced
    assert teacher_pass(counting, (0,), _sequences([4], seed=2, prefix="late"), shards, deadline=0.0) == len(
        grown
    )  # past it


def test_the_pool_holds_at_most_its_capacity_and_draws_the_same_sets_when_resumed(model, tmp_path):
    shards = tmp_path / "shards"
    teacher_pass(lean_teacher(model, (0,)), (0,), _sequences([3] * (4 * SHARD_SEQUENCES)), shards, float("inf"))
    paths = shard_paths(shards)
    pool = ShardPool(paths, capacity=2, seed=7, swap_every=10)
    keys = lambda rows: sorted(r["key"] for r in rows)  # noqa: E731
    sets = [keys(pool.rows_for(step)) for step in (0, 9, 10, 35)]
    assert all(len(s) == 2 * SHARD_SEQUENCES for s in sets) and sets[0] == sets[1]
    assert len({tuple(s) for s in sets[1:]}) > 1  # the set changes between periods
    resumed = ShardPool(paths, capacity=2, seed=7, swap_every=10)
    assert keys(resumed.rows_for(35)) == sets[3] and keys(resumed.rows_for(10)) == sets[2]
    seen = set().union(*(keys(pool.rows_for(10 * period)) for period in range(20)))
    assert seen == {r["key"] for r in load_shards(shards)}  # every shard is drawn in time
    whole = ShardPool.within(shards, memory_bytes=1e12)
    assert keys(whole.rows_for(0)) == keys(whole.rows_for(10_000)) and len(whole.rows) == 4 * SHARD_SEQUENCES
    with pytest.raises(ValueError, match="no teacher shards"):
        ShardPool([], 1)


def test_a_reader_takes_its_own_layers_of_the_stored_ones_and_a_pass_of_other_layers_is_refused(model, tmp_path):
    """One pass serves drafts of every layout: the shards record their layers, and each reader gets its own of them."""
    shards, sequences = tmp_path / "shards", _sequences([7, 12, 5])
    teacher_pass(lean_teacher(model, (0, 1)), (1, 0), sequences, shards, float("inf"))
    assert stored_layers(shards) == (0, 1)
    width = model.cfg.hidden_size
    whole = load_shards(shards)
    for layers, columns in (((1,), slice(width, 2 * width)), ((0,), slice(0, width)), ((0, 1), slice(0, 2 * width))):
        for row, full in zip(load_shards(shards, layers), whole):
            assert torch.equal(row["features"], full["features"][:, columns]) and row["key"] == full["key"]
    pool = ShardPool.within(shards, memory_bytes=1e12, layers=(1,))
    assert all(torch.equal(r["features"], f["features"][:, width:]) for r, f in zip(pool.rows_for(0), whole))
    size = shard_paths(shards)[0].stat().st_size  # one shard: half of its features is about half of it in memory
    assert (
        ShardPool.within(shards, 1.1 * size).capacity == 1
        and ShardPool.within(shards, 1.1 * size, layers=(1,)).capacity == 2
    )
    with pytest.raises(ValueError, match=r"hold target layers \[0, 1\], not \[2\]"):
        load_shards(shards, (2,))
    with pytest.raises(ValueError, match=r"holds features of target layers \[0, 1\], not \[0\]"):
        teacher_pass(lean_teacher(model, (0,)), (0,), _sequences([4], prefix="more"), shards, float("inf"))
    assert len(load_shards(shards)) == len(sequences)  # nothing written by the refused pass
