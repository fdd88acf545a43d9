"""Length buckets of the local backend's training pass (pure planning math)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from retrain.backends.local.training.pack import length_buckets

lengths_st = st.lists(st.integers(min_value=1, max_value=80), min_size=1, max_size=40)


def padded(lengths: list[int], runs: list[list[int]], overhead: int) -> int:
    return sum(len(r) * max(lengths[i] for i in r) + overhead for r in runs)


@given(lengths_st, st.integers(min_value=0, max_value=200))
def test_buckets_partition_the_rows_shortest_first(lengths, overhead):
    runs = length_buckets(lengths, overhead)
    assert sorted(i for r in runs for i in r) == list(range(len(lengths)))
    flat = [lengths[i] for r in runs for i in r]
    assert flat == sorted(flat)


@given(lengths_st, st.integers(min_value=0, max_value=200))
def test_buckets_never_cost_more_than_one_run_or_one_per_row(lengths, overhead):
    cost = padded(lengths, length_buckets(lengths, overhead), overhead)
    rows = list(range(len(lengths)))
    assert cost <= padded(lengths, [rows], overhead)
    assert cost <= padded(lengths, [[i] for i in rows], overhead)


def test_equal_lengths_make_one_bucket_and_a_long_tail_its_own():
    assert length_buckets([5] * 8, 16) == [list(range(8))]
    lengths = [10] * 16 + [64] * 4
    assert length_buckets(lengths, 16) == [list(range(16)), list(range(16, 20))]
    assert len(length_buckets(lengths, 10**6)) == 1  # a forward costs more than the padding
