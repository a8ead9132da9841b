"""This rank's stages of a plan as torch.distributed.pipelining `PipelineStage`s, and torch's runtime for its actions.

torch's runtime passes stage s's outputs to stage s + 1 and nothing else, and only tensors, while
our stages read values by name from any earlier stage, Python numbers (sizes) and tuples
included. `CarryStage` bridges the two: stage s takes the values that cross the cut before it
and returns those that cross the cut after it, its own and the ones it passes on to a later
reader, each as the tensors it crosses as (partitioner.export.wire):

    model inputs ─► stage 0 ─► (its outputs + inputs later stages read) ─► stage 1 ─► ... ─► model output
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import _Action as TorchAction, _PipelineScheduleRuntime

from partitioner.capture.example import shaped, trace_example
from partitioner.errors import PartitionError
from partitioner.export.torch_schedule import TorchSchedule, to_torch_schedule
from partitioner.export.wire import Wire, meta_args, wire
from runtime.plan import Plan
from runtime.stage import Stage, build_stages, stage_io

__all__ = ["CarryStage", "TorchStages", "carried", "pipeline_stages", "schedule_runtime"]


@dataclass(frozen=True)
class _Ref:
    """A value of the graph, by node name, inside the model output's structure."""

    name: str


class CarryStage(nn.Module):
    """One stage of a plan with torch's calling convention: the values crossing the cut before it in, after it out.

    Args:
        stage: the stage built by `runtime.stage.build_stages` (reads `stage.inputs`, writes `stage.outputs`).
        takes: the values it is called with, in order, each as the tensors it crosses as.
        gives: the values it returns, in order; None for the last stage, which returns `output`
            (the model's output: a value, or a tuple of values, by `_Ref`).
    """

    def __init__(self, stage: Stage, takes: Sequence[Wire], gives: Sequence[Wire] | None, output: Any = None) -> None:
        super().__init__()
        self.stage = stage.module
        self.index = stage.index
        self.reads, self.writes = list(stage.inputs), list(stage.outputs)
        self.takes, self.gives, self.output = list(takes), None if gives is None else list(gives), output
        self.deferred_bns = list(stage.deferred_bns)

    def forward(self, *tensors: torch.Tensor) -> Any:
        env: dict[str, Any] = {}
        at = 0
        for w in self.takes:
            env[w.name] = w.decode(tensors[at:at + w.width])
            at += w.width
        outs = self.stage(*[env[n] for n in self.reads])
        env.update(zip(self.writes, outs))
        if self.gives is None:
            if isinstance(self.output, tuple):
                return tuple(env[r.name] for r in self.output)
            return env[self.output.name]
        return tuple(t for w in self.gives for t in w.encode(env[w.name]))

    def commit_batch_norms(self) -> None:
        """Apply the step's BatchNorm running statistics (held back per micro-batch, as our runtime does at STEP)."""
        for bn in self.deferred_bns:
            bn.commit()


def carried(gm: torch.fx.GraphModule, plan: Plan) -> list[list[str]]:
    """For each cut (after stage c, c < stages - 1), the values crossing it, in graph order.

    A value crosses when an earlier stage (or the model's input) makes it and a later stage
    or the model's output reads it.
    """
    stage_of = plan.stage_of()
    io = stage_io(gm, plan)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    position = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    last = len(plan.stages) - 1
    readers: dict[str, list[int]] = {}
    for s, (inputs, _) in enumerate(io):
        for name in inputs:
            readers.setdefault(name, []).append(s)
    for node in output.all_input_nodes:
        readers.setdefault(node.name, []).append(last + 1)
    cuts = []
    for c in range(last):
        crossing = [n for n, rs in readers.items() if stage_of.get(n, -1) <= c and max(rs) > c]
        cuts.append(sorted(crossing, key=position.__getitem__))
    return cuts


@dataclass
class TorchStages:
    """This rank's `PipelineStage`s of a plan, the schedule they run, and how to put the model back."""

    stages: list[PipelineStage]
    schedule: TorchSchedule
    undo: Callable[[], None]

    def commit_batch_norms(self) -> None:
        """After each step: apply BatchNorm running statistics (see `CarryStage.commit_batch_norms`)."""
        for stage in self.stages:
            module = stage.submod
            if isinstance(module, CarryStage):
                module.commit_batch_norms()


def pipeline_stages(
    model: nn.Module,
    plan: Plan,
    example_inputs: Sequence[Any],
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    rank: int | None = None,
    group: Any = None,
    device: torch.device | str | None = None,
) -> TorchStages:
    """This rank's stages of `plan` as torch `PipelineStage`s (each a `CarryStage` around our stage module).

    The model is traced as `partition` traces it and this rank's weights move to `device` (the
    stages' own device by default); weights of other ranks' stages are freed, as under
    torchrun: `undo()` puts every weight back. Shapes come from one micro-batch of
    `example_inputs` run on meta tensors, so the stages need no shape inference messages.

    Args:
        rank: the global rank (default: this process's); it runs the stages whose `ranks` hold it.
        group: the pipeline's process group (required when stages have replicas: one group per pipeline).

    Raises:
        PartitionError: a plan torch's runtime cannot run (see `to_torch_schedule`), or a cut
            that carries a value that is not a tensor.
    """
    sched = to_torch_schedule(plan)
    if sched.pipelines > 1 and group is None:
        raise PartitionError(f"each stage runs on {sched.pipelines} ranks: pass group=, the process group of this "
                             "rank's pipeline (replica j of every stage)")
    rank = dist.get_rank() if rank is None else rank
    mine = [s.index for s in plan.stages if rank in (s.ranks or [s.index])]
    if not mine:
        raise PartitionError(f"the plan gives rank {rank} no stage")
    example = trace_example(model, tuple(example_inputs), dict(example_kwargs or {}), plan.micro_batches)
    gm = example.graph_module
    cuts = carried(gm, plan)
    output = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    shapes = _example_values(model, example, [n for cut in cuts for n in cut])
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for name, value in zip(placeholders, example.first_chunk):
        if not isinstance(value, torch.Tensor):
            raise PartitionError(f"input {name} is a {type(value).__name__}; torch's pipelining runtime splits tensor "
                                 "inputs into micro-batches: pass tensors")
        shapes[name] = value
    wires = {n: wire(n, shapes[n]) for n in placeholders + [n for cut in cuts for n in cut]}
    here = torch.device(device) if device is not None else torch.device(plan.stages[mine[0]].device)
    built, undo = build_stages(gm, plan, local=mine, device=here)
    try:
        last = len(plan.stages) - 1
        out_ref = _output_ref(output)
        stages = []
        for stage in built:
            s = stage.index
            takes = [wires[n] for n in (placeholders if s == 0 else cuts[s - 1])]
            gives = None if s == last else [wires[n] for n in cuts[s]]
            module = CarryStage(stage, takes, gives, out_ref)
            ins = meta_args(takes, [shapes[w.name] for w in takes], grads=s > 0)
            if gives is None:
                outs = _output_values(out_ref, shapes)
                out_args = meta_args([wire(str(k), v) for k, v in enumerate(outs)], outs)
            else:
                out_args = meta_args(gives, [shapes[w.name] for w in gives])
            stages.append(PipelineStage(module, s, len(plan.stages), here, input_args=ins, output_args=out_args,
                                        group=group))
    except BaseException:
        undo()
        raise
    return TorchStages(stages, sched, undo)


def schedule_runtime(stages: TorchStages, loss_fn: Callable[[Any, Any], torch.Tensor], *,
                     csv: str | os.PathLike[str] | None = None, **kwargs: Any) -> _PipelineScheduleRuntime:
    """torch's `_PipelineScheduleRuntime` over `stages`, running the plan's exported actions.

    `loss_fn(output, target)` is a mean over one micro-batch; the runtime is given it divided
    by the micro-batch count (with `scale_grads=False`, as torchtitan does), so gradients equal
    those of the mean loss over the whole batch and the losses it reports add up to that loss.
    With `csv` (the plan's `to_torch_schedule().write_csv(...)`), torch reads the actions from
    that file (`_load_csv`, as torchtitan does); otherwise from `stages.schedule` in memory.
    """
    m = stages.schedule.micro_batches

    def scaled(output: Any, target: Any) -> torch.Tensor:
        return loss_fn(output, target) / m

    runtime = _PipelineScheduleRuntime(stages.stages, n_microbatches=m, loss_fn=scaled, scale_grads=False, **kwargs)
    if csv is not None:
        runtime._load_csv(str(csv))
    else:
        runtime._prepare_schedule_with_comms(
            {r: [TorchAction.from_str(a) for a in row] for r, row in enumerate(stages.schedule.actions)})
    return runtime


def _example_values(model: nn.Module, example: Any, names: Sequence[str]) -> dict[str, Any]:
    """The values `names` (and the output) take on the first micro-batch, run on meta tensors (shapes only)."""
    wanted = set(names)
    found: dict[str, Any] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n: torch.fx.Node) -> Any:
            value = super().run_node(n)
            if n.name in wanted or n.op == "output" or any(u.op == "output" for u in n.users):
                found[n.name] = value
            return value

    def run() -> None:
        inputs = [x.to("meta") if isinstance(x, torch.Tensor) else x for x in example.first_chunk]
        with torch.no_grad():
            Recorder(example.graph_module).run(*inputs)

    shaped(model, example.traced, run, shapes=True)
    return found


def _output_ref(output: Any) -> Any:
    """The model output's structure with each value as a `_Ref` (a value, or a tuple of values)."""
    if isinstance(output, torch.fx.Node):
        return _Ref(output.name)
    if isinstance(output, (tuple, list)) and all(isinstance(o, torch.fx.Node) for o in output):
        return tuple(_Ref(o.name) for o in output)
    raise PartitionError("the model returns a structure other than a tensor or a tuple of tensors; torch's pipelining "
                         "runtime passes the last stage's tensors to the loss: return a tensor or a tuple of them")


def _output_values(ref: Any, values: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(values[r.name] for r in ref) if isinstance(ref, tuple) else (values[ref.name],)
