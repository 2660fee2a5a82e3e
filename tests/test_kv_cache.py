"""The one KV cache of the torch runtimes (exactspec.models.kv_cache): sizes, per-slot lengths, views that alias the
storage, ragged writes that land at each row's own positions, and copies between slots and caches."""

from __future__ import annotations

import pytest
import torch

from exactspec.models.kv_cache import ATTENTION_CHUNK, MAX_BLOCK, KVCache, slot_rows


def cache(slots: int = 3, max_len: int = 10) -> KVCache:
    return KVCache(
        layers=2, slots=slots, kv_heads=2, head_size=4, max_len=max_len, dtype=torch.float32, device=torch.device("cpu")
    )


def test_capacity_leaves_padding_room_in_whole_chunks():
    kv = cache(max_len=10)
    capacity = kv.keys.shape[3]
    assert kv.keys.shape == (2, 3, 2, capacity, 4) and capacity % ATTENTION_CHUNK == 0 and capacity >= 10 + MAX_BLOCK
    assert kv.lengths == [0, 0, 0]


def test_a_slot_view_writes_into_the_shared_storage():
    kv = cache()
    keys, values = kv.slot(1, 2)  # layer 1, slot 2: (1, nkv, capacity, hd)
    keys[0, :, 3] = 7.0
    values[0, :, 3] = 8.0
    assert torch.all(kv.keys[1, 2, :, 3] == 7.0) and torch.all(kv.values[1, 2, :, 3] == 8.0)
    assert kv.keys[1, :2].abs().sum() == 0 and kv.keys[0].abs().sum() == 0  # no other slot or layer touched


def test_ragged_writes_land_at_each_rows_positions_and_read_returns_the_slots_in_order():
    kv = cache()
    kv.lengths[:] = [4, 0, 2]
    slots, positions = torch.tensor([0, 2]), torch.tensor([[4, 5], [2, 3]])  # (B, T)
    new = torch.arange(2 * 2 * 2 * 4, dtype=torch.float32).reshape(2, 2, 2, 4)  # (B, nkv, T, hd)
    kv.write(0, slots, positions, new, -new)
    assert torch.equal(kv.keys[0, 0, :, 4:6], new[0]) and torch.equal(kv.keys[0, 2, :, 2:4], new[1])
    assert torch.equal(kv.values[0, 2, :, 2:4], -new[1]) and kv.keys[0, 1].abs().sum() == 0
    keys, _ = kv.read(0, slot_rows([0, 2], "cpu"), 6)  # not consecutive: an index, rows in the order asked
    assert keys.shape == (2, 2, 6, 4) and torch.equal(keys[1, :, 2:4], new[1])
    assert slot_rows([1, 2], "cpu") == slice(1, 3)


def test_rollback_and_copies_check_their_lengths():
    kv, other = cache(), cache()
    kv.lengths[0] = 5
    kv.keys[:, 0, :, :5] = 1.0
    kv.copy_prefix(0, 1, 3)
    assert kv.lengths[1] == 3 and torch.all(kv.keys[:, 1, :, :3] == 1.0) and kv.keys[:, 1, :, 3:].abs().sum() == 0
    other.copy_prefix(0, 2, 4, source_cache=kv)  # from another cache of the same shape
    assert other.lengths == [0, 0, 4] and torch.all(other.keys[:, 2, :, :4] == 1.0)
    kv.rollback(0, 2)
    assert kv.lengths[0] == 2
    with pytest.raises(ValueError, match="roll back to length 3"):
        kv.rollback(0, 3)
    with pytest.raises(ValueError, match="cannot copy 4 positions of slot 0: it holds 2"):
        kv.copy_prefix(0, 1, 4)


def test_rows_need_distinct_slots_and_room():
    kv = cache(max_len=10)
    kv.lengths[1] = 8
    kv.check_rows([0, 1], [10, 2])
    with pytest.raises(ValueError, match="distinct slots in"):
        kv.check_rows([1, 1], [1, 1])
    with pytest.raises(ValueError, match="distinct slots in"):
        kv.check_rows([3], [1])
    with pytest.raises(ValueError, match="8 cached . 3 new tokens exceeds 10 positions"):
        kv.check_rows([1], [3])
    with pytest.raises(ValueError, match="slots >= 1"):
        cache(slots=0)
