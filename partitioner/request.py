"""The typed request: every option of plan() and partition() held once, checked once, carried whole to every layer.

    plan(model, devices, micro_batches=8, schedule="1f1b")
      -> PlanRequest(devices=(cpu, cpu), processes=False, micro_batches=8, schedule="1f1b", ...)
    partition(model, devices, ..., threads=False, weights="model.safetensors")
      -> the same PlanRequest, and RunOptions(threads=False, weights=...)

`PlanRequest` is what to plan (where, how the step is cut and ordered, what the model's cuts and
inputs mean, how it is priced); `RunOptions` is how a plan runs once made. Both are frozen: an
"auto" choice re-planned by calibration is `request.but(schedule="1f1b")`, never an edited dict.
A bad value is a PartitionError naming it and the fix, raised when the request is built, before
anything is traced or moved. Checks that need the model (argument names, module paths, where its
weights are) are partitioner.arguments'.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Sequence, get_args

import torch

from cost_model.analytic import CostModel
from cost_model.calibration_store import CalibrationArg
from cost_model.precision import Precision
from partitioner.errors import PartitionError
from rules.kernels import KERNEL_SETS, KernelSet
from rules.schedules import either, schedule_names, searched_names
from rules.sharding import SHARDING_MODES, ShardingMode, sharding_problem
from runtime.materialize import Init
from runtime.microbatch import InputSplitSpec, OutputMergeSpec, check_merge_spec
from runtime.plan import RECOMPUTE_MODES, UPDATES, Schedule, Update
from runtime.staleness import check_staleness
from runtime.weights import Weights

try:
    from torch.distributed.pipelining import SplitPoint
except ImportError:  # torch without distributed: split_spec cannot be given
    import enum

    class SplitPoint(enum.Enum):  # type: ignore[no-redef]
        BEGINNING = 1
        END = 2

__all__ = [
    "CROSS_BATCH_CHOICES", "PLACEMENTS", "RECOMPUTE_CHOICES", "SCHEDULE_CHOICES", "SHARDING_CHOICES", "SPLIT_POINTS",
    "CrossBatchChoice", "PlacementChoice", "PlanRequest", "RecomputeChoice", "RunOptions", "ScheduleChoice",
    "ShardingChoice", "SplitPoint", "SplitPoints", "TensorChoice",
]

PlacementChoice = Literal["pipeline", "branches", "auto"]
PLACEMENTS: tuple[str, ...] = get_args(PlacementChoice)
# A schedule, or "auto" (the fastest predicted that fits; partitioner.place.planning). A Plan always
# holds the concrete schedule it runs.
ScheduleChoice = Schedule | Literal["auto"]
SCHEDULE_CHOICES: tuple[str, ...] = (*schedule_names(), "auto")  # at import; a check reads schedule_names() then
# Activation recomputation for every stage, or "auto" (per stage, the cheapest that fits).
RecomputeChoice = Literal["none", "selective", "full", "auto"]
RECOMPUTE_CHOICES: tuple[str, ...] = (*RECOMPUTE_MODES, "auto")
# "markers": pipe_split() calls and split_spec are cuts every plan makes; "cost": cut by cost alone.
SplitPoints = Literal["markers", "cost"]
SPLIT_POINTS: tuple[str, ...] = get_args(SplitPoints)
# What the hybrid search (replicas="auto") may use besides stages and replicas: "auto" lets it choose;
# a sharding mode (rules.sharding) is every stage's; a tensor degree every stage's (1: no layer split).
ShardingChoice = ShardingMode | Literal["auto"]
SHARDING_CHOICES: tuple[str, ...] = ("auto", *SHARDING_MODES)
TensorChoice = int | Literal["auto"]
# What an operation that mixes samples across the batch does with micro_batches > 1 (capture.cross_batch):
# "refuse" (the default): an error naming it; "allow": it runs on each micro-batch alone, logged.
CrossBatchChoice = Literal["refuse", "allow"]
CROSS_BATCH_CHOICES: tuple[str, ...] = get_args(CrossBatchChoice)


def _int_at_least(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise PartitionError(f"{name} must be an integer >= {low}, got {value!r}")


@dataclass(frozen=True)
class PlanRequest:
    """What to plan: the devices and process layout, how a step is cut and ordered, how it is priced.

    `devices`: one per rank (resolved torch devices; a described cluster's need not be here).
    `processes`: one process per rank (torchrun) rather than one process holding every device.
    `sharding` and `tensor`: what the hybrid search (replicas="auto") may shard replicas by and split layers
    over; "auto": it chooses (partitioner.place.search.space.SearchSpace), "none" and 1: it never does.
    `cross_batch`: whether an operation mixing samples across the batch is refused with micro_batches > 1.
    `gpus_per_host`: a described cluster's (0: the devices present). `cluster`: the devices are a
    described cluster's ranks (plan(cluster=...)): priced from shapes, never run here. `precision`: the
    dtypes training keeps each state in (cost_model.precision.Precision.of reads names and optimizers);
    None: every state at the model's dtype. `kernels`: the kernel set the searches price (rules/kernels.py):
    "eager" (this runtime's) or "fused" (the engines a plan is exported to).
    The other fields mean what partition()'s keywords of the same names mean.
    """

    devices: tuple[torch.device, ...]
    processes: bool = False
    micro_batches: int = 1
    schedule: ScheduleChoice = "gpipe"
    placement: PlacementChoice = "pipeline"
    replicas: tuple[int, ...] | Literal["auto"] | None = None
    virtual_stages: int = 2
    recompute: RecomputeChoice | tuple[RecomputeChoice, ...] = "none"
    update: Update = "sync"
    input_split_spec: InputSplitSpec | None = None
    split_points: SplitPoints = "markers"
    split_spec: Mapping[str, SplitPoint] | None = None
    cost_model: CostModel | None = None
    calibration: CalibrationArg = None
    gpus_per_host: int = 0
    cluster: bool = False
    precision: Precision | None = None
    sharding: ShardingChoice = "auto"
    tensor: TensorChoice = "auto"
    cross_batch: CrossBatchChoice = "refuse"
    kernels: KernelSet = "eager"

    def __post_init__(self) -> None:
        if not self.devices:
            raise PartitionError("devices is empty: pass one device per stage, e.g. ['cuda:0', 'cuda:1']")
        _int_at_least("micro_batches", self.micro_batches, 1)
        _int_at_least("virtual_stages", self.virtual_stages, 1)
        if self.placement not in PLACEMENTS:
            raise PartitionError(f"placement={self.placement!r}; use one of {', '.join(map(repr, PLACEMENTS))}")
        if self.schedule not in (*schedule_names(), "auto"):  # registered ones too (rules.schedules.register)
            raise PartitionError(f"schedule={self.schedule!r}; use one of "
                                 f"{', '.join(map(repr, (*schedule_names(), 'auto')))}")
        self._check_replicas()
        modes = [self.recompute] if isinstance(self.recompute, str) else list(self.recompute)
        if not modes or any(not isinstance(m, str) or m not in RECOMPUTE_CHOICES for m in modes):
            raise PartitionError(f"recompute={self.recompute!r}; use one of {', '.join(map(repr, RECOMPUTE_CHOICES))}"
                                 ", or a list of those with one per stage")
        if self.kernels not in KERNEL_SETS:
            raise PartitionError(f"kernels={self.kernels!r}; use 'eager' (this runtime's kernels) or 'fused' (flash "
                                 "attention, fused SwiGLU and norms: the engines a plan is exported to)")
        if self.update not in UPDATES:
            raise PartitionError(f"update={self.update!r}; use one of {', '.join(map(repr, UPDATES))}")
        if self.update != "sync" and self.schedule != "1f1b":
            raise PartitionError(f"update={self.update!r} streams 1F1B with no flush between steps; use "
                                 "schedule='1f1b'")
        if self.split_points not in SPLIT_POINTS:
            raise PartitionError(f"split_points={self.split_points!r}; use one of {', '.join(map(repr, SPLIT_POINTS))}")
        if self.cross_batch not in CROSS_BATCH_CHOICES:
            raise PartitionError(f"cross_batch={self.cross_batch!r}; use 'refuse' (operations mixing samples across "
                                 "the batch are an error with micro_batches > 1) or 'allow' (they run per micro-batch)")
        if self.placement != "pipeline" and (self.replicas is not None or self.schedule not in ("gpipe", "auto")):
            raise PartitionError(f"placement={self.placement!r} runs the GPipe schedule without replicas")
        if self.replicas == "auto" and self.schedule not in (*searched_names(), "auto"):
            raise PartitionError(f"replicas='auto' plans a pipeline of replicated stages for schedule "
                                 f"{either(searched_names())}, not {self.schedule!r}; pick one of those, or give "
                                 "replicas yourself")
        if self.precision is not None and not isinstance(self.precision, Precision):
            raise PartitionError(f"precision={self.precision!r}; pass Precision.of(...) of a name ('mixed', 'bf16', "
                                 "'fp32'), a dtype form 'COMPUTE/PARAM/GRAD/STATE[:OPTIMIZER]' or an optimizer")
        if self.replicas is not None and not self.processes:
            raise PartitionError("replicas need one process per stage replica: launch with torchrun (or initialize "
                                 "torch.distributed)")
        self._check_split()

    def _check_replicas(self) -> None:
        replicas: Any = self.replicas  # as the user passed it
        if isinstance(replicas, str) and replicas != "auto":
            raise PartitionError(f"replicas={replicas!r}; use 'auto' or a list of counts such as [2, 1]")

    def _check_split(self) -> None:
        """sharding and tensor: known values, and ones the hybrid search can honour ("auto", "none" and 1 always)."""
        if not isinstance(self.sharding, str) or self.sharding not in SHARDING_CHOICES:
            raise PartitionError(f"sharding={self.sharding!r}; use one of {', '.join(map(repr, SHARDING_CHOICES))}")
        tensor: Any = self.tensor  # as the user passed it
        if tensor != "auto" and (isinstance(tensor, bool) or not isinstance(tensor, int) or tensor < 1):
            raise PartitionError(f"tensor={tensor!r}; use 'auto' (the search chooses) or a degree such as 8 (1: no "
                                 "layer is split)")
        if self.sharding not in ("auto", "none"):
            if self.replicas != "auto":
                raise PartitionError(f"sharding={self.sharding!r} shards stage replicas the hybrid planner makes; "
                                     "use replicas='auto' (or sharding='none')")
            problem = sharding_problem(self.sharding, precision=self.precision is not None)
            if problem is not None:
                raise PartitionError(problem)
        if isinstance(self.tensor, int) and self.tensor > 1:
            if self.replicas != "auto":
                raise PartitionError(f"tensor={self.tensor} splits layers in the stages the hybrid planner makes; "
                                     "use replicas='auto' (or tensor=1)")
            if self.world % self.tensor:
                raise PartitionError(f"tensor={self.tensor} does not divide the {self.world} devices into tensor "
                                     f"groups; use a degree that divides {self.world}, or tensor='auto'")

    @classmethod
    def of(cls, devices: Sequence[torch.device], **options: Any) -> PlanRequest:
        """A request from plan()'s keywords as users pass them (lists where the request holds tuples)."""
        replicas = options.get("replicas")
        if isinstance(replicas, (list, tuple)):
            options["replicas"] = tuple(replicas)
        recompute = options.get("recompute")
        if isinstance(recompute, list):
            options["recompute"] = tuple(recompute)
        if isinstance(options.get("calibration"), os.PathLike):
            options["calibration"] = os.fspath(options["calibration"])
        return cls(devices=tuple(devices), **options)

    def but(self, **changes: Any) -> PlanRequest:
        """This request with some options changed (checked again)."""
        return dataclasses.replace(self, **changes)

    @property
    def world(self) -> int:
        """How many ranks (devices) the plan spreads over."""
        return len(self.devices)


@dataclass(frozen=True)
class RunOptions:
    """How a plan runs once made: threads, timeouts, output merging, where weights come from, staleness.

    The fields mean what partition()'s keywords of the same names mean; `calibrate` is the number of
    calibration steps to run once built, None (the default) to refit from the first training steps,
    0 for neither.
    """

    threads: bool | None = None
    timeout: float = 300.0
    output_merge_spec: OutputMergeSpec | None = None
    weights: Weights | None = None
    init: Init | None = None
    staleness: int = 0
    calibrate: int | None = None

    def __post_init__(self) -> None:
        try:
            check_merge_spec(self.output_merge_spec)
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        if self.output_merge_spec is not None and not isinstance(self.output_merge_spec, (str, tuple, Mapping)):
            raise PartitionError(f"output_merge_spec={self.output_merge_spec!r}; use a rule or {{output path: rule}}")
        if isinstance(self.timeout, bool) or not isinstance(self.timeout, (int, float)) or self.timeout <= 0:
            raise PartitionError(f"timeout={self.timeout!r}; give the seconds to wait for another rank (> 0)")
        if self.init is not None and not callable(self.init) and self.init != "reset_parameters":
            raise PartitionError(f"init={self.init!r}; pass a callable init(module) or 'reset_parameters'")
        try:
            check_staleness(self.staleness)
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        if self.calibrate is not None and (isinstance(self.calibrate, bool) or not isinstance(self.calibrate, int)
                                           or self.calibrate < 0):
            raise PartitionError(f"calibrate={self.calibrate!r}; give the number of calibration steps to run now, "
                                 "None to refit from the first training steps (the default), or 0 for neither")
