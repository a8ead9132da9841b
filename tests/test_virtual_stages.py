"""Interleaved 1F1B as the searches price it (partitioner.place.search.virtual_stages), against Megatron-LM's counts."""

from __future__ import annotations

import pytest

from partitioner.errors import PartitionError
from partitioner.place.search.virtual_stages import check_virtual, interleaved_chunks, scaled_windows
from rules.generators import interleaved_fill


def test_the_bubble_shrinks_by_the_chunks_per_rank() -> None:
    # SC'21 eq. 2: bubble (p - 1) / v of n micro-batches; v = 1 is plain 1F1B's (n + p - 1) / n
    assert interleaved_fill(8, 4, 1) == pytest.approx((8 + 3) / 8)
    assert interleaved_fill(8, 4, 2) == pytest.approx((8 + 1.5) / 8)
    assert interleaved_fill(16, 16, 8) == pytest.approx((16 + 15 / 8) / 16)


def test_chunks_in_flight_are_megatrons_warmup_forwards_plus_one() -> None:
    # megatron/schedules.py: num_warmup_microbatches = (p - rank - 1) * 2 + (v - 1) * p, at most n v
    p, v, n = 4, 2, 8
    for rank in range(p):
        assert interleaved_chunks(p - rank, p, n, v) == min(n * v, (p - rank - 1) * 2 + (v - 1) * p + 1)
    assert interleaved_chunks(4, 4, 8, 2) == 11 and interleaved_chunks(1, 4, 8, 2) == 5
    assert interleaved_chunks(4, 4, 2, 2) == 4  # every chunk of every micro-batch: n v
    assert interleaved_chunks(4, 4, 8, 1) == 7  # v = 1: 2 (p - 1) + 1 (ranks in warmup, as Megatron's 1F1B)


def test_scaled_windows_pay_each_crossing_v_times() -> None:
    window = (2, (0, 1), (1e-5, 1e-9), None, (2e-5, 3e-9), 8e10)
    (r, kinds, recv, send, reduce, capacity), = scaled_windows([window], 3)
    assert (r, kinds, send, reduce, capacity) == (2, (0, 1), None, (2e-5, 3e-9), 8e10)
    assert recv == pytest.approx((3e-5, 3e-9))
    assert scaled_windows([window], 1) == [window]


@pytest.mark.parametrize("v, p, n, words", [
    (0, 4, 8, "whole number of chunks"), (True, 4, 8, "whole number"), (2, 1, 8, "2 or more stages"),
    (2, 4, 6, "a multiple of the stages (4)"),
])
def test_configurations_interleaving_cannot_run(v: int, p: int, n: int, words: str) -> None:
    with pytest.raises(PartitionError, match=words.replace("(", r"\(").replace(")", r"\)")):
        check_virtual(v, p, n)
    check_virtual(1, 1, 3)
    check_virtual(2, 4, 8)
