"""A cluster by its shape ("16x8xH100": hosts x GPUs per host x type), priced by where ranks sit.

    rank r = host * gpus_per_host + local            (any size: no per-device or per-pair entries)
    transfer_time(b, a, c) = intra or inter link's latency + b / bandwidth, by whether a and c share a host
    allreduce_time(b, ranks): a ring inside one host, hierarchical across hosts with the same count on
    each, a flat ring otherwise (formulas on the method; runtime/hier_allreduce.py runs the same rule)

A cluster also reads from JSON (or YAML where pyyaml is installed) with the same fields:

    {"hosts": 2, "gpus_per_host": 8, "gpu": "A100-80GB",
     "fabric": {"intra": "nvswitch", "inter": {"kind": "infiniband", "gbit_per_s": 200, "latency_us": 5}},
     "efficiency": 0.6}

The GPU type is found through the GPU table (`gpu_table.py`, names and aliases); the fabric's
defaults by type (`fabric.py`), each with its source, are the "fabrics" section of `cost_model/gpus.json`:
the bandwidths NCCL reaches on them (nccl-tests bus bandwidth), not line rates, unless a description
gives its own.
`Cluster.device_set()` gives the `DeviceSet` interface (torch device names) up to 128 GPUs.
"""

from __future__ import annotations

import collections
import dataclasses
import difflib
import json
import os
import re
from typing import Any, Iterable, Mapping, Sequence

import torch

from cost_model.analytic import DEFAULT_GPU_EFFICIENCY, STATED, TABLE, bandwidth_efficiency
from cost_model.cluster import DeviceSet
from cost_model.comm import Link, p2p_time, ring_allreduce_time
from cost_model.devices import DeviceSpec
from cost_model.fabric import ClusterError, Fabric, Inter, Intra
from cost_model.gpu_table import GpuTable, GpuType, UnknownGpuError, _tokens

__all__ = ["Cluster", "ClusterDeviceSet", "ClusterError", "Fabric", "Inter", "Intra", "Rank", "as_cluster"]

Rank = int | tuple[int, int]  # a rank, or (host, local index)
TORCH_INDEX_LIMIT = 128  # torch keeps a device index in an int8: "cuda:128" reads back as cuda:-128
_SHAPE = re.compile(r"\s*(-?\d+)\s*[xX]\s*(-?\d+)\s*[xX]\s*(\S.*?)\s*")
_FORM = "'HOSTSxGPUSxTYPE', e.g. '16x8xH100' or '2x8xA100-80GB'"
_FIELDS = {"hosts", "gpus_per_host", "gpu", "fabric", "efficiency"}


def _resolve_gpu(name: str, gpus: GpuTable, where: str) -> GpuType:
    """The table's type for `name`; an error with the closest spellings and every known type."""
    try:
        return gpus.get(name)
    except UnknownGpuError:
        spelled = {" ".join(sorted(_tokens(a))): t.name for t in gpus.types for a in (t.name, *t.aliases)}
        wanted = " ".join(sorted(_tokens(name))) or name.lower()
        close = difflib.get_close_matches(wanted, list(spelled), n=1, cutoff=0.5)
        hint = f"; did you mean {spelled[close[0]]}?" if close else ";"
        raise ClusterError(
            f"{where}: unknown GPU type {name!r}{hint} known: {', '.join(gpus.names)} "
            "(add types with GpuTable.load(extra=...) and pass gpus=)"
        ) from None


@dataclasses.dataclass(frozen=True)
class Cluster:
    """`hosts` hosts of `gpus_per_host` GPUs of one type, joined by a `fabric`; ranks are host-major."""

    hosts: int
    gpus_per_host: int
    gpu: GpuType
    fabric: Fabric
    efficiency: float | None = None  # stated fraction of peak for compute; None: the analytic default

    def __post_init__(self) -> None:
        for name in ("hosts", "gpus_per_host"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ClusterError(f"{name}={value!r}; {name} must be an integer >= 1")
        if self.efficiency is not None and not 0 < self.efficiency <= 1:
            raise ClusterError(f"efficiency={self.efficiency!r}; give a fraction of peak in (0, 1], e.g. 0.6")

    @property
    def size(self) -> int:
        """Number of GPUs."""
        return self.hosts * self.gpus_per_host

    @property
    def shape(self) -> str:
        return f"{self.hosts}x{self.gpus_per_host}x{self.gpu.name}"

    # --- building ---------------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str, *, gpus: GpuTable | None = None) -> Cluster:
        """A cluster from 'HOSTSxGPUSxTYPE' ('16x8xH100', '2x8xA100-80GB'), with the type's default fabric.

        Raises:
            ClusterError: bad syntax (names the form), a count below 1, or an unknown GPU type
                (names close matches and every known type).
        """
        match = _SHAPE.fullmatch(str(text))
        if not match:
            raise ClusterError(f"{text!r} is not a cluster shape; write {_FORM}, or give a JSON/YAML file")
        hosts, per_host, name = int(match.group(1)), int(match.group(2)), match.group(3)
        return cls.from_dict({"hosts": hosts, "gpus_per_host": per_host, "gpu": name}, gpus=gpus, where=str(text))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, gpus: GpuTable | None = None, where: str = "cluster") -> Cluster:
        """A cluster from {'hosts', 'gpus_per_host', 'gpu', optional 'fabric' and 'efficiency'} (module docstring).

        Raises:
            ClusterError: every problem found, each with its fix; a DeviceSet description is named as such.
        """
        if not isinstance(data, Mapping):
            raise ClusterError(f"{where}: expected an object with {sorted(_FIELDS)}, got {type(data).__name__}")
        if "devices" in data:
            raise ClusterError(_device_set_hint(data, where))
        problems = [f"unknown field {f!r}; use {sorted(_FIELDS)}" for f in sorted(set(data) - _FIELDS)]
        problems += [f"missing {f!r}" for f in ("hosts", "gpus_per_host", "gpu") if f not in data]
        for name in ("hosts", "gpus_per_host"):
            value = data.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append(f"{name}={value!r} is not an integer")
            elif value < 1:
                problems.append(f"{name} must be >= 1 (got {value})")
        if problems:
            raise ClusterError(f"{where}: " + "; ".join(problems))
        gpu = _resolve_gpu(str(data["gpu"]), gpus or GpuTable.load(), where)
        fabric_given = data.get("fabric")
        if fabric_given is not None and not isinstance(fabric_given, Mapping):
            example = "{'intra': 'nvswitch', 'inter': 'infiniband'}"
            raise ClusterError(f"{where}: fabric must be an object such as {example}")
        try:
            fabric = Fabric.default(gpu, fabric_given)
            efficiency = data.get("efficiency")
            return cls(int(data["hosts"]), int(data["gpus_per_host"]), gpu, fabric,
                       None if efficiency is None else float(efficiency))  # fmt: skip
        except (ClusterError, TypeError, ValueError) as exc:
            raise ClusterError(f"{where}: {exc}") from None

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, gpus: GpuTable | None = None) -> Cluster:
        """A cluster from a JSON file (YAML for .yaml/.yml where pyyaml is installed).

        Raises:
            ClusterError: unreadable or malformed file, a DeviceSet file (says what to write
                instead), or the problems of `from_dict`.
        """
        name = os.fspath(path)
        try:
            with open(name) as f:
                text = f.read()
        except OSError as exc:
            raise ClusterError(f"cannot read the cluster file {name!r}: {exc}") from None
        if name.endswith((".yaml", ".yml")):
            try:
                import yaml  # type: ignore[import-untyped]
            except ImportError:
                raise ClusterError(f"{name}: reading YAML needs pyyaml (pip install pyyaml); or write JSON") from None
            try:
                data = yaml.safe_load(text)
            except yaml.YAMLError as exc:
                raise ClusterError(f"{name} is not valid YAML: {exc}") from None
        else:
            try:
                data = json.loads(text)
            except ValueError as exc:
                raise ClusterError(f"{name} is not valid JSON: {exc}") from None
        return cls.from_dict(data, gpus=gpus, where=name)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"hosts": self.hosts, "gpus_per_host": self.gpus_per_host, "gpu": self.gpu.name,
                               "fabric": self.fabric.to_dict()}  # fmt: skip
        if self.efficiency is not None:
            out["efficiency"] = self.efficiency
        return out

    # --- ranks ------------------------------------------------------------------------------------
    def rank(self, device: Rank) -> int:
        """The rank of `device` (a rank, or (host, local)). Raises ClusterError when it is outside."""
        if isinstance(device, tuple):
            host, local = device
            if not (0 <= host < self.hosts and 0 <= local < self.gpus_per_host):
                raise ClusterError(
                    f"device {device} is outside {self.shape}: "
                    f"hosts 0..{self.hosts - 1}, local 0..{self.gpus_per_host - 1}"
                )
            return host * self.gpus_per_host + local
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < self.size:
            raise ClusterError(f"rank {device!r} is outside {self.shape}: use 0..{self.size - 1} or (host, local)")
        return device

    def where(self, device: Rank) -> tuple[int, int]:
        """(host, local index) of a rank."""
        return divmod(self.rank(device), self.gpus_per_host)

    def same_host(self, a: Rank, b: Rank) -> bool:
        return self.rank(a) // self.gpus_per_host == self.rank(b) // self.gpus_per_host

    # --- prices -----------------------------------------------------------------------------------
    def link(self, a: Rank, b: Rank) -> Link:
        """The link between two ranks: none for one GPU, intra when they share a host, else inter."""
        if self.rank(a) == self.rank(b):
            return Link("same", 0.0, float("inf"))
        return self.fabric.intra if self.same_host(a, b) else self.fabric.inter

    def transfer_time(self, nbytes: float, src: Rank, dst: Rank) -> float:
        """Point-to-point seconds: latency + nbytes / bandwidth of the pair's link (0 on one GPU)."""
        return p2p_time(nbytes, self.link(src, dst))

    def allreduce_time(self, nbytes: float, ranks: Iterable[Rank]) -> float:
        """All-reduce seconds of `nbytes` per GPU over a replica group, by how it spreads over hosts.

        Priced as runtime/hier_allreduce.py issues it (the same rule picks the algorithm).
        One host, n GPUs (ring over the intra link, latency l_i, bandwidth B_i):
            2 (n - 1) l_i + 2 (n - 1) / n * b / B_i
        H > 1 hosts with g GPUs of the group on every one of them (hierarchical):
            reduce-scatter in each host     (g - 1) l_i + (g - 1) / g * b / B_i
            all-reduce across hosts         2 (H - 1) l_e + 2 (H - 1) / H * (b / g) / B_e
            all-gather in each host         as the reduce-scatter
        Each GPU crosses hosts with its shard over its own NIC (B_e is per GPU).
        H > 1 hosts with uneven counts (the runtime's flat all-reduce): one ring over all n GPUs,
        each step paced by the inter-host link: 2 (n - 1) l_e + 2 (n - 1) / n * b / B_e.

        Raises:
            ClusterError: a rank outside the cluster, or one named twice.
        """
        group = [self.rank(r) for r in ranks]
        if len(set(group)) != len(group):
            doubled = sorted(r for r, c in collections.Counter(group).items() if c > 1)
            raise ClusterError(f"allreduce_time: ranks {doubled[:8]} appear twice; name each GPU of the group once")
        if len(group) <= 1 or nbytes <= 0:
            return 0.0
        per_host = collections.Counter(r // self.gpus_per_host for r in group).values()
        g, h = max(per_host), len(per_host)
        if h == 1:
            return ring_allreduce_time(nbytes, g, self.fabric.intra)
        if min(per_host) != g:  # uneven: the runtime falls back to the flat all-reduce
            return ring_allreduce_time(nbytes, len(group), self.fabric.inter)
        local = ring_allreduce_time(nbytes, g, self.fabric.intra)  # reduce-scatter + all-gather
        return local + ring_allreduce_time(nbytes / g, h, self.fabric.inter)

    # --- specs and interop ------------------------------------------------------------------------
    def spec(self, device: Rank = 0) -> DeviceSpec:
        """The DeviceSpec of a rank from the GPU table, as AnalyticCostModel reads it.

        Without a stated `efficiency`, matmul_precision is TABLE: the analytic model takes the table's
        efficiency by precision and shape (flops_per_s, the default fraction of the fp32 peak, stands
        for nothing there). With one, flops_per_s is that fraction of the fp32 peak, recorded as STATED,
        so the analytic model applies it to every precision's peak (see [Note: GPU rates from the table]
        in analytic.py).
        """
        self.rank(device)
        efficiency = self.efficiency if self.efficiency is not None else DEFAULT_GPU_EFFICIENCY
        return DeviceSpec(
            name=self.gpu.name, flops_per_s=efficiency * self.gpu.fp32_flops,
            bytes_per_s=bandwidth_efficiency(self.gpu) * self.gpu.memory_bytes_per_s, op_overhead_s=5e-6,
            memory_bytes=self.gpu.memory_bytes, kind="cuda", gpu_type=self.gpu.name,
            matmul_precision=STATED if self.efficiency is not None else TABLE,
        )  # fmt: skip

    def device_set(self) -> DeviceSet:
        """The DeviceSet interface (torch names cuda:0..cuda:N-1 for ranks 0..N-1), priced by this cluster.

        Raises:
            ClusterError: more than 128 GPUs, which torch device names cannot hold.
        """
        if self.size > TORCH_INDEX_LIMIT:
            raise ClusterError(
                f"{self.shape} has {self.size} GPUs, but torch device names stop at cuda:{TORCH_INDEX_LIMIT - 1} "
                f"(cuda:{TORCH_INDEX_LIMIT} reads back as cuda:-{TORCH_INDEX_LIMIT}); use the rank-based API: "
                "Cluster.transfer_time(nbytes, rank_a, rank_b), Cluster.allreduce_time(nbytes, ranks), "
                "Cluster.spec(rank)"
            )
        return ClusterDeviceSet({f"cuda:{r}": self.spec(r) for r in range(self.size)}, cluster=self)


class ClusterDeviceSet(DeviceSet):
    """A DeviceSet whose prices come from a Cluster (cuda:r is rank r): no list of pairs, hierarchical all-reduce."""

    def __init__(self, devices: dict[str, DeviceSpec], *, cluster: Cluster) -> None:
        super().__init__(devices)
        self.cluster = cluster

    def _rank(self, device: str | torch.device) -> int:
        self.spec(device)  # a DeviceError naming the set's devices for a stranger
        dev = torch.device(device)
        return int(dev.index or 0)

    def link(self, a: str | torch.device, b: str | torch.device) -> Link:
        return self.cluster.link(self._rank(a), self._rank(b))

    def transfer_time(self, nbytes: float, src: str | torch.device, dst: str | torch.device) -> float:
        return self.cluster.transfer_time(nbytes, self._rank(src), self._rank(dst))

    def allreduce_time(self, nbytes: float, devices: Sequence[str | torch.device]) -> float:
        return self.cluster.allreduce_time(nbytes, [self._rank(d) for d in devices])

    def to_dict(self) -> dict[str, Any]:
        """The plain DeviceSet description (links of every pair written out: at most 128 GPUs)."""
        names = list(self.devices)
        self.links = {frozenset((a, b)): self.link(a, b) for i, a in enumerate(names) for b in names[i + 1:]}
        return super().to_dict()


def _device_set_hint(data: Mapping[str, Any], where: str) -> str:
    """What to write instead of a DeviceSet description, filled in from it where it says."""
    devices = data.get("devices")
    count = len(devices) if isinstance(devices, (Mapping, list)) else "N"
    kinds = set()
    if isinstance(devices, Mapping):
        kinds = {str(v.get("gpu_type") or v.get("name", "")) for v in devices.values() if isinstance(v, Mapping)}
    gpu = kinds.pop() if len(kinds) == 1 and "" not in kinds else "<type, e.g. H100>"
    return (
        f"{where} is a DeviceSet description (one entry per torch device, links per pair); load it with "
        f"cost_model.DeviceSet.load(path), or describe the cluster by its shape: "
        f'{{"hosts": 1, "gpus_per_host": {count}, "gpu": "{gpu}"}} (or the string "1x{count}x{gpu}")'
    )


def as_cluster(value: Cluster | str | os.PathLike[str] | Mapping[str, Any], *, gpus: GpuTable | None = None) -> Cluster:
    """A Cluster from a Cluster, a shape string, a path to a JSON/YAML file, or a dict.

    Raises:
        ClusterError: neither a shape nor a readable file (names both forms), or a bad description.
    """
    if isinstance(value, Cluster):
        return value
    if isinstance(value, Mapping):
        return Cluster.from_dict(value, gpus=gpus)
    text = os.fspath(value)
    if _SHAPE.fullmatch(text) and not os.path.exists(text):
        return Cluster.parse(text, gpus=gpus)
    if os.path.exists(text):
        return Cluster.load(text, gpus=gpus)
    raise ClusterError(f"{text!r} is neither a cluster shape ({_FORM}) nor an existing JSON/YAML file")
