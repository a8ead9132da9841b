"""partition(model, devices): trace, cost, split and return a pipelined model in one call."""

from __future__ import annotations

import os
from typing import Any, Iterator, Literal, Mapping, Sequence

from torch import nn

from cost_model.analytic import CostModel
from cost_model.calibration_store import CalibrationArg
from cost_model.devices import DeviceLike
from cost_model.precision import Precision
from cost_model.progress import library_call
from partitioner.arguments import (
    ClusterLike,
    check_model_options,
    example_call,
    load_plan,
    materializer,
    plan_target,
    resolve,
)
from partitioner.calibrate.decide import Setup, attach
from partitioner.capture.describe import describe_model
from partitioner.capture.fidelity import InputSplitSpec, OutputMergeSpec
from partitioner.errors import PartitionError
from partitioner.make.pipeline import build_pipeline, traced_call
from partitioner.make.plan import plan_counts, plan_example, plan_on_rank0, planning_cost, with_update
from partitioner.place.planning import stage_ranks_for
from partitioner.request import (
    CrossBatchChoice,
    PlacementChoice,
    PlanRequest,
    RecomputeChoice,
    RunOptions,
    ScheduleChoice,
    ShardingChoice,
    SplitPoint,
    SplitPoints,
    TensorChoice,
)
from partitioner.show.visualizer import DrawablePlan
from rules.kernels import KernelSet
from runtime.distributed import DistributedPipeline
from runtime.launch import distributed
from runtime.materialize import Init
from runtime.pipeline import Pipeline
from runtime.plan import Plan, Update
from runtime.weights import Weights

__all__ = ["describe_model", "partition", "plan", "plans"]


def plan(
    model: nn.Module,
    devices: Sequence[DeviceLike] | None = None,
    *,
    cluster: ClusterLike | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: ScheduleChoice = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    processes: bool | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
    recompute: RecomputeChoice | Sequence[RecomputeChoice] = "none",
    update: Update = "sync",
    calibration: CalibrationArg = None,
    precision: Any = None,
    sharding: ShardingChoice = "auto",
    tensor: TensorChoice = "auto",
    cross_batch: CrossBatchChoice = "refuse",
    kernels: KernelSet = "eager",
) -> DrawablePlan:
    """Plan `model` onto `devices` and return the Plan; nothing is moved and nothing is built.

    The arguments mean what they mean for `partition`. `processes` says whether the plan is
    for one process per rank (torchrun; the default when running under it) or for one
    process holding every device; the plan then prices transfers between processes.
    `cluster` (instead of `devices`): a cluster described, not here: a shape such as "2x8xH100",
    a JSON/YAML file or a cost_model.Cluster (any size); every GPU is a torchrun rank
    (rank r on host r // GPUs per host: `plan.gpus_per_host`, its GPU the local cuda:{r % that}), priced by the analytic
    model at the dtypes of the model and inputs. Run it with `partition(model, devices, plan=...)`.
    `calibration`, `precision`, `sharding`, `tensor` and `cross_batch`: as for `partition`. `kernels`: the kernel
    set the plan is priced for: "eager" (this project's runtime) or "fused" (for a plan exported to an engine
    that runs flash attention, fused SwiGLU and norms: fewer activations kept, fewer memory passes).

    Raises:
        PartitionError: bad arguments, a model that cannot be traced, or a plan that cannot fit.
    """
    ((_, made),) = _plans(
        model, devices, [micro_batches], cluster=cluster, example_inputs=example_inputs,
        example_kwargs=example_kwargs, schedule=schedule, placement=placement, replicas=replicas,
        virtual_stages=virtual_stages, cost_model=cost_model, processes=processes, input_split_spec=input_split_spec,
        split_points=split_points, split_spec=split_spec, recompute=recompute, update=update, calibration=calibration,
        precision=precision, sharding=sharding, tensor=tensor, cross_batch=cross_batch, kernels=kernels)
    if isinstance(made, PartitionError):
        raise made
    return made


def plans(model: nn.Module, devices: Sequence[DeviceLike] | None = None, *, micro_batches: Sequence[int],
          **options: Any) -> Iterator[tuple[int, DrawablePlan | PartitionError]]:
    """`plan` for each micro-batch count of `micro_batches`, the model traced once: (count, its plan, or the
    PartitionError that count met), in order, each as it is made. `options`: plan's other keywords.

    Raises:
        PartitionError: bad arguments (at the call), or a model that cannot be traced (at the first plan).
    """
    if not micro_batches:
        raise PartitionError("micro_batches=[]: give the micro-batch counts to plan, e.g. [16, 32]")
    return _plans(model, devices, list(micro_batches), **options)


def _plans(
    model: nn.Module,
    devices: Sequence[DeviceLike] | None,
    counts: list[int],
    *,
    cluster: ClusterLike | None = None,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    schedule: ScheduleChoice = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    processes: bool | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
    recompute: RecomputeChoice | Sequence[RecomputeChoice] = "none",
    update: Update = "sync",
    calibration: CalibrationArg = None,
    precision: Any = None,
    sharding: ShardingChoice = "auto",
    tensor: TensorChoice = "auto",
    cross_batch: CrossBatchChoice = "refuse",
    kernels: KernelSet = "eager",
) -> Iterator[tuple[int, DrawablePlan | PartitionError]]:
    """plan()'s request checked now; its plans for `counts` made as they are asked for (make.plan.plan_counts)."""
    devices, processes, cost_model, per_host = plan_target(devices, cluster, processes, cost_model)
    request = PlanRequest.of(
        resolve(devices, described=cluster is not None), processes=distributed() if processes is None else processes,
        micro_batches=counts[0], schedule=schedule, placement=placement, replicas=replicas,
        virtual_stages=virtual_stages, recompute=recompute, update=update, input_split_spec=input_split_spec,
        split_points=split_points, split_spec=split_spec, cost_model=cost_model, calibration=calibration,
        gpus_per_host=per_host, cluster=cluster is not None, precision=_precision(precision), sharding=sharding,
        tensor=tensor, cross_batch=cross_batch, kernels=kernels)
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    check_model_options(model, request)
    return _drawable(plan_counts(model, args, kwargs, request, counts))


def _drawable(made: Iterator[tuple[int, Plan | PartitionError]]) -> Iterator[tuple[int, DrawablePlan | PartitionError]]:
    """Each plan drawable, made inside a library call (cost_model.progress: its long phases said by default)."""
    with library_call():
        for m, each in made:
            yield m, each if isinstance(each, PartitionError) else DrawablePlan.from_plan(each)


@library_call()
def partition(
    model: nn.Module,
    devices: Sequence[DeviceLike],
    *,
    example_inputs: Any = (),
    example_kwargs: Mapping[str, Any] | None = None,
    micro_batches: int = 1,
    schedule: ScheduleChoice = "gpipe",
    placement: PlacementChoice = "pipeline",
    replicas: Sequence[int] | Literal["auto"] | None = None,
    virtual_stages: int = 2,
    cost_model: CostModel | None = None,
    plan: Plan | str | os.PathLike[str] | None = None,
    threads: bool | None = None,
    timeout: float = 300.0,
    output_merge_spec: OutputMergeSpec | None = None,
    input_split_spec: InputSplitSpec | None = None,
    split_points: SplitPoints = "markers",
    split_spec: Mapping[str, SplitPoint] | None = None,
    recompute: RecomputeChoice | Sequence[RecomputeChoice] = "none",
    weights: Weights | None = None,
    init: Init | None = None,
    update: Update = "sync",
    staleness: int = 0,
    calibrate: int | None = None,
    calibration: CalibrationArg = None,
    precision: Any = None,
    sharding: ShardingChoice = "auto",
    tensor: TensorChoice = "auto",
    cross_batch: CrossBatchChoice = "refuse",
) -> Pipeline | DistributedPipeline:
    """Split `model` into pipeline stages on `devices` and return it ready to run.

    Args:
        model: the module to partition; its parameters are moved to the stages' devices in
            place and stay its own (an optimizer over `model.parameters()` keeps working).
        devices: one device per stage (one per rank under torchrun); a device may repeat.
        example_inputs: a full batch of positional inputs (a tuple, or one tensor). Dim 0
            of the first tensor is the batch that is split into micro-batches.
        example_kwargs: keyword inputs of the same example call.
        micro_batches: how many micro-batches each call is split into.
        schedule: "gpipe", "1f1b", "interleaved" (interleaved 1F1B, `virtual_stages` stages
            per device), "zb1" (zero-bubble ZB-H1: 1F1B with weight gradients deferred into the
            bubble), "zbv" (zero-bubble ZB-V: 2 stages per device in a V) or "dualpipev"
            (DeepSeek's DualPipeV on zbv's V; micro_batches >= 2 x devices). Every schedule runs
            in one process (`pipe.train_step`) and under torchrun. "auto": each schedule this
            layout can run is simulated and the fastest that fits memory is kept; the plan holds
            it (`plan.schedule`) and every candidate's predicted ms (`plan.alternatives`).
        placement: "pipeline" (contiguous stages, one per device), "branches" (parallel
            branches of fork/join regions side by side on the devices, the rest on the first)
            or "auto" (whichever the simulator predicts faster).
        replicas: torchrun only: processes per stage, e.g. [2, 1] puts stage 0 on ranks 0 and
            1 (taking micro-batches in turn) and stage 1 on rank 2. Default: one each. "auto":
            the hybrid planner chooses the stages and each stage's replicas.
        cost_model: what predicts node and transfer times; by default profiled on the devices
            present (cached on disk, see cost_model.profiler), analytic for absent ones.
        plan: a Plan to run as it is (from `partitioner.plan`, or `Plan.from_json`), or the path of one
            saved with `plan.to_json()` (`python -m partitioner plan --save`), skipping planning.
        threads: one process only: run each worker on a thread; default when there are several devices.
        timeout: torchrun only: seconds to wait for another rank before failing with an error naming it.
        output_merge_spec: how outputs without a batch dimension merge across micro-batches: one
            rule ("sum", "mean" (weighted by micro-batch size), "first", "cat", ("cat", dim)) for
            all of them, or {output path: rule} ("[1]", "['aux']"). Without a rule such an output
            is returned once if every micro-batch gave the same value, else PartitionError.
        input_split_spec: {forward argument name: dim to split along, or None to give the
            tensor whole to every micro-batch}; default: tensors whose dim 0 is the batch split.
        split_points: "markers" (default): pipe_split() calls and `split_spec` are cuts every
            plan makes; "cost": ignore them and cut by cost alone.
        split_spec: PiPPy's {module path: SplitPoint.BEGINNING or SplitPoint.END}: cut before
            the module's first node or after its last one.
        recompute: activation recomputation, for every stage or one per stage: "none", "selective"
            (keep matmul and convolution outputs, recompute element-wise ops, norms, softmax and
            dropout in backward), "full" (keep only each stage's inputs, run its forward again in
            backward) or "auto" (per stage, the cheapest that fits the device's memory). Results
            equal the run without it, dropout included. A given `plan` carries its own
            (`plan.stages[s].recompute`).
        weights: where the weights come from, read by state-dict key one tensor at a time and
            only for the stages this process holds: a .safetensors file, a folder of them (with
            or without model.safetensors.index.json), a DCP checkpoint folder, a torch.save file,
            or a Mapping[str, Tensor]. Required (or `init`) for a model on `meta`, which is then
            traced and planned from shapes (the analytic cost model unless `cost_model` is
            given) and materialized stage by stage on its devices; a model with real weights
            loads them too (strictly: every key it holds). See runtime.materialize for the rules.
        init: for a model on `meta`: a callable `init(module)` run on each module whose tensors
            a stage materializes (under a per-module seed, so the split and the rank do not change
            the values), or "reset_parameters" (each module's own); with `weights`, init runs
            first and the checkpoint overwrites what it holds.
        staleness: torchrun only: bounded-staleness data parallelism for weights held by several
            ranks (stage replicas, tied weights): each rank all-reduces its step-t gradients in the
            background and the update of step t uses the sums of step t - staleness (in the first
            `staleness` steps those weights get no gradient, so the optimizer leaves them). 0 (the
            default) is the synchronous all-reduce. Call `pipe.wait_gradients()` on every rank
            before destroy_process_group. See [Note: bounded staleness] in runtime.staleness.
        calibrate: None (the default): calibrated by default: the first 10 `train_step` calls are timed
            (the last 3 traced; nothing else changes), then the machine's calibration is refitted and saved,
            `pipe.plan.predicted_step_ms` and the plan's alternatives are updated and "auto" choices are
            predicted again (partitioner.calibrate.passive). N >= 1: run `pipe.calibrate(steps=N)` now instead
            (it measures N extra steps and may switch plans; partitioner.calibrate.decide). 0: neither. The
            report is `pipe.calibration_report`.
        calibration: a calibration (or its JSON path) to price with, where `pipe.calibrate` saves; default:
            the one saved on this machine for these devices (not applied over a given `cost_model`).
        precision: the dtypes training keeps each state in, for the memory each stage is priced to hold:
            "mixed" (torch.amp: bf16 compute, fp32 weights, gradients and Adam moments), "bf16" (every
            state bf16), "fp32", "COMPUTE/PARAM/GRAD/STATE[:OPTIMIZER]", a cost_model.precision.Precision,
            or the torch optimizer you train with (mixed precision with its states). Default None: every
            state at the model's dtype. On a cluster it also lets the planner shard replicas (ZeRO 1/2/3).
        sharding: with replicas="auto" on a cluster, how stage replicas shard their states: "auto" (the
            default: the planner chooses per stage, with a `precision`), "none" (never: e.g. as Megatron-LM's
            SC'21 runs), or "zero1", "zero2", "zero3" (FSDP2) for every stage.
        tensor: with replicas="auto", the tensor-parallel degree of every stage: "auto" (the default: the
            planner chooses), 1 (no layer is split) or a degree such as 8 (on a cluster).
        cross_batch: with micro_batches > 1, what to do with an operation of forward that mixes samples across
            the batch (`h - h.mean(0)`, `softmax(h, 0)`, `h[0]`, `h.T @ h`), which a micro-batch would compute
            over its own samples only: "refuse" (the default: a PartitionError naming it and its line) or
            "allow" (run it per micro-batch, logged). BatchNorm modules and outputs without a batch dim (a
            scalar loss, merged by `output_merge_spec`) are the runtime's, never refused.

    `pipe(x)` returns what `model(x)` returns and `loss.backward()` reaches the model's own
    parameters (one process); `pipe.train_step(x, y, loss_fn)` runs a whole step of the
    plan's schedule (one process and torchrun, where it is called on every rank).

    Raises:
        TypeError: `model` is not an nn.Module.
        PartitionError: bad devices, micro_batches or inputs, or a model that cannot be traced;
            the model is then left exactly as it was.
    """
    given = _given_plan(plan, recompute)
    if given is not None:  # the plan's schedule and micro-batches, unless others are asked for
        schedule, virtual_stages = given.schedule, max(given.virtual_stages, 2)
        if micro_batches == 1 and given.pieces != 1:  # a step's micro-batches, over every replica (Plan.pieces)
            micro_batches = given.pieces
        staleness = staleness or given.staleness
    request = PlanRequest.of(
        resolve(devices), processes=distributed(), micro_batches=micro_batches, schedule=schedule,
        placement=placement, replicas=replicas, virtual_stages=virtual_stages, recompute=recompute, update=update,
        input_split_spec=input_split_spec, split_points=split_points, split_spec=split_spec, cost_model=cost_model,
        calibration=calibration, precision=_precision(precision), sharding=sharding, tensor=tensor,
        cross_batch=cross_batch)
    if given is not None and (sharding, tensor) != ("auto", "auto"):
        raise PartitionError(f"sharding={sharding!r}, tensor={tensor!r} with a given plan: the plan carries each "
                             "stage's sharding and tensor degree; plan again with them, or leave both 'auto'")
    run = RunOptions(threads=threads, timeout=timeout, output_merge_spec=output_merge_spec, weights=weights,
                     init=init, staleness=staleness, calibrate=calibrate)
    args, kwargs = example_call(model, example_inputs, example_kwargs)
    check_model_options(model, request, run)
    fill = materializer(model, weights, init)
    if given is None:
        stage_ranks_for(request)  # a layout the schedule cannot run fails here, before the model is traced
    setup = Setup(model, list(devices), args, kwargs, request, run)
    cost = setup.planned_with = planning_cost(model, request)
    request, example = traced_call(model, args, kwargs, request, devices, run.timeout)
    if given is None:
        made = plan_on_rank0(model, example, request, cost) if request.processes else \
            plan_example(model, example, request, cost)
        given_or_made = DrawablePlan.from_plan(made)
    else:
        given_or_made = given
    pipe = build_pipeline(model, example, given_or_made, request, run, fill)
    if isinstance(pipe, DistributedPipeline):
        pipe.staleness = run.staleness  # recorded in pipe.plan.staleness
    with_update(pipe.plan, request, priced=given is None)
    return attach(pipe, setup)


def _given_plan(plan: Plan | str | os.PathLike[str] | None, recompute: Any) -> DrawablePlan | None:
    """partition(plan=...): the plan (read from its file), checked; None when none is given."""
    if plan is None:
        return None
    given = DrawablePlan.from_plan(load_plan(plan))
    try:
        given.check()
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if not (isinstance(recompute, str) and recompute == "none"):
        raise PartitionError(f"recompute={recompute!r} with a given plan: the plan carries each stage's "
                             "recomputation; set plan.stages[s].recompute, or plan again with recompute=...")
    return given


def _precision(value: Any) -> Precision | None:
    """plan(precision=...) as a Precision (cost_model.precision.Precision.of), a bad value a PartitionError."""
    try:
        return Precision.of(value)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
