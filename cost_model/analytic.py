"""Analytic cost model: roofline time per node and latency + bandwidth time per transfer."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

import torch

from cost_model.devices import DeviceSpec, measure_device

__all__ = ["AnalyticCostModel", "CostModel"]

# Default links when nothing better is known: (latency seconds, bytes per second).
_LINKS = {
    frozenset({"cuda"}): (10e-6, 20e9),  # PCIe 4 x16 peer-to-peer, roughly
    frozenset({"cpu", "cuda"}): (10e-6, 12e9),
}
_DEFAULT_LINK = (20e-6, 5e9)
# Backward of a layer costs about twice its forward (two matmuls per forward matmul).
BACKWARD_FACTOR = 2.0


class CostModel(Protocol):
    """What the planner asks. Times are seconds for one micro-batch."""

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward plus backward time of one graph vertex (its attribute dict) on `device`."""
        ...

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        """Time to move `nbytes` from `src` to `dst`; zero on the same device."""
        ...


class AnalyticCostModel:
    """Roofline: max(FLOPs / matmul rate, bytes / bandwidth) plus a fixed per-op overhead.

    Rates come from `measure_device` (measured once per process) unless `specs` gives them,
    which lets tests and planning for absent hardware use fixed numbers.
    """

    def __init__(
        self,
        specs: Mapping[torch.device, DeviceSpec] | None = None,
        measure: Callable[[torch.device], DeviceSpec] = measure_device,
    ) -> None:
        self._specs = dict(specs or {})
        self._measure = measure

    def spec(self, device: torch.device) -> DeviceSpec:
        if device not in self._specs:
            self._specs[device] = self._measure(device)
        return self._specs[device]

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        if node.get("op") not in ("call_function", "call_method", "call_module"):
            return 0.0
        spec = self.spec(device)
        flops = float(node.get("flops", 0))
        moved = 2.0 * float(node.get("out_bytes", 0)) + float(node.get("param_bytes", 0))
        forward = spec.op_overhead_s + max(flops / spec.flops_per_s, moved / spec.bytes_per_s)
        return forward * (1.0 + BACKWARD_FACTOR)

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        if src == dst or nbytes <= 0:
            return 0.0
        latency, bandwidth = _LINKS.get(frozenset({src.type, dst.type}), _DEFAULT_LINK)
        return latency + nbytes / bandwidth
