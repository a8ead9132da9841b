"""Trace clocks: time.time() marks on CPU; CUDA events resolved to the same wall-clock time base."""

from __future__ import annotations

import time
from typing import Any, Callable

import pytest
import torch

from runtime.clock import Clock


def needs_cuda(test: Callable[..., Any]) -> Callable[..., Any]:
    """Marked `cuda` (the GPU suite selects it) and skipped where no CUDA device is visible."""
    skip = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
    return pytest.mark.cuda(skip(test))


def test_cpu_marks_are_wall_clock_seconds_in_order() -> None:
    clock = Clock("cpu")
    before = time.time()
    marks = [clock.mark() for _ in range(100)]
    after = time.time()
    assert all(isinstance(m, float) for m in marks)
    clock.resolve()  # nothing to wait for on CPU
    seconds = [clock.seconds(m) for m in marks]
    assert seconds == marks  # a CPU mark is its time.time() value
    assert seconds == sorted(seconds)
    assert before <= seconds[0] and seconds[-1] <= after


def test_host_times_resolve_to_themselves_on_any_clock() -> None:
    assert Clock().seconds(1234.5) == 1234.5
    assert Clock().seconds(7) == 7.0


@needs_cuda
def test_cuda_marks_resolve_to_wall_clock_seconds() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    clock = Clock(device)
    start = time.time()
    first = clock.mark()
    torch.cuda._sleep(50_000_000)  # tens of milliseconds on the GPU; the host returns at once
    second = clock.mark()
    launched = time.time()
    clock.resolve()
    done = time.time()
    a, b = clock.seconds(first), clock.seconds(second)
    tolerance = 0.005
    assert start - tolerance <= a <= launched + tolerance
    assert a < b <= done + tolerance
    assert b - a > launched - start  # the events saw the kernel run, the host only its launch


@needs_cuda
def test_cuda_clocks_on_one_device_share_a_time_base() -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    one = Clock(device)
    mark = one.mark()
    other = Clock(device)  # made later: another anchor, the same wall-clock reading of the mark
    other.resolve()
    assert other.seconds(mark) == pytest.approx(one.seconds(mark), abs=0.005)
