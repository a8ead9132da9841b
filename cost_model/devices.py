"""Resolve device names, and measure each device's matmul rate, copy bandwidth and op overhead."""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

__all__ = ["DeviceError", "DeviceLike", "DeviceSpec", "cpu_cores", "device_present", "host_memory", "measure_device",
           "resolve_devices", "tf32_enabled"]  # fmt: skip

DeviceLike = str | torch.device


class DeviceError(ValueError):
    """A requested device does not exist or is not visible to this process."""


@dataclass(frozen=True)
class DeviceSpec:
    """One device: measured (or described) rates, and what discovery found.

    A rate of 0 means "not known yet": the analytic model then measures the device if it is
    present here, and otherwise asks for a hand description.
    """

    name: str
    flops_per_s: float  # sustained fp32 matmul rate
    bytes_per_s: float  # sustained memory copy bandwidth (read + write counted once)
    op_overhead_s: float  # fixed cost of launching one small op
    memory_bytes: int
    free_memory_bytes: int | None = None
    kind: str = ""  # "cpu", "cuda", ...: the torch device type ("" when unknown)
    cores: int | None = None  # CPU cores usable by this process
    compute_capability: tuple[int, int] | None = None  # CUDA only
    gpu_type: str = ""  # a type of cost_model/gpus.json ("H100-SXM"); "" = found from `name` where known
    matmul_precision: str = ""  # "fp32" or "tf32": what flops_per_s was measured in ("" = not recorded)

    @property
    def measured(self) -> bool:
        """True when the three rates are known (measured or described)."""
        return self.flops_per_s > 0 and self.bytes_per_s > 0


def device_index(device: torch.device) -> int | None:
    """The device's index; None where it names none (`torch.device("cuda")`), which torch's stubs leave out."""
    return device.index


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
            raise DeviceError(
                f"devices contains {d!r}, which is not a device name ('cpu', 'cuda:0', ...): {exc}"
            ) from None
        if dev.type == "cpu":
            resolved.append(torch.device("cpu"))
        elif dev.type == "cuda":
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            index = torch.cuda.current_device() if device_index(dev) is None and count else (dev.index or 0)
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


def _timeit(fn: Callable[[], object], device: torch.device, repeats: int = 5, clock: str = "wall") -> float:
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    timer = time.thread_time if clock == "cpu" else time.perf_counter
    fn()
    sync()
    times = []
    for _ in range(repeats):
        start = timer()
        fn()
        sync()
        times.append(timer() - start)
    return statistics.median(times)


def _memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return host_memory()[0]


def host_memory() -> tuple[int, int]:
    """(total, available) bytes of host memory; 16 GiB each when the OS does not say."""
    try:
        total = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 16 << 30, 16 << 30
    available = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return total, available


def device_present(device: torch.device) -> bool:
    """True when `device` exists in this process (so it can be measured or profiled)."""
    device = torch.device(device)
    if device.type == "cpu":
        return True
    if device.type == "cuda":
        return torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()
    module = getattr(torch, device.type, None)
    return bool(module is not None and getattr(module, "is_available", lambda: False)())


def cpu_cores() -> int:
    """CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def tf32_enabled(family: str = "matmul") -> bool:
    """Whether CUDA runs fp32 matrix products (`family="matmul"`) or convolutions ("conv") on TF32 tensor cores.

    Reads torch's switches as they are now: `torch.backends.cuda.matmul.fp32_precision` ("tf32" / "ieee";
    "none" defers to `allow_tf32` and `torch.get_float32_matmul_precision() != "highest"`), and for
    convolutions `torch.backends.cudnn.conv.fp32_precision`, else `torch.backends.cudnn.allow_tf32`.
    """
    if family == "conv":
        precision = str(getattr(getattr(torch.backends.cudnn, "conv", None), "fp32_precision", "none"))
        if precision in ("tf32", "ieee"):
            return precision == "tf32"
        return bool(torch.backends.cudnn.allow_tf32)
    precision = str(getattr(torch.backends.cuda.matmul, "fp32_precision", "none"))
    if precision in ("tf32", "ieee"):
        return precision == "tf32"
    return torch.get_float32_matmul_precision() != "highest" or bool(torch.backends.cuda.matmul.allow_tf32)


def measure_device(device: torch.device, clock: str = "wall") -> DeviceSpec:
    """Measure a device once per process (and thread count): a square matmul, a large copy, a tiny op.

    The matmul is 1024 x 1024 on CPU and 4096 x 4096 elsewhere; the copy 32 MiB on CPU and
    256 MiB elsewhere; the tiny op an 8-element add (its median time is the op overhead).
    `clock="cpu"` times this thread's CPU time (CPU, one torch thread; see `timing.make_timer`).
    On CUDA the matmul runs as torch is set now (TF32 or not, see `tf32_enabled`), and the spec's
    `matmul_precision` says which, so the analytic model compares it with the right peak.

    Raises:
        ValueError: clock is not "wall" or "cpu", or "cpu" where it cannot time the device.
    """
    device = torch.device(device)
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock={clock!r}; use 'wall' or 'cpu'")
    if clock == "cpu" and (device.type != "cpu" or torch.get_num_threads() != 1):
        raise ValueError(f"clock='cpu' needs device 'cpu' and torch.set_num_threads(1), got {device}; use clock='wall'")
    precision = "tf32" if device.type == "cuda" and tf32_enabled("matmul") else "fp32"
    return _measure(device, torch.get_num_threads(), clock, precision)


@functools.cache
def _measure(device: torch.device, threads: int, clock: str, precision: str = "fp32") -> DeviceSpec:
    n = 1024 if device.type == "cpu" else 4096
    g = torch.Generator(device=device).manual_seed(0)  # its own generator: planning leaves the user's RNG alone
    a = torch.randn(n, n, device=device, generator=g)
    b = torch.randn(n, n, device=device, generator=g)
    with torch.no_grad():
        t_mm = _timeit(functools.partial(torch.mm, a, b), device, clock=clock)
        big = torch.empty(8 << 20 if device.type == "cpu" else 64 << 20, device=device)
        dst = torch.empty_like(big)
        t_copy = _timeit(functools.partial(dst.copy_, big), device, repeats=15, clock=clock)
        tiny = torch.ones(8, device=device)
        t_op = _timeit(functools.partial(torch.add, tiny, tiny), device, repeats=200, clock=clock)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return DeviceSpec(
        name=name,
        flops_per_s=2 * n**3 / max(t_mm, 1e-9),
        bytes_per_s=2 * big.numel() * big.element_size() / max(t_copy, 1e-9),
        op_overhead_s=t_op,
        memory_bytes=_memory_bytes(device),
        kind=device.type,
        cores=cpu_cores() if device.type == "cpu" else None,
        matmul_precision=precision,
    )
