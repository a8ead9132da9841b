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

from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx

from runtime.boundary import as_leaves, detached, gradients, leaves, summed
from runtime.caller_backward import at_backward_end, trace_backward
from runtime.clock import Clock, Mark
from runtime.loss_split import SplitLogits
from runtime.microbatch import output_builder, to_device
from runtime.mutation import own_copies
from runtime.program import Op
from runtime.routes import Routes, stage_aliases
from runtime.split_backward import WeightWork, backward_input, backward_weight
from runtime.stage import Stage, switches_state
from runtime.steps import StepInputs, micro_batch_loss
from runtime.thread_state import caller_state
from runtime.transport import Key, Span, Transport, batch_spans
from runtime.versions import StageVersions
from runtime.weight_grads import SelfComputed, WeightGradHook, check_self_computed, self_computed

__all__ = ["Interpreter", "Routes", "Transport"]

_NO_STEP = StepInputs([], "forward")  # between steps
_HOST = Clock("cpu")  # marks are time.time() values: one clock serves every step that is not traced


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
        self.device = stages[0].device if stages else torch.device("cpu")  # this rank's
        # Stages whose graph switches grad mode or autocast: only around those is the caller's state restored.
        self._restores = {s.index for s in stages if switches_state(s.module)}
        self._batches: dict[int, tuple[Sequence[Op], list[Span]]] = {}  # id(program ops) -> its batches, see `run`
        self.shared: frozenset[tuple[int, int]] = frozenset()  # see `begin`
        self._inline: set[int] = set()  # see `begin`
        self.routes = routes
        self.transport = transport
        self.rank_of = rank_of
        self.rank = rank
        self.last = len(routes.reads) - 1
        self._constants = dict(constants)
        self._unflatten = unflatten_outputs
        self._reduce = reduce
        self.tracing = False
        self.clock = _HOST  # per step: CUDA events on a GPU while tracing (see runtime.clock), else time.time()
        self._trace: list[dict[str, Any]] = []
        self._unresolved: list[tuple[dict[str, Any], Clock]] = []  # entries still holding marks, not seconds
        self.outputs: dict[int, Any] = {}
        self.loss: torch.Tensor | None = None
        # One step's state (`begin` to `end`): what backwards will use, what waits to be sent
        self.saved: dict[tuple[int, int], tuple[dict[int, list[Any]], dict[str, Any], Any]] = {}
        self.weight_work: dict[tuple[int, int], WeightWork] = {}  # a split B's part for its W
        self.outgoing: dict[Key, list[Any]] = {}
        self._batch: list[Op] = []
        # Asynchronous updates (runtime.versions): each stage's weight versions, and the stream's state.
        self.versions: dict[int, StageVersions] = {}
        self.weighted_backward = True  # False (stash): each micro-batch's update uses its own loss, unweighted
        self.batch_losses: dict[int, tuple[torch.Tensor, int]] = {}  # stream: batch -> (loss so far, forwards)
        self._micro: dict[int, tuple[StepInputs, int]] = {}  # micro-batch -> (its step, its index there)
        self.aliases = stage_aliases(stages, routes)  # values that are pipeline inputs (runtime.mutation)
        self.weight_grad_hook: WeightGradHook | None = None  # see runtime.weight_grads
        self.self_computed: dict[int, list[SelfComputed]] = {}
        for call in self_computed(stages):
            self.self_computed.setdefault(call.stage, []).append(call)
        self._reads, self._sends, self._moves = routes.walks(stages)  # what a forward walks, worked out once
        self._output = output_builder(output_node, self._constants)
        self._rare = {s.index for s in stages if s.writes} | self._restores | set(self.self_computed)
        self.logits = SplitLogits(self.stages[self.last].module if self.last in self.stages else None)

    @property
    def trace(self) -> list[dict[str, Any]]:
        """Recorded events, {kind, stage, microbatch, start, end, peer}, times in time.time() seconds."""
        pending, self._unresolved = self._unresolved, []
        for clock in dict.fromkeys(c for _, c in pending):
            clock.resolve()  # CUDA: one synchronize per clock
        for entry, clock in pending:
            entry["start"], entry["end"] = clock.seconds(entry["start"]), clock.seconds(entry["end"])
        return self._trace

    def begin(self, step: StepInputs, local: dict[Key, list[Any]],
              shared: frozenset[tuple[int, int]] = frozenset()) -> None:
        """Start a step; `local` holds values between stages of this rank, and between the (src, dst) stage
        pairs in `shared` (workers of one process in one thread, on one device: no SEND/RECV)."""
        if shared is not self.shared:
            self.shared, self._inline = shared, self.routes.inline(self.stages, shared)
        if self.tracing or self.clock is not _HOST:
            self.clock = Clock(self._device()) if self.tracing else _HOST
        self.step = step
        self.local = local
        self._micro = {i: (step, i) for i in range(len(step.envs))}
        self.envs = {i: dict(env) for i, env in enumerate(step.envs)}
        if self.saved or self.weight_work or self.outgoing or self._batch:  # what a failed step left
            self.saved, self.weight_work, self.outgoing, self._batch = {}, {}, {}, []
        if self.outputs:  # a new dict only where the caller did not take the last
            self.outputs = {}
        train_last = step.mode == "train" and self.last in self.stages
        self.loss = torch.zeros((), device=self._device()) if train_last else None
        self.logits.start(train_last)
        self._streaming = False

    def end(self) -> None:
        """End a step, even one that failed: let go of the values it held for later ops (stage outputs,
        received values, what backwards were to use), so autograd frees them with the rest of the graph,
        as the plain model's, not the next step (`outputs` and `loss` stay for the caller)."""
        self.envs = {}
        self._micro = {}
        self.local = {}
        self.logits.start(False)
        if self.saved or self.weight_work or self.outgoing or self._batch:  # a failed step
            self.saved, self.weight_work, self.outgoing, self._batch = {}, {}, {}, []
        self.step = _NO_STEP

    def begin_stream(self, local: dict[Key, list[Any]]) -> None:
        """Start a stream of calls (runtime.flushless): what forwards save lives on from call to call."""
        self.begin(StepInputs([], "train"), local)
        self._streaming = True
        self.batch_losses = {}

    def add_batch(self, step: StepInputs, batch: int) -> None:
        """Batch `batch` of a stream: its micro-batches are numbered batch * m .. batch * m + m - 1."""
        self.clock = Clock(self._device()) if self.tracing else _HOST
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
        spans = self._spans(ops)
        at = {first: b for b, (first, _, _) in enumerate(spans)}
        posted = self._post_early(ops, spans, 0)  # batches before this one are posted
        k = 0
        while k < len(ops):
            b = at.get(k)
            if b is None:
                self.compute(ops[k])
                k += 1
                continue
            first, end, _ = spans[b]
            if b == posted:
                self.post(list(ops[first:end]))
                posted = self._post_early(ops, spans, b + 1)
            k = end

    def _spans(self, ops: Sequence[Op]) -> list[Span]:
        """(first op, end, has a send) of each batch of `ops`: walked once per program, not per step."""
        cached = self._batches.get(id(ops))
        if cached is not None and cached[0] is ops:
            return cached[1]
        spans = batch_spans(ops)
        if len(self._batches) >= 8:  # a stream's calls are new lists each time: keep the plan's few
            self._batches.clear()
        self._batches[id(ops)] = (ops, spans)  # holding `ops` keeps its id from being reused
        return spans

    def _post_early(self, ops: Sequence[Op], spans: list[Span], posted: int) -> int:
        while posted < len(spans) and not spans[posted][2] and self.transport.can_post_early:
            first, end, _ = spans[posted]
            self.post(list(ops[first:end]))
            posted += 1
        return posted

    def execute(self, op: Op) -> None:
        """Run `op`; consecutive SEND/RECV of one tick are held and posted as one batch before the next op."""
        if op.is_p2p:
            if self._batch and self._batch[-1].tick != op.tick:
                self.flush_batch()
            self._batch.append(op)
            return
        self.flush_batch()
        self.compute(op)

    def compute(self, op: Op) -> None:
        """Run one F, B, W or AR (STEP: nothing)."""
        kind = op.kind
        if kind == "F":
            self._forward(op.stage, op.microbatch)
        elif kind == "B":
            self._backward(op.stage, op.microbatch, split=op.split)
        elif kind == "AR":
            start = self._mark()
            self._reduce(op.group)
            self._record("allreduce", min(self.stages, default=-1), -1, start)
        elif kind == "W":
            self._weight(op.stage, op.microbatch)

    def flush_batch(self) -> None:
        """Post the pending batch of sends and receives (one `batch_isend_irecv` on a P2P transport)."""
        if self._batch:
            batch, self._batch = self._batch, []
            self.post(batch)

    def post(self, batch: Sequence[Op]) -> None:
        """Post one batch of SEND/RECV ops of one tick, with the values this rank's ops left to send."""
        start = self._mark()
        outgoing: dict[Key, list[Any]] = {}
        for op in batch:  # a message to several tensor ranks is several SENDs of one key (runtime.program)
            if op.kind == "SEND" and op.key() not in outgoing:
                outgoing[op.key()] = self.outgoing.pop(op.key())
        self.transport.post(batch, outgoing, self.device)
        if self.tracing:
            self._record("send" if outgoing else "recv", batch[0].src, batch[0].microbatch, start, batch[0].peer)

    def _mark(self) -> Mark:
        """A start mark for `_record` (nothing to take while not tracing)."""
        return self.clock.mark() if self.tracing else 0.0

    def _device(self) -> torch.device:
        return self.device

    # ---- compute ----

    def _local(self, key: Key) -> bool:
        return (key[0], key[1]) in self.shared or self.rank_of(key[0], key[2]) == self.rank_of(key[1], key[2])

    def _value(self, key: Key, device: torch.device) -> list[Any]:
        if self._local(key):
            return self.local.pop(key)
        start = self._mark()
        values = self.transport.take(key, device)
        if self.tracing:
            self._record("recv", key[1], key[2], start, self.rank_of(key[0], key[2]))
        return values

    def _give(self, key: Key, values: list[Any]) -> None:
        if self._local(key):
            self.local[key] = values if self.step.mode == "forward" else detached(values)
        else:
            self.outgoing[key] = values

    def _forward(self, s: int, i: int) -> None:
        stage = self.stages[s]
        env = self.envs[i]
        step, j = self._micro[i]
        train = step.mode == "train"
        quick = not (train or self.tracing or self.versions or self.weight_grad_hook is not None)
        if quick and s in self._inline and s not in self._rare:  # pipe(x) in one thread, nothing special: short way
            local = self.local
            for t, names in self._reads[s]:
                env.update(zip(names, local.pop((t, s, i))))
            env.update(zip(stage.outputs, stage.module(*[to_device(env[name], stage.device) if move else env[name]
                                                         for name, move in zip(stage.inputs, self._moves[s])])))
            for c, names in self._sends[s]:
                local[(s, c, i)] = [env[n] for n in names]
            if s == self.last:
                self.outputs[i] = self._output(env)
            return
        received: dict[int, list[Any]] = {}  # what the backward sends gradients back for (train)
        for t, names in self._reads[s]:
            values = self._value((t, s, i), stage.device)
            if train:
                values = received[t] = as_leaves(values)
            env.update(zip(names, values))
        inputs = [to_device(env[name], stage.device) if move else env[name]
                  for name, move in zip(stage.inputs, self._moves[s])]
        if stage.writes:  # its own copies (runtime.mutation): the caller's tensors get them (steps.write_back)
            inputs = own_copies(stage.inputs, inputs, stage.writes)
            step.envs[j].update((self.aliases[n], v) for n, v in zip(stage.inputs, inputs)
                                if n in stage.writes and self.aliases.get(n) in step.written)
        start = self.clock.mark() if self.tracing else 0.0
        if s in self._restores:
            with caller_state():  # grad mode and autocast restored whatever the stage switches, even if it raises
                outputs = self._call(stage, i, inputs)
        else:
            outputs = self._call(stage, i, inputs)
        if self.tracing:
            self._record("forward", s, i, start)
        env.update(zip(stage.outputs, outputs))
        for c, names in self._sends[s]:
            self._give((s, c, i), [env[n] for n in names])
        loss = None
        if s == self.last:
            out = self._output(env)
            if train:  # the loss sees what the model returns; pipe(x) gathers raw outputs, then unflattens
                raw = self.logits.loss(i, lambda o, t: micro_batch_loss(step, j, o, stage.device, t),
                                        self._unflatten(out), step.targets[j], step.reduction, step.per_token)
                loss = raw * step.weights[j]
                self._count_loss(i, loss.detach())
                if not self.weighted_backward:
                    loss = raw
            else:
                self.outputs[i] = out
        if train:
            self.saved[(s, i)] = (received, dict(zip(stage.outputs, outputs)), loss)
            return
        if self.tracing:
            clock = self.clock  # the hooks may fire after the next step has begun
            trace_backward(inputs, outputs, clock.mark, lambda b: self._record("backward", s, i, b, clock=clock))
        if self.weight_grad_hook is not None:
            hook = self.weight_grad_hook
            at_backward_end(outputs, lambda: hook(stage.module))
        elif s in self.self_computed and len(step.envs) > 1:
            calls, m = self.self_computed[s], len(step.envs)
            at_backward_end(outputs, lambda: check_self_computed(calls, m))

    def _call(self, stage: Stage, i: int, inputs: list[Any]) -> Any:
        if stage.index in self.versions:  # asynchronous updates: the version of the weights micro-batch i reads
            weights = self.versions[stage.index].weights(stage.module, i)
            return torch.func.functional_call(stage.module, weights, tuple(inputs))
        return stage.module(*inputs)

    def _backward(self, s: int, i: int, split: bool = False) -> None:
        """Gradients from the outputs' back to the inputs (sent on); with `split`, the weights' wait for W."""
        received, outputs, loss = self.saved.pop((s, i))
        device = self.stages[s].device
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if loss is not None:
            roots, grads = [loss], [None]
        arrived: dict[str, Any] = {}  # each output's gradient, summed over the stages that read it
        for c, names in self.routes.sends[s].items():
            for name, g in zip(names, self._value((c, s, i), device)):
                arrived[name] = g if name not in arrived else summed(arrived[name], g)
        for name, g in arrived.items():
            for value, grad in zip(leaves(outputs.get(name, self.envs[i].get(name))), leaves(g)):
                if isinstance(value, torch.Tensor) and value.requires_grad and grad is not None:
                    roots.append(value)
                    grads.append(grad.to(value.device))
        if roots:
            start = self._mark()
            with self.logits.backward(i if loss is not None else None):
                if split and self.weight_grad_hook is None:  # see runtime.split_backward
                    inputs = [x for x in leaves(received) if isinstance(x, torch.Tensor) and x.requires_grad]
                    self.weight_work[(s, i)] = backward_input(roots, grads, inputs)
                else:  # whole; with a weight-gradient hook W runs only the hook (runtime.weight_grads)
                    torch.autograd.backward(roots, grads)
                    if split:
                        self.weight_work[(s, i)] = WeightWork()
                    elif self.weight_grad_hook is not None:
                        self.weight_grad_hook(self.stages[s].module)
            self._record("backward", s, i, start)
        if s in self.versions:
            self.versions[s].backward_done(i)
        for t, values in received.items():
            self._give((s, t, i), [gradients(v) for v in values])
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
            start = self._mark()
            backward_weight(work)
            if self.weight_grad_hook is not None:
                self.weight_grad_hook(self.stages[s].module)
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
