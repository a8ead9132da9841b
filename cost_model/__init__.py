"""Predict how long graph nodes and transfers take on each device (never imports the planner)."""

from cost_model.analytic import AnalyticCostModel, CostModel
from cost_model.devices import DeviceError, DeviceSpec, measure_device, resolve_devices

__all__ = ["AnalyticCostModel", "CostModel", "DeviceError", "DeviceSpec", "measure_device", "resolve_devices"]
