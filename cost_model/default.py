"""The cost model `partition()` uses when none is given: profiled where the device is here, analytic elsewhere."""

from __future__ import annotations

from cost_model.analytic import AnalyticCostModel
from cost_model.interface import CostModel
from cost_model.profiler import ProfiledCostModel

__all__ = ["default_cost_model"]


def default_cost_model() -> CostModel:
    """What `partition()` should use by default: profiled where the device is present, else analytic.

    The caller hands it the traced graph with `prepare(graph_module, flat_inputs)` before planning.
    """
    return ProfiledCostModel(fallback=AnalyticCostModel())
