"""Planning a traced model: choose the placement, give it its exact stage DAG, programs and predictions.

`partitioner.api` traces and checks what the user passed, then calls `plan_traced`; the
planners (chain.py, branches.py, replicated.py) choose where nodes go, and
`partitioner.predict.assemble` turns that into the Plan's numbers, programs and predictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence, cast

import torch
from torch import nn

from cost_model import default_cost_model
from cost_model.analytic import CostModel
from cost_model.devices import host_memory
from cost_model.memory import usable_bytes
from cost_model.processes import BetweenProcesses
from cost_model.progress import say
from partitioner.capture.example import Example
from partitioner.capture.fidelity import Cuts, forced_cuts, shape_graph
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.errors import PartitionError
from partitioner.place.branches import plan_branches
from partitioner.place.chain import plan_pipeline
from partitioner.place.cluster.plan import cluster_of
from partitioner.place.cluster.split_axes import found_splits
from partitioner.place.devices.plan import plan_devices
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.axes import NodeFacts
from partitioner.place.search.kernels import fused_plan
from partitioner.place.search.space import SearchSpace
from partitioner.predict.assemble import counted_per_rank, finish, recompute_memory, recount
from partitioner.predict.graph_data import store_graph
from partitioner.request import RECOMPUTE_CHOICES, PlanRequest, RecomputeChoice
from rules.schedules import auto_layouts, virtual_stages
from runtime.interpreter import Routes
from runtime.launch import stage_layout
from runtime.plan import RECOMPUTE_MODES, Plan, RecomputeMode
from runtime.recompute import kept_output_writes
from runtime.stage import stage_io
from runtime.stage_weights import weight_groups

__all__ = [
    "choose", "choose_recompute", "device_capacity", "finish_plan", "fits_memory", "plan_traced", "prepared",
    "schedule_layouts", "stage_ranks_for", "within_memory",
]

def stage_ranks_for(request: PlanRequest) -> list[list[int]]:
    """The ranks of each stage the request's schedule and replicas lay out (replicas="auto": one per rank,
    the hybrid planner chooses)."""
    if request.replicas == "auto":
        return [[r] for r in range(request.world)]
    schedule = "gpipe" if request.schedule == "auto" else request.schedule
    try:
        return stage_layout(request.world, schedule, request.replicas, request.virtual_stages)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None


@dataclass
class _Placing:
    """What every candidate placement of one traced model shares (`plan_traced` makes it once)."""

    model: nn.Module
    example: Example
    graph: Any  # the shape graph of the first micro-batch (capture.fidelity.shape_graph)
    order: list[str]
    forced: list[int]
    cost: CostModel
    request: PlanRequest

    @property
    def gm(self) -> torch.fx.GraphModule:
        return self.example.graph_module


def plan_traced(model: nn.Module, example: Example, request: PlanRequest, cost_model: CostModel | None) -> Plan:
    """The plan for a traced model: chosen, with exact stage DAG, programs and predictions.

    `cost_model`: what prices it (the request's, calibrated; None: the default profiled one).
    `schedule="auto"` plans every schedule this layout can run (`schedule_layouts`) and keeps
    the fastest whose ranks hold their stages (`fits_memory`); `plan.alternatives` records each
    candidate's predicted step ms ("(over memory)" after the name of one that does not fit).
    """
    layout = stage_ranks_for(request)
    auto = request.replicas == "auto"
    gm = example.graph_module
    if request.micro_batches < max(len(r) for r in layout):
        raise PartitionError(f"micro_batches={request.micro_batches} leaves a replica idle; use at least "
                             f"{max(len(r) for r in layout)}")
    graph = shape_graph(example.traced, example.first_chunk)
    for node in gm.graph.nodes:  # module classes: what each call saves for backward (cost_model.recompute_cost)
        if node.op == "call_module" and node.name in graph:
            graph.nodes[node.name]["kind"] = type(gm.get_submodule(str(node.target))).__name__
    order = [n.name for n in compute_nodes(gm)]
    forced = forced_cuts(graph, order, Cuts(request.split_points, dict(request.split_spec or {})))
    if forced and (auto or request.placement != "pipeline"):
        raise PartitionError(f"the model has pipe_split() markers (or a split_spec), which "
                             f"placement={request.placement!r}{' with replicas=auto' if auto else ''} cannot keep; "
                             "use placement='pipeline', or split_points='cost' to ignore them")
    cost = prepared(cost_model, gm, example.first_chunk)
    if request.processes:  # every stage replica is a process: ranks on one device still pay for transfers
        cost = BetweenProcesses(cost)
    say(f"planning {len(order)} nodes on {request.world} devices ({request.schedule}, "
        f"{request.micro_batches} micro-batches)")
    placing = _Placing(model, example, graph, order, forced, cost, request)
    if request.schedule != "auto":
        return store_graph(_place(placing, request.schedule, layout), graph, cost)
    if request.placement != "pipeline":
        return store_graph(_place(placing, "gpipe", layout), graph, cost)  # branches run GPipe only
    made: dict[str, Plan] = {}
    refused: dict[str, PartitionError] = {}
    for name, ranks in schedule_layouts(layout, request.micro_batches, hybrid=auto).items():
        try:
            made[name] = _place(placing, name, ranks)
        except PartitionError as exc:  # this layout cannot run it (or cannot fit at all): not a candidate
            refused[name] = exc
    if not made:
        needs = {n: max(getattr(e, "needed_bytes", None) or [0]) for n, e in refused.items()}
        if all(needs.values()):  # none fits in memory: the error of the one that came closest, as it is
            raise refused[min(needs, key=lambda n: needs[n])]
        raise PartitionError("schedule='auto' found no schedule that can run this model here:\n"
                             + "\n".join(f"- {n}: {e}" for n, e in refused.items()))
    fits = {name: fits_memory(p, cost) for name, p in made.items()}
    pool = [name for name in made if fits[name]] or list(made)
    best = min(pool, key=lambda name: made[name].predicted_step_ms)
    chosen = made[best]
    chosen.alternatives = {(name if fits[name] else f"{name} (over memory)"): p.predicted_step_ms
                           for name, p in made.items()}
    return store_graph(chosen, graph, cost)


def schedule_layouts(layout: list[list[int]], micro_batches: int, *,
                     hybrid: bool = False) -> dict[str, list[list[int]]]:
    """The schedules `schedule="auto"` compares, each with the stage ranks it runs on (rules.schedules.auto_layouts).

    In each schedule's `auto` order: 1F1B comes first, so it wins a tie with GPipe (same step,
    fewer activations held). gpipe, 1f1b and zb1 run `layout` (one stage per rank, or replicated
    stages); interleaved (2 stages per rank, round robin; micro-batches in rounds of one per
    rank), zbv (2 stages per rank in a V) and dualpipev (zbv's V; a micro-batch per stage or
    more) need one replica per stage and 2 ranks or more. The hybrid planner (replicas="auto")
    chooses among the schedules with a `fill` (gpipe and 1f1b).
    """
    return auto_layouts(layout, micro_batches, searched=hybrid)


def fits_memory(plan: Plan, cost: CostModel) -> bool:
    """Whether every device holds what its ranks' stages need: `memory_bytes` of each stage a
    program runs, summed over the programs on the device, within `device_capacity`."""
    need: dict[tuple[int, str], int] = {}
    for prog in plan.programs:
        held = {op.stage for op in prog.ops if op.is_compute}
        key = (plan.host_of(prog.rank), prog.device)  # a cluster plan names each host's GPUs alike
        need[key] = need.get(key, 0) + sum(plan.stages[s].memory_bytes for s in held)
    return all(n <= device_capacity(cost, torch.device(d)) for (_, d), n in need.items())


def _place(placing: _Placing, schedule: str, layout: list[list[int]]) -> Plan:
    """One schedule's plan on `layout`: placed, recomputation chosen, programs and predictions made."""
    request, graph, gm, cost = placing.request, placing.graph, placing.gm, placing.cost
    devices, micro_batches, recompute = list(request.devices), request.micro_batches, request.recompute
    recomputing = recompute != "none"
    whole_graph = lambda: build_graph(gm, placing.example.flat)  # noqa: E731 - the whole batch's shapes, on demand
    if request.replicas == "auto":  # the hybrid planner wants the whole batch's shapes and chooses the layout
        whole = whole_graph()
        splits = found_splits(gm, placing.model, whole, placing.order) if cluster_of(cost) is not None else None
        made = plan_hybrid(whole, placing.order, devices, cost, space=SearchSpace.of(request, schedule),
                           shardable=find_shardable(gm, whole), splits=splits)  # replicas="auto" runs under torchrun
    elif request.placement == "pipeline":
        stage_devices = [devices[r[0]] for r in layout]
        made = plan_pipeline(graph, placing.order, stage_devices, cost, micro_batches,
                             schedule=schedule, stage_ranks=layout,
                             forced=placing.forced)  # the layout's ranks: zbv lowers only on its V
        for stage, ranks in zip(made.stages, layout):
            stage.ranks = ranks
        if not request.processes and not placing.forced:  # the memory-aware fallback knows no markers
            if recomputing:  # what recomputation saves may let this split fit
                choose_recompute(made, graph, gm, cost, recompute)
            made = within_memory(made, whole_graph, placing.order, devices, cost, micro_batches)
            for stage, ranks in zip(made.stages, layout):
                stage.ranks = ranks
    else:
        made = choose(graph, placing.order, devices, cost, micro_batches, request.placement)
        if made.placement != "branches":
            for stage, ranks in zip(made.stages, layout):
                stage.ranks = ranks
    if request.kernels == "fused" and made.kernels != "fused":  # the searches price it; a split given is priced here
        fused_plan(made, NodeFacts(whole_graph(), placing.order, torch.device(devices[0]), cost).fused)
    made.schedule = schedule
    made.virtual_stages = virtual_stages_of(made)
    made.gpus_per_host = request.gpus_per_host  # fits_memory counts each host's GPUs apart (cuda:0 is on every host)
    if recomputing:
        choose_recompute(made, graph, gm, cost, recompute)
    finish_plan(made, gm, placing.model, processes=request.processes, regenerate=True)
    return made


def virtual_stages_of(plan: Plan) -> int:
    """Stages per rank of the plan's loop or V layout, 1 for a chain (rules.schedules.virtual_stages)."""
    return virtual_stages(plan.schedule, [s.ranks for s in plan.stages])


def finish_plan(plan: Plan, gm: torch.fx.GraphModule, model: nn.Module, *, processes: bool, regenerate: bool) -> None:
    """Give `plan` its exact stage DAG (from the traced graph) and all-reduce groups, then its
    programs and predictions (partitioner.predict.assemble.finish); a given plan keeps its programs
    when nothing they depend on changed."""
    output_node = next(n for n in gm.graph.nodes if n.op == "output")
    producers = Routes.of(stage_io(gm, plan), output_node).producers()
    changed = regenerate or not plan.programs
    for stage, reads in zip(plan.stages, producers):
        if not stage.ranks:
            stage.ranks, changed = [stage.index], True
        if stage.reads_from != reads:
            stage.reads_from, changed = reads, True
    split = plan.data_split == "slice" or any(s.width > 1 for s in plan.stages)
    if not changed or (split and not plan.programs):
        return  # sliced replicas and split layers are lowered where they run (runtime.program.plan_programs)
    stage_ranks = [list(s.ranks) for s in plan.stages]
    groups = weight_groups(gm, plan.stage_of(), stage_ranks, model) if processes else []
    finish(plan, [(list(r), st) for r, st in groups])


def choose(
    graph: Any, order: list[str], devices: list[torch.device], cost: CostModel, micro_batches: int, placement: str
) -> Plan:
    """The plan for `placement`; for "auto", the faster of pipeline and branches as simulated."""
    if placement == "pipeline":
        return plan_pipeline(graph, order, devices, cost, micro_batches)
    min_gain = 0.0 if placement == "branches" else 0.05
    branches = plan_branches(graph, order, devices, cost, micro_batches, min_gain=min_gain)
    if placement == "branches":
        return branches
    chain = plan_pipeline(graph, order, devices, cost, micro_batches)
    times = {"pipeline": chain.predicted_step_ms, "branches": branches.predicted_step_ms}
    best = branches if branches.placement == "branches" and times["branches"] < times["pipeline"] else chain
    best.alternatives = times
    return best


def choose_recompute(plan: Plan, graph: Any, gm: torch.fx.GraphModule, cost: CostModel,
                     recompute: RecomputeChoice | Sequence[RecomputeChoice]) -> None:
    """Give each stage of `plan` its activation recomputation and recount its numbers (assemble.recount).

    `recompute`: one choice for every stage or one per stage; "auto" is per stage the cheapest of
    "none", "selective" and "full" whose predicted memory fits the stage's share of its device
    (its `capacity_bytes`, else the device's capacity split among the stages on it), "full"
    where none fits. Stages that write in place into a product's output never recompute selectively. A stage
    the cluster search priced on its own share (split over tensor or context ranks, or sharded: `recount` keeps
    its numbers) keeps the search's choice under "auto": this module's count is of the whole graph, which would
    judge a stage split 16 ways as if it held everything (and recount it so).

    Raises:
        PartitionError: not one choice per stage, or "selective" asked for a stage that cannot run it.
    """
    p = len(plan.stages)
    modes = [recompute] * p if isinstance(recompute, str) else list(recompute)
    if len(modes) != p:
        raise PartitionError(f"recompute lists {len(modes)} modes for a plan of {p} stages; give one per stage, or "
                             f"one of {', '.join(map(repr, RECOMPUTE_CHOICES))} for all")
    stage_of = plan.stage_of()
    blocked = {stage_of[w] for w, k in kept_output_writes(gm) if w in stage_of and stage_of[w] == stage_of.get(k)}
    refused = sorted(s for s in blocked if modes[s] == "selective")
    if refused:
        raise PartitionError(f"stages {refused} write in place into the output of a matmul or convolution, which "
                             "selective recomputation keeps; use recompute='full' or 'auto' for them, or write out "
                             "of place in the model (h = h * 2 rather than h.mul_(2))")
    memory = recompute_memory(plan, graph, cost) if "auto" in modes else []
    shares = {d: plan.devices.count(d) for d in plan.devices}
    chosen: list[RecomputeMode] = []
    for s, (stage, mode) in enumerate(zip(plan.stages, modes)):
        if mode != "auto":
            chosen.append(mode)
            continue
        if counted_per_rank(stage):
            chosen.append(stage.recompute)
            continue
        limit = stage.capacity_bytes
        if limit is None:
            limit = device_capacity(cost, torch.device(stage.device)) // shares[stage.device]
        fits = [m for m in RECOMPUTE_MODES if memory[s][m] <= limit and not (m == "selective" and s in blocked)]
        chosen.append(cast(RecomputeMode, fits[0] if fits else "full"))
    recount(plan, graph, cost, chosen)


def device_capacity(cost: CostModel, device: torch.device) -> int:
    """Bytes a device holds for tensors: the cost model's (possibly hand-described) spec, else what
    is there; a GPU's CUDA context and allocator headroom come off (cost_model.memory.usable_bytes)."""
    for model in (cost, getattr(cost, "fallback", None)):
        spec = getattr(model, "spec", None)
        if callable(spec):
            memory = int(spec(device).memory_bytes)
            if memory > 0:
                return usable_bytes(memory, device)
    if device.type == "cuda":
        return usable_bytes(int(torch.cuda.get_device_properties(device).total_memory), device)
    return host_memory()[0]


def within_memory(
    plan: Plan, whole_graph: Any, order: list[str], devices: list[torch.device], cost: CostModel, micro_batches: int
) -> Plan:
    """`plan` if every device holds its stages (weights, gradients, activations in flight), else a
    memory-aware split from the hybrid planner; InfeasibleError names what each device would need."""
    need: dict[str, int] = {}
    for stage in plan.stages:
        need[stage.device] = need.get(stage.device, 0) + 2 * stage.param_bytes + stage.activation_bytes
    capacity = {d: device_capacity(cost, torch.device(d)) for d in need}
    if all(n <= capacity[d] for d, n in need.items()):
        return plan
    shares = {d: sum(1 for x in devices if str(x) == d) for d in need}  # stages sharing one device split it
    limits = [capacity[str(d)] / shares[str(d)] for d in devices]
    return plan_devices(
        whole_graph(), order, devices, cost, space=SearchSpace(micro_batches=micro_batches, schedules=("gpipe",)),
        replicate=False, stages=len(devices), memory_bytes=limits, optimizer="sgd",
    )


def prepared(cost_model: CostModel | None, gm: torch.fx.GraphModule, flat_inputs: list[Any]) -> CostModel:
    """The cost model to plan with (profiled where the device is here, by default), shown the graph."""
    cost = cost_model if cost_model is not None else default_cost_model()
    prepare = getattr(cost, "prepare", None)  # optional: see cost_model.interface
    if callable(prepare):
        prepare(gm, flat_inputs)
    return cost
