"""A stage's data-parallel cost by sharding mode, against hand-computed literals (ring: 0.1 ns per byte, no latency)."""

from __future__ import annotations

import numpy as np
import pytest

from cost_model.data_parallel import DataParallelCost
from cost_model.precision import MIXED, PURE_BF16
from cost_model.training_memory import state_bytes, training_memory

RING = (0.0, 1e-10)  # all-reduce of b bytes: b / 10 GB/s
P, U, F, B = 1e9, 1e8, 0.05, 0.3  # weights per rank, one block's, a micro-batch's forward and backward (s)


def cost(mode: str, degree: int = 8, overlap: bool = True) -> DataParallelCost:
    return DataParallelCost(mode, degree, RING, compute_bytes=2, grad_bytes=4, overlap=overlap)


def test_ddp_all_reduce_beside_the_last_backward() -> None:
    # AR(4 GB of fp32 gradients) = 0.4 s; the 0.3 s backward hides all but 0.1 s (more than the last 25 MiB bucket)
    assert cost("none").per_step(P, U, F, B) == pytest.approx(0.1)
    assert cost("none").per_micro_batch(P, U, F, B) == 0.0
    assert cost("none", overlap=False).per_step(P, U, F, B) == pytest.approx(0.4)  # after the backward, whole
    # a short backward hides nothing; a long one leaves the last bucket: AR(25 MiB) = 2.62 ms
    assert cost("none").per_step(P, U, F, 2.0) == pytest.approx(25 * 2**20 * 1e-10)


def test_zero_modes_gather_and_reduce_scatter_as_fsdp2_does() -> None:
    # AG(2 GB of bf16 weights) = 0.1 s beside a 0.05 s forward: 0.05 s; a block's AG(0.2 GB) = 0.01 s at least
    # RS(4 GB of gradients) = 0.2 s beside the 0.3 s backward: only the last block's RS(0.4 GB) = 0.02 s
    assert cost("zero1").per_micro_batch(P, U, F, B) == 0.0
    assert cost("zero1").per_step(P, U, F, B) == pytest.approx(0.02 + 0.05)  # gathered once a step
    assert cost("zero2").per_micro_batch(P, U, F, B) == pytest.approx(0.05)
    assert cost("zero2").per_step(P, U, F, B) == pytest.approx(0.02)
    assert cost("zero3").gathers(P, U, F, B) == pytest.approx((0.05, 0.01))  # again before each backward
    assert cost("zero3").per_micro_batch(P, U, F, B) == pytest.approx(0.06)
    assert cost("zero3", degree=1).per_micro_batch(P, U, F, B) == 0.0 and cost("zero3", 1).per_step(P, U, F, B) == 0.0


def test_every_cut_at_once() -> None:
    params = np.array([[P, 0.0], [P, 2 * P]])
    got = cost("zero2").per_micro_batch(params, U, F, B)
    np.testing.assert_allclose(got, [[0.05, 0.0], [0.05, 0.15]])
    with pytest.raises(ValueError, match="is not one of"):
        DataParallelCost("zero4", 2, RING, 2, 4)


def test_state_bytes_is_training_memory_for_arrays() -> None:
    for precision in (MIXED, PURE_BF16):
        for mode, m in (("none", 1), ("zero1", 4), ("zero2", 1), ("zero3", 1), ("zero3", 4)):
            one = training_memory(1000, precision, mode=mode, degree=4, micro_batches=m, units=[300, 300, 200])
            kinds = state_bytes(np.array([1000]), precision, mode=mode, degree=4, micro_batches=m, root=np.array([200]),
                                unit=np.array([300]), second=np.array([300]))
            assert [int(k[0]) for k in kinds] == [one.weights, one.master, one.gradients, one.optimizer], (precision,
                                                                                                           mode)
