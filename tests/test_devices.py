"""Device discovery without a GPU, NVML topology on a fake NVML, and hand-described device sets."""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from cost_model.cluster import DeviceDescriptionError, DeviceSet, parse_bytes
from cost_model.comm import LINK_KINDS, Link
from cost_model.devices import DeviceError, resolve_devices
from cost_model.discovery import discover_devices, load_nvml, nvml_link


def test_discovery_with_no_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    found = discover_devices()
    assert found.names == ["cpu"]
    cpu = found.spec("cpu")
    assert cpu.kind == "cpu" and cpu.cores is not None and cpu.cores >= 1
    assert cpu.memory_bytes > 0 and 0 < (cpu.free_memory_bytes or 0) <= cpu.memory_bytes
    assert not cpu.measured  # rates are measured lazily, not at discovery
    assert found.links == {}


def test_missing_nvml_library_is_not_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml now raises ImportError
    assert load_nvml() is None
    assert "cpu" in discover_devices(nvml=True).names


class FakeNvml:
    """Two GPUs; `nvlinks` of GPU 0's links lead to GPU 1."""

    NVML_NVLINK_MAX_LINKS = 6
    NVML_FEATURE_ENABLED = 1
    NVML_TOPOLOGY_SYSTEM = 50

    def __init__(self, nvlinks: int, level: int = 10) -> None:
        self.nvlinks = nvlinks
        self.level = level

    def nvmlDeviceGetPciInfo(self, handle: int) -> Any:  # noqa: N802 - NVML's names
        return SimpleNamespace(busId=f"0000:0{handle}:00.0".encode())

    def nvmlDeviceGetNvLinkState(self, handle: int, link: int) -> int:  # noqa: N802
        return 1 if link < self.nvlinks else 0

    def nvmlDeviceGetNvLinkRemotePciInfo(self, handle: int, link: int) -> Any:  # noqa: N802
        return self.nvmlDeviceGetPciInfo(1 - handle)

    def nvmlDeviceGetTopologyCommonAncestor(self, a: int, b: int) -> int:  # noqa: N802
        return self.level


def test_nvml_topology_nvlink_pcie_and_cross_socket() -> None:
    four = nvml_link(FakeNvml(nvlinks=4), 0, 1)  # type: ignore[arg-type]
    assert four.kind == "nvlink" and four.bandwidth == pytest.approx(4 * 25e9)
    assert nvml_link(FakeNvml(nvlinks=0), 0, 1) == LINK_KINDS["pcie"]  # type: ignore[arg-type]
    cross = nvml_link(FakeNvml(nvlinks=0, level=50), 0, 1)  # type: ignore[arg-type]
    assert cross.kind == "pcie" and cross.bandwidth == pytest.approx(LINK_KINDS["pcie"].bandwidth / 2)


def eight_gpus() -> dict[str, Any]:
    """Two nodes of four H100s: NVLink inside a node, the network between nodes."""
    devices = {
        f"cuda:{i}": {"name": "NVIDIA H100", "speed": 6.0e13, "bandwidth": 3.0e12, "memory": "80GiB",
                      "compute_capability": [9, 0]}
        for i in range(8)
    }
    links = [
        {"between": [f"cuda:{a}", f"cuda:{b}"], "kind": "nvlink"}
        for group in (range(0, 4), range(4, 8))
        for a in group
        for b in group
        if a < b
    ]
    return {"devices": devices, "links": links, "default_link": "network"}


def test_hand_described_eight_gpus_round_trip_through_json(tmp_path: Any) -> None:
    cluster = DeviceSet.from_dict(eight_gpus())
    assert len(cluster.names) == 8 and len(cluster.links) == 12
    spec = cluster.spec("cuda:5")
    got = (spec.flops_per_s, spec.memory_bytes, spec.kind, spec.compute_capability)
    assert got == (6.0e13, 80 << 30, "cuda", (9, 0))
    assert cluster.link("cuda:0", "cuda:3").kind == "nvlink"
    assert cluster.link("cuda:3", "cuda:4") == LINK_KINDS["network"]

    again = DeviceSet.from_json(cluster.to_json())
    assert again == cluster
    path = tmp_path / "cluster.json"
    cluster.save(path)
    assert DeviceSet.load(path) == cluster


def test_bad_description_lists_every_problem() -> None:
    data = {
        "devices": {"cuda:0": {"speed": 1e13, "memory": "80 parsecs"}, "cuda:1": {"colour": "green"}},
        "links": [{"between": ["cuda:0", "cuda:9"], "kind": "nvlink"}],
    }
    with pytest.raises(DeviceDescriptionError) as info:
        DeviceSet.from_dict(data)
    message = str(info.value)
    assert "80 parsecs" in message and "colour" in message and "cuda:9" in message
    with pytest.raises(DeviceDescriptionError, match="devices"):
        DeviceSet.from_dict({})
    with pytest.raises(DeviceDescriptionError, match="not valid JSON"):
        DeviceSet.from_json("{")


def test_parse_bytes() -> None:
    assert parse_bytes("80GiB") == 80 << 30
    assert parse_bytes("16 GB") == 16_000_000_000
    assert parse_bytes(1024) == 1024
    with pytest.raises(ValueError, match="80GiB"):
        parse_bytes("lots")


def test_unknown_device_names_the_known_ones() -> None:
    cluster = DeviceSet.from_dict(eight_gpus())
    with pytest.raises(DeviceError, match="cuda:0"):
        cluster.spec("cuda:8")


def test_resolve_devices_without_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_devices(["cpu", "cpu"]) == [torch.device("cpu")] * 2
    with pytest.raises(DeviceError, match="0 CUDA devices"):
        resolve_devices(["cuda:0"])
    with pytest.raises(DeviceError, match="a list"):
        resolve_devices("cpu")  # type: ignore[arg-type]


def test_link_round_trip() -> None:
    link = Link("loopback", 60e-6, 2.5e9)
    assert Link.from_dict(link.to_dict()) == link


def test_measuring_a_device_leaves_the_global_random_state_alone() -> None:
    """Planning measures the CPU once per process; the user's RNG stream must not move (dropout, init)."""
    from cost_model import devices

    devices._measure.cache_clear()
    before = torch.get_rng_state()
    devices.measure_device(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)
