"""Communication formulas against hand-computed values, link fitting, and a real gloo send."""

from __future__ import annotations

import math

import pytest
import torch

from cost_model.cluster import DeviceSet
from cost_model.comm import LINK_KINDS, Link, default_link, p2p_time, ring_allreduce_time, slowest
from cost_model.devices import DeviceSpec
from cost_model.links import fit_link, measure_copy_link, measure_gloo_p2p


def test_p2p_is_latency_plus_bytes_over_bandwidth() -> None:
    link = Link("pcie", 10e-6, 1e9)
    assert p2p_time(1_000_000, link) == pytest.approx(10e-6 + 1e-3)
    assert link.time(2_000_000) == pytest.approx(10e-6 + 2e-3)
    assert p2p_time(0, link) == 0.0
    assert p2p_time(1e9, LINK_KINDS["same"]) == 0.0


def test_ring_allreduce_hand_computed() -> None:
    link = Link("nvlink", 5e-6, 100e9)
    # 4 devices, 400 MB: 2*(4-1) = 6 steps of latency, 2*3/4 of the bytes over the link.
    assert ring_allreduce_time(400e6, 4, link) == pytest.approx(6 * 5e-6 + 1.5 * 400e6 / 100e9)
    # 2 devices: 2 steps, the whole buffer once.
    assert ring_allreduce_time(1e6, 2, link) == pytest.approx(2 * 5e-6 + 1e6 / 100e9)
    assert ring_allreduce_time(1e6, 1, link) == 0.0
    with pytest.raises(ValueError, match="n >= 1"):
        ring_allreduce_time(1e6, 0, link)


def test_slowest_link_takes_worst_latency_and_bandwidth() -> None:
    worst = slowest([Link("a", 1e-6, 50e9), Link("b", 9e-6, 80e9), Link("c", 2e-6, 10e9)])
    assert (worst.latency_s, worst.bandwidth) == (9e-6, 10e9)


def test_allreduce_over_a_ring_uses_its_slowest_link() -> None:
    spec = DeviceSpec("gpu", 1e13, 1e12, 5e-6, 80 << 30, kind="cuda")
    devices = {f"cuda:{i}": spec for i in range(4)}
    data = {
        "devices": {k: {"flops_per_s": 1e13, "bytes_per_s": 1e12, "memory_bytes": 80 << 30} for k in devices},
        "links": [{"between": ["cuda:1", "cuda:2"], "kind": "pcie", "latency_s": 10e-6, "bandwidth": 20e9}],
        "default_link": {"kind": "nvlink", "latency_s": 5e-6, "bandwidth": 100e9},
    }
    ring = DeviceSet.from_dict(data)
    expected = 6 * 10e-6 + 1.5 * 1e9 / 20e9
    assert ring.allreduce_time(1e9, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]) == pytest.approx(expected)
    assert ring.transfer_time(1e6, "cuda:0", "cuda:3") == pytest.approx(5e-6 + 1e6 / 100e9)
    assert ring.transfer_time(1e6, "cuda:2", "cuda:1") == pytest.approx(10e-6 + 1e6 / 20e9)


def test_default_links_by_device_type() -> None:
    cpu, g0, g1 = torch.device("cpu"), torch.device("cuda", 0), torch.device("cuda", 1)
    assert default_link(g0, g1).kind == "pcie"
    assert default_link(cpu, g0).kind == "host"
    assert default_link(g0, g0).kind == "same"
    assert default_link(cpu, cpu).kind == "same"


def test_link_from_dict_defaults_and_errors() -> None:
    assert Link.from_dict("nvlink") == LINK_KINDS["nvlink"]
    assert Link.from_dict({"kind": "pcie", "bandwidth": 32e9}) == Link("pcie", LINK_KINDS["pcie"].latency_s, 32e9)
    with pytest.raises(ValueError, match="latency_s and bandwidth"):
        Link.from_dict({"kind": "carrier-pigeon"})
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Link("x", 1e-6, 0.0)


def test_fit_link_recovers_an_exact_line() -> None:
    latency, bandwidth = 50e-6, 2e9
    measured = {s: latency + s / bandwidth for s in (1 << 16, 1 << 20, 8 << 20, 32 << 20)}
    link = fit_link(measured)
    assert link.latency_s == pytest.approx(latency, rel=1e-6)
    assert link.bandwidth == pytest.approx(bandwidth, rel=1e-6)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_link({1024: 1e-5})


def test_gloo_send_between_two_local_processes() -> None:
    times = measure_gloo_p2p([1 << 10, 1 << 20], repeats=2, timeout_s=60)
    assert set(times) == {1 << 10, 1 << 20}
    assert all(0 < t < 1 and math.isfinite(t) for t in times.values())


def test_copy_link_between_local_devices() -> None:
    link = measure_copy_link("cpu", "cpu", sizes=(1 << 16, 1 << 20), repeats=2)
    assert link.kind == "copy:cpu->cpu" and link.bandwidth > 0 and link.latency_s >= 0
    absent = torch.device("cuda", 0 if not torch.cuda.is_available() else 99)
    with pytest.raises(ValueError, match="describe the link"):
        measure_copy_link("cpu", absent)
