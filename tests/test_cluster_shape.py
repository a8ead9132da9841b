"""Clusters by shape: strings and files (good and bad), any size, prices against hand-computed values."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.cluster_shape import Cluster, ClusterError, as_cluster
from cost_model.devices import DeviceSpec

pytestmark = pytest.mark.timeout(60)


def never(device: torch.device) -> DeviceSpec:
    raise AssertionError(f"measured {device} although the cluster describes it")


# --- strings ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "text, hosts, per_host, gpu, intra_gb, inter_gbit",
    [  # NCCL's bus bandwidth, not line rates (cost_model/gpus.json "fabrics"): through NVSwitch 370 GB/s on
        # H100 (nccl-tests issue 212) and 200 on A100 (issue 149); InfiniBand 0.9 of its NICs' 400 / 200 Gb/s
        # (issue 119: 84.8 GB/s average busbw of 100)
        ("16x8xH100", 16, 8, "H100-SXM", 370, 400 * 0.9),
        ("2x8xA100-80GB", 2, 8, "A100-SXM4-80GB", 200, 200 * 0.9),
        ("4x8xA100-40GB", 4, 8, "A100-SXM4-40GB", 200, 200 * 0.9),
        (" 1 X 4 x L4 ", 1, 4, "L4", 31.5, 100),  # no NVLink: PCIe inside, Ethernet between hosts (no factor)
    ],
)
def test_shape_strings(text: str, hosts: int, per_host: int, gpu: str, intra_gb: float, inter_gbit: float) -> None:
    cluster = Cluster.parse(text)
    assert (cluster.hosts, cluster.gpus_per_host, cluster.gpu.name) == (hosts, per_host, gpu)
    assert cluster.size == hosts * per_host
    assert cluster.fabric.intra.bandwidth == pytest.approx(intra_gb * 1e9)
    assert cluster.fabric.inter.bandwidth == pytest.approx(inter_gbit * 1e9 / 8)


@pytest.mark.parametrize(
    "text, words",
    [
        ("16x8xH1000", ["16x8xH1000", "unknown GPU type 'H1000'", "did you mean H100-SXM?", "known:", "B200"]),
        ("0x8xH100", ["0x8xH100", "hosts must be >= 1"]),
        ("2x0xH100", ["gpus_per_host must be >= 1"]),
        ("16x8", ["is not a cluster shape", "HOSTSxGPUSxTYPE", "16x8xH100"]),
        ("sixteen x 8 x H100", ["is not a cluster shape"]),
    ],
)
def test_bad_shape_strings_name_the_problem(text: str, words: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.parse(text)
    for word in words:
        assert word in str(info.value)


# --- files -----------------------------------------------------------------------------------------------
def write(tmp_path: Path, data: Any, name: str = "cluster.json") -> Path:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return path


def test_json_file_with_fabric_overrides_and_efficiency(tmp_path: Path) -> None:
    path = write(tmp_path, {"hosts": 2, "gpus_per_host": 4, "gpu": "H100",
                            "fabric": {"intra": {"kind": "nvswitch", "gb_per_s": 400, "latency_us": 3},
                                       "inter": {"kind": "roce", "gbit_per_s": 100, "latency_us": 20}},
                            "efficiency": 0.5})  # fmt: skip
    cluster = Cluster.load(path)
    assert (cluster.fabric.intra.bandwidth, cluster.fabric.intra.latency_s) == (400e9, pytest.approx(3e-6))
    assert (cluster.fabric.inter.kind, cluster.fabric.inter.bandwidth) == ("roce", 12.5e9)
    assert cluster.efficiency == 0.5
    assert Cluster.from_dict(cluster.to_dict()) == cluster  # round trip
    assert as_cluster(str(path)) == cluster and as_cluster("2x4xH100").size == 8


def test_yaml_file(tmp_path: Path) -> None:
    pytest.importorskip("yaml")
    path = write(tmp_path, "hosts: 2\ngpus_per_host: 8\ngpu: A100-80GB\nfabric:\n  inter: ethernet\n", "c.yaml")
    cluster = Cluster.load(path)
    assert cluster.shape == "2x8xA100-SXM4-80GB" and cluster.fabric.inter.kind == "ethernet"


@pytest.mark.parametrize(
    "data, words",
    [
        ({"hosts": 2, "gpu": "H100"}, ["missing 'gpus_per_host'"]),
        ({"hosts": 2, "gpus_per_host": 8, "gpu": "H100", "gpus": 3}, ["unknown field 'gpus'"]),
        ({"hosts": "two", "gpus_per_host": 8, "gpu": "H100"}, ["hosts='two' is not an integer"]),
        ({"hosts": 1, "gpus_per_host": 8, "gpu": "H100", "fabric": {"intra": "token-ring"}},
         ["unknown kind 'token-ring'", "nvswitch"]),
        ({"hosts": 1, "gpus_per_host": 2, "gpu": "L4", "fabric": {"intra": "nvswitch"}}, ["L4 has no NVLink", "pcie"]),
        ({"hosts": 1, "gpus_per_host": 8, "gpu": "H100", "efficiency": 1.5}, ["efficiency=1.5", "(0, 1]"]),
        ({"hosts": 1, "gpus_per_host": 8, "gpu": "H100", "fabric": {"inter": {"kind": "roce", "gbit_per_s": "x"}}},
         ["fabric.inter"]),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, data: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ClusterError) as info:
        Cluster.load(write(tmp_path, data))
    for word in [str(tmp_path / "cluster.json"), *words]:
        assert word in str(info.value)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(ClusterError, match="cannot read the cluster file"):
        Cluster.load(tmp_path / "absent.json")
    with pytest.raises(ClusterError, match="is not valid JSON"):
        Cluster.load(write(tmp_path, "{hosts: 2"))
    with pytest.raises(ClusterError, match="neither a cluster shape"):
        as_cluster(str(tmp_path / "absent.json"))


def test_device_set_json_keeps_loading_and_cluster_load_says_what_to_write(tmp_path: Path) -> None:
    description = {"devices": {"cuda:0": {"gpu_type": "H100-SXM"}, "cuda:1": {"gpu_type": "H100-SXM"}},
                   "links": [{"between": ["cuda:0", "cuda:1"], "kind": "nvlink"}]}  # fmt: skip
    path = write(tmp_path, description)
    assert DeviceSet.load(path).names == ["cuda:0", "cuda:1"]
    with pytest.raises(ClusterError) as info:
        Cluster.load(path)
    message = str(info.value)
    assert "DeviceSet description" in message and "DeviceSet.load" in message
    assert '"gpus_per_host": 2, "gpu": "H100-SXM"' in message and "1x2xH100-SXM" in message


# --- size and point-to-point -----------------------------------------------------------------------------
def test_16384_gpus_ranks_and_pairs_without_a_list_of_pairs() -> None:
    cluster = Cluster.parse("2048x8xH100")
    assert cluster.size == 16384
    assert cluster.where(16383) == (2047, 7) and cluster.rank((2047, 7)) == 16383 and cluster.rank((1, 0)) == 8
    intra, inter = cluster.fabric.intra, cluster.fabric.inter
    nbytes = 64e6  # bus bandwidths as in test_shape_strings: 370 GB/s in a host, 400 Gb/s x 0.9 = 45 GB/s across
    assert cluster.transfer_time(nbytes, 16376, 16383) == pytest.approx(8e-6 + nbytes / 370e9)  # one host
    assert cluster.transfer_time(nbytes, 0, 16383) == pytest.approx(5e-6 + nbytes / 45e9)  # across hosts
    assert cluster.transfer_time(nbytes, (3, 2), (3, 2)) == 0.0
    assert cluster.link(7, 8) == inter and cluster.link(8, 15) == intra
    assert cluster.spec(16383).gpu_type == "H100-SXM"
    # all 16,384 GPUs in one group: hierarchical, g = 8, H = 2048
    expected = 2 * (7 * 8e-6 + 7 / 8 * 1e9 / 370e9) + 2 * 2047 * 5e-6 + 2 * 2047 / 2048 * (1e9 / 8) / 45e9
    assert cluster.allreduce_time(1e9, range(16384)) == pytest.approx(expected)
    for bad in (16384, -1, (2048, 0), (0, 8)):
        with pytest.raises(ClusterError, match="outside 2048x8xH100-SXM"):
            cluster.transfer_time(1.0, 0, bad)


# --- hierarchical all-reduce against hand-computed values ------------------------------------------------
# Round numbers: intra 100 GB/s and 10 us, inter 10 GB/s (80 Gb/s) and 20 us.
ROUND = {"intra": {"kind": "nvswitch", "gb_per_s": 100, "latency_us": 10},
         "inter": {"kind": "infiniband", "gbit_per_s": 80, "latency_us": 20}}  # fmt: skip
B = 1e9  # bytes per GPU


def round_cluster(hosts: int, per_host: int) -> Cluster:
    return Cluster.from_dict({"hosts": hosts, "gpus_per_host": per_host, "gpu": "H100", "fabric": ROUND})


def test_allreduce_one_host_is_a_ring() -> None:
    cluster = round_cluster(1, 8)
    # 4 GPUs: 2 * 3 * 10 us + 2 * 3 / 4 * 1e9 / 100e9 = 60 us + 15 ms
    assert cluster.allreduce_time(B, [0, 1, 2, 3]) == pytest.approx(60e-6 + 15e-3)
    assert cluster.allreduce_time(B, [5]) == 0.0 and cluster.allreduce_time(0, [0, 1]) == 0.0


def test_allreduce_two_hosts_one_gpu_each() -> None:
    # no intra phase; across: 2 * 1 * 20 us + 2 * 1 / 2 * 1e9 / 10e9 = 40 us + 100 ms
    assert round_cluster(2, 8).allreduce_time(B, [0, 8]) == pytest.approx(40e-6 + 0.1)


def test_allreduce_two_hosts_of_four() -> None:
    # reduce-scatter + all-gather in each host: 2 * (3 * 10 us + 3 / 4 * 10 ms) = 60 us + 15 ms
    # across hosts, shards of 1e9 / 4: 2 * 20 us + 2 * 1 / 2 * 0.25e9 / 10e9 = 40 us + 25 ms
    cluster = round_cluster(2, 4)
    assert cluster.allreduce_time(B, range(8)) == pytest.approx(100e-6 + 40e-3)
    assert cluster.allreduce_time(B, [(1, 3), (0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3), (1, 2)]) == (
        pytest.approx(100e-6 + 40e-3)
    )  # order does not matter
    flat_over_inter = 2 * 7 * 20e-6 + 2 * 7 / 8 * B / 10e9  # a flat ring paced by the NICs: slower
    assert cluster.allreduce_time(B, range(8)) < flat_over_inter


def test_allreduce_uneven_group_is_the_flat_ring_the_runtime_runs() -> None:
    # 3 GPUs on host 0, 1 on host 1: runtime/hier_allreduce.py falls back to one flat ring over the 4
    # GPUs, paced by the inter link: 2 * 3 * 20 us + 2 * 3 / 4 * 1e9 / 10e9 = 120 us + 150 ms
    cluster = round_cluster(2, 4)
    assert cluster.allreduce_time(B, [0, 1, 2, 4]) == pytest.approx(120e-6 + 0.15)
    # three hosts, 2 + 2 + 1: a ring over 5 GPUs: 2 * 4 * 20 us + 2 * 4 / 5 * 1e9 / 10e9
    assert round_cluster(3, 4).allreduce_time(B, [0, 1, 4, 5, 8]) == pytest.approx(160e-6 + 0.16)
    with pytest.raises(ClusterError, match="appear twice"):
        cluster.allreduce_time(B, [0, 1, 1])


def test_allreduce_2x8_and_4x8_groups_hand_computed() -> None:
    # 2 hosts x 8 GPUs: in-host reduce-scatter + all-gather 2 * (7 * 10 us + 7 / 8 * 10 ms) = 140 us + 17.5 ms;
    # across hosts, shards of 1e9 / 8 = 125 MB: 2 * 1 * 20 us + 2 * 1 / 2 * 125e6 / 10e9 = 40 us + 12.5 ms
    assert round_cluster(2, 8).allreduce_time(B, range(16)) == pytest.approx(180e-6 + 30e-3)
    # 4 hosts x 8 GPUs: the same in-host part; across: 2 * 3 * 20 us + 2 * 3 / 4 * 125e6 / 10e9 = 120 us + 18.75 ms
    assert round_cluster(4, 8).allreduce_time(B, range(32)) == pytest.approx(260e-6 + 36.25e-3)
    # the same 4x8 ranks of a bigger cluster, given as (host, local): only where they sit matters
    spread = [(h, g) for h in (1, 3, 4, 6) for g in range(8)]
    assert round_cluster(8, 8).allreduce_time(B, spread) == pytest.approx(260e-6 + 36.25e-3)


# --- DeviceSet interop and the analytic model ------------------------------------------------------------
def test_device_set_interface_up_to_128_gpus() -> None:
    cluster = round_cluster(2, 4)
    devices = cluster.device_set()
    assert devices.names == [f"cuda:{r}" for r in range(8)]
    assert devices.transfer_time(1e6, "cuda:0", torch.device("cuda", 3)) == cluster.transfer_time(1e6, 0, 3)
    assert devices.transfer_time(1e6, "cuda:3", "cuda:4") == pytest.approx(20e-6 + 1e6 / 10e9)
    assert devices.allreduce_time(B, [f"cuda:{r}" for r in range(8)]) == pytest.approx(100e-6 + 40e-3)
    assert devices.link("cuda:1", "cuda:6").kind == "infiniband"
    saved = DeviceSet.from_json(devices.to_json())  # a plain description with every pair's link
    assert saved.transfer_time(1e6, "cuda:3", "cuda:4") == devices.transfer_time(1e6, "cuda:3", "cuda:4")
    assert len(Cluster.parse("16x8xH100").device_set().names) == 128
    with pytest.raises(ClusterError) as info:
        Cluster.parse("17x8xH100").device_set()
    assert "136 GPUs" in str(info.value) and "cuda:127" in str(info.value)
    assert "Cluster.transfer_time(nbytes, rank_a, rank_b)" in str(info.value)


def test_spec_drives_the_analytic_model_with_the_stated_efficiency() -> None:
    from cost_model.ops import gemm_efficiency

    n = 8192
    node = {"name": "fc", "op": "call_function", "target": "linear", "flops": 2 * n**3, "shapes": [(n, n)],
            "dtypes": ["bfloat16"], "out_bytes": n * n * 2, "param_bytes": n * n * 2}  # fmt: skip
    cluster = Cluster.from_dict({"hosts": 1, "gpus_per_host": 2, "gpu": "H100", "efficiency": 0.5})
    cost = AnalyticCostModel(cluster.device_set(), measure=never)
    assert cost.gpu_rates("cuda:1") is not None and cost.gpu_rates("cuda:1")[1] == pytest.approx(0.5)  # type: ignore[index]
    expected = 2 * n**3 / (989.4e12 * 0.5 * gemm_efficiency(n, n, n, "cuda", 4096))
    assert cost.forward_time(node, torch.device("cuda:1")) == pytest.approx(4 * 5e-6 + expected)
    assert cost.transfer_time(1e6, torch.device("cuda:0"), torch.device("cuda:1")) == cluster.transfer_time(1e6, 0, 1)
    assert cluster.spec(0).memory_bytes == 80 << 30


def test_fabric_defaults_name_known_types_and_cite_sources() -> None:
    from cost_model.fabric import _fabrics
    from cost_model.gpu_table import default_table

    table = _fabrics()
    names = set(default_table().names)
    for gpu, entry in table["defaults"].items():
        assert gpu == "*" or gpu in names, f"fabric default for {gpu!r}, which is not in the GPU table"
        assert entry["intra"] in table["intra"] and entry["inter"] in table["inter"]
        assert entry["source"]
    for side in ("intra", "inter"):
        assert all(kind["source"] for kind in table[side].values())
