"""One pipeline rank under torch.distributed: its stages, its program, its gradients.

Every rank holds the stages the plan gives it and runs its program (runtime.program) with
the one execution core (runtime.interpreter) over the peer-to-peer transport: forwards send
outputs to the ranks that read them, backwards send gradients back, all in the order every
pair of ranks agreed on, so the same code is safe on gloo and NCCL.

    rank 0 (stage 0): F0 SEND F1 SEND . RECV B0 RECV B1 AR STEP   -> activations ->
    rank 1 (stage 1): RECV F0 B0 SEND RECV F1 B1 SEND STEP        <- gradients  <-

A weight held by several ranks (replicas of a stage, or a tied weight read by two stages)
has its gradient summed over exactly the ranks holding it, so every copy takes the same
update and the sum equals single-process full-batch training.
"""

from __future__ import annotations

import atexit
import functools
import os
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
from torch import nn

from runtime import checkpoint
from runtime.async_updates import AsyncTrainer, refuse_optimizer
from runtime.axis_reduce import AxisReductions
from runtime.calibration_hook import Calibratable, StepCall
from runtime.comm import Comm, TorchComm
from runtime.errors import PartitionError
from runtime.grad_groups import grad_groups
from runtime.interpreter import Interpreter
from runtime.launch import wire_device
from runtime.layer_split import ShardedRun
from runtime.microbatch import SplitDim
from runtime.mutation import inputs_written_with_grad
from runtime.nccl_rules import NcclRulesComm
from runtime.pipeline import StageGraph, for_mode
from runtime.plan import Plan
from runtime.program import Op, plan_programs
from runtime.stage import Stage
from runtime.stage_weights import tensor_stages
from runtime.staleness import StaleReductions, check_staleness
from runtime.steps import StepInputs, train_step_inputs, transaction, write_back
from runtime.transport_p2p import P2PTransport
from runtime.weight_grads import WeightGradHook, check_self_computed, check_whole_modules

__all__ = ["DistributedPipeline", "NCCL_RULES_ENV"]

NCCL_RULES_ENV = "PARTITIONER_NCCL_RULES"  # "1": run messages through runtime.nccl_rules (tests on gloo)


class DistributedPipeline(Calibratable, nn.Module):
    """This rank's part of a pipelined model; `train_step` runs one step of the whole job."""

    def __init__(
        self,
        model: nn.Module,
        gm: torch.fx.GraphModule,
        plan: Plan,
        stages: list[Stage],
        io: list[tuple[list[str], list[str]]],
        flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
        unflatten_outputs: Callable[[Any], Any],
        input_names: list[str],
        constants: Mapping[str, Any],
        timeout_s: float,
        groups: Sequence[tuple[tuple[int, ...], list[int]]] = (),
        mutated_inputs: Sequence[str] = (),
        other_mode: StageGraph | None = None,
        other_mode_error: str | None = None,
        input_dims: Sequence[SplitDim] | None = None,
        rank_devices: Sequence[torch.device] | None = None,
        axes: AxisReductions | None = None,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.rank = dist.get_rank()
        extra = other_mode.stages if other_mode is not None else []
        self.stage_modules = nn.ModuleList([s.module for s in stages + extra])
        self._model = [model]
        self._stages = {s.index: s for s in stages}
        self._flatten = flatten_inputs
        self._input_names = input_names
        self._mutated = list(mutated_inputs)
        self._input_dims = list(input_dims) if input_dims is not None else None
        self._last = len(plan.stages) - 1
        self.device = stages[0].device
        # Each rank's device (runtime.launch): tensors to a peer travel on the GPU only where both ends have one.
        self.rank_devices = list(rank_devices) if rank_devices is not None else [self.device] * dist.get_world_size()
        if not plan.programs:
            plan.programs = plan_programs(plan, groups)
        if len(plan.programs) != dist.get_world_size():
            raise ValueError(
                f"the plan has programs for {len(plan.programs)} ranks but the job has {dist.get_world_size()}"
            )
        self._program = plan.programs[self.rank].ops
        # a sliced plan runs as the dealt one of m * d micro-batches (see [Note: one agreed order])
        self._pieces = plan.pieces
        self._sharded = {s.index: s.module for s in stages if isinstance(s.module, ShardedRun)}
        readers = tensor_stages(gm, plan.stage_of())
        self._axes = axes or AxisReductions()  # sums inside replicas: sequence parts, split experts
        self._groups, self._loss_group = grad_groups(plan, model, readers, self.rank, self._wire,
                                                     checked=os.environ.get(NCCL_RULES_ENV) == "1",
                                                     leave=self._axes.experts)
        reduced = {op.group for op in self._program if op.kind == "AR"}
        missing = [g.ranks for g in self._groups if g.ranks not in reduced]
        if missing:
            raise ValueError(
                f"rank {self.rank} holds weights shared with ranks {missing}, but its program never all-reduces them; "
                "re-plan, or regenerate the plan's programs (plan.programs = []) so they include those all-reduces"
            )
        self.comm = _make_comm(timeout_s)
        headers = dist.new_group(backend="gloo")  # message descriptions travel on the CPU, also on NCCL jobs
        self.transport = P2PTransport(self.comm, self._wire, headers, timeout_s, self.describe_rank)
        output_node = next(n for n in gm.graph.nodes if n.op == "output")
        graphs = {model.training: StageGraph(stages, output_node, constants, plan, io)}
        if other_mode is not None:  # forward reads self.training: the other mode's graph, cut alike
            graphs[not model.training] = other_mode
            if not other_mode.plan.programs:
                other_mode.plan.programs = plan_programs(other_mode.plan, groups)
        self._modes = {
            training: (Interpreter(g.stages, g.routes(), self.transport, self.rank_of, self.rank, g.output_node,
                                   g.constants, unflatten_outputs, reduce=self._start_reduce),
                       g.plan.programs[self.rank].ops)
            for training, g in graphs.items()
        }
        self._traced_mode = model.training
        self._other_mode_error = other_mode_error
        self._async: AsyncTrainer | None = None  # update="2bw"/"stash": the stream of calls
        self._drains = 0  # drains of asynchronous streams so far (each a fresh header exchange)
        self._params = list(dict.fromkeys(p for s in stages + extra for p in s.module.parameters()))
        self._leaf_writes = {n for s in stages + extra if s.writes for g in s.module.modules()  # runtime.steps
                             if isinstance(g, torch.fx.GraphModule) for n in inputs_written_with_grad(g)}
        self._held = {k for k, (_, st) in readers.items() if any(x in self._stages for x in st)}
        if self.rank == 0:
            everything = list(model.parameters()) + list(model.buffers())
            self._held |= {id(t) for t in everything if id(t) not in readers}

    # ---- layout ----

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    @property
    def stages(self) -> list[Stage]:
        return list(self._stages.values())

    @property
    def interpreter(self) -> Interpreter:
        """The interpreter of the model's mode now (see StageGraph)."""
        return self._mode()[0]

    def _mode(self) -> tuple[Interpreter, list[Op]]:
        return for_mode(self._modes, self.model.training, self._traced_mode, self._other_mode_error)

    @property
    def tracing(self) -> bool:
        """While True, this rank records each op's start and end (see `gather_trace`); off, nothing grows."""
        return any(i.tracing for i, _ in self._modes.values())

    @tracing.setter
    def tracing(self, on: bool) -> None:
        for interpreter, _ in self._modes.values():
            interpreter.tracing = on

    @property
    def trace(self) -> list[dict[str, Any]]:
        return [e for interpreter, _ in self._modes.values() for e in interpreter.trace]

    def clear_trace(self) -> None:
        """Drop the recorded events (as Pipeline.clear_trace), so the next gather holds only new steps."""
        for interpreter, _ in self._modes.values():
            interpreter.trace.clear()

    def held_tensor_ids(self) -> set[int]:
        """Weights this rank holds: those its stages read, and (rank 0) those no stage reads."""
        return self._held

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save this rank's weights and optimizer state; call on every rank (see runtime.checkpoint)."""
        self._guard("save_checkpoint()")
        self.wait_gradients()  # nothing in flight while files are written
        checkpoint.save(self, path, optimizer)

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the weights and optimizer state this rank holds from a checkpoint of any plan."""
        self._guard("load_checkpoint()")
        self.wait_gradients(drop=True)  # stale gradients of other weights: warm-up starts again
        checkpoint.load(self, path, optimizer)

    def rank_of(self, stage: int, microbatch: int) -> int:
        ranks = self.plan.stages[stage].ranks
        return ranks[microbatch % len(ranks)]

    def describe_rank(self, rank: int) -> str:
        stages = [s.index for s in self.plan.stages if rank in s.all_ranks]
        return f"rank {rank} (stage {', '.join(map(str, stages))})"

    def _wire(self, *ranks: int) -> torch.device:
        """Where tensors between this rank and `ranks` travel: see runtime.launch.wire_device."""
        if dist.get_backend() == "gloo":
            return torch.device("cpu")
        return wire_device(self.device, [self.rank_devices[r] for r in ranks])

    def _start_reduce(self, ranks: tuple[int, ...]) -> None:
        for g in self._groups:
            if g.ranks == ranks:
                try:
                    g.start(self.comm)
                except Exception as exc:  # noqa: BLE001
                    raise self.transport.group_failure(g.ranks, exc) from None

    # ---- bounded staleness (runtime.staleness) ----

    @property
    def staleness(self) -> int:
        """Steps by which updates of weights held by several ranks lag their gradients ([Note: bounded staleness])."""
        return self.plan.staleness

    @staleness.setter
    def staleness(self, steps: int) -> None:
        self.plan.staleness = check_staleness(steps)
        self.wait_gradients(drop=True)  # a new rule starts from its warm-up
        for g in self._groups:
            g.reductions = StaleReductions(steps)

    def wait_gradients(self, *, drop: bool = False) -> None:
        """Wait for the gradient all-reduces still in flight (staleness > 0); they stay queued for their
        step unless `drop`. Call on every rank before destroy_process_group; checkpoints call it."""
        for g in self._groups:
            what = f"the all-reduce over ranks {list(g.ranks)}"
            try:
                wait = functools.partial(self.transport.wait, peer=-1, what=what)
                g.reductions.reset(wait) if drop else g.reductions.drain(wait)
            except Exception as exc:  # noqa: BLE001 - a peer died during the all-reduce
                raise self.transport.group_failure(g.ranks, exc) from None

    # ---- one training step ----

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        input_kwargs: Mapping[str, Any] | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        loss_per_token: bool = False,
    ) -> torch.Tensor | None:
        """Forward and backward of one batch over all ranks; every rank calls it with the same batch.

        Gradients equal `loss_fn(model(inputs), targets).backward()` on the whole batch (see
        runtime.steps for `loss_reduction`). `loss_per_token`: the loss is a mean or sum over tokens of
        terms each reading its own token's outputs and targets (cross-entropy of targets already shifted, not
        shifted inside loss_fn), so a sequence split over context ranks runs it on each rank's tokens instead
        of gathering the outputs whole (runtime.loss_tokens). Returns that loss on the ranks of the last stage,
        None elsewhere; the optimizer then steps on local weights. With `plan.update` "2bw" or
        "stash" the runtime steps `optimizer` (required) inside the call, and the last stage's
        ranks get the previous batch's loss (runtime.async_updates; `flush` ends the stream).
        """
        step = train_step_inputs(self._flatten, self._input_names, inputs, targets, loss_fn, input_kwargs,
                                 self._pieces, loss_reduction, self._mutated, self._input_dims,
                                 leaf_writes=self._leaf_writes, per_token=loss_per_token and self.plan.update == "sync")
        self.remember_step(StepCall(inputs, targets, loss_fn, input_kwargs, loss_reduction))
        if self.plan.update != "sync":
            return self._trainer().train_step(step, optimizer, self.model.training, self._mutated, self._run_segment)
        refuse_optimizer(optimizer)
        bns = list(dict.fromkeys(bn for stage in self._stages.values() for bn in stage.deferred_bns))
        with transaction(self._params, bns, grads=True):
            interpreter, program = self._mode()
            for index, run in self._sharded.items():  # FSDP2 reduces in this stage's last backward of the step
                run.expect(sum(op.kind == "B" and op.stage == index for op in program))
            self.transport.begin_step((self.model.training, _signature(step.envs)))
            interpreter.begin(step, {})
            interpreter.run(program)
            self.transport.flush()
            for run in self._sharded.values():  # fused weights FSDP2 leaves whole (runtime.sharding)
                run.stage.reduce_whole()
            if interpreter.self_computed and interpreter.weight_grad_hook is None:  # see runtime.weight_grads
                check_self_computed([c for cs in interpreter.self_computed.values() for c in cs], len(step.envs))
            for g in self._groups:
                start = interpreter.clock.mark()
                try:
                    what = f"the all-reduce over ranks {list(g.ranks)}"
                    g.finish(functools.partial(self.transport.wait, peer=-1, what=what))
                except Exception as exc:  # noqa: BLE001 - a peer died during the all-reduce
                    raise self.transport.group_failure(g.ranks, exc) from None
                interpreter._record("allreduce-wait", min(self._stages), -1, start)
            self._axes.run()
        write_back(step)
        interpreter.end()  # the step's activations go with its graph (runtime.interpreter)
        self.end_step()
        loss = interpreter.loss
        if loss is None:
            return None
        interpreter.logits.reduce(loss)  # over the context ranks, where each one's loss covered its tokens
        if self._loss_group is not None:
            try:
                dist.all_reduce(loss, group=self._loss_group)
            except Exception as exc:  # noqa: BLE001
                raise self.transport.group_failure(self.plan.stages[self._last].ranks, exc) from None
        return loss

    def set_weight_grad_hook(self, hook: WeightGradHook | None) -> None:
        """As Pipeline.set_weight_grad_hook, for this rank's stages (runtime.weight_grads)."""
        for interpreter, _ in self._modes.values():
            if hook is not None:
                check_whole_modules([c for cs in interpreter.self_computed.values() for c in cs])
            interpreter.weight_grad_hook = hook

    # ---- asynchronous updates (runtime.async_updates) ----

    def flush(self) -> torch.Tensor | None:
        """Finish the micro-batches in flight and apply the pending updates (every rank calls it); the last
        batch's loss on the last stage's rank, else None."""
        trainer = self._async
        return trainer.flush(self._run_segment) if trainer is not None and trainer.in_flight else None

    def _guard(self, what: str) -> None:
        trainer = self._async
        if trainer is not None:
            trainer.guard(what)

    def _trainer(self) -> AsyncTrainer:
        trainer: AsyncTrainer | None = self._async
        if trainer is None:
            if self._groups:
                raise PartitionError(f"update={self.plan.update!r}: rank {self.rank} shares weights with ranks "
                                     f"{[list(g.ranks) for g in self._groups]} (replicas or tied weights); "
                                     "asynchronous updates need every weight on one rank")
            devices = {r: str(self.rank_devices[r]) for r in range(dist.get_world_size())}
            trainer = self._async = AsyncTrainer(self.plan, {self.rank: self.interpreter}, self.stages,
                                                 [devices[r] for r in sorted(devices)])
        elif trainer.interpreters[self.rank] is not self.interpreter:
            trainer.guard("train_step after a train()/eval() switch")
            trainer = self._async = None
            return self._trainer()
        return trainer

    def _run_segment(self, segment: list[list[Op]], step: StepInputs | None) -> None:
        """This rank's ops of one call of the stream (or of the drain after call t).

        Calls past the stream's periodic start t0 are shifted copies of call t0, so with message
        headers known relative to the call's first micro-batch they reuse call t0's headers.
        """
        trainer = self._trainer()
        t = trainer.calls if step is not None else trainer.calls - 1
        if step is not None:
            signature: tuple[Any, ...] = (self.model.training, "stream", min(t, trainer.stream.t0),
                                          _signature(step.envs))
        else:  # a drain's shapes are its last batch's: fresh headers (drains are rare)
            self._drains += 1
            signature = (self.model.training, "drain", self._drains)
        self.transport.begin_step(signature, carry=True, base=t * self.plan.micro_batches)
        self.interpreter.run(segment[self.rank])
        self.transport.flush()

    def gather_trace(self, origin: float | None = None) -> dict[str, Any] | None:
        """Every rank's recorded events on rank 0, as {"devices": [{"device", "events"}]} in ms.

        Call on every rank (it is a collective); the others get None. Times count from
        `origin` (a time.time() value) or from the earliest event. Recording is on while
        `pipe.tracing` is True; `pipe.trace` holds this rank's raw events (seconds).
        """
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.rank, str(self.device), self.trace))
        if self.rank != 0:
            return None
        t0 = origin if origin is not None else min((e["start"] for _, _, ev in gathered for e in ev), default=0.0)
        return {
            "devices": [
                {
                    "device": f"{device} (rank {rank})",
                    "events": [{**e, "start": (e["start"] - t0) * 1e3, "end": (e["end"] - t0) * 1e3} for e in events],
                }
                for rank, device, events in sorted(gathered, key=lambda g: g[0])
            ]
        }


def _signature(envs: list[dict[str, Any]]) -> tuple[Any, ...]:
    """What decides every message's shapes: each micro-batch's input shapes, dtypes and plain values."""
    return tuple(
        tuple((k, (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else repr(v)) for k, v in env.items())
        for env in envs
    )


def _make_comm(timeout_s: float) -> Comm:
    if os.environ.get(NCCL_RULES_ENV) == "1":
        comm = NcclRulesComm(timeout_s=min(timeout_s, 60.0))
        atexit.register(comm.close)  # its threads must not outlive a hang into process teardown
        return comm
    return TorchComm()
