"""Weights several ranks hold, their gradients summed over exactly those ranks: the groups, made in one order, bucketed.

A weight is held by the ranks of every stage that reads it: replicas of a stage, or a weight tied
across stages. Where stages split layers over t tensor ranks ([Note: ranks of a split stage]), the
ranks of one tensor index k hold the same part of it (a DTensor's local shard, or the whole weight
where it is not split), so its gradient is summed over the data dimension only: ranks[j] + k of every
replica j of every stage reading it, one group per k, as runtime.program.split_programs moves the
programs' AR ops. Weights FSDP2 shards (read by one sharded stage only) are reduced by FSDP2, not here; the
ranks of a replica that split its sequence sum theirs afterwards, as do replicas holding the same experts
(runtime.axis_reduce).

    leaders (0, 4), t = 2:   k = 0 -> AR r0,4     k = 1 -> AR r1,5
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Mapping

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.comm import Comm
from runtime.hier_allreduce import all_reduce, replica_group
from runtime.nccl_rules import collective_checks
from runtime.plan import Plan
from runtime.staleness import Reduction, StaleReductions

__all__ = ["GradGroup", "grad_groups", "local"]

BUCKET_BYTES = 25 << 20


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of `t`: a DTensor's local shard, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


class GradGroup:
    """Weights held by the same set of ranks, all-reduced together in buckets.

    `reductions` keeps the last `staleness` steps' all-reduces in flight (runtime.staleness):
    `finish` gives the weights the sums of step t - staleness (0: this step's, waited for now).
    """

    def __init__(self, ranks: tuple[int, ...], params: list[nn.Parameter], handle: Any,
                 wire: torch.device | None = None, staleness: int = 0) -> None:
        self.ranks = ranks
        self.params = params
        self.group = handle
        self.wire = wire  # where the reduction runs (the CPU where a rank of the group has no GPU)
        self.pending: list[Reduction] = []
        self.reductions = StaleReductions(staleness)

    def start(self, comm: Comm) -> None:
        bucket: list[nn.Parameter] = []
        size = 0
        for p in [*self.params, None]:  # a DTensor's gradient: its local part (its placement may differ from p's)
            nbytes = local(p.grad if p.grad is not None else p).numel() * p.element_size() if p is not None else 0
            if p is None or (bucket and size + nbytes > BUCKET_BYTES):
                if bucket:
                    grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in bucket]
                    flat = torch.cat([local(g).reshape(-1) for g in grads])
                    if self.wire is not None and flat.device != self.wire:
                        flat = flat.to(self.wire)
                    self.pending.append(Reduction(all_reduce(comm, flat, self.group), flat, bucket))
                bucket, size = [], 0
            if p is not None:
                bucket.append(p)
                size += nbytes

    def finish(self, wait: Callable[[Any], None]) -> None:
        pending, self.pending = self.pending, []
        self.reductions.step(pending, self.params, wait)


def _sharded_only(plan: Plan, stages: list[int]) -> bool:
    """A weight FSDP2 reduces: read by one stage, which shards its weights."""
    return len(set(stages)) == 1 and plan.stages[stages[0]].sharding != "none"


def grad_groups(plan: Plan, model: nn.Module, readers: Mapping[int, tuple[torch.Tensor, list[int]]], rank: int,
                wire: Callable[..., torch.device], *, checked: bool = False, leave: Collection[int] = ()
                ) -> tuple[list[GradGroup], dist.ProcessGroup | None]:
    """This rank's gradient groups and its group of the last stage's replicas (to sum the loss), or None.

    Every rank creates every group, in one order (sorted, then by tensor index). `readers`:
    runtime.stage.tensor_stages of the graph (after its stages were split and sharded); `wire(*ranks)`:
    where a group's tensors travel; `checked`: runtime.nccl_rules.collective_checks on the groups. `leave`: ids
    of weights summed otherwise (split experts: runtime.axis_reduce).
    """
    names = {id(p): n for n, p in model.named_parameters()}
    by_ranks: dict[tuple[int, ...], list[tuple[str, nn.Parameter]]] = {}
    for t, stages in readers.values():
        if isinstance(t, nn.Parameter) and t.requires_grad and id(t) in names and not _sharded_only(plan, stages) \
                and id(t) not in leave:
            ranks = tuple(sorted({r for s in stages for r in plan.stages[s].ranks}))
            by_ranks.setdefault(ranks, []).append((names[id(t)], t))
    last_ranks = tuple(sorted(plan.stages[-1].ranks))
    degree = {r: s.width for s in plan.stages for r in s.ranks}
    groups: list[GradGroup] = []
    loss_group = None
    with collective_checks(checked):
        for leaders in sorted({k for k in by_ranks if len(k) > 1} | ({last_ranks} if len(last_ranks) > 1 else set())):
            for k in range(degree[leaders[0]]):  # every rank creates every group, in the same order
                ranks = tuple(r + k for r in leaders)
                handle = dist.new_group(list(ranks))
                reducer = replica_group(ranks, gpus_per_host=plan.gpus_per_host, flat=handle)  # every rank
                if rank not in ranks:
                    continue
                if leaders == last_ranks and isinstance(handle, dist.ProcessGroup):  # this rank is in it: a group
                    loss_group = handle
                if leaders in by_ranks:
                    params = [p for _, p in sorted(by_ranks[leaders], key=lambda e: e[0])]
                    groups.append(GradGroup(ranks, params, reducer, wire(*ranks)))
    return groups, loss_group
