"""Timing for benchmarks run under torchrun: every rank runs the step, barriers bracket the clock."""

from __future__ import annotations

import time
from typing import Callable

import torch.distributed as dist


def timed(step: Callable[[], None], steps: int, warmup: int = 2) -> float:
    """Seconds per step, measured on every rank between barriers, after `warmup` untimed steps."""
    for _ in range(warmup):
        step()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - start) / steps
