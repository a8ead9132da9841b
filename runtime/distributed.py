"""One pipeline rank under torch.distributed: its stages, its share of the schedule, its gradients.

Every rank holds the stages the plan gives it and runs its action list (GPipe, 1F1B or
interleaved 1F1B); replicas of a stage take micro-batches in turn (micro-batch i goes to
replica i mod r). Stage boundaries are detached: a forward sends its outputs to the ranks
that read them, a backward receives their gradients, runs autograd locally and sends the
gradients of its own inputs back.

    rank 0 (stage 0): F0 F1 . . B0 B1        -> activations ->
    rank 1 (stage 1):    F0 F1 B0 B1         <- gradients  <-

A weight held by several ranks (replicas of a stage, or a tied weight read by two stages)
has its gradient summed over exactly the ranks holding it, so every copy takes the same
update and the sum equals single-process full-batch training.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.distributed as dist
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from runtime import checkpoint
from runtime.microbatch import graph_output, scatter, to_device
from runtime.p2p import Messenger
from runtime.plan import Plan
from runtime.schedule import Action
from runtime.stage import Stage, tensor_stages

__all__ = ["DistributedPipeline"]

_BUCKET_BYTES = 25 << 20
FORWARD, BACKWARD = 0, 1


def _is_none(x: Any) -> bool:
    return x is None


def _leaves(tree: Any) -> list[Any]:
    return pytree.tree_flatten(tree, is_leaf=_is_none)[0]


class _GradGroup:
    """Weights held by the same set of ranks, all-reduced together in buckets."""

    def __init__(self, ranks: tuple[int, ...], params: list[nn.Parameter], stages: set[int]) -> None:
        self.ranks = ranks
        self.params = params
        self.stages = stages  # local stages reading these weights
        self.group: Any = None
        self.pending: list[tuple[Any, torch.Tensor, list[nn.Parameter]]] = []

    def start(self) -> None:
        bucket: list[nn.Parameter] = []
        size = 0
        for p in self.params + [None]:  # type: ignore[list-item]
            if p is None or (bucket and size + p.numel() * p.element_size() > _BUCKET_BYTES):
                if bucket:
                    flat = torch.cat([(q.grad if q.grad is not None else torch.zeros_like(q)).reshape(-1) for q in bucket])
                    self.pending.append((dist.all_reduce(flat, group=self.group, async_op=True), flat, bucket))
                bucket, size = [], 0
            if p is not None:
                bucket.append(p)
                size += p.numel() * p.element_size()

    def finish(self) -> None:
        pending, self.pending = self.pending, []
        for work, flat, bucket in pending:
            work.wait()
            offset = 0
            for q in bucket:
                part = flat[offset : offset + q.numel()].view_as(q)
                offset += q.numel()
                if q.grad is None:
                    q.grad = part.clone()
                else:
                    q.grad.copy_(part)


class DistributedPipeline(nn.Module):
    """This rank's part of a pipelined model; `train_step` runs one step of the whole job."""

    def __init__(
        self,
        model: nn.Module,
        gm: torch.fx.GraphModule,
        plan: Plan,
        stages: list[Stage],
        io: list[tuple[list[str], list[str]]],
        schedule: Sequence[Sequence[Action]],
        flatten_inputs: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
        unflatten_outputs: Callable[[Any], Any],
        input_names: list[str],
        constants: Mapping[str, Any],
        timeout_s: float,
    ) -> None:
        super().__init__()
        self.plan = plan
        self.rank = dist.get_rank()
        self.stage_modules = nn.ModuleList([s.module for s in stages])
        self._model = [model]
        self._stages = {s.index: s for s in stages}
        self._flatten = flatten_inputs
        self._unflatten = unflatten_outputs
        self._input_names = input_names
        self._constants = dict(constants)
        self._output_node = next(n for n in gm.graph.nodes if n.op == "output")
        self._last = len(plan.stages) - 1
        self.device = stages[0].device
        self._route(io)
        self._actions = [
            a for actions in schedule for a in actions
            if a.stage in self._stages and self.rank_of(a.stage, a.microbatch) == self.rank
        ]
        self.messenger = Messenger(self.device, len(plan.stages), plan.micro_batches, timeout_s, self.describe_rank)
        readers = tensor_stages(gm, plan.stage_of())
        self._groups = self._make_groups(model, readers)
        self.tracing = False  # set True to record `trace` (see `gather_trace`); off, it cannot grow
        self.trace: list[dict[str, Any]] = []
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

    def held_tensor_ids(self) -> set[int]:
        """Weights this rank holds: those its stages read, and (rank 0) those no stage reads."""
        return self._held

    def save_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Save this rank's weights and optimizer state; call on every rank (see runtime.checkpoint)."""
        checkpoint.save(self, path, optimizer)

    def load_checkpoint(self, path: str, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the weights and optimizer state this rank holds from a checkpoint of any plan."""
        checkpoint.load(self, path, optimizer)

    def rank_of(self, stage: int, microbatch: int) -> int:
        ranks = self.plan.stages[stage].ranks
        return ranks[microbatch % len(ranks)]

    def describe_rank(self, rank: int) -> str:
        stages = [s.index for s in self.plan.stages if rank in s.ranks]
        return f"rank {rank} (stage {', '.join(map(str, stages))})"

    def _route(self, io: list[tuple[list[str], list[str]]]) -> None:
        producer = {name: s for s, (_, outs) in enumerate(io) for name in outs}
        out_names: list[str] = []
        torch.fx.node.map_arg(self._output_node.args[0], lambda n: out_names.append(n.name) or n)
        needs = [list(ins) for ins, _ in io]
        needs[self._last] += [n for n in out_names if producer.get(n, self._last) != self._last and n not in needs[self._last]]
        # from_stage[s][t]: names stage s reads from stage t; to_stage[t][s]: the same, seen by t.
        self._from: list[dict[int, list[str]]] = [{} for _ in io]
        self._to: list[dict[int, list[str]]] = [{} for _ in io]
        for s, names in enumerate(needs):
            for name in names:
                if name in producer:
                    self._from[s].setdefault(producer[name], []).append(name)
                    self._to[producer[name]].setdefault(s, []).append(name)

    def _make_groups(self, model: nn.Module, readers: dict[int, tuple[torch.Tensor, list[int]]]) -> list[_GradGroup]:
        names = {id(p): n for n, p in model.named_parameters()}
        by_ranks: dict[tuple[int, ...], list[tuple[str, nn.Parameter, list[int]]]] = {}
        for t, stages in readers.values():
            if isinstance(t, nn.Parameter) and t.requires_grad and id(t) in names:
                ranks = tuple(sorted({r for s in stages for r in self.plan.stages[s].ranks}))
                by_ranks.setdefault(ranks, []).append((names[id(t)], t, stages))
        last_ranks = tuple(sorted(self.plan.stages[self._last].ranks))
        all_sets = sorted(set(k for k in by_ranks if len(k) > 1) | ({last_ranks} if len(last_ranks) > 1 else set()))
        groups: list[_GradGroup] = []
        self._loss_group = None
        for ranks in all_sets:  # every rank creates every group, in the same order
            handle = dist.new_group(list(ranks))
            if self.rank not in ranks:
                continue
            if ranks == last_ranks:
                self._loss_group = handle
            if ranks in by_ranks:
                entries = sorted(by_ranks[ranks], key=lambda e: e[0])
                local = {s for _, _, st in entries for s in st if s in self._stages}
                group = _GradGroup(ranks, [p for _, p, _ in entries], local)
                group.group = handle
                groups.append(group)
        return groups

    # ---- one training step ----

    def train_step(
        self,
        inputs: Any,
        targets: Any,
        loss_fn: Callable[[Any, Any], torch.Tensor],
        input_kwargs: Mapping[str, Any] | None = None,
        loss_reduction: str = "mean",
    ) -> torch.Tensor | None:
        """Forward and backward of one batch over all ranks; every rank calls it with the same batch.

        Each micro-batch's loss is weighted by its share of the batch (`loss_reduction="mean"`,
        for losses that average over samples) or not at all ("sum"), so gradients equal
        `loss_fn(model(inputs), targets).backward()` on the whole batch. Returns that loss on
        the ranks of the last stage, None elsewhere; the optimizer then steps on local weights.
        """
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
        args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
        m = self.plan.micro_batches
        chunks = scatter(self._flatten(args, dict(input_kwargs or {})), m)
        target_chunks = scatter([targets], m)
        total = sum(int(c[0].shape[0]) for c in target_chunks)
        self._envs = [dict(zip(self._input_names, c)) for c in chunks]
        self._targets = [c[0] for c in target_chunks]
        self._weights = [c[0].shape[0] / total if loss_reduction == "mean" else 1.0 for c in target_chunks]
        self._saved: dict[tuple[int, int], Any] = {}
        self._local: dict[tuple[int, int, int, int], Any] = {}
        self._loss = torch.zeros((), device=self.device)
        self._loss_fn = loss_fn
        for stage in self._stages.values():
            for bn in stage.deferred_bns:
                bn.deferring = m > 1
        remaining = {s: sum(1 for a in self._actions if a.stage == s and a.kind == "B") for s in self._stages}
        started: set[int] = set()
        self._expect_all()
        for action in self._actions:
            self.messenger.poll()
            if action.kind == "F":
                self._forward(action.stage, action.microbatch)
            else:
                self._backward(action.stage, action.microbatch)
                remaining[action.stage] -= 1
                for k, g in enumerate(self._groups):
                    if k not in started and all(remaining[s] == 0 for s in g.stages):
                        started.add(k)
                        try:
                            g.start()
                        except Exception as exc:  # noqa: BLE001
                            raise self.messenger.group_failure(g.ranks, exc) from None
        for stage in self._stages.values():
            for bn in stage.deferred_bns:
                bn.commit()
        self.messenger.flush()
        for g in self._groups:
            start = time.time()
            try:
                g.finish()
            except Exception as exc:  # noqa: BLE001 - a peer died during the all-reduce
                raise self.messenger.group_failure(g.ranks, exc) from None
            self._record("allreduce", min(g.stages, default=-1), -1, start)
        if self._last not in self._stages:
            return None
        if self._loss_group is not None:
            try:
                dist.all_reduce(self._loss, group=self._loss_group)
            except Exception as exc:  # noqa: BLE001
                raise self.messenger.group_failure(self.plan.stages[self._last].ranks, exc) from None
        return self._loss

    def _forward(self, s: int, i: int) -> None:
        stage = self._stages[s]
        env = self._envs[i]
        received: dict[int, list[Any]] = {}
        for t, names in self._from[s].items():
            values = self._take(FORWARD, t, s, i)
            values = pytree.tree_map(self._as_leaf, values)
            received[t] = values
            env.update(zip(names, values))
        inputs = [to_device(env[name], self.device) for name in stage.inputs]
        start = time.time()
        outputs = stage.module(*inputs)
        self._record("forward", s, i, start)
        env.update(zip(stage.outputs, outputs))
        self._saved[(s, i)] = (received, dict(zip(stage.outputs, outputs)))
        for c, names in self._to[s].items():
            self._give(FORWARD, s, c, i, [env[n] for n in names])
        if s == self._last:
            out = graph_output(self._output_node, env, self._constants)
            loss = self._loss_fn(self._unflatten(out), to_device(self._targets[i], self.device)) * self._weights[i]
            self._saved[(s, i)] += (loss,)
            self._loss += loss.detach()

    def _backward(self, s: int, i: int) -> None:
        saved = self._saved.pop((s, i))
        received, outputs = saved[0], saved[1]
        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if s == self._last:
            roots, grads = [saved[2]], [None]
        else:
            summed: dict[str, Any] = {}
            for c, names in self._to[s].items():
                for name, g in zip(names, self._take(BACKWARD, c, s, i)):
                    summed[name] = g if name not in summed else pytree.tree_map(_add, summed[name], g, is_leaf=_is_none)
            for name, g in summed.items():
                for value, grad in zip(_leaves(outputs[name]), _leaves(g)):
                    if isinstance(value, torch.Tensor) and value.requires_grad and grad is not None:
                        roots.append(value)
                        grads.append(grad.to(value.device))
        if roots:
            start = time.time()
            torch.autograd.backward(roots, grads)
            self._record("backward", s, i, start)
        for t, values in received.items():
            self._give(BACKWARD, s, t, i, [pytree.tree_map(_grad_of, v, is_leaf=_is_none) for v in values])
        self._envs[i] = {k: v for k, v in self._envs[i].items() if k in self._input_names}

    def _expect_all(self) -> None:
        """Post the header receives of every message this rank gets in the step (see runtime.p2p)."""
        for a in self._actions:
            peers = self._from[a.stage] if a.kind == "F" else self._to[a.stage]
            kind = FORWARD if a.kind == "F" else BACKWARD
            for other in peers:
                src = self.rank_of(other, a.microbatch)
                if src != self.rank:
                    pair = (other, a.stage) if a.kind == "F" else (other, a.stage)
                    self.messenger.expect(src, self.messenger.tag(kind, pair[0], pair[1], a.microbatch))

    # ---- trace of what this rank did ----

    def _record(self, kind: str, stage: int, microbatch: int, start: float, peer: int = -1) -> None:
        if self.tracing:
            self.trace.append({"kind": kind, "stage": stage, "microbatch": microbatch, "start": start, "end": time.time(), "peer": peer})

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

    def _take(self, kind: int, src: int, dst: int, i: int) -> list[Any]:
        """Values stage `src` sent stage `dst` for micro-batch i (forward) or their gradients."""
        key = (kind, src, dst, i)
        if key in self._local:
            return self._local.pop(key)
        peer = self.rank_of(src, i)
        start = time.time()
        values = self.messenger.recv(peer, self.messenger.tag(kind, src, dst, i), self.device)
        self._record("recv", dst, i, start, peer)
        return values

    def _give(self, kind: int, src: int, dst: int, i: int, values: list[Any]) -> None:
        peer = self.rank_of(dst, i)
        if peer == self.rank:
            self._local[(kind, src, dst, i)] = pytree.tree_map(_detached, values)
        else:
            start = time.time()
            self.messenger.send(values, peer, self.messenger.tag(kind, src, dst, i))
            self._record("send", src, i, start, peer)

    def _as_leaf(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled():
            return x.detach().requires_grad_(True)
        return x



def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def _grad_of(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.requires_grad:
        return x.grad
    return None


def _detached(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach()
    return x
