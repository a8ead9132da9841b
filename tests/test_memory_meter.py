"""MemoryMeter against hand-computed bytes: a chain of Linear layers, two stages of a pipeline, Adam's state."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner import partition
from runtime.memory_meter import CudaPeaks, MemoryMeter

W, N = 64, 32  # width and rows: a weight is W*W*4 = 16 KiB, an activation N*W*4 = 8 KiB
WEIGHT, ACT = W * W * 4, N * W * 4


def cost() -> AnalyticCostModel:
    spec = DeviceSpec(name="test", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 34)
    return AnalyticCostModel(measure=lambda d: spec)


def chain(layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(W, W, bias=False) for _ in range(layers)])


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


def test_parameters_count_at_start_and_a_forward_holds_what_autograd_saves() -> None:
    model = chain(3)
    x = torch.randn(N, W)
    with MemoryMeter([model]) as meter:
        assert meter.now == [3 * WEIGHT]
        out = model(x)  # each layer saves its input: x (the caller's, read by the stage) and two hidden
        assert meter.now == [3 * WEIGHT + 3 * ACT + ACT]  # + the output
        del out
        assert meter.now == [3 * WEIGHT + ACT]  # the graph died with the output; x is still alive
    assert meter.peaks == [3 * WEIGHT + 4 * ACT]


def test_backward_and_sgd_hand_computed() -> None:
    model = chain(2)
    x = torch.randn(N, W)
    with MemoryMeter([model]) as meter:
        model(x).sum().backward()
        assert meter.now == [2 * WEIGHT + 2 * WEIGHT + ACT]  # weights, their gradients, x
        assert meter.peaks[0] >= 2 * WEIGHT + 3 * ACT + ACT  # the forward's peak: x, hidden, output, its gradient


def test_adam_state_counts_on_its_parameters_stage() -> None:
    model = chain(2)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(N, W)).sum().backward()
    with MemoryMeter([model[0], model[1]], optimizer=optimizer) as meter:
        assert meter.now == [2 * WEIGHT, 2 * WEIGHT]  # weight and gradient each
        optimizer.step()  # exp_avg and exp_avg_sq per weight (the scalar step tensors go to no stage)
        assert meter.now == [4 * WEIGHT, 4 * WEIGHT]
    with MemoryMeter([model[0], model[1]], optimizer=optimizer) as meter:  # state present already, step counter too
        assert meter.now == [4 * WEIGHT + 4, 4 * WEIGHT + 4]


@pytest.mark.parametrize("threads", [False, True])
def test_two_stages_of_a_pipeline_attributed_per_stage(threads: bool) -> None:
    # 4 layers, 2 per stage, one micro-batch of 8 x N rows (an activation outweighs Adam's temporaries)
    model = chain(4)
    reference = copy.deepcopy(model)
    x, y = torch.randn(8 * N, W), torch.randn(8 * N, W)
    act = 8 * ACT
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), schedule="1f1b", threads=threads,
                     cost_model=cost())
    assert [len(list(s.module.parameters())) for s in pipe.stages] == [2, 2]
    optimizer = torch.optim.Adam(model.parameters())
    for _ in range(2):
        with MemoryMeter([s.module for s in pipe.stages], optimizer=optimizer) as meter:
            optimizer.zero_grad()
            pipe.train_step(x, y, mse)
            optimizer.step()
    # after the step: weights, gradients and Adam's two states of the stage's 2 weights, the batch (stage 0)
    # or the targets (stage 1) the caller still holds, and a few scalars (Adam's step counters, the loss)
    static = 2 * 4 * WEIGHT
    assert [n - static - act for n in meter.now] <= [16, 16] and min(n - static - act for n in meter.now) >= 0
    # at the peak, stage 0 holds its 4 static copies, x, its hidden, its output (also sent), and the
    # gradient it received; stage 1 its static copies, the received input, its hidden, output, the targets,
    # the loss's difference and square, and in backward their gradients
    assert static + 3 * act <= meter.peaks[0] <= static + 6 * act
    assert static + 6 * act <= meter.peaks[1] <= static + 10 * act
    assert meter.other_peak <= 2 * act  # the caller's batch and targets at most
    plain = torch.optim.Adam(reference.parameters())
    for _ in range(2):  # metering changed nothing: the plain model trained alike
        plain.zero_grad()
        mse(reference(x), y).backward()
        plain.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-7)


def test_stages_reading_a_storage_each_hold_it() -> None:
    # Stage 1 reads what stage 0 made (one storage on one CPU): both hold it, as two devices would
    a, b = nn.Linear(W, W, bias=False), nn.Linear(W, W, bias=False)
    x = torch.randn(N, W)
    with MemoryMeter([a, b]) as meter, torch.no_grad():
        h = a(x)
        assert meter.now == [WEIGHT + ACT + ACT, WEIGHT]  # x read by stage 0, h made there
        out = b(h)
        assert meter.now == [WEIGHT + 2 * ACT, WEIGHT + 2 * ACT]  # h read by stage 1, out made there
        del h
        assert meter.now == [WEIGHT + ACT, WEIGHT + ACT]  # h died: neither holds it
        del out


def test_meter_refuses_a_second_start_and_stops_watching() -> None:
    model = chain(1)
    meter = MemoryMeter([model])
    meter.start()
    with pytest.raises(RuntimeError, match="running already"):
        meter.start()
    meter.stop()
    before = meter.now
    kept = model(torch.randn(N, W))
    assert meter.now == before and kept.shape == (N, W)
    with pytest.raises(ValueError, match="pipe.stages"):
        MemoryMeter([])


@pytest.mark.cuda
def test_cuda_allocator_peak_agrees_with_the_meter() -> None:
    model = chain(4).cuda()
    x = torch.randn(N * 16, W, device="cuda")
    peaks = CudaPeaks(["cuda"])
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    peaks.reset()
    with MemoryMeter([model]) as meter:
        model(x).sum().backward()
    measured = meter.peaks[0] - 4 * WEIGHT - x.numel() * 4  # what the step made
    allocated = peaks.peaks[0] - base
    assert abs(allocated - measured) <= 0.1 * allocated + (1 << 20)  # the allocator rounds blocks up
    with pytest.raises(ValueError, match="MemoryMeter"):
        CudaPeaks(["cpu"])
