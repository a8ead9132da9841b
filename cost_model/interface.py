"""The small interface the planner uses to ask a cost model for times (see [Note: cost model interface])."""

from __future__ import annotations

from typing import Any, Mapping, Protocol, runtime_checkable

import torch

__all__ = ["BACKWARD_FACTOR", "CostModel", "backward_time", "forward_time"]

# Backward of a layer costs about twice its forward (two matmuls per forward matmul).
BACKWARD_FACTOR = 2.0

# [Note: cost model interface]
# The planner calls only `node_time` and `transfer_time`; everything else is optional and
# looked up with getattr, so profiled, analytic, calibrated and hand-described models swap
# without any change in the planner. Optional methods:
#   forward_time(node, device) / backward_time(node, device): the split of node_time.
#   allreduce_time(nbytes, devices): data-parallel gradient all-reduce among replicas.
#   prepare(graph_module, flat_inputs): called once before planning by models that need the
#       traced graph itself (the profiler); others do not define it.


@runtime_checkable
class CostModel(Protocol):
    """What the planner asks. Times are seconds for one micro-batch."""

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        """Forward plus backward time of one graph vertex (its attribute dict) on `device`."""
        ...

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        """Time to move `nbytes` from `src` to `dst`; zero on the same device."""
        ...


def forward_time(cost: CostModel, node: Mapping[str, Any], device: torch.device) -> float:
    """Forward part of `cost.node_time`, from the model's own split when it has one."""
    method = getattr(cost, "forward_time", None)
    if callable(method):
        return float(method(node, device))
    return cost.node_time(node, device) / (1.0 + BACKWARD_FACTOR)


def backward_time(cost: CostModel, node: Mapping[str, Any], device: torch.device) -> float:
    """Backward part of `cost.node_time`: the total minus the forward."""
    return cost.node_time(node, device) - forward_time(cost, node, device)
