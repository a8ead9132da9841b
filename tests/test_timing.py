"""Interval timers: host clocks on CPU (today's numbers, exactly), CUDA events on a GPU; node runs and the probe."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch
import torch.fx
from torch import nn

from cost_model.rounds import BackwardCallProbe
from cost_model.timing import (
    CudaTimer,
    NodeRunner,
    Timer,
    is_out_of_memory,
    make_timer,
    materialize,
    timer_for,
)  # fmt: skip
from rules.timing import elapsed_s, record_event, sync, uses_events

CPU = torch.device("cpu")


def needs_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marked `cuda` (the GPU suite selects it) and skipped where no CUDA device is visible."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


def ticking(step: float = 1.0) -> Callable[[], float]:
    """A fake clock that advances by `step` at every reading."""
    now = [0.0]

    def clock() -> float:
        now[0] += step
        return now[0]

    return clock


def test_host_timer_gives_clock_differences_in_order_then_starts_a_new_list() -> None:
    readings = iter([1.0, 3.5, 4.0, 4.25, 10.0, 10.5])
    timer = Timer(CPU, lambda: next(readings))
    timer.start()
    assert timer.stop() == 0
    timer.start()
    assert timer.stop() == 1
    assert timer.results() == [2.5, 0.25]
    timer.start()
    assert timer.stop() == 0  # indices count from the last results()
    assert timer.results() == [0.5]
    assert timer.results() == []


def test_timer_for_cpu_uses_todays_clocks(monkeypatch: pytest.MonkeyPatch) -> None:
    wall = timer_for(CPU, "wall")
    assert type(wall) is Timer and wall.clock is time.perf_counter is make_timer(CPU, "wall")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert timer_for(CPU, "cpu").clock is time.thread_time is make_timer(CPU, "cpu")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 4)
    with pytest.raises(ValueError, match="set_num_threads"):
        timer_for(CPU, "cpu")


def linear_node() -> tuple[torch.fx.GraphModule, torch.fx.Node, dict[str, Any]]:
    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(16, 16)))
    values = materialize(gm, [torch.randn(4, 16)])
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    return gm, node, values


def test_node_runner_reads_the_clock_around_forward_and_backward() -> None:
    gm, node, values = linear_node()
    timer = Timer(CPU, ticking())  # one tick between every two readings, as a host clock would see it
    runner = NodeRunner(node, gm, values, CPU, timer)
    forward, backward = runner.run_once()
    assert (forward, backward) == (0, 1)
    assert timer.results() == [1.0, 1.0]
    assert runner.measure(warmup=1, repeats=3) == (1.0, 1.0)
    runner.restore()
    assert all(p.grad is None for p in gm.parameters())


def test_node_without_gradients_has_no_backward_interval() -> None:
    gm, node, values = linear_node()
    for p in gm.parameters():
        p.requires_grad_(False)
    values = materialize(gm, [torch.randn(4, 16)])
    timer = Timer(CPU, ticking())
    assert NodeRunner(node, gm, values, CPU, timer).run_once() == (0, None)
    assert len(timer.results()) == 1


def test_backward_call_probe_estimate() -> None:
    probe = BackwardCallProbe(CPU, chain=9, timer=Timer(CPU, ticking()))
    spans = probe.run_once()
    seconds = probe.timer.results()
    assert spans == (0, 1) and len(seconds) == 2
    # E = t1 - (tk - t1) / (k - 1): one view 5 s, nine views 13 s -> 4 s of fixed cost.
    assert probe.estimate([5.0, 13.0], (0, 1)) == pytest.approx(4.0)


def test_out_of_memory_is_recognized() -> None:
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))


@needs_cuda
def test_cuda_timer_times_kernels_with_events() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    timer = timer_for(device)
    assert isinstance(timer, CudaTimer)
    a = torch.randn(2048, 2048, device=device)
    torch.cuda.synchronize(device)
    for _ in range(3):
        timer.start()
        torch.cuda._sleep(1_000_000)  # about a millisecond of GPU time, whatever the host does
        timer.stop()
        timer.start()
        a @ a
        timer.stop()
    seconds = timer.results()
    assert len(seconds) == 6 and all(s > 0 for s in seconds)
    assert timer.results() == []


@needs_cuda
def test_node_runner_on_cuda_defers_reading_to_the_round_end() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    gm, node, values = linear_node()
    gm = gm.to(device)
    values = materialize(gm, [torch.randn(4, 16, device=device)])
    runner = NodeRunner(node, gm, values, device, CudaTimer(device))
    forward, backward = runner.measure(warmup=1, repeats=3)
    runner.restore()
    assert forward > 0 and backward > 0


# ---- rules.timing: the one CUDA-event helper (the profiler's CudaTimer and runtime.clock.Clock use it) ----


def test_host_devices_are_not_timed_by_events() -> None:
    assert not uses_events(CPU) and not uses_events(torch.device("meta"))
    sync(CPU)  # nothing to wait for
    with pytest.raises(ValueError, match="host clock"):
        record_event(CPU)


@needs_cuda
def test_events_time_the_work_between_them() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    assert uses_events(device)
    a = torch.randn(2048, 2048, device=device)
    begin = record_event(device)
    for _ in range(10):
        a = a @ a / 2048
    end = record_event(device)
    sync(device)
    assert end.query() and 0 < elapsed_s(begin, end) < 10
