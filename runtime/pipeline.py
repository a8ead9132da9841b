"""Run stages over micro-batches in one process with the GPipe fill-drain schedule.

One worker thread per distinct device runs that device's (micro-batch, stage) tasks in
clock-tick order; a task waits for the tasks that produce its inputs. With a single
distinct device the tasks run inline in the caller's thread (no thread hand-offs) unless
`threads=True` asks for one worker per stage (how the threaded path is tested on CPU).

    device 0: 0F0 0F1 0F2                 tick:  0   1   2   3
    device 1:     1F0 1F1 1F2             dev0: F0  F1  F2
                                          dev1:     F0  F1  F2

Backward is autograd's: the merged output's graph spans every device, and gradients land
in the model's own parameters.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from runtime.microbatch import gather, graph_output, scatter, to_device
from runtime.plan import Plan
from runtime.schedule import dag_levels
from runtime.stage import Stage

__all__ = ["Pipeline"]


def _device_context(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class Pipeline(nn.Module):
    """The partitioned model: call it like the original; `plan` says where everything runs.

    Parameters, `state_dict()` and `load_state_dict()` are the original model's own.
    """

    def __init__(
        self,
        model: nn.Module,
        stages: list[Stage],
        plan: Plan,
        output_node: torch.fx.Node,
        flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
        unflatten_outputs: Callable[[Any], Any],
        input_names: list[str],
        constants: Mapping[str, Any],
        threads: bool | None = None,
    ) -> None:
        super().__init__()
        self.stage_modules = nn.ModuleList([s.module for s in stages])
        self.plan = plan
        self._model = [model]  # a list so nn.Module does not register it twice
        self._stages = stages
        self._output_node = output_node
        self._flatten = flatten_inputs
        self._unflatten = unflatten_outputs
        self._input_names = input_names
        self._constants = dict(constants)
        # A worker per device, or per (device, slot) where the plan gives stages slots (ranks),
        # as branch-parallel plans do to run branches side by side on one device.
        keys = [(s.device, tuple(plan.stages[s.index].ranks[:1])) for s in stages]
        distinct = len(set(keys))
        self._threaded = distinct > 1 if threads is None else threads
        self._worker_of: list[Any] = keys if distinct > 1 else [s.index for s in stages]
        producer = {name: s.index for s in stages for name in s.outputs}
        self._levels = dag_levels([sorted({producer[n] for n in s.inputs if n in producer}) for s in stages])
        self._workers: dict[Any, ThreadPoolExecutor] = {}
        self._task_order: dict[int, list[tuple[int, Stage]]] = {}
        self.tracing = False  # set True to record `trace` (see `measured_timeline`)
        self.trace: list[dict[str, Any]] = []

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

    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:  # type: ignore[override]
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        if assign:
            raise ValueError("load_state_dict(assign=True) would replace parameters the pipeline holds; use assign=False")
        return self.model.load_state_dict(state_dict, strict=strict)

    def train(self, mode: bool = True) -> "Pipeline":
        self.model.train(mode)
        return super().train(mode)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = self._flatten(args, kwargs)
        chunks = scatter(flat, self.plan.micro_batches)
        envs = [dict(zip(self._input_names, chunk)) for chunk in chunks]
        deferring = len(chunks) > 1
        for stage in self._stages:
            for bn in stage.deferred_bns:
                bn.deferring = deferring
        self._run(envs)
        if deferring:
            for stage in self._stages:
                for bn in stage.deferred_bns:
                    bn.commit()
        outputs = [graph_output(self._output_node, env, self._constants) for env in envs]
        return self._unflatten(to_device(gather(outputs), self.output_device))

    def _tasks(self, chunks: int) -> list[tuple[int, Stage]]:
        """(micro-batch, stage) in clock-tick order: forward of stage s on micro-batch i at i + level(s)."""
        order = self._task_order.get(chunks)
        if order is None:
            ticks = sorted((i + self._levels[s], s, i) for s in range(len(self._stages)) for i in range(chunks))
            order = self._task_order[chunks] = [(i, self._stages[s]) for _, s, i in ticks]
        return order

    def _run_task(self, env: dict[str, Any], stage: Stage, microbatch: int = -1) -> None:
        inputs = [to_device(env[name], stage.device) for name in stage.inputs]
        if not self.tracing:
            env.update(zip(stage.outputs, stage.module(*inputs)))
            return
        start = time.time()
        outputs = stage.module(*inputs)
        self._event("forward", stage, microbatch, start, time.time())
        env.update(zip(stage.outputs, outputs))
        self._trace_backward(stage, microbatch, inputs, outputs)

    def _event(self, kind: str, stage: Stage, microbatch: int, start: float, end: float) -> None:
        self.trace.append({"kind": kind, "stage": stage.index, "microbatch": microbatch, "start": start, "end": end,
                           "device": f"{stage.device} (worker {self._worker_of[stage.index]})"})

    def _trace_backward(self, stage: Stage, microbatch: int, inputs: list[Any], outputs: Any) -> None:
        """Record a stage's backward: from its outputs' gradients arriving to its inputs' being done."""
        outs = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not torch.is_grad_enabled():
            return
        began: list[float] = []

        def first(_: Any) -> None:
            began.append(time.time())

        def done(_: Any) -> None:
            if began:
                self._event("backward", stage, microbatch, began[0], time.time())

        torch.autograd.graph.register_multi_grad_hook(outs, first, mode="any")
        if ins:
            torch.autograd.graph.register_multi_grad_hook(ins, done, mode="all")

    def measured_timeline(self, origin: float | None = None) -> dict[str, Any]:
        """The recorded trace as {"devices": [{"device", "events"}]} in ms, for plan.visualize(measured=...).

        Forward events are timed directly; a stage's backward runs from its outputs'
        gradients arriving to its inputs' gradients being computed (stages whose inputs
        need no gradient, such as the first, have no backward event).
        """
        t0 = origin if origin is not None else min((e["start"] for e in self.trace), default=0.0)
        rows: dict[str, list[dict[str, Any]]] = {}
        for e in self.trace:
            rows.setdefault(e["device"], []).append({**e, "start": (e["start"] - t0) * 1e3, "end": (e["end"] - t0) * 1e3})
        return {"devices": [{"device": d, "events": ev} for d, ev in rows.items()]}

    def _run(self, envs: list[dict[str, Any]]) -> None:
        if not self._threaded:
            for i, stage in self._tasks(len(envs)):
                self._run_task(envs[i], stage, i)
            return
        grad = torch.is_grad_enabled()  # thread-local: each worker takes the caller's
        producer = {name: s.index for s in self._stages for name in s.outputs}
        done: dict[tuple[int, int], Future[None]] = {}

        def task(i: int, stage: Stage, waits: list[Future[None]]) -> None:
            for w in waits:
                w.result()
            with torch.set_grad_enabled(grad), _device_context(stage.device):
                self._run_task(envs[i], stage, i)

        for i, stage in self._tasks(len(envs)):
            waits = [done[(i, producer[n])] for n in stage.inputs if n in producer]
            key = self._worker_of[stage.index]
            worker = self._workers.get(key)
            if worker is None:
                worker = self._workers[key] = ThreadPoolExecutor(1, thread_name_prefix=f"pipe-{key}")
            done[(i, stage.index)] = worker.submit(task, i, stage, waits)
        errors = [f.exception() for f in done.values()]
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    def close(self) -> None:
        """Stop the worker threads (they are also stopped when the pipeline is garbage collected)."""
        for worker in self._workers.values():
            worker.shutdown(wait=True)
        self._workers.clear()

    def __del__(self) -> None:
        for worker in getattr(self, "_workers", {}).values():
            worker.shutdown(wait=False)
