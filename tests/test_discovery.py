"""GPU links classified from recorded NVML answers: NVSwitch boards, NVLink meshes, PCIe, old drivers."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Iterable, Mapping, Sequence

import pytest
import torch

from cost_model.comm import LINK_KINDS, Link
from cost_model.discovery import PCIE_EFFICIENCY, discover_devices, nvml_link, nvml_links


class NVMLError(Exception):
    """What pynvml raises (NVMLError_NotSupported, NVMLError_FunctionNotFound, ...)."""


def fake_nvml(
    buses: Sequence[str],
    nvlinks: Mapping[int, Sequence[str]] | None = None,
    switches: Iterable[str] = (),
    version: int = 6,
    pcie: Mapping[int, tuple[int, int]] | None = None,
    p2p: Mapping[tuple[int, int], int] | None = None,
    topology: Mapping[tuple[int, int], int] | None = None,
    missing: Iterable[str] = (),
    failing: Iterable[str] = (),
) -> Any:
    """An NVML module answering as a recorded machine did; handles are GPU indices.

    Args:
        buses: each GPU's PCI bus id, as nvmlDeviceGetPciInfo(h).busId (bytes, 8-digit domain).
        nvlinks: per GPU, the remote bus id of each active link (GPU or NVSwitch).
        switches: bus ids that are NVSwitches (remote device type 2); the rest are GPUs (0).
        version: what nvmlDeviceGetNvLinkVersion answers (an nvmlNvlinkVersion_t: 2 = NVLink 2.0, 6 = 4.0).
        pcie: per GPU (max generation, max width).
        p2p: NVML_P2P_CAPS_INDEX_READ status per pair (default OK); topology: common ancestor (default 10).
        missing: calls the library lacks (AttributeError); failing: calls the driver refuses (NVMLError).
    """
    links = nvlinks or {}
    switch = set(switches)
    missing, failing = set(missing), set(failing)

    def pci(bus: str) -> Any:
        return SimpleNamespace(busId=bus.encode())

    def state(h: int, link: int) -> int:
        if link >= 18:  # past the GPU's links
            raise NVMLError("invalid argument")
        return 1 if link < len(links.get(h, ())) else 0

    def p2p_status(a: int, b: int, index: int) -> int:
        if not isinstance(index, int):  # ctypes refuses pynvml's own NVML_P2P_CAPS_INDEX_READ = (0,)
            raise TypeError(f"index {index!r}")
        if index == 2:  # NVML_P2P_CAPS_INDEX_NVLINK
            return 0 if any(buses[b] == r for r in links.get(a, ())) else 5
        return (p2p or {}).get((min(a, b), max(a, b)), 0)

    calls = {
        "nvmlDeviceGetCount": lambda: len(buses),
        "nvmlDeviceGetHandleByIndex": lambda i: i,
        "nvmlDeviceGetPciInfo": lambda h: pci(buses[h]),
        "nvmlDeviceGetNvLinkState": state,
        "nvmlDeviceGetNvLinkRemotePciInfo": lambda h, link: pci(links[h][link]),
        "nvmlDeviceGetNvLinkRemoteDeviceType": lambda h, link: 2 if links[h][link] in switch else 0,
        "nvmlDeviceGetNvLinkVersion": lambda h, link: version,
        "nvmlDeviceGetMaxPcieLinkGeneration": lambda h: (pcie or {})[h][0],
        "nvmlDeviceGetMaxPcieLinkWidth": lambda h: (pcie or {})[h][1],
        "nvmlDeviceGetCurrPcieLinkGeneration": lambda h: 1,  # idle links train down: never read first
        "nvmlDeviceGetCurrPcieLinkWidth": lambda h: 16,
        "nvmlDeviceGetP2PStatus": p2p_status,
        "nvmlDeviceGetTopologyCommonAncestor": lambda a, b: (topology or {}).get((min(a, b), max(a, b)), 10),
    }

    def refuse(*args: Any) -> Any:
        raise NVMLError("not supported")

    functions = {name: refuse if name in failing else fn for name, fn in calls.items() if name not in missing}
    return SimpleNamespace(
        NVML_NVLINK_MAX_LINKS=18, NVML_FEATURE_ENABLED=1, NVML_NVLINK_DEVICE_TYPE_SWITCH=2, NVML_P2P_STATUS_OK=0,
        NVML_P2P_CAPS_INDEX_READ=(0,), NVML_P2P_CAPS_INDEX_NVLINK=2, NVML_TOPOLOGY_SYSTEM=50, **functions,
    )


def bus(i: int) -> str:
    return f"00000000:{0x18 + 0x10 * i:02X}:00.0"


SWITCHES = [f"00000000:0{k}:00.0" for k in range(4)]


def hgx_h100() -> Any:
    """8 x H100 SXM on an HGX board: 18 NVLink 4 links each, 5 + 4 + 4 + 5 to four NVSwitches."""
    spread = [SWITCHES[0]] * 5 + [SWITCHES[1]] * 4 + [SWITCHES[2]] * 4 + [SWITCHES[3]] * 5
    sockets = {(a, b): 50 for a in range(4) for b in range(4, 8)}  # GPUs 0-3 and 4-7 on two CPUs
    return fake_nvml([bus(i) for i in range(8)], dict.fromkeys(range(8), spread), SWITCHES, version=6,
                     pcie=dict.fromkeys(range(8), (5, 16)), topology=sockets)


def test_nvswitch_board_gives_every_pair_the_full_nvlink_bandwidth() -> None:
    links = nvml_links(hgx_h100(), list(range(8)))
    assert len(links) == 28
    assert set(links.values()) == {Link("nvswitch", LINK_KINDS["nvswitch"].latency_s, 18 * 25e9)}  # 450 GB/s
    # across the two sockets too: the switch, not the CPUs, carries it


def test_nvswitch_found_without_the_remote_device_type() -> None:
    """Older drivers lack nvmlDeviceGetNvLinkRemoteDeviceType: links of several GPUs land on one non-GPU bus id."""
    spread = [SWITCHES[k % 4] for k in range(12)]
    nvml = fake_nvml([bus(i) for i in range(4)], dict.fromkeys(range(4), spread), SWITCHES, version=4,
                     missing=["nvmlDeviceGetNvLinkRemoteDeviceType"])
    links = nvml_links(nvml, [0, 1, 2, 3])
    assert {link.kind for link in links.values()} == {"nvswitch"}
    assert {link.bandwidth for link in links.values()} == {12 * 25e9}  # A100: NVLink 3.0, 12 links, 300 GB/s


def dgx1_quad() -> Any:
    """4 x V100 SXM2 of a hybrid cube-mesh: pairs on 2 links, on 1 link, and one pair with none (PCIe gen3)."""
    wiring = {(0, 1): 2, (0, 2): 1, (0, 3): 1, (1, 2): 1, (1, 3): 2}  # (2, 3): no NVLink
    nvlinks: dict[int, list[str]] = {i: [] for i in range(4)}
    for (a, b), count in wiring.items():
        nvlinks[a] += [bus(b)] * count
        nvlinks[b] += [bus(a)] * count
    return fake_nvml([bus(i) for i in range(4)], nvlinks, version=2, pcie=dict.fromkeys(range(4), (3, 16)))


def test_hybrid_cube_mesh_counts_links_per_pair() -> None:
    links = nvml_links(dgx1_quad(), [0, 1, 2, 3])
    latency = LINK_KINDS["nvlink"].latency_s
    assert links[0, 1] == Link("nvlink", latency, 50e9) and links[1, 3] == Link("nvlink", latency, 50e9)
    assert links[0, 2] == links[0, 3] == links[1, 2] == Link("nvlink", latency, 25e9)
    assert links[2, 3] == Link("pcie", LINK_KINDS["pcie"].latency_s, 0.985e9 * 16 * PCIE_EFFICIENCY)  # ~ 11.8 GB/s
    assert nvml_link(dgx1_quad(), 3, 1) == links[1, 3]


def test_pcie_gpus_on_two_sockets_are_halved() -> None:
    nvml = fake_nvml([bus(0), bus(1)], pcie={0: (4, 16), 1: (4, 16)}, topology={(0, 1): 50}, p2p={(0, 1): 1})
    gen4 = 1.969e9 * 16 * PCIE_EFFICIENCY  # ~ 23.6 GB/s of 31.5
    cross = nvml_link(nvml, 0, 1)
    assert cross == Link("pcie", 2 * LINK_KINDS["pcie"].latency_s, gen4 / 2)
    same = fake_nvml([bus(0), bus(1)], pcie={0: (4, 16), 1: (4, 16)})
    assert nvml_link(same, 0, 1) == Link("pcie", LINK_KINDS["pcie"].latency_s, gen4)
    no_p2p = fake_nvml([bus(0), bus(1)], pcie={0: (4, 16), 1: (4, 16)}, p2p={(0, 1): 3})  # IOH topology
    assert nvml_link(no_p2p, 0, 1).bandwidth == pytest.approx(gen4 / 2)
    slower = fake_nvml([bus(0), bus(1)], pcie={0: (5, 16), 1: (4, 8)})  # the slower end sets the pace
    assert nvml_link(slower, 0, 1).bandwidth == pytest.approx(1.969e9 * 8 * PCIE_EFFICIENCY)


def test_pcie_falls_back_to_the_current_link_then_the_typical_one() -> None:
    lacks_max = ["nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetMaxPcieLinkWidth"]
    current = fake_nvml([bus(0), bus(1)], missing=lacks_max)
    assert nvml_link(current, 0, 1).bandwidth == pytest.approx(0.25e9 * 16 * PCIE_EFFICIENCY)  # gen 1 as read
    silent = fake_nvml([bus(0), bus(1)], failing=["nvmlDeviceGetMaxPcieLinkGeneration",
                                                  "nvmlDeviceGetCurrPcieLinkGeneration"])
    assert nvml_link(silent, 0, 1) == LINK_KINDS["pcie"]


NVLINK_CALLS = ["nvmlDeviceGetNvLinkState", "nvmlDeviceGetNvLinkRemotePciInfo",
                "nvmlDeviceGetNvLinkRemoteDeviceType", "nvmlDeviceGetNvLinkVersion"]


def test_old_driver_whose_nvlink_calls_raise() -> None:
    wired = {0: [bus(1)] * 4, 1: [bus(0)] * 4}
    # the links are there, but only the peer-to-peer capability says so: the typical NVLink
    nvml = fake_nvml([bus(0), bus(1)], wired, failing=NVLINK_CALLS)
    assert nvml_link(nvml, 0, 1) == LINK_KINDS["nvlink"]
    # nothing answers at all: the typical PCIe link, and never an exception
    every = ["nvmlDeviceGetP2PStatus", "nvmlDeviceGetTopologyCommonAncestor", "nvmlDeviceGetPciInfo",
             "nvmlDeviceGetMaxPcieLinkGeneration", "nvmlDeviceGetCurrPcieLinkGeneration", "nvmlDeviceGetCount"]
    assert nvml_link(fake_nvml([bus(0), bus(1)], wired, failing=NVLINK_CALLS + every), 0, 1) == LINK_KINDS["pcie"]
    assert nvml_link(SimpleNamespace(), 0, 1) == LINK_KINDS["pcie"]  # a library with none of the calls


def test_nvlink_version_enum_sets_the_per_link_rate() -> None:
    two = {0: [bus(1)] * 2, 1: [bus(0)] * 2}
    rates = {v: nvml_link(fake_nvml([bus(0), bus(1)], two, version=v), 0, 1).bandwidth for v in (1, 4, 5, 6, 7, 99)}
    assert rates == {1: 40e9, 4: 50e9, 5: 50e9, 6: 50e9, 7: 100e9, 99: 50e9}  # 7 = NVLink 5.0 (B200): 50 GB/s a link


def test_pynvml_spells_the_read_index_as_a_tuple() -> None:
    pynvml = pytest.importorskip("pynvml")
    from cost_model.discovery import _constant

    assert _constant(pynvml, "NVML_P2P_CAPS_INDEX_READ", 0) == 0
    assert _constant(pynvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 0) == 2


def test_discovery_with_fake_gpus_names_their_type_and_links(monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = hgx_h100()
    nvml.nvmlDeviceGetUUID = lambda h: f"GPU-{h:04d}"
    nvml.nvmlDeviceGetMemoryInfo = lambda h: SimpleNamespace(total=85_520_809_984, free=84_000_000_000)
    props = [SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=85_520_809_984, major=9, minor=0,
                             uuid=f"GPU-{i:04d}") for i in (3, 5)]  # CUDA_VISIBLE_DEVICES=3,5
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: props[i])
    found = discover_devices(nvml=nvml)
    assert found.names == ["cpu", "cuda:0", "cuda:1"]
    spec = found.spec("cuda:1")
    assert (spec.gpu_type, spec.memory_bytes, spec.compute_capability) == ("H100-SXM", 85_520_809_984, (9, 0))
    assert found.link("cuda:0", "cuda:1").kind == "nvswitch"
    assert found.link("cuda:0", "cuda:1").bandwidth == 450e9
    assert found.link("cpu", "cuda:0") == LINK_KINDS["host"]
