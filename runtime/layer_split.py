"""A rank's share of a plan that splits layers: its tensor, data, expert and context groups, its stages split.

Every rank creates every group in one order (`dist.new_group` is collective), then keeps its own
([Note: ranks of a split stage] in runtime/plan_axes.py: replica j on ranks[j] + c t + k, tensor innermost):

    tensor groups   ranks[j] + c t .. ranks[j] + c t + t - 1 of every replica j and context index c, sorted
    data groups     per sharded stage and tensor index k: ranks[j] + c t + k of every replica j and c (FSDP2's
                    mesh: the context ranks too, as torchtitan's dp_shard x cp)
    expert groups   per stage splitting experts e ways and index i in the replica: ranks[j] + i of e consecutive
                    replicas j (all-to-all), and of the replicas holding the same experts (their gradients)
    context groups  per stage splitting its sequence and replica j, tensor index k: ranks[j] + c t + k of every c

A stage both split and sharded gets one 2-D (data, tensor) mesh of its two groups, and its tensor and
data meshes are that mesh's dimensions: FSDP2 shards DTensor weights only over a mesh that shares a
root with theirs (as torchtitan's FSDP + TP), gathering its shards back into the tensor split.

`split_groups` makes them (under runtime.nccl_rules.collective_checks, so CI checks NCCL's rule 5 on
them); runtime.stage.build_stages splits a stage's layers on its tensor mesh (runtime.tensor_parallel)
before recomputation wraps it, and `shard_stages` hands sharded stages to FSDP2 (runtime.sharding),
wrapped so each backward first tells FSDP2 whether it is the step's last for that stage:

    program:  F s0 mb0  F s0 mb2  B s0 mb0  B s0 mb2          (this rank's micro-batches of a sliced plan)
    FSDP2:    gather    gather    last=False last=True -> reduce-scatter once (gradient_sync "last")

Gradients are summed over replicas (the runtime weighs each micro-batch's loss by its share of the whole
batch), so FSDP2 reduces with SUM (divide factor 1), as the runtime's own all-reduce does.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from runtime.axis_groups import AxisGroups, axis_groups, data_ranks, tensor_ranks
from runtime.axis_reduce import AxisReductions, Reduction
from runtime.context_graph import ContextGraph
from runtime.context_parallel import parallelize_sequence, split_boundaries
from runtime.expert_parallel import ExpertDispatch, parallelize_experts
from runtime.nccl_rules import collective_checks
from runtime.plan import Plan, StagePlan
from runtime.sharding import ShardedStage, ShardingConfig, shard_stage
from runtime.stage import Rewrite, Stage

__all__ = ["RankSplit", "ShardedRun", "axis_reductions", "axis_rewrite", "expert_params", "shard_stages",
           "sharding_config", "split_groups", "splits_layers", "tensor_index"]


def splits_layers(plan: Plan) -> bool:
    """Whether any stage splits layers, experts or its sequence, or shards its weights over replicas."""
    return any(s.tensor > 1 or s.sharding != "none" or s.expert > 1 or s.context > 1 for s in plan.stages)


def tensor_index(plan: Plan, rank: int) -> int:
    """`rank`'s index in its tensor group (0 where its stages split nothing)."""
    for s in plan.stages:
        for group in s.rank_groups:
            if rank in group:
                return group.index(rank) % s.tensor
    return 0


@dataclass
class RankSplit:
    """This rank's groups: its tensor mesh (None: its stages split nothing), each sharded stage's data mesh, and
    its expert and context groups (runtime.axis_groups)."""

    tensor_index: int = 0
    tensor_mesh: DeviceMesh | None = None
    data_meshes: dict[int, DeviceMesh] = field(default_factory=dict)
    axes: AxisGroups = field(default_factory=AxisGroups)


def split_groups(plan: Plan, device_type: str, timeout_s: float, *, checked: bool = False) -> RankSplit:
    """Create every tensor and data-parallel group of `plan` on every rank, in one order; return this rank's.

    Call on every rank at the same point. `checked`: the groups check that their ranks post the same
    collectives in the same order (runtime.nccl_rules.collective_checks).
    """
    rank = dist.get_rank()
    tensor_groups = sorted({g for s in plan.stages if s.tensor > 1 for g in tensor_ranks(s)})
    data_groups = sorted({data_ranks(s, k) for s in plan.stages if s.sharding != "none" for k in range(s.tensor)})
    timeout = datetime.timedelta(seconds=timeout_s)
    split = RankSplit(tensor_index(plan, rank))
    handles: dict[tuple[int, ...], Any] = {}
    with collective_checks(checked):
        for ranks in [*tensor_groups, *data_groups]:
            handles[ranks] = dist.new_group(list(ranks), timeout=timeout)
        split.axes = axis_groups(plan, rank, device_type, timeout, checked)  # experts, sequence: after, in one order
    meshes: dict[tuple[tuple[int, ...] | None, ...], DeviceMesh] = {}  # stages on one rank share its meshes
    for s in plan.stages:
        if rank not in s.all_ranks:
            continue
        tensor = next(g for g in tensor_ranks(s) if rank in g) if s.tensor > 1 else None
        data = data_ranks(s, split.tensor_index) if s.sharding != "none" else None
        if tensor is not None and data is not None:  # FSDP2 over DTensors: one (data, tensor) mesh
            if (data, tensor) not in meshes:
                meshes[data, tensor] = DeviceMesh.from_group(
                    [handles[data], handles[tensor]], device_type,
                    mesh=torch.tensor([list(g) for g in tensor_ranks(s)]), mesh_dim_names=("data", "tensor"))
            split.tensor_mesh, split.data_meshes[s.index] = meshes[data, tensor]["tensor"], meshes[data, tensor]["data"]
        elif tensor is not None and split.tensor_mesh is None:
            split.tensor_mesh = DeviceMesh.from_group(handles[tensor], device_type)
        elif data is not None:
            if (data,) not in meshes:
                meshes[data,] = DeviceMesh.from_group(handles[data], device_type)
            split.data_meshes[s.index] = meshes[data,]
    return split


def sharding_config(plan: Plan, stage: StagePlan) -> ShardingConfig:
    """FSDP2's settings for `stage`: its mode, gradient sync and the plan's precision as FSDP2's mixed-precision policy
    (compute dtype: the gathered weights; grad dtype: the reduction), None where it is the weights' own."""
    precision = plan.precision or {}

    def dtype(key: str) -> torch.dtype | None:
        name = precision.get(key)
        return getattr(torch, name) if name else None

    compute, param, grad = dtype("compute"), dtype("param"), dtype("grad")
    return ShardingConfig(stage.sharding, compute if compute != param else None,
                          grad if grad not in (None, compute if compute is not None else param) else None,
                          gradient_sync=stage.gradient_sync)


class ShardedRun(nn.Module):
    """A sharded stage run by the interpreter: before each backward, FSDP2 is told whether it is the step's last.

    `expect(n)`: the step runs n backwards of this stage on this rank (its micro-batches); the n-th is the last.
    A stage with one graph per train/eval mode has one run per graph (`other_mode`), sharing the stage and the
    count, each selecting its graph before it calls the stage ([Note: sharding both modes of a stage]).
    """

    def __init__(self, stage: ShardedStage, graph: int = 0, counts: list[int] | None = None) -> None:
        super().__init__()
        self.stage = stage
        self.mode_graph = graph  # 0: the traced mode's graph, 1: the other mode's
        self._counts = counts if counts is not None else [0, 0]  # backwards expected this step, seen so far

    def expect(self, backwards: int) -> None:
        self._counts[:] = [backwards, 0]

    def other_mode(self) -> ShardedRun:
        """The run of the stage's other graph: same FSDP2 units, same backward count."""
        return ShardedRun(self.stage, 1 - self.mode_graph, self._counts)

    def forward(self, *args: Any) -> Any:
        if self.stage.modes is not None:
            self.stage.modes.graph = self.mode_graph
        out = self.stage(*args)
        tensors = [t for t in _leaves(out) if t.requires_grad]
        if tensors and torch.is_grad_enabled():
            torch.autograd.graph.register_multi_grad_hook(tensors, self._before_backward, mode="any")
        return out

    def _before_backward(self, _: Any) -> None:
        self._counts[1] += 1
        self.stage.before_backward(last=self._counts[1] >= self._counts[0])


def _leaves(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    return []


def shard_stages(stages: Sequence[Stage], plan: Plan, split: RankSplit, model: nn.Module,
                 readers: Mapping[int, tuple[torch.Tensor, list[int]]],
                 owners: Sequence[nn.Module] = (), others: Sequence[Stage] = ()) -> list[ShardedRun]:
    """Hand this rank's sharded stages to FSDP2 (in stage order: one order of collectives), in place.

    A weight another stage also reads (a tied embedding) stays whole: the runtime all-reduces it over both
    stages' ranks. `owners`: modules besides `model` that hold the stages' weights (the traced graph), pointed
    at the shards. Every rank of a stage's data mesh calls this with the same stages. A stage that also
    recomputes is sharded one unit per checkpointed segment ([Note: sharding a recomputed stage]). `others`: the
    same stages built from the model's other train/eval graph, sharded with them as one ([Note: sharding both
    modes of a stage]) and run through the same units.
    """
    other_of = {s.index: s for s in others}
    runs: list[ShardedRun] = []
    for stage in sorted(stages, key=lambda s: s.index):
        spec = plan.stages[stage.index]
        if spec.sharding == "none" or not any(True for _ in stage.module.parameters()):
            continue  # a stage without weights has nothing to shard: its replicas run their slices as they are
        tied = _tied(stage.index, readers)
        other = other_of.get(stage.index)  # split experts stay whole to FSDP2 (runtime.axis_reduce sums them)
        sharded = shard_stage(stage.module, split.data_meshes[stage.index], sharding_config(plan, spec), model=model,
                              unsharded=[*tied, *expert_params(stage.module)], owners=owners,
                              other=other.module if other is not None else None)
        for module in sharded.root.modules():
            if isinstance(module, FSDPModule):  # a sum over replicas, as the runtime's own all-reduce
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        run = ShardedRun(sharded)
        stage.module = run  # type: ignore[assignment]
        if other is not None:
            other.module = run.other_mode()  # type: ignore[assignment]
        runs.append(run)
    return runs


def _tied(index: int, readers: Mapping[int, tuple[torch.Tensor, list[int]]]) -> list[torch.Tensor]:
    """Weights stage `index` reads that another stage reads too."""
    return [t for t, readers_of in readers.values() if index in readers_of and len(readers_of) > 1]


def expert_params(module: nn.Module) -> list[nn.Parameter]:
    """The split experts' weights of a stage module (each ExpertDispatch's own), in module order."""
    return [p for m in module.modules() if isinstance(m, ExpertDispatch) for p in m.parameters(recurse=False)]


def axis_rewrite(plan: Plan, split: RankSplit, gm: torch.fx.GraphModule, model: nn.Module) -> Rewrite:
    """runtime.stage's `rewrite` for this rank: split a stage's experts (runtime.expert_parallel), then its sequence
    (runtime.context_parallel, read off the whole graph `gm` once), on the groups `split` holds."""
    found: list[tuple[ContextGraph, frozenset[str]]] = []

    def rewrite(module: torch.fx.GraphModule, index: int, device: torch.device) -> dict[int, nn.Parameter]:
        spec, swaps = plan.stages[index], {}
        if spec.expert > 1:
            swaps = parallelize_experts(module, spec.expert_layers, split.axes.experts[index], model.get_submodule,
                                        split.axes.checked)
        if spec.context > 1:
            if not found:
                found.append((ContextGraph.of(gm), split_boundaries(gm, plan.stages)))
            graph, boundaries = found[0]
            parallelize_sequence(module, graph, split.axes.context[index], spec.context_attention, device,
                                 boundaries)
        return swaps

    return rewrite


def axis_reductions(stages: Sequence[Stage], plan: Plan, split: RankSplit,
                    readers: Mapping[int, tuple[torch.Tensor, list[int]]]) -> AxisReductions:
    """What runtime.axis_reduce sums for this rank's stages (built and sharded), in stage order."""
    out = AxisReductions()
    for stage in sorted(stages, key=lambda s: s.index):
        spec, experts = plan.stages[stage.index], expert_params(stage.module)
        out.experts |= {id(p) for p in experts}
        if experts and stage.index in split.axes.expert_data:
            out.reductions.append(Reduction(f"stage {stage.index} experts", split.axes.expert_data[stage.index],
                                            experts))
        if spec.context > 1:
            whole = list(dict.fromkeys(stage.module.parameters())) if spec.sharding == "none" else [
                *_tied(stage.index, readers), *experts]
            params = [p for p in whole if isinstance(p, nn.Parameter) and p.requires_grad]
            out.reductions.append(Reduction(f"stage {stage.index} sequence", split.axes.context[stage.index].group,
                                            params))
    return out
