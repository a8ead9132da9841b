"""Find the devices of this machine: CPU always, CUDA GPUs through torch and NVML, and their links.

NVML (the `pynvml` module of nvidia-ml-py) gives names, free memory and the topology: two
GPUs joined by NVLink get an "nvlink" link (bandwidth scaled by how many NVLinks join
them), other pairs "pcie". Without NVML, or without GPUs, discovery still works: torch
gives what it can, and a CPU-only machine is a set of one device. Nothing here raises
because a driver or library is missing.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import torch

from cost_model.cluster import DeviceSet
from cost_model.comm import LINK_KINDS, Link
from cost_model.devices import DeviceSpec, cpu_cores, host_memory, measure_device
from cost_model.links import measure_copy_link

__all__ = ["discover_devices", "load_nvml", "nvml_link"]

_NVLINK_PER_LINK = 25e9  # bytes/s one way per NVLink (NVLink 3 and 4)


def load_nvml() -> ModuleType | None:
    """pynvml, initialized, or None when the library or a driver is missing."""
    try:
        import importlib

        pynvml = importlib.import_module("pynvml")
        pynvml.nvmlInit()
        return pynvml
    except Exception:  # noqa: BLE001 - ImportError, NVMLError_LibraryNotFound, driver errors, ...
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cpu_spec(measure: bool) -> DeviceSpec:
    total, available = host_memory()
    base = measure_device(torch.device("cpu")) if measure else None
    return DeviceSpec(
        name="cpu",
        flops_per_s=base.flops_per_s if base else 0.0,
        bytes_per_s=base.bytes_per_s if base else 0.0,
        op_overhead_s=base.op_overhead_s if base else 0.0,
        memory_bytes=total,
        free_memory_bytes=available,
        kind="cpu",
        cores=cpu_cores(),
    )


def _nvml_handles(nvml: ModuleType, count: int) -> list[Any | None]:
    """NVML handle of each torch CUDA index, matched by UUID (CUDA_VISIBLE_DEVICES may reorder)."""
    try:
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        by_uuid = {_text(nvml.nvmlDeviceGetUUID(h)).removeprefix("GPU-"): h for h in handles}
    except Exception:  # noqa: BLE001
        return [None] * count
    out: list[Any | None] = []
    for i in range(count):
        uuid = ""
        try:
            uuid = str(getattr(torch.cuda.get_device_properties(i), "uuid", "")).removeprefix("GPU-")
        except Exception:  # noqa: BLE001
            pass
        out.append(by_uuid.get(uuid, handles[i] if i < len(handles) and len(handles) == count else None))
    return out


def _cuda_spec(index: int, handle: Any | None, nvml: ModuleType | None, measure: bool) -> DeviceSpec:
    props = torch.cuda.get_device_properties(index)
    total, free = int(props.total_memory), None
    if nvml is not None and handle is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle)
            total, free = int(info.total), int(info.free)
        except Exception:  # noqa: BLE001
            pass
    if free is None:
        try:
            free = int(torch.cuda.mem_get_info(index)[0])
        except Exception:  # noqa: BLE001
            free = None
    base = measure_device(torch.device("cuda", index)) if measure else None
    return DeviceSpec(
        name=str(props.name),
        flops_per_s=base.flops_per_s if base else 0.0,
        bytes_per_s=base.bytes_per_s if base else 0.0,
        op_overhead_s=base.op_overhead_s if base else 0.0,
        memory_bytes=total,
        free_memory_bytes=free,
        kind="cuda",
        compute_capability=(int(props.major), int(props.minor)),
    )


def nvml_link(nvml: ModuleType, a: Any, b: Any) -> Link:
    """The link between two NVML device handles: NVLink (counted) if any joins them, else PCIe."""
    nvlinks = 0
    try:
        target = _text(nvml.nvmlDeviceGetPciInfo(b).busId).lower()
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                if nvml.nvmlDeviceGetNvLinkState(a, link) != getattr(nvml, "NVML_FEATURE_ENABLED", 1):
                    continue
                if _text(nvml.nvmlDeviceGetNvLinkRemotePciInfo(a, link).busId).lower() == target:
                    nvlinks += 1
            except Exception:  # noqa: BLE001 - links past the device's count raise
                continue
    except Exception:  # noqa: BLE001
        nvlinks = 0
    if nvlinks:
        base = LINK_KINDS["nvlink"]
        return Link("nvlink", base.latency_s, nvlinks * _NVLINK_PER_LINK)
    pcie = LINK_KINDS["pcie"]
    try:  # through the CPU's interconnect (different sockets): about half the bandwidth
        level = nvml.nvmlDeviceGetTopologyCommonAncestor(a, b)
        if level >= getattr(nvml, "NVML_TOPOLOGY_SYSTEM", 50):
            return Link("pcie", pcie.latency_s * 2, pcie.bandwidth / 2)
    except Exception:  # noqa: BLE001
        pass
    return pcie


def discover_devices(measure: bool = False, nvml: ModuleType | None | bool = True) -> DeviceSet:
    """The devices of this machine and their links, never raising for a missing GPU stack.

    Args:
        measure: also measure each device's matmul rate, copy bandwidth and op overhead, and
            each GPU pair's copy bandwidth (seconds per device); otherwise rates are 0
            ("unknown", measured on first use) and links take typical numbers for their kind.
        nvml: True to load pynvml, False to skip it, or an initialized module (tests).
    """
    devices = {"cpu": _cpu_spec(measure)}
    links: dict[frozenset[str], Link] = {}
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001 - a broken driver: treat as no GPU
        count = 0
    if count == 0:
        return DeviceSet(devices, links)
    module = load_nvml() if nvml is True else (nvml or None)
    handles = _nvml_handles(module, count) if module is not None else [None] * count
    for i in range(count):
        devices[f"cuda:{i}"] = _cuda_spec(i, handles[i], module, measure)
        links[frozenset(("cpu", f"cuda:{i}"))] = LINK_KINDS["host"]
    for i in range(count):
        for j in range(i + 1, count):
            a, b = handles[i], handles[j]
            if module is not None and a is not None and b is not None:
                link = nvml_link(module, a, b)
            else:
                link = LINK_KINDS["pcie"]
            if measure:  # keep the kind the topology names, take the numbers from a real copy
                copied = measure_copy_link(f"cuda:{i}", f"cuda:{j}")
                link = Link(link.kind, copied.latency_s, copied.bandwidth)
            links[frozenset((f"cuda:{i}", f"cuda:{j}"))] = link
    return DeviceSet(devices, links)
