"""Every argument check of plan() and partition(), before anything is traced or moved.

A bad argument is a PartitionError naming it and the fix; the model is never touched first.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Mapping, Sequence, get_args

import torch
from torch import nn

from cost_model.analytic import AnalyticCostModel, CostModel
from cost_model.cluster import DeviceSet
from cost_model.cluster_shape import Cluster, ClusterDeviceSet, ClusterError, as_cluster
from cost_model.devices import DeviceLike, resolve_devices
from partitioner.capture.meta import is_meta, on_meta
from partitioner.errors import PartitionError
from partitioner.place.planning import RECOMPUTE_CHOICES, SCHEDULE_CHOICES
from partitioner.show.visualizer import Plan as DrawablePlan
from runtime.launch import distributed, job_devices
from runtime.materialize import Init, Materializer
from runtime.microbatch import to_device
from runtime.plan import UPDATES, Plan
from runtime.staleness import check_staleness
from runtime.weights import Weights, open_weights

__all__ = [
    "MAX_CLUSTER_GPUS", "PLACEMENTS", "ClusterLike", "PlacementChoice", "check_arguments", "check_staleness_argument",
    "check_update", "cluster_devices", "default_cost", "load_plan", "materializer", "model_device", "plan_target",
]

PlacementChoice = Literal["pipeline", "branches", "auto"]
PLACEMENTS: tuple[str, ...] = get_args(PlacementChoice)
_SCHEDULES: tuple[str, ...] = SCHEDULE_CHOICES  # the Plan's Schedule, or "auto"
ClusterLike = Cluster | str | os.PathLike[str] | Mapping[str, Any]  # cost_model.cluster_shape.as_cluster takes these
MAX_CLUSTER_GPUS = 128  # up to this many GPUs rank r is cuda:r; above, cuda:{r % gpus_per_host} (cluster_devices)


def cluster_devices(cluster: ClusterLike) -> tuple[Cluster, list[torch.device], DeviceSet]:
    """`plan(cluster=...)`: the cluster, a device per rank (none need be here), and its prices.

    Up to 128 GPUs, rank r is cuda:r (priced by rank: cost_model.ClusterDeviceSet). Above, torch
    device names run out (an index is below 128), so rank r is its GPU on its host,
    cuda:{r % gpus_per_host}, and the prices hold one host's names (node times; the cluster
    planner prices links and all-reduces by rank: partitioner/place/cluster_plan.py).

    Raises:
        PartitionError: a bad shape or file (cost_model.cluster_shape names the fix).
    """
    try:
        found = as_cluster(cluster)
    except ClusterError as exc:
        raise PartitionError(f"cluster={cluster!r}: {exc}") from None
    if found.size <= MAX_CLUSTER_GPUS:
        device_set = found.device_set()
        return found, [torch.device(name) for name in device_set.devices], device_set
    per_host = found.gpus_per_host
    local = ClusterDeviceSet({f"cuda:{g}": found.spec(g) for g in range(per_host)}, cluster=found)
    names = [torch.device(f"cuda:{g}") for g in range(per_host)]
    return found, [names[r % per_host] for r in range(found.size)], local


def plan_target(
    devices: Sequence[DeviceLike] | None, cluster: ClusterLike | None, processes: bool | None,
    cost_model: CostModel | None,
) -> tuple[Sequence[DeviceLike], bool | None, CostModel | None, int]:
    """What `plan()` plans for: (devices, processes, cost model, GPUs per host; 0 without a cluster).

    With `cluster`, every GPU of it is a torchrun rank (`cluster_devices` names them), priced by
    the analytic model on the cluster's prices unless `cost_model` is given; with
    replicas="auto" the planner searches the cluster by counts at any size (16,384 GPUs and more).
    """
    if cluster is None:
        if devices is None:
            raise PartitionError("plan() needs devices (e.g. ['cuda:0', 'cuda:1'], here) or cluster= (e.g. "
                                 "'2x8xH100', described: its GPUs need not be here)")
        return devices, processes, cost_model, 0
    if devices is not None:
        raise PartitionError("plan() got both devices and cluster=; the cluster's GPUs are the devices: drop one")
    if processes is False:
        raise PartitionError("cluster= plans one torchrun process per GPU; drop processes=False")
    found, ranks, prices = cluster_devices(cluster)
    return ranks, True, cost_model if cost_model is not None else AnalyticCostModel(prices), found.gpus_per_host


def load_plan(plan: Plan | str | os.PathLike[str]) -> Plan:
    """`partition(plan=...)`: a Plan as it is, or one read from a file written by `Plan.to_json()` (`plan --save`).

    Raises:
        PartitionError: a missing or unreadable file, or one that is not a valid saved plan.
    """
    if isinstance(plan, Plan):
        return plan
    if not isinstance(plan, (str, os.PathLike)):
        raise PartitionError(f"plan={type(plan).__name__}; pass a Plan or the path of one saved with plan.to_json()")
    try:
        with open(plan, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        raise PartitionError(f"plan={os.fspath(plan)!r}: cannot read it ({exc.strerror or exc}); give the path of "
                             "a plan saved with plan.to_json() or `python -m partitioner plan --save PLAN.json`"
                             ) from None
    try:
        return DrawablePlan.from_json(text)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        what = str(exc).replace("\n", " ")
        raise PartitionError(f"plan={os.fspath(plan)!r} is not a saved plan ({type(exc).__name__}: {what}); write it "
                             "with plan.to_json() or `python -m partitioner plan --save PLAN.json`") from None


def check_update(update: str, schedule: str, planned: bool) -> bool:
    """partition(update=...) before anything moves: a known rule, on the 1F1B schedule it streams."""
    if update not in UPDATES:
        raise PartitionError(f"update={update!r}; use one of {', '.join(map(repr, UPDATES))}")
    if update != "sync" and schedule != "1f1b":
        raise PartitionError(f"update={update!r} streams 1F1B with no flush between steps; use schedule='1f1b'")
    return planned


def check_arguments(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    example_inputs: Any,
    example_kwargs: Mapping[str, Any] | None,
    micro_batches: int,
    schedule: str,
    placement: str,
    replicas: Any,
    virtual_stages: int,
    recompute: Any = "none",
    *,
    described: bool = False,
) -> tuple[list[torch.device], tuple[Any, ...], dict[str, Any]]:
    """Every argument check of plan() and partition(), before anything is traced or moved.

    `described`: `devices` are a described cluster's ranks (cluster_devices), taken as they are:
    they need not be here.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    try:
        if described:
            resolved = [torch.device(d) for d in devices]
        else:
            resolved = job_devices(devices) if distributed() else resolve_devices(devices)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise PartitionError(f"micro_batches must be an integer >= 1, got {micro_batches!r}")
    if placement not in PLACEMENTS:
        raise PartitionError(f"placement={placement!r}; use one of {', '.join(map(repr, PLACEMENTS))}")
    if schedule not in _SCHEDULES:
        raise PartitionError(f"schedule={schedule!r}; use one of {', '.join(map(repr, _SCHEDULES))}")
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 1:
        raise PartitionError(f"virtual_stages must be an integer >= 1, got {virtual_stages!r}")
    if isinstance(replicas, str) and replicas != "auto":
        raise PartitionError(f"replicas={replicas!r}; use 'auto' or a list of counts such as [2, 1]")
    choices = [recompute] if isinstance(recompute, str) else recompute if isinstance(recompute, (list, tuple)) else None
    if not choices or any(not isinstance(c, str) or c not in RECOMPUTE_CHOICES for c in choices):
        raise PartitionError(f"recompute={recompute!r}; use one of {', '.join(map(repr, RECOMPUTE_CHOICES))}, "
                             "or a list of those with one per stage")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise PartitionError("example_inputs is empty: pass one batch of inputs, e.g. example_inputs=(x,)")
    home = model_device(model)  # tracing runs the model as it is: the example goes where its weights are
    if home is not None:
        args, kwargs = to_device(args, home), to_device(kwargs, home)
    elif is_meta(model):  # planned from shapes: see partitioner.capture.meta
        args, kwargs = on_meta(args), on_meta(kwargs)
    if placement != "pipeline" and (replicas is not None or schedule not in ("gpipe", "auto")):
        raise PartitionError(f"placement={placement!r} runs the GPipe schedule without replicas")
    if replicas == "auto" and schedule not in ("gpipe", "1f1b", "auto"):
        raise PartitionError(f"replicas='auto' plans a pipeline of replicated stages for schedule 'gpipe' or '1f1b', "
                             f"not {schedule!r}; pick one of those, or give replicas yourself")
    return resolved, args, kwargs


def materializer(model: nn.Module, weights: Weights | None, init: Init | None) -> Materializer | None:
    """What fills a meta model's stages (and loads `weights` into a real one); None: nothing to fill."""
    if init is not None and not callable(init) and init != "reset_parameters":
        raise PartitionError(f"init={init!r}; pass a callable init(module) or 'reset_parameters'")
    meta = is_meta(model)
    if meta and weights is None and init is None:
        raise PartitionError(
            f"{type(model).__name__} has weights on meta (no storage): pass weights= (a safetensors file or folder, "
            "a DCP folder, a torch.save file or a state dict) to load each stage's weights on its device, or init= "
            "(a callable init(module), or 'reset_parameters') to initialize them there"
        )
    if weights is None and (init is None or not meta):
        if init is not None:
            raise PartitionError("init= initializes a model on meta; this model's weights are real: drop init=, "
                                 "or build the model on meta (with torch.device('meta'): ...)")
        return None
    return Materializer(model, weights=open_weights(weights) if weights is not None else None, init=init,
                        load_real=not meta)


def default_cost(model: nn.Module, cost_model: CostModel | None) -> CostModel | None:
    """The user's cost model; for a model on meta by default the analytic one (profiling needs values)."""
    return cost_model if cost_model is not None or not is_meta(model) else AnalyticCostModel()


def check_staleness_argument(staleness: Any) -> int:
    """`partition(staleness=...)` checked: an int >= 0, and above 0 only under torchrun (where replicas exchange)."""
    try:
        steps = check_staleness(staleness)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if steps and not distributed():
        raise PartitionError(f"staleness={steps} delays the all-reduce between ranks holding one weight, which only "
                             "torchrun jobs have (one process shares its weights); launch with torchrun, or drop it")
    return steps


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first weight or buffer (None: it has none, or they are on `meta`)."""
    for t in [*model.parameters(), *model.buffers()]:
        return None if t.device.type == "meta" else t.device
    return None
