"""The partitioned model in one process: the plan's programs run by the one execution core.

Each rank of the plan is a worker here (a slot on a device); its program runs on its own
thread when the stages sit on several devices (or `threads=True`), else every program runs
in the caller's thread, tick by tick. Values between workers go through a LocalTransport.

    worker 0 (cpu:0): F s0 mb0 | SEND | F s0 mb1 | SEND | ...       pipe(x): forwards only,
    worker 1 (cpu:1):          | RECV | F s1 mb0 | RECV | F s1 mb1  autograd across stages
                                                                    train_step: the whole
                                                                    schedule (GPipe, 1F1B, ...)
`pipe(x)` returns the model's output and `loss.backward()` runs through every stage into the
model's own parameters; `pipe.train_step(x, y, loss_fn)` runs forward and backward of the
plan's schedule, so 1F1B holds at most the pipeline depth's activations.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import torch.fx
from torch import nn

from runtime.async_updates import AsyncTrainer, refuse_optimizer
from runtime.calibration_hook import Calibratable, StepCall
from runtime.cuda_streams import compute_stream, current, join_caller
from runtime.errors import PartitionError
from runtime.inline import InlineOrders, run_inline
from runtime.interpreter import Interpreter
from runtime.microbatch import OutputMergeSpec, SplitDim, gather, to_device
from runtime.mutation import inputs_written_with_grad
from runtime.program import Op, Program, plan_programs
from runtime.routes import stage_aliases
from runtime.stage import Stage
from runtime.stage_graph import StageGraph, for_mode
from runtime.steps import StepInputs, forward_step, step_sizes, train_step_inputs, transaction, write_back
from runtime.thread_state import thread_state
from runtime.transport_local import LocalTransport, WorkerFailed
from runtime.weight_grads import WeightGradHook, check_self_computed, check_whole_modules

__all__ = ["Pipeline", "StageGraph", "for_mode"]


def _device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Mode:
    """The workers of one StageGraph: an interpreter per rank, and its train and forward programs."""

    def __init__(self, graph: StageGraph, transport: LocalTransport, rank_of: list[int],
                 unflatten: Callable[[Any], Any]) -> None:
        plan = graph.plan
        if not plan.programs:
            plan.programs = plan_programs(plan)
        self.plan = plan
        self.stages = graph.stages
        self.programs = {"train": plan.programs, "forward": plan_programs(plan, forward_only=True)}
        routes = graph.routes()
        self.workers = [
            Interpreter([s for s in graph.stages if rank_of[s.index] == r], routes, transport,
                        lambda stage, mb: rank_of[stage], r, graph.output_node, graph.constants, unflatten)
            for r in range(len(plan.programs))
        ]
        aliases = stage_aliases(graph.stages, routes)  # across workers: a value one writes, another writes again
        for w in self.workers:
            w.aliases = aliases
        self.self_computed = [c for w in self.workers for calls in w.self_computed.values() for c in calls]
        self.bns = list(dict.fromkeys(bn for stage in graph.stages for bn in stage.deferred_bns))


class Pipeline(Calibratable, nn.Module):
    """The partitioned model: call it like the original; `plan` says where everything runs.

    Parameters, `state_dict()` and `load_state_dict()` are the original model's own. Where
    forward reads `self.training`, each mode has its own graph with the same cuts, and every
    call runs the one of the model's current mode (`pipe.train()`, `pipe.eval()`, or the
    model's own `train()`): switching costs nothing.
    """

    def __init__(
        self,
        model: nn.Module,
        graph: StageGraph,
        flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
        unflatten_outputs: Callable[[Any], Any],
        input_names: list[str],
        threads: bool | None = None,
        mutated_inputs: Sequence[str] = (),
        other_mode: StageGraph | None = None,
        other_mode_error: str | None = None,
        *,
        batched_outputs: Sequence[bool] | None = None,
        output_merge_spec: OutputMergeSpec | None = None,
        input_dims: Sequence[SplitDim] | None = None,
    ) -> None:
        super().__init__()
        # How micro-batch outputs merge and inputs split: see [Note: merging micro-batches never guesses]
        self._batched = list(batched_outputs) if batched_outputs is not None else None
        self._merge_spec = output_merge_spec
        self._input_dims = list(input_dims) if input_dims is not None else None
        stages, plan = graph.stages, graph.plan
        extra = other_mode.stages if other_mode is not None else []
        self.stage_modules = nn.ModuleList([s.module for s in stages + extra])
        self.plan = plan
        self._model = [model]  # a list so nn.Module does not register it twice
        self._stages = stages
        self._flatten = flatten_inputs
        self._unflatten = unflatten_outputs
        self._input_names = input_names
        self._mutated = list(mutated_inputs)
        ranks = [list(s.ranks) or [s.index] for s in plan.stages]
        if any(len(r) > 1 for r in ranks):
            raise ValueError(f"stage replicas {[len(r) for r in ranks]} need one process each: launch with torchrun")
        self._rank_of = [r[0] for r in ranks]
        self._transport = LocalTransport([s.device for s in stages])
        traced_mode = model.training
        self._modes = {traced_mode: _Mode(graph, self._transport, self._rank_of, unflatten_outputs)}
        if other_mode is not None:
            self._modes[not traced_mode] = _Mode(other_mode, self._transport, self._rank_of, unflatten_outputs)
        self._other_mode_error = other_mode_error
        self._traced_mode = traced_mode
        # Threads where work can overlap: several devices, or branches side by side in slots.
        overlap = len({s.device for s in stages}) > 1 or plan.placement == "branches"
        self._threaded = overlap if threads is None else threads
        self._pools: dict[int, ThreadPoolExecutor] = {}
        self._streams: dict[int, Any] = {}  # each worker's CUDA compute stream (None off CUDA)
        self._orders = InlineOrders()  # the one-thread order of each mode's programs, worked out once
        self._tracing = False  # see `tracing`
        devices = [s.device for s in stages]  # one thread: stages on one device hand values over directly
        self._shared = frozenset((a, b) for a in range(len(devices)) for b in range(len(devices))
                                 if a != b and devices[a] == devices[b])
        self._params = list(dict.fromkeys(p for s in stages + extra for p in s.module.parameters()))
        # Inputs written in place with grad on: a leaf requiring grad among them is refused (runtime.steps).
        self._leaf_writes = {n for s in stages + extra if s.writes for g in s.module.modules()
                             if isinstance(g, torch.fx.GraphModule) for n in inputs_written_with_grad(g)}
        self._async: dict[bool, AsyncTrainer] = {}  # update "2bw"/"stash": the stream of each mode's graph

    def _mode(self) -> _Mode:
        """The graph of the model's mode now."""
        return for_mode(self._modes, self.model.training, self._traced_mode, self._other_mode_error)

    @property
    def _workers(self) -> list[Interpreter]:
        return self._mode().workers

    @property
    def model(self) -> nn.Module:
        return self._model[0]

    @property
    def stages(self) -> list[Stage]:
        """The runnable stages (module, device, input and output value names), in order."""
        return list(self._stages)

    @property
    def output_device(self) -> torch.device:
        return self._stages[-1].device

    @property
    def tracing(self) -> bool:
        """While True, every op's start and end are recorded (see `measured_timeline`)."""
        return self._tracing

    @tracing.setter
    def tracing(self, on: bool) -> None:
        self._tracing = on
        for mode in self._modes.values():
            for w in mode.workers:
                w.tracing = on

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        self._guard("state_dict()")
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace parameters the pipeline holds; "
                             "use assign=False")
        self._guard("load_state_dict()")
        return self.model.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True) -> Pipeline:
        if mode != self.model.training:
            self._guard("train()" if mode else "eval()")
        self.model.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._async:
            self._guard("pipe(...)")
        step = forward_step(self._flatten, self._input_names, args, kwargs, self.plan.micro_batches, self._mutated,
                            self._input_dims, leaf_writes=self._leaf_writes)
        last = self._run(step).workers[self._rank_of[-1]]
        held, last.outputs = last.outputs, {}  # the caller holds them now
        device = self._stages[-1].device
        if len(step.envs) == 1:
            return self._unflatten(to_device(held[0], device))
        outputs = [to_device(held[i], device) for i in range(len(step.envs))]
        try:
            merged = gather(outputs, step_sizes(step, self._input_dims), self._batched, self._merge_spec)
        except ValueError as exc:
            raise PartitionError(str(exc)) from None
        return self._unflatten(merged)

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
        """Forward and backward of one batch under the plan's schedule; returns the batch's loss.
        (`loss_per_token`: see DistributedPipeline.train_step; one process splits no sequence.)

        `plan.update == "sync"`: gradients land in the model's parameters as
        `loss_fn(model(inputs), targets).backward()` would put them (see runtime.steps); then
        step the optimizer as usual. "2bw" / "stash": no flush between calls; the runtime steps
        `optimizer` (required) inside the call and owns the gradients, and the call returns the
        loss of the batch before (None on the first call): see runtime.async_updates, `flush`.
        """
        step = train_step_inputs(self._flatten, self._input_names, inputs, targets, loss_fn, input_kwargs,
                                 self.plan.micro_batches, loss_reduction, self._mutated, self._input_dims,
                                 leaf_writes=self._leaf_writes)
        self.remember_step(StepCall(inputs, targets, loss_fn, input_kwargs, loss_reduction))
        if self.plan.update != "sync":
            return self._trainer().train_step(step, optimizer, self.model.training, self._mutated, self._run_segment)
        refuse_optimizer(optimizer)
        loss = self._run(step).workers[self._rank_of[-1]].loss
        assert loss is not None
        self.end_step()
        return loss

    def set_weight_grad_hook(self, hook: WeightGradHook | None) -> None:
        """Call `hook(stage_module)` after each micro-batch's backward of each stage, for a model that computes
        its own weight gradients after backward (as PyTorch's `dw_builder`); None removes it. See
        runtime/weight_grads.py for what it gets, and what is detected when it is missing."""
        for mode in self._modes.values():
            if hook is not None:
                check_whole_modules(mode.self_computed)
            for w in mode.workers:
                w.weight_grad_hook = hook

    def flush(self) -> torch.Tensor | None:
        """Asynchronous updates: finish every micro-batch in flight, apply the pending updates, and return
        the last batch's loss (None when nothing is in flight, and always under update='sync')."""
        loss = None
        for trainer in self._async.values():
            loss = trainer.flush(self._run_segment) if trainer.in_flight else loss
        return loss

    def _guard(self, what: str) -> None:
        for trainer in self._async.values():
            trainer.guard(what)

    def _trainer(self) -> AsyncTrainer:
        training = self.model.training
        trainer = self._async.get(training)
        if trainer is None:
            mode = self._mode()
            plan = mode.plan if mode.plan is self.plan else dataclasses.replace(mode.plan, update=self.plan.update)
            trainer = self._async[training] = AsyncTrainer(plan, dict(enumerate(mode.workers)), mode.stages,
                                                           [p.device for p in mode.programs["train"]])
        for other, trainer_other in self._async.items():
            if other != training:
                trainer_other.guard("train_step in the other train()/eval() mode")
        return trainer

    def _run_segment(self, segment: list[list[Op]], step: StepInputs | None) -> None:
        """One call of an asynchronous stream (runtime.flushless): each worker's ops of that call."""
        mode = self._mode()
        programs = [Program(rank=r, device=str(w._device()), ops=ops) for r, (w, ops) in
                    enumerate(zip(mode.workers, segment))]
        self._transport.reset(mail=False)  # a value sent at the end of one call is taken in the next
        if self._threaded:
            self._run_threads(programs, mode.workers)
        else:
            self._run_inline(programs, mode.workers)

    def _run(self, step: StepInputs) -> _Mode:
        """One synchronous step of the model's mode now; returns that mode's workers and programs."""
        mode = self._modes.get(self._model[0].training) or self._mode()
        self._transport.reset()
        local: dict[Any, Any] = {}
        # One thread and no trace to record: values between stages on one device skip the mailbox.
        shared = frozenset() if self._threaded or self._tracing else self._shared
        for w in mode.workers:
            w.begin(step, local, shared)
        try:
            if step.mode == "train" or mode.bns:
                with transaction(self._params, mode.bns, grads=step.mode == "train"):
                    self._run_programs(mode, step, shared)
            else:
                self._run_programs(mode, step, shared)
            if step.written:
                write_back(step)
        finally:
            for w in mode.workers:
                w.end()
            self._transport.reset()  # a failed step's undelivered values hold their graphs
        return mode

    def _run_programs(self, mode: _Mode, step: StepInputs, shared: frozenset[tuple[int, int]]) -> None:
        programs = mode.programs[step.mode]
        if self._threaded:
            self._run_threads(programs, mode.workers)
        else:
            self._run_inline(programs, mode.workers, shared)
        if step.mode == "train" and mode.self_computed and mode.workers[0].weight_grad_hook is None:
            check_self_computed(mode.self_computed, len(step.envs))

    def _run_inline(self, programs: Sequence[Program], workers: list[Interpreter],
                    shared: frozenset[tuple[int, int]] = frozenset()) -> None:
        """Every program in this thread, tick by tick (runtime.inline): no thread hand-offs, no waits."""
        self._transport.blocking = False
        run_inline(self._orders.of(programs, shared), workers)

    def _run_threads(self, programs: Sequence[Program], workers: list[Interpreter]) -> None:
        """A thread per program; the last runs in this thread, so a step hands off one program fewer."""
        self._transport.blocking = True
        state = thread_state()  # grad mode, autocast, ... are thread-local: each worker takes the caller's
        devices = {p.rank: workers[p.rank]._device() for p in programs}
        sharing = Counter(devices.values())
        callers = {d: current(d) for d in sharing}  # this thread's streams: workers start after their work

        def work(p: Program, here: bool) -> None:
            device = devices[p.rank]
            stream = self._streams.get(p.rank)
            if stream is None:  # workers sharing a GPU (branch slots) each get a stream
                stream = compute_stream(device, own=sharing[device] > 1)
                if not here or sharing[device] > 1:  # this thread's current stream is the caller's, not cached
                    self._streams[p.rank] = stream
            try:
                with (contextlib.nullcontext() if here else state()), _device_context(device), \
                        join_caller(stream, callers[device]):
                    workers[p.rank].run(p.ops)
            except BaseException:
                self._transport.abort()
                raise

        futures: list[Future[None]] = []
        for p in programs[:-1]:
            pool = self._pools.get(p.rank)
            if pool is None:
                pool = self._pools[p.rank] = ThreadPoolExecutor(1, thread_name_prefix=f"pipe-worker{p.rank}")
            futures.append(pool.submit(work, p, False))
        mine: BaseException | None = None
        try:
            work(programs[-1], True)
        except BaseException as exc:  # noqa: BLE001 - reported below, after the other workers stop
            mine = exc
        errors = [f.exception() for f in futures] + [mine]
        first = next((e for e in errors if e is not None and not isinstance(e, WorkerFailed)), None)
        first = first or next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def measured_timeline(self, origin: float | None = None) -> dict[str, Any]:
        """The recorded trace as {"devices": [{"device", "events"}]} in ms, for plan.visualize(measured=...).

        One row per worker; forward and backward are timed around each op, as are the waits
        for values from other workers ("recv") and the posting of sends.
        """
        events = [(w, e) for mode in self._modes.values() for w in mode.workers for e in w.trace]
        t0 = origin if origin is not None else min((e["start"] for _, e in events), default=0.0)
        rows: dict[str, list[dict[str, Any]]] = {}
        for w, e in events:
            device = f"{w._device()} (worker {w.rank})"
            rows.setdefault(device, []).append({**e, "start": (e["start"] - t0) * 1e3, "end": (e["end"] - t0) * 1e3})
        return {"devices": [{"device": d, "events": ev} for d, ev in rows.items()]}

    @property
    def trace(self) -> list[dict[str, Any]]:
        """Every worker's raw events (times from time.time(), seconds); cleared with `clear_trace`."""
        return [e for mode in self._modes.values() for w in mode.workers for e in w.trace]

    def clear_trace(self) -> None:
        for mode in self._modes.values():
            for w in mode.workers:
                w.trace.clear()

    def close(self) -> None:
        """Stop the worker threads (they are also stopped when the pipeline is garbage collected)."""
        for pool in self._pools.values():
            pool.shutdown(wait=True)
        self._pools.clear()

    def __del__(self) -> None:
        for pool in getattr(self, "_pools", {}).values():
            pool.shutdown(wait=False)

