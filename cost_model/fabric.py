"""A cluster's links by GPU type: NVLink/NVSwitch/PCIe inside a host, InfiniBand/RoCE/Ethernet between hosts.

The defaults by type, each with its source, are the "fabrics" section of `cost_model/gpus.json`: the bandwidths
NCCL reaches on them (nccl-tests bus bandwidth), not line rates, unless a description gives its own.
`Fabric.default(gpu, given)` reads them and a user's overrides (cluster_shape.Cluster's "fabric" field).
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib import resources
from typing import Any, Literal, Mapping, get_args

from cost_model.comm import Link
from cost_model.gpu_table import GpuType

__all__ = ["ClusterError", "Fabric", "Inter", "Intra"]

Intra = Literal["nvswitch", "nvlink", "pcie"]
Inter = Literal["infiniband", "roce", "ethernet"]
_GB = 1e9


class ClusterError(ValueError):
    """A cluster shape or description has problems; the message names each one and the fix."""


@functools.cache
def _fabrics() -> dict[str, Any]:
    """The "fabrics" section of the package's gpus.json (kinds and defaults by GPU type)."""
    data = json.loads(resources.files("cost_model").joinpath("gpus.json").read_text())
    return dict(data["fabrics"])


@dataclasses.dataclass(frozen=True)
class Fabric:
    """The links of a cluster: between two GPUs of one host, and from a GPU to another host (per GPU)."""

    intra: Link
    inter: Link

    @classmethod
    def default(cls, gpu: GpuType, given: Mapping[str, Any] | None = None) -> Fabric:
        """The fabric of `gpu`'s reference system (gpus.json "fabrics"), with `given`'s overrides.

        Args:
            gpu: the cluster's GPU type.
            given: {"intra": kind or {"kind", "gb_per_s", "latency_us"}, "inter": kind or
                {"kind", "gbit_per_s" (or "gb_per_s"), "latency_us"}}; absent parts take the defaults.

        Raises:
            ClusterError: an unknown kind or field, a bad number, or NVLink on a GPU that has none.
        """
        table = _fabrics()
        base = table["defaults"].get(gpu.name, table["defaults"]["*"])
        given = dict(given or {})
        unknown = sorted(set(given) - {"intra", "inter"})
        if unknown:
            raise ClusterError(f"fabric: unknown fields {unknown}; use 'intra' and 'inter'")
        intra = _link("intra", given.get("intra"), base, gpu)
        inter = _link("inter", given.get("inter"), base, gpu)
        return cls(intra, inter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "intra": {"kind": self.intra.kind, "gb_per_s": self.intra.bandwidth / _GB,
                      "latency_us": self.intra.latency_s * 1e6},
            "inter": {"kind": self.inter.kind, "gbit_per_s": self.inter.bandwidth * 8 / _GB,
                      "latency_us": self.inter.latency_s * 1e6},
        }  # fmt: skip


def _link(side: Literal["intra", "inter"], given: Any, base: Mapping[str, Any], gpu: GpuType) -> Link:
    """One side's Link from the defaults `base` (by GPU type) and what the user gave."""
    kinds: Mapping[str, Any] = _fabrics()[side]
    choices = get_args(Intra if side == "intra" else Inter)
    known = {"kind", "gb_per_s", "gbit_per_s", "latency_us"}
    entry = {"kind": given} if isinstance(given, str) else dict(given) if isinstance(given, Mapping) else {}
    if not isinstance(given, (str, Mapping, type(None))) or set(entry) - known:
        raise ClusterError(
            f"fabric.{side}: {given!r}; write one of {list(choices)} or "
            "{'kind': ..., 'gb_per_s' or 'gbit_per_s': ..., 'latency_us': ...}"
        )
    kind = str(entry.get("kind", base[side]))
    if kind not in choices:
        raise ClusterError(f"fabric.{side}: unknown kind {kind!r}; use one of {list(choices)}")
    same = kind == base[side]  # the type's own system: its NIC rate applies
    try:
        latency = float(entry.get("latency_us", kinds[kind]["latency_us"])) * 1e-6
        if "gb_per_s" in entry:
            bandwidth = float(entry["gb_per_s"]) * _GB
        elif "gbit_per_s" in entry:
            bandwidth = float(entry["gbit_per_s"]) * _GB / 8
        elif kind in ("nvswitch", "nvlink"):
            if not gpu.nvlink_bytes_per_s:
                raise ClusterError(
                    f"fabric.intra: {gpu.name} has no NVLink in the GPU table; use 'pcie' or give 'gb_per_s'"
                )
            measured = base.get("intra_bus_gb_per_s") if same else None  # NCCL's bus bandwidth on that system
            bandwidth = float(measured) * _GB if measured else \
                gpu.nvlink_bytes_per_s * float(kinds[kind].get("bus_efficiency", 1.0))
        elif side == "inter":
            bandwidth = float(base.get("gbit_per_s", kinds[kind]["gbit_per_s"]) if same else kinds[kind]["gbit_per_s"])
            bandwidth *= _GB / 8 * float(kinds[kind].get("bus_efficiency", 1.0))
        else:
            bandwidth = float(kinds[kind]["gb_per_s"]) * _GB
        return Link(kind, latency, bandwidth)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ClusterError):
            raise
        raise ClusterError(f"fabric.{side}: {exc}; give positive numbers (gb_per_s: GB/s, gbit_per_s: Gb/s)") from None
