"""The checks of plan() and partition() that need the model or the machine, before anything is traced or moved.

A bad argument is a PartitionError naming it and the fix; the model is never touched first.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

import torch
from torch import nn

from cost_model.analytic import AnalyticCostModel, CostModel
from cost_model.cluster import DeviceSet
from cost_model.cluster_shape import Cluster, ClusterDeviceSet, ClusterError, as_cluster
from cost_model.devices import DeviceLike, resolve_devices
from partitioner.capture.fidelity import check_fidelity_arguments
from partitioner.capture.meta import is_meta, on_meta
from partitioner.errors import PartitionError
from partitioner.request import PlanRequest, RunOptions
from partitioner.show.visualizer import DrawablePlan
from runtime.launch import distributed, job_devices
from runtime.materialize import Init, Materializer
from runtime.microbatch import to_device
from runtime.plan import Plan
from runtime.weights import Weights, open_weights

__all__ = [
    "MAX_CLUSTER_GPUS", "ClusterLike", "check_model_options", "cluster_devices", "example_call", "load_plan",
    "materializer", "model_device", "plan_target", "resolve",
]

ClusterLike = Cluster | str | os.PathLike[str] | Mapping[str, Any]  # cost_model.cluster_shape.as_cluster takes these
MAX_CLUSTER_GPUS = 128  # up to this many GPUs rank r is cuda:r; above, cuda:{r % gpus_per_host} (cluster_devices)


def cluster_devices(cluster: ClusterLike) -> tuple[Cluster, list[torch.device], DeviceSet]:
    """`plan(cluster=...)`: the cluster, a device per rank (none need be here), and its prices.

    Up to 128 GPUs, rank r is cuda:r (priced by rank: cost_model.ClusterDeviceSet). Above, torch
    device names run out (an index is below 128), so rank r is its GPU on its host,
    cuda:{r % gpus_per_host}, and the prices hold one host's names (node times; the cluster
    planner prices links and all-reduces by rank: partitioner/place/cluster/plan.py).

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


def resolve(devices: Sequence[DeviceLike], *, described: bool = False) -> list[torch.device]:
    """The devices as torch devices, checked (under torchrun, every rank's entry); `described`: a described
    cluster's ranks (cluster_devices), taken as they are: they need not be here."""
    try:
        if described:
            return [torch.device(d) for d in devices]
        return job_devices(devices) if distributed() else resolve_devices(devices)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


def example_call(model: nn.Module, example_inputs: Any,
                 example_kwargs: Mapping[str, Any] | None) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The example call's (args, kwargs), where the model's weights are (tracing runs the model as it is),
    or on meta for a model on meta (planned from shapes: see partitioner.capture.meta)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    kwargs = dict(example_kwargs or {})
    if not args and not kwargs:
        raise PartitionError("example_inputs is empty: pass one batch of inputs, e.g. example_inputs=(x,)")
    home = model_device(model)
    if home is not None:
        return to_device(args, home), to_device(kwargs, home)
    if is_meta(model):
        return on_meta(args), on_meta(kwargs)
    return args, kwargs


def check_model_options(model: nn.Module, request: PlanRequest, run: RunOptions | None = None) -> None:
    """The checks of plan()'s and partition()'s options that need the model: forward's argument names,
    its module paths (capture.fidelity), and staleness, which only replicas across processes have."""
    check_fidelity_arguments(model, run.output_merge_spec if run is not None else None, request.input_split_spec,
                             request.split_points, request.split_spec)
    if run is None or not run.staleness:
        return
    if request.update != "sync":
        raise PartitionError(f"staleness={run.staleness} delays the all-reduce of weights held by several ranks, and "
                             f"update={request.update!r} runs every weight on one rank; drop one of them")
    if not request.processes:
        raise PartitionError(f"staleness={run.staleness} delays the all-reduce between ranks holding one weight, "
                             "which only torchrun jobs have (one process shares its weights); launch with torchrun, "
                             "or drop it")


def materializer(model: nn.Module, weights: Weights | None, init: Init | None) -> Materializer | None:
    """What fills a meta model's stages (and loads `weights` into a real one); None: nothing to fill."""
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


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first weight or buffer (None: it has none, or they are on `meta`)."""
    for t in [*model.parameters(), *model.buffers()]:
        return None if t.device.type == "meta" else t.device
    return None
