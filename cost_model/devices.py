"""Resolve device names, and measure each device's matmul rate, copy bandwidth and op overhead."""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Sequence, Union

import torch

__all__ = ["DeviceError", "DeviceSpec", "measure_device", "resolve_devices"]

DeviceLike = Union[str, torch.device]


class DeviceError(ValueError):
    """A requested device does not exist or is not visible to this process."""


@dataclass(frozen=True)
class DeviceSpec:
    """What the analytic cost model needs to know about one device."""

    name: str
    flops_per_s: float  # sustained fp32 matmul rate
    bytes_per_s: float  # sustained memory copy bandwidth (read + write counted once)
    op_overhead_s: float  # fixed cost of launching one small op
    memory_bytes: int


def resolve_devices(devices: Sequence[DeviceLike]) -> list[torch.device]:
    """Check every device exists here and return them as torch.device objects with indices.

    Raises:
        DeviceError: empty list, unknown device type, or an index past what is visible.
    """
    if isinstance(devices, (str, torch.device)):
        raise DeviceError(f"devices must be a list such as ['{devices}'], got the single value {devices!r}")
    if len(devices) == 0:
        raise DeviceError("devices is empty: pass at least one device, e.g. devices=['cpu']")
    resolved: list[torch.device] = []
    for d in devices:
        try:
            dev = torch.device(d)
        except (RuntimeError, TypeError) as exc:
            raise DeviceError(f"devices contains {d!r}, which is not a device name ('cpu', 'cuda:0', ...): {exc}") from None
        if dev.type == "cpu":
            resolved.append(torch.device("cpu"))
        elif dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = torch.cuda.current_device() if dev.index is None and count else (dev.index or 0)
            if index >= count:
                raise DeviceError(
                    f"devices={[str(x) for x in devices]} but only {count} CUDA devices are visible"
                    + (f" (cuda:0..cuda:{count - 1})" if count else "")
                    + "; use indices below that or check CUDA_VISIBLE_DEVICES"
                )
            resolved.append(torch.device("cuda", index))
        elif dev.type == "meta":
            raise DeviceError("the meta device holds no data and cannot run a pipeline stage; use 'cpu' or 'cuda:N'")
        else:
            module = getattr(torch, dev.type, None)
            if module is None or not getattr(module, "is_available", lambda: False)():
                raise DeviceError(f"devices contains {str(dev)!r} but no {dev.type} backend is available here")
            resolved.append(dev)
    return resolved


def _timeit(fn: "functools.partial[object]", device: torch.device, repeats: int = 5) -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30


@functools.lru_cache(maxsize=None)
def measure_device(device: torch.device) -> DeviceSpec:
    """Measure a device once per process: a square matmul, a large copy and a tiny op."""
    n = 1024 if device.type == "cpu" else 4096
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    with torch.no_grad():
        t_mm = _timeit(functools.partial(torch.mm, a, b), device)
        big = torch.empty(8 << 20 if device.type == "cpu" else 64 << 20, device=device)
        dst = torch.empty_like(big)
        t_copy = _timeit(functools.partial(dst.copy_, big), device)
        tiny = torch.ones(8, device=device)
        t_op = _timeit(functools.partial(torch.add, tiny, tiny), device, repeats=50)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return DeviceSpec(
        name=name,
        flops_per_s=2 * n**3 / max(t_mm, 1e-9),
        bytes_per_s=2 * big.numel() * big.element_size() / max(t_copy, 1e-9),
        op_overhead_s=t_op,
        memory_bytes=_memory_bytes(device),
    )
