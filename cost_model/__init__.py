"""Predict how long graph nodes, transfers and collectives take on each device (never imports the planner).

The planner asks a `CostModel` two questions, `node_time` and `transfer_time`; any of the
models here answers them, so swapping one for another needs no change in the planner:

    ProfiledCostModel   nodes timed on the device itself (cached on disk); analytic fallback
    AnalyticCostModel   roofline per operator class from measured or hand-described rates
    CalibratedCostModel either of them, corrected by factors learned from measured runs
"""

from cost_model.analytic import AnalyticCostModel
from cost_model.cache import cache_dir
from cost_model.calibration import CalibratedCostModel, Calibration, measured_stage_ms, stage_records
from cost_model.cluster import DeviceDescriptionError, DeviceSet, parse_bytes
from cost_model.cluster_shape import Cluster, ClusterError, Fabric, as_cluster
from cost_model.comm import LINK_KINDS, Link, default_link, p2p_time, ring_allreduce_time, slowest
from cost_model.default import default_cost_model
from cost_model.devices import DeviceError, DeviceSpec, measure_device, resolve_devices
from cost_model.discovery import discover_devices
from cost_model.interface import BACKWARD_FACTOR, CostModel, backward_time, forward_time
from cost_model.links import fit_link, measure_copy_link, measure_gloo_link, measure_gloo_p2p
from cost_model.memory import OPTIMIZER_STATES, StageMemory, in_flight, saved_activation_bytes, stage_memory
from cost_model.processes import BetweenProcesses
from cost_model.profiler import Profile, ProfiledCostModel, profile_graph

__all__ = [
    "BetweenProcesses",
    "AnalyticCostModel",
    "BACKWARD_FACTOR",
    "CalibratedCostModel",
    "Calibration",
    "Cluster",
    "ClusterError",
    "CostModel",
    "DeviceDescriptionError",
    "DeviceError",
    "DeviceSet",
    "DeviceSpec",
    "Fabric",
    "LINK_KINDS",
    "Link",
    "OPTIMIZER_STATES",
    "Profile",
    "ProfiledCostModel",
    "StageMemory",
    "as_cluster",
    "backward_time",
    "cache_dir",
    "default_cost_model",
    "default_link",
    "discover_devices",
    "fit_link",
    "forward_time",
    "in_flight",
    "measure_copy_link",
    "measure_device",
    "measured_stage_ms",
    "measure_gloo_link",
    "measure_gloo_p2p",
    "p2p_time",
    "parse_bytes",
    "profile_graph",
    "resolve_devices",
    "ring_allreduce_time",
    "saved_activation_bytes",
    "slowest",
    "stage_memory",
    "stage_records",
]
