"""Per-sample seeds (exactspec.decoding.seeds): sample 0 is the request's seed, and no two (seed, sample) pairs of a
realistic sweep share a stream, as `seed + i` did."""

from __future__ import annotations

import pytest

from exactspec.decoding.seeds import sample_seed


def test_sample_zero_is_the_seed_and_the_others_are_fixed_and_in_range():
    assert sample_seed(5, 0) == 5 and sample_seed(0, 0) == 0
    assert sample_seed(5, 1) == sample_seed(5, 1) != sample_seed(5, 2)
    assert all(0 <= sample_seed(s, i) < 2**63 for s in (0, 1, 2**63 - 1) for i in range(1, 50))
    with pytest.raises(ValueError, match="sample index"):
        sample_seed(5, -1)


def test_no_two_seed_and_sample_pairs_of_a_sweep_share_a_stream():
    streams = [sample_seed(seed, i) for seed in range(200) for i in range(8)]
    assert len(set(streams)) == len(streams)
    assert sample_seed(5, 1) != 6  # the collision seed + i made: sample 1 of seed 5 was sample 0 of seed 6
