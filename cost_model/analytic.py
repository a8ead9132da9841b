"""Analytic cost model: per-op-class roofline time per node, latency + bandwidth per transfer.

    forward  = overhead + max(FLOPs / (matmul rate * efficiency), bytes / copy bandwidth)
    backward = 2 * the compute part for matrix products, the class's own bytes otherwise

The rates are a DeviceSpec's: measured once per device (a large matmul, a large copy and a
tiny op, `measure_device`) or described by hand (`DeviceSet`). Given the specs, the model
is deterministic. Operator classes and their constants live in `ops.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from cost_model.cluster import DeviceSet
from cost_model.comm import default_link, p2p_time, ring_allreduce_time, slowest
from cost_model.devices import DeviceError, DeviceSpec, device_present, measure_device
from cost_model.interface import BACKWARD_FACTOR, CostModel
from cost_model.ops import classify, gemm_dims, gemm_efficiency, op_costs

__all__ = ["AnalyticCostModel", "BACKWARD_FACTOR", "CostModel"]

_COMPUTE_OPS = ("call_function", "call_method", "call_module")
# Side of the square product `measure_device` times, by device type (efficiency is relative to it).
_REFERENCE_MATMUL = {"cpu": 1024.0}
_REFERENCE_MATMUL_DEFAULT = 4096.0
# Tensor cores: half-precision matrix products run this much faster than the fp32 rate.
_HALF_SPEEDUP = {"float16": 8.0, "bfloat16": 8.0}

Specs = Mapping[Any, DeviceSpec] | DeviceSet | None


class AnalyticCostModel:
    """Roofline per operator class, from device rates; links from a DeviceSet or typical values.

    Args:
        specs: rates per device, as {torch.device or name: DeviceSpec} or a DeviceSet
            (which also supplies the links). Devices missing here, or with rate 0, are
            measured on first use when present in this process.
        measure: how to measure a present device (tests pass a fake).
    """

    def __init__(self, specs: Specs = None, measure: Callable[[torch.device], DeviceSpec] = measure_device) -> None:
        self.device_set = specs if isinstance(specs, DeviceSet) else None
        given = specs.devices if isinstance(specs, DeviceSet) else dict(specs or {})
        self._specs: dict[str, DeviceSpec] = {str(torch.device(k)): v for k, v in given.items()}
        self._measure = measure
        self._kinds: dict[str, str] = {}

    def prepare(self, graph_module: torch.fx.GraphModule, flat_inputs: Sequence[Any] = ()) -> None:
        """Learn each module call's class (Conv2d, MaxPool2d, ...) from the traced graph."""
        for node in graph_module.graph.nodes:
            if node.op == "call_module":
                self._kinds[node.name] = type(graph_module.get_submodule(str(node.target))).__name__

    def spec(self, device: torch.device | str) -> DeviceSpec:
        """The rates used for `device`, measuring it once if it is present and not described.

        Raises:
            DeviceError: the device is neither described nor present here.
        """
        key = str(torch.device(device))
        spec = self._specs.get(key)
        if spec is not None and spec.measured:
            return spec
        if not device_present(torch.device(key)):
            raise DeviceError(
                f"no rates for {key}: it is not present here and not described; pass "
                f"AnalyticCostModel(DeviceSet.from_dict({{'devices': {{'{key}': {{'flops_per_s': ..., "
                "'bytes_per_s': ..., 'memory_bytes': ...}}}}}))"
            )
        measured = self._measure(torch.device(key))
        if spec is not None:  # keep what discovery knew (memory, cores), add the rates
            measured = dataclasses.replace(
                spec,
                flops_per_s=measured.flops_per_s,
                bytes_per_s=measured.bytes_per_s,
                op_overhead_s=measured.op_overhead_s,
            )
        self._specs[key] = measured
        return measured

    def _kind(self, device: torch.device, spec: DeviceSpec) -> str:
        return spec.kind or torch.device(device).type

    def _times(self, node: Mapping[str, Any], device: torch.device) -> tuple[float, float]:
        if node.get("op") not in _COMPUTE_OPS:
            return 0.0, 0.0
        spec = self.spec(device)
        device_kind = self._kind(device, spec)
        kind = self._kinds.get(str(node.get("name", "")))
        cls = classify(node, kind)
        cost = op_costs(device_kind)[cls]
        overhead = spec.op_overhead_s
        out_bytes = float(node.get("out_bytes", 0) or 0)
        memory_fwd = cost.fwd_bytes * out_bytes / spec.bytes_per_s
        memory_bwd = cost.bwd_bytes * out_bytes / spec.bytes_per_s
        if cls in ("gemm", "conv"):
            flops = float(node["flops"])
            shapes = node.get("shapes") or [()]
            _, m, n, k = gemm_dims(shapes[0], flops, "conv" if cls == "conv" else kind or str(node.get("target", "")))
            reference = _REFERENCE_MATMUL.get(device_kind, _REFERENCE_MATMUL_DEFAULT)
            family = "conv" if cls == "conv" else "matmul"
            rate = spec.flops_per_s * gemm_efficiency(m, n, k, device_kind, reference, family)
            dtypes = node.get("dtypes") or []
            if device_kind != "cpu" and dtypes and dtypes[0] in _HALF_SPEEDUP:
                rate *= _HALF_SPEEDUP[dtypes[0]]
            param_bytes = float(node.get("param_bytes", 0) or 0)
            moved = (2.0 * out_bytes + param_bytes) / spec.bytes_per_s
            compute = max(flops / rate, moved)
            return cost.fwd_overhead * overhead + compute, cost.bwd_overhead * overhead + BACKWARD_FACTOR * compute
        if cls == "embedding":  # backward writes a dense gradient as large as the table
            memory_bwd += 2.0 * float(node.get("param_bytes", 0) or 0) / spec.bytes_per_s
        forward = cost.fwd_overhead * overhead + memory_fwd
        backward = cost.bwd_overhead * overhead + memory_bwd if node.get("shapes") else 0.0
        return forward, backward

    def forward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward seconds of one vertex on `device`."""
        return self._times(node, device)[0]

    def backward_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Backward seconds of one vertex on `device`."""
        return self._times(node, device)[1]

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        forward, backward = self._times(node, device)
        return forward + backward

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        if self.device_set is not None:
            return self.device_set.transfer_time(nbytes, src, dst)
        return p2p_time(nbytes, default_link(torch.device(src), torch.device(dst)))

    def allreduce_time(self, nbytes: float, devices: Sequence[torch.device]) -> float:
        """Ring all-reduce seconds of `nbytes` among `devices` (data-parallel replicas)."""
        if self.device_set is not None:
            return self.device_set.allreduce_time(nbytes, devices)
        n = len(devices)
        if n <= 1:
            return 0.0
        ring = [default_link(torch.device(devices[i]), torch.device(devices[(i + 1) % n])) for i in range(n)]
        return ring_allreduce_time(nbytes, n, slowest(ring))
