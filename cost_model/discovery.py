"""Find the devices of this machine: CPU always, CUDA GPUs through torch and NVML, and their links.

NVML (the `pynvml` module of nvidia-ml-py) gives names, free memory and the topology; each
GPU pair is classed step by step, from the best evidence NVML gives:

    nvswitch  both GPUs have NVLinks to an NVSwitch (remote device type SWITCH, or links of
              several GPUs landing on one non-GPU bus id): the full per-GPU NVLink bandwidth
    nvlink    NVLinks join the two GPUs directly: links x per-link rate of their generation
              (or, where the link calls fail, NVML's NVLink peer-to-peer capability)
    pcie      otherwise: PCIe generation x width x PCIE_EFFICIENCY, halved (latency doubled)
              when the GPUs cannot read each other peer to peer or only meet through the CPUs'
              interconnect (common ancestor SYSTEM: different sockets)

NVLink figures are link rates, one direction (a copy reaches about 85-90% of them; `measure`
takes real ones). Without NVML, or without GPUs, discovery still works: torch gives what it
can, and a CPU-only machine is a set of one device. Nothing here raises because a driver or
library is missing or an NVML call fails (older drivers lack some): each step falls back.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Sequence

import torch

from cost_model.cluster import DeviceSet
from cost_model.comm import LINK_KINDS, Link
from cost_model.devices import DeviceSpec, cpu_cores, host_memory, measure_device
from cost_model.gpu_table import default_table
from cost_model.links import measure_copy_link

__all__ = ["PCIE_EFFICIENCY", "discover_devices", "load_nvml", "nvml_link", "nvml_links"]

# One direction of one NVLink by what nvmlDeviceGetNvLinkVersion answers. That is an
# nvmlNvlinkVersion_t (1: 1.0, 2: 2.0, 3: 2.2, 4: 3.0, 5: 3.1, 6: 4.0, 7: 5.0), not the
# generation (an A100 answers 4 or 5): NVLink 1 20 GB/s, 2-4 25 GB/s, 5 50 GB/s. Older drivers
# answered the generation itself, which reads the same except for 5, which no such driver gives.
_NVLINK_PER_LINK = {1: 20e9, 2: 25e9, 3: 25e9, 4: 25e9, 5: 25e9, 6: 25e9, 7: 50e9}
_NVLINK_DEFAULT = 25e9  # version unknown: NVLink 2-4
# PCIe bytes/s per lane, one direction, by generation (after line encoding; gen 6 after FLIT overhead).
_PCIE_LANE = {1: 0.25e9, 2: 0.5e9, 3: 0.985e9, 4: 1.969e9, 5: 3.938e9, 6: 7.563e9}
# Fraction of that a GPU-to-GPU copy reaches (packet headers, flow control): gen4 x16 ~ 24 GB/s.
PCIE_EFFICIENCY = 0.75
_SWITCH = 2  # NVML_NVLINK_DEVICE_TYPE_SWITCH
_P2P_OK = 0  # NVML_P2P_STATUS_OK


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
    known = default_table().lookup(str(props.name), total)
    return DeviceSpec(
        name=str(props.name),
        flops_per_s=base.flops_per_s if base else 0.0,
        bytes_per_s=base.bytes_per_s if base else 0.0,
        op_overhead_s=base.op_overhead_s if base else 0.0,
        memory_bytes=total,
        free_memory_bytes=free,
        kind="cuda",
        compute_capability=(int(props.major), int(props.minor)),
        gpu_type=known.name if known is not None else "",
        matmul_precision=base.matmul_precision if base else "",
    )


def _call(nvml: Any, name: str, *args: Any) -> Any:
    """nvml.<name>(*args), or None where the library lacks it or the driver says no."""
    try:
        return getattr(nvml, name)(*args)
    except Exception:  # noqa: BLE001 - NVMLError_NotSupported, _FunctionNotFound, AttributeError, ...
        return None


def _constant(nvml: Any, name: str, default: int) -> int:
    value = getattr(nvml, name, default)
    if isinstance(value, tuple):  # pynvml spells NVML_P2P_CAPS_INDEX_READ as (0,)
        value = value[0] if value else default
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _bus_id(info: Any) -> str:
    """A PCI bus id in one spelling, whatever the domain's width: '00000000:18:00.0' -> '0:18:00.0'."""
    text = _text(getattr(info, "busId", "") or "").strip().lower()
    parts = text.split(":")
    try:
        return f"{int(parts[0], 16):x}:{parts[1]}:{parts[2]}" if len(parts) == 3 else text
    except ValueError:
        return text


@dataclass(frozen=True)
class _NvLink:
    """One active NVLink of a GPU: where it lands, whether NVML says that is a switch, its rate (one way)."""

    remote: str  # remote bus id ('' unknown)
    to_switch: bool | None  # None: the remote device type is unknown (older drivers)
    bandwidth: float


def _nvlinks(nvml: Any, handle: Any) -> list[_NvLink]:
    """The active NVLinks of one GPU; [] where NVML has no NVLink calls or the GPU has none."""
    enabled = _constant(nvml, "NVML_FEATURE_ENABLED", 1)
    switch = _constant(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", _SWITCH)
    links = []
    for link in range(_constant(nvml, "NVML_NVLINK_MAX_LINKS", 18)):
        if _call(nvml, "nvmlDeviceGetNvLinkState", handle, link) != enabled:
            continue  # off, or past the GPU's links (those raise)
        kind = _call(nvml, "nvmlDeviceGetNvLinkRemoteDeviceType", handle, link)
        version = _call(nvml, "nvmlDeviceGetNvLinkVersion", handle, link)
        links.append(_NvLink(
            _bus_id(_call(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", handle, link)),
            None if kind is None else int(kind) == switch,
            _NVLINK_PER_LINK.get(int(version), _NVLINK_DEFAULT) if version is not None else _NVLINK_DEFAULT,
        ))
    return links


def _pcie(nvml: Any, handle: Any) -> float | None:
    """One GPU's PCIe bytes/s one way (generation x width x PCIE_EFFICIENCY), or None when NVML does not say.

    The Max calls come first: an idle GPU trains its link down, so the current generation reads 1.
    """
    gen = _call(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", handle) or _call(
        nvml, "nvmlDeviceGetCurrPcieLinkGeneration", handle)
    width = _call(nvml, "nvmlDeviceGetMaxPcieLinkWidth", handle) or _call(
        nvml, "nvmlDeviceGetCurrPcieLinkWidth", handle)
    try:
        lane = _PCIE_LANE[int(gen)]
        return lane * int(width) * PCIE_EFFICIENCY if int(width) > 0 else None
    except (KeyError, TypeError, ValueError):
        return None


def _pcie_link(nvml: Any, a: Any, b: Any) -> Link:
    """The PCIe path between two GPUs, halved where they cannot read each other or sit on different sockets."""
    base = LINK_KINDS["pcie"]
    rates = [r for r in (_pcie(nvml, a), _pcie(nvml, b)) if r is not None]
    bandwidth = min(rates) if len(rates) == 2 else base.bandwidth  # the slower end; typical where NVML is silent
    read = _constant(nvml, "NVML_P2P_CAPS_INDEX_READ", 0)
    status = _call(nvml, "nvmlDeviceGetP2PStatus", a, b, read)
    no_p2p = status is not None and status != _constant(nvml, "NVML_P2P_STATUS_OK", _P2P_OK)
    level = _call(nvml, "nvmlDeviceGetTopologyCommonAncestor", a, b)
    cross = isinstance(level, int) and level >= _constant(nvml, "NVML_TOPOLOGY_SYSTEM", 50)
    if no_p2p or cross:  # staged through host memory, or over the CPUs' interconnect
        return Link("pcie", base.latency_s * 2, bandwidth / 2)
    return Link("pcie", base.latency_s, bandwidth)


def nvml_links(nvml: ModuleType | Any, handles: Sequence[Any]) -> dict[tuple[int, int], Link]:
    """The link of every pair (i, j), i < j, of NVML device handles: nvswitch, nvlink or pcie (module docstring).

    Never raises: calls an older driver lacks fall back to the next step, and to the typical
    PCIe link where NVML says nothing at all.
    """
    buses = [_bus_id(_call(nvml, "nvmlDeviceGetPciInfo", h)) for h in handles]
    everyone = [_call(nvml, "nvmlDeviceGetHandleByIndex", i) for i in range(_call(nvml, "nvmlDeviceGetCount") or 0)]
    gpus = {b for b in buses if b} | {_bus_id(_call(nvml, "nvmlDeviceGetPciInfo", h)) for h in everyone}  # hidden too
    inventory = [_nvlinks(nvml, h) for h in handles]
    landing: dict[str, set[int]] = {}
    for i, links in enumerate(inventory):
        for link in links:
            if link.remote and link.remote not in gpus and link.to_switch is not False:
                landing.setdefault(link.remote, set()).add(i)
    shared = {bus for bus, where in landing.items() if len(where) > 1}  # several GPUs land there: a switch

    def via_switch(i: int) -> float:
        return sum(x.bandwidth for x in inventory[i] if x.to_switch or (x.to_switch is None and x.remote in shared))

    nvlink_caps = _constant(nvml, "NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = _constant(nvml, "NVML_P2P_STATUS_OK", _P2P_OK)
    out: dict[tuple[int, int], Link] = {}
    for i in range(len(handles)):
        for j in range(i + 1, len(handles)):
            direct = sum(x.bandwidth for x in inventory[i] if buses[j] and x.remote == buses[j] and not x.to_switch)
            switched = min(via_switch(i), via_switch(j))
            if switched > 0:
                out[i, j] = Link("nvswitch", LINK_KINDS["nvswitch"].latency_s, switched + direct)
            elif direct > 0:
                out[i, j] = Link("nvlink", LINK_KINDS["nvlink"].latency_s, direct)
            elif not inventory[i] and _call(nvml, "nvmlDeviceGetP2PStatus", handles[i], handles[j], nvlink_caps) == ok:
                out[i, j] = LINK_KINDS["nvlink"]  # NVLink peer to peer, but no link counts: the typical NVLink
            else:
                out[i, j] = _pcie_link(nvml, handles[i], handles[j])
    return out


def nvml_link(nvml: ModuleType | Any, a: Any, b: Any) -> Link:
    """The link between two NVML device handles (see `nvml_links`); never raises."""
    return nvml_links(nvml, [a, b])[0, 1]


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
    known = [i for i in range(count) if handles[i] is not None]
    classified = nvml_links(module, [handles[i] for i in known]) if module is not None else {}
    topology = {(known[a], known[b]): link for (a, b), link in classified.items()}
    for i in range(count):
        for j in range(i + 1, count):
            link = topology.get((i, j), LINK_KINDS["pcie"])
            if measure:  # keep the kind the topology names, take the numbers from a real copy
                copied = measure_copy_link(f"cuda:{i}", f"cuda:{j}")
                link = Link(link.kind, copied.latency_s, copied.bandwidth)
            links[frozenset((f"cuda:{i}", f"cuda:{j}"))] = link
    return DeviceSet(devices, links)
