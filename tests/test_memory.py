"""Stage memory under GPipe and 1F1B against hand-computed byte counts."""

from __future__ import annotations

import pytest

from cost_model.memory import (
    ALLOCATOR_HEADROOM,
    CUDA_CONTEXT_BYTES,
    device_overhead_bytes,
    in_flight,
    saved_activation_bytes,
    stage_memory,
    usable_bytes,
)


def test_micro_batches_in_flight() -> None:
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]  # never more than m
    with pytest.raises(ValueError, match="gpipe"):
        in_flight("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="0 <= stage < stages"):
        in_flight("gpipe", 4, 4, 8)


def test_stage_memory_adam_1f1b_hand_computed() -> None:
    mem = stage_memory(100, 10, stage=1, stages=4, micro_batches=8, schedule="1f1b", optimizer="adam",
                       recv_bytes=5, send_bytes=7)
    # params 100, grads 100, Adam 2 x 100, activations (4 - 1) x (10 + 5), buffers 2 x (5 + 7)
    assert (mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers) == (100, 100, 200, 45, 24)
    assert mem.total == 469
    assert mem.to_dict()["total"] == 469


def test_stage_memory_gpipe_and_optimizers() -> None:
    sgd = stage_memory(1000, 50, stage=0, stages=2, micro_batches=4, optimizer="sgd")
    assert (sgd.optimizer, sgd.activations, sgd.buffers) == (0, 200, 0)
    momentum = stage_memory(1000, 50, stage=0, stages=2, micro_batches=4, optimizer="sgd_momentum")
    assert momentum.optimizer == 1000
    with pytest.raises(ValueError, match="adam"):
        stage_memory(1, 1, stage=0, stages=1, micro_batches=1, optimizer="lion")
    with pytest.raises(ValueError, match=">= 0"):
        stage_memory(-1, 1, stage=0, stages=1, micro_batches=1)


def test_fits_with_headroom() -> None:
    mem = stage_memory(100, 0, stage=0, stages=1, micro_batches=1, optimizer="sgd")  # 200 bytes
    assert mem.fits(1000)
    assert not mem.fits(210)  # 90% of 210 is 189
    assert mem.fits(210, headroom=1.0)


def test_saved_activations_skip_views_and_sizes() -> None:
    nodes = [
        {"op": "call_module", "target": "fc", "flops": 10, "shapes": [(2, 4)], "out_bytes": 32},
        {"op": "call_method", "target": "view", "shapes": [(8,)], "out_bytes": 32},
        {"op": "call_function", "target": "relu", "shapes": [(8,)], "out_bytes": 32},
        {"op": "call_function", "target": "floordiv", "shapes": [], "out_bytes": 0},
    ]
    assert saved_activation_bytes(nodes) == 64


def test_cuda_loses_its_context_and_allocator_headroom() -> None:
    import torch

    gib = 1 << 30
    assert CUDA_CONTEXT_BYTES == 512 << 20 and ALLOCATOR_HEADROOM == 0.10
    assert device_overhead_bytes("cuda") == device_overhead_bytes("cuda:3") == CUDA_CONTEXT_BYTES
    assert device_overhead_bytes(torch.device("cuda", 1)) == CUDA_CONTEXT_BYTES
    assert device_overhead_bytes("cpu") == device_overhead_bytes(torch.device("cpu")) == 0
    # an 80 GiB H100: (80 GiB - 0.5 GiB) x 0.9 = 71.55 GiB for tensors
    assert usable_bytes(80 * gib, "cuda:0") == int(79.5 * gib * 0.9)
    assert usable_bytes(80 * gib, "cpu") == 80 * gib  # host memory: no context, no headroom
    assert usable_bytes(100 << 20, "cuda") == 0  # smaller than the context: nothing, never negative
    mem = stage_memory(30 * gib, 5 * gib, stage=0, stages=2, micro_batches=4, optimizer="sgd")  # 80 GiB
    assert mem.total <= 80 * gib and mem.total > usable_bytes(80 * gib, "cuda")
    with pytest.raises(ValueError, match="negative"):
        usable_bytes(-1, "cuda")
