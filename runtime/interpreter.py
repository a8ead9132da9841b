"""The one execution core: run a rank's program (runtime.program) over a transport.

Both runtimes use it: the one-process Pipeline runs one interpreter per worker over a
LocalTransport, the torchrun DistributedPipeline one per process over a P2PTransport.

    program:  F s0 mb0 | SEND s0->s1 mb0 | F s0 mb1 | SEND ... | RECV s1->s0 mb0 | B s0 mb0 | AR | STEP
                 |          |                                      |               |
    stage module(*inputs)   transport.post(batch)          transport.take(key)   autograd.backward

Two modes. "train": stage boundaries are detached; a forward keeps what its backward needs,
the last stage computes the loss, a backward sends its inputs' gradients back (any schedule,
1F1B memory included). "forward": forwards only and boundaries stay attached, so the caller's
`loss.backward()` runs through every stage (how `pipe(x)` works in one process).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from runtime.clock import Clock, Mark
from runtime.microbatch import graph_output, to_device
from runtime.program import Op
from runtime.split_backward import WeightWork, backward_input, backward_weight
from runtime.stage import Stage
from runtime.steps import StepInputs
from runtime.thread_state import caller_state
from runtime.versions import StageVersions

__all__ = ["Interpreter", "Routes", "Transport"]

Key = tuple[int, int, int]  # (src stage, dst stage, micro-batch)


class Transport(Protocol):
    """Moves values between ranks: `post` a batch of SEND/RECV ops, then `take` what arrived.

    `can_post_early`: receive-only batches may be posted ahead of their turn (in order) now.
    """

    @property
    def can_post_early(self) -> bool: ...

    def post(self, ops: Sequence[Op], outgoing: Mapping[Key, list[Any]], device: Any) -> None: ...

    def take(self, key: Key, device: Any) -> list[Any]: ...


@dataclass
class Routes:
    """Which value names each stage reads from and sends to every other stage.

    `reads[s][t]`: names stage s reads from stage t; `sends[t][s]`: the same, seen by t.
    Values only the model output reads are routed to the last stage, which assembles it.
    """

    reads: list[dict[int, list[str]]]
    sends: list[dict[int, list[str]]]

    @classmethod
    def of(cls, io: Sequence[tuple[list[str], list[str]]], output_node: torch.fx.Node) -> Routes:
        producer = {name: s for s, (_, outs) in enumerate(io) for name in outs}
        last = len(io) - 1
        out_names: list[str] = []
        torch.fx.node.map_arg(output_node.args[0], lambda n: out_names.append(n.name) or n)  # type: ignore[func-returns-value]
        needs = [list(ins) for ins, _ in io]
        needs[last] += [n for n in dict.fromkeys(out_names) if producer.get(n, last) != last and n not in needs[last]]
        reads: list[dict[int, list[str]]] = [{} for _ in io]
        sends: list[dict[int, list[str]]] = [{} for _ in io]
        for s, names in enumerate(needs):
            for name in names:
                if name in producer:
                    reads[s].setdefault(producer[name], []).append(name)
                    sends[producer[name]].setdefault(s, []).append(name)
        return cls(reads, sends)

    def producers(self) -> list[list[int]]:
        return [sorted(r) for r in self.reads]


class Interpreter:
    """Runs one rank's ops for the stages it holds; `run` a whole program or `execute` op by op."""

    def __init__(
        self,
        stages: Sequence[Stage],
        routes: Routes,
        transport: Transport,
        rank_of: Callable[[int, int], int],
        rank: int,
        output_node: torch.fx.Node,
        constants: Mapping[str, Any],
        unflatten_outputs: Callable[[Any], Any],
        reduce: Callable[[tuple[int, ...]], None] = lambda group: None,
    ) -> None:
        self.stages = {s.index: s for s in stages}
        self.routes = routes
        self.transport = transport
        self.rank_of = rank_of
        self.rank = rank
        self.last = len(routes.reads) - 1
        self._output_node = output_node
        self._constants = dict(constants)
        self._unflatten = unflatten_outputs
        self._reduce = reduce
        self.tracing = False
        self.clock = Clock()  # per step: CUDA events on a GPU while tracing (see runtime.clock), else time.time()
        self._trace: list[dict[str, Any]] = []
        self._unresolved: list[tuple[dict[str, Any], Clock]] = []  # entries still holding marks, not seconds
        self.outputs: dict[int, Any] = {}
        self.loss: torch.Tensor | None = None
        # Asynchronous updates (runtime.versions): each stage's weight versions, and the stream's state.
        self.versions: dict[int, StageVersions] = {}
        self.weighted_backward = True  # False (stash): each micro-batch's update uses its own loss, unweighted
        self.batch_losses: dict[int, tuple[torch.Tensor, int]] = {}  # stream: batch -> (loss so far, forwards)
        self._micro: dict[int, tuple[StepInputs, int]] = {}  # micro-batch -> (its step, its index there)

    @property
    def trace(self) -> list[dict[str, Any]]:
        """Recorded events, {kind, stage, microbatch, start, end, peer}, times in time.time() seconds."""
        pending, self._unresolved = self._unresolved, []
        for clock in dict.fromkeys(c for _, c in pending):
            clock.resolve()  # CUDA: one synchronize per clock
        for entry, clock in pending:
            entry["start"], entry["end"] = clock.seconds(entry["start"]), clock.seconds(entry["end"])
        return self._trace

    def begin(self, step: StepInputs, local: dict[Key, list[Any]]) -> None:
        """Start a step; `local` holds values between stages of this process (shared by its workers)."""
        self.clock = Clock(self._device() if self.tracing else "cpu")
        self.step = step
        self.local = local
        self._micro = {i: (step, i) for i in range(len(step.envs))}
        self.envs = {i: dict(env) for i, env in enumerate(step.envs)}
        self.saved: dict[tuple[int, int], tuple[dict[int, list[Any]], dict[str, Any], Any]] = {}
        self.weight_work: dict[tuple[int, int], WeightWork] = {}  # a split B's part for its W
        self.outgoing: dict[Key, list[Any]] = {}
        self.outputs = {}
        train_last = step.mode == "train" and self.last in self.stages
        self.loss = torch.zeros((), device=self._device()) if train_last else None
        self._batch: list[Op] = []
        self._streaming = False

    def begin_stream(self, local: dict[Key, list[Any]]) -> None:
        """Start a stream of calls (runtime.stream): what forwards save lives on from call to call."""
        self.begin(StepInputs([], "train"), local)
        self._streaming = True
        self.batch_losses = {}

    def add_batch(self, step: StepInputs, batch: int) -> None:
        """Batch `batch` of a stream: its micro-batches are numbered batch * m .. batch * m + m - 1."""
        self.clock = Clock(self._device() if self.tracing else "cpu")
        m = len(step.envs)
        for j, env in enumerate(step.envs):
            self._micro[batch * m + j] = (step, j)
            self.envs[batch * m + j] = dict(env)
        if self.last in self.stages:
            self.batch_losses[batch] = (torch.zeros((), device=self._device()), 0)

    @property
    def in_flight(self) -> int:
        """Micro-batches forwarded here whose backward has not run yet."""
        return len(self.saved)

    def run(self, ops: Sequence[Op]) -> None:
        """Run a whole program. Receive-only batches are posted as early as the transport allows
        (right after the batch before them), so data flows while this rank computes; batches
        are still posted in the program's order, which is all NCCL's rules need."""
        spans: list[tuple[int, int, bool]] = []  # (first op, end, has a send) of each batch
        k = 0
        while k < len(ops):
            end = k + 1
            if ops[k].is_p2p:
                while end < len(ops) and ops[end].is_p2p and ops[end].tick == ops[k].tick:
                    end += 1
                spans.append((k, end, any(op.kind == "SEND" for op in ops[k:end])))
            k = end
        at = {first: b for b, (first, _, _) in enumerate(spans)}
        posted = 0  # batches before this one are posted
        posted = self._post_early(ops, spans, posted)
        k = 0
        while k < len(ops):
            b = at.get(k)
            if b is None:
                self.execute(ops[k])
                k += 1
                continue
            first, end, _ = spans[b]
            if b == posted:
                self._post(list(ops[first:end]))
                posted = self._post_early(ops, spans, b + 1)
            k = end

    def _post_early(self, ops: Sequence[Op], spans: list[tuple[int, int, bool]], posted: int) -> int:
        while posted < len(spans) and not spans[posted][2] and self.transport.can_post_early:
            first, end, _ = spans[posted]
            self._post(list(ops[first:end]))
            posted += 1
        return posted

    def execute(self, op: Op) -> None:
        if op.is_p2p:
            if self._batch and self._batch[-1].tick != op.tick:
                self.flush_batch()
            self._batch.append(op)
            return
        self.flush_batch()
        if op.kind == "F":
            self._forward(op.stage, op.microbatch)
        elif op.kind == "B":
            self._backward(op.stage, op.microbatch, split=op.split)
        elif op.kind == "AR":
            start = self.clock.mark()
            self._reduce(op.group)
            self._record("allreduce", min(self.stages, default=-1), -1, start)
        elif op.kind == "W":
            self._weight(op.stage, op.microbatch)

    def flush_batch(self) -> None:
        """Post the pending batch of sends and receives (one `batch_isend_irecv` on a P2P transport)."""
        if self._batch:
            batch, self._batch = self._batch, []
            self._post(batch)

    def _post(self, batch: list[Op]) -> None:
        start = self.clock.mark()
        outgoing = {op.key(): self.outgoing.pop(op.key()) for op in batch if op.kind == "SEND"}
        self.transport.post(batch, outgoing, self._device())
        self._record("send" if outgoing else "recv", batch[0].src, batch[0].microbatch, start, batch[0].peer)

    def _device(self) -> torch.device:
        return next(iter(self.stages.values())).device if self.stages else torch.device("cpu")

    # ---- compute ----

    def _value(self, key: Key, device: torch.device) -> list[Any]:
        if self.rank_of(key[0], key[2]) == self.rank_of(key[1], key[2]):
            return self.local.pop(key)
        start = self.clock.mark()
        values = self.transport.take(key, device)
        self._record("recv", key[1], key[2], start, self.rank_of(key[0], key[2]))
        return values

    def _give(self, key: Key, values: list[Any]) -> None:
        if self.rank_of(key[0], key[2]) == self.rank_of(key[1], key[2]):
            self.local[key] = values if self.step.mode == "forward" else pytree.tree_map(_detached, values)
        else:
            self.outgoing[key] = values

    def _forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        env = self.envs[i]
        step, j = self._micro[i]
        train = step.mode == "train"
        received: dict[int, list[Any]] = {}
        for t, names in self.routes.reads[s].items():
            values = self._value((t, s, i), stage.device)
            if train:
                values = pytree.tree_map(_as_leaf, values)
            received[t] = values
            env.update(zip(names, values))
            if train and stage.writes:  # a leaf cannot be written in place; its clone can, gradients still reach it
                env.update({n: _non_leaf(v) for n, v in zip(names, values) if n in stage.writes})
        inputs = [to_device(env[name], stage.device) for name in stage.inputs]
        start = self.clock.mark()
        with caller_state():  # grad mode and autocast restored whatever the stage switches, even if it raises
            if s in self.versions:  # asynchronous updates: the version of the weights this micro-batch reads
                weights = self.versions[s].weights(stage.module, i)
                outputs = torch.func.functional_call(stage.module, weights, tuple(inputs))
            else:
                outputs = stage.module(*inputs)
        self._record("forward", s, i, start)
        env.update(zip(stage.outputs, outputs))
        for c, names in self.routes.sends[s].items():
            self._give((s, c, i), [env[n] for n in names])
        loss = None
        if s == self.last:
            out = graph_output(self._output_node, env, self._constants)
            if train:  # the loss sees what the model returns; pipe(x) gathers raw outputs, then unflattens
                assert step.loss_fn is not None and self.loss is not None
                raw = step.loss_fn(self._unflatten(out), to_device(step.targets[j], stage.device))
                loss = raw * step.weights[j]
                self._count_loss(i, loss.detach())
                if not self.weighted_backward:
                    loss = raw
            else:
                self.outputs[i] = out
        if train:
            self.saved[(s, i)] = (received, dict(zip(stage.outputs, outputs)), loss)
        elif self.tracing:
            self._trace_backward(s, i, inputs, outputs)

    def _trace_backward(self, s: int, i: int, inputs: list[Any], outputs: Any) -> None:
        """Forward mode: record the stage's backward under the caller's autograd, from its outputs'
        gradients arriving to its inputs' being done (stages whose inputs need none have no event)."""
        outs = [t for t in pytree.tree_leaves(outputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        ins = [t for t in pytree.tree_leaves(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not outs or not ins or not torch.is_grad_enabled():
            return
        began: list[Mark] = []
        clock = self.clock  # the hooks may fire after the next step has begun

        def first(_: Any) -> None:
            began.append(clock.mark())

        def done(_: Any) -> None:
            if began:
                self._record("backward", s, i, began[0], clock=clock)

        torch.autograd.graph.register_multi_grad_hook(outs, first, mode="any")
        torch.autograd.graph.register_multi_grad_hook(ins, done, mode="all")

    def _backward(self, s: int, i: int, split: bool = False) -> None:
        """Gradients from the outputs' back to the inputs (sent on); with `split`, the weights' wait for W."""
        received, outputs, loss = self.saved.pop((s, i))
        device = self.stages[s].device
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None:
            roots, grads = [loss], [None]
        summed: dict[str, Any] = {}
        for c, names in self.routes.sends[s].items():
            for name, g in zip(names, self._value((c, s, i), device)):
                summed[name] = g if name not in summed else pytree.tree_map(_add, summed[name], g, is_leaf=_is_none)
        for name, g in summed.items():
            for value, grad in zip(_leaves(outputs.get(name, self.envs[i].get(name))), _leaves(g)):
                if isinstance(value, torch.Tensor) and value.requires_grad and grad is not None:
                    roots.append(value)
                    grads.append(grad.to(value.device))
        if roots:
            start = self.clock.mark()
            if split:  # see runtime.split_backward
                inputs = [x for x in _leaves(received) if isinstance(x, torch.Tensor) and x.requires_grad]
                self.weight_work[(s, i)] = backward_input(roots, grads, inputs)
            else:
                torch.autograd.backward(roots, grads)
            self._record("backward", s, i, start)
        if s in self.versions:
            self.versions[s].backward_done(i)
        for t, values in received.items():
            self._give((s, t, i), [pytree.tree_map(_grad_of, v, is_leaf=_is_none) for v in values])
        step, j = self._micro[i]
        self.envs[i] = dict(step.envs[j])  # drop this micro-batch's activations
        if self._streaming and not any(k[1] == i for k in self.saved):
            del self.envs[i], self._micro[i]

    def _count_loss(self, i: int, loss: torch.Tensor) -> None:
        """Add micro-batch i's weighted loss to its step's (stream: to its batch's, with a count of forwards)."""
        assert self.loss is not None
        if not self._streaming:
            self.loss += loss
            return
        step, j = self._micro[i]
        batch = (i - j) // len(step.envs)
        total, count = self.batch_losses[batch]
        self.batch_losses[batch] = (total + loss, count + 1)

    def _weight(self, s: int, i: int) -> None:
        """W: the weight gradients a split B left (nothing when B ran the whole backward)."""
        work = self.weight_work.pop((s, i), None)
        if work is not None:
            start = self.clock.mark()
            backward_weight(work)
            self._record("weight", s, i, start)

    def _record(
        self, kind: str, stage: int, microbatch: int, start: Mark, peer: int = -1, clock: Clock | None = None
    ) -> None:
        """Trace an op from `start` (a mark of `clock`, or a time.time() value) to now."""
        if self.tracing:
            clock = clock or self.clock
            entry = {"kind": kind, "stage": stage, "microbatch": microbatch, "start": start, "end": clock.mark(),
                     "peer": peer}
            self._trace.append(entry)
            self._unresolved.append((entry, clock))


def _is_none(x: Any) -> bool:
    return x is None


def _leaves(tree: Any) -> list[Any]:
    return pytree.tree_flatten(tree, is_leaf=_is_none)[0]


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _grad_of(x: Any) -> Any:
    return x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _as_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled():
        return x.detach().requires_grad_(True)
    return x


def _non_leaf(x: Any) -> Any:
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, x)
