"""The ranks of each group inside a stage's replicas, and this rank's expert and context groups, made in one order.

Rank arithmetic of [Note: ranks of a split stage] (runtime/plan_axes.py) in one place: replica j of a
stage runs on ranks[j] + c t + k for context index c < context and tensor index k < tensor.
`axis_groups` creates every expert and context group of a plan on every rank (`dist.new_group` is
collective: one sorted order, after the tensor and data groups) and keeps this rank's, per stage.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from runtime.context_parallel import ContextGroup

__all__ = ["AxisGroups", "axis_groups", "context_ranks", "data_ranks", "expert_data_ranks", "expert_ranks",
           "tensor_ranks"]


class _Stage(Protocol):  # runtime.plan.StagePlan, read only
    @property
    def ranks(self) -> list[int]: ...

    @property
    def tensor(self) -> int: ...

    @property
    def context(self) -> int: ...

    @property
    def expert(self) -> int: ...

    @property
    def width(self) -> int: ...


def tensor_ranks(s: _Stage) -> list[tuple[int, ...]]:
    """Each tensor group of the stage: per replica and context index, `tensor` consecutive ranks."""
    return [tuple(r + c * s.tensor + k for k in range(s.tensor)) for r in s.ranks for c in range(s.context)]


def data_ranks(s: _Stage, k: int) -> tuple[int, ...]:
    """The ranks of tensor index k over every replica and context index (a sharded stage's FSDP2 mesh)."""
    return tuple(sorted(r + c * s.tensor + k for r in s.ranks for c in range(s.context)))


def context_ranks(s: _Stage) -> list[tuple[int, ...]]:
    """Each context group of the stage: per replica and tensor index, its context ranks."""
    return [tuple(r + c * s.tensor + k for c in range(s.context)) for r in s.ranks for k in range(s.tensor)]


def expert_ranks(s: _Stage) -> list[tuple[int, ...]]:
    """Each expert group: per `expert` consecutive replicas and index i in the replica, their ranks + i."""
    blocks = [s.ranks[b:b + s.expert] for b in range(0, len(s.ranks), s.expert)]
    return [tuple(r + i for r in block) for block in blocks for i in range(s.width)]


def expert_data_ranks(s: _Stage) -> list[tuple[int, ...]]:
    """The replicas holding the same experts (position p of each expert group), per index i: [] where each
    expert is on one replica."""
    if len(s.ranks) <= s.expert:
        return []
    return [tuple(s.ranks[j] + i for j in range(p, len(s.ranks), s.expert)) for p in range(s.expert)
            for i in range(s.width)]


@dataclass
class AxisGroups:
    """This rank's groups of each stage splitting experts or its sequence (by stage index)."""

    experts: dict[int, DeviceMesh] = field(default_factory=dict)  # all-to-all of the stage's expert group
    expert_data: dict[int, Any] = field(default_factory=dict)  # replicas holding the same experts
    context: dict[int, ContextGroup] = field(default_factory=dict)
    checked: bool = False  # all-to-alls checked under the NCCL rules first


def axis_groups(plan: Any, rank: int, device_type: str, timeout: datetime.timedelta, checked: bool) -> AxisGroups:
    """Create every expert and context group of `plan` (every rank, one order); return this rank's.

    Call on every rank at the same point, inside runtime.nccl_rules.collective_checks where checked.
    """
    wanted: dict[tuple[str, tuple[int, ...]], list[int]] = {}  # (kind, ranks) -> stages whose group it is
    for s in plan.stages:
        if s.expert > 1:
            for g in expert_ranks(s):
                wanted.setdefault(("expert", g), []).append(s.index)
            for g in expert_data_ranks(s):
                wanted.setdefault(("expert_data", g), []).append(s.index)
        if s.context > 1:
            for g in context_ranks(s):
                wanted.setdefault(("context", g), []).append(s.index)
    found = AxisGroups(checked=checked)
    for (kind, ranks), stages in sorted(wanted.items(), key=lambda e: (e[0][1], e[0][0])):
        handle = dist.new_group(list(ranks), timeout=timeout)
        if rank not in ranks:
            continue
        for index in stages:
            if kind == "expert":
                found.experts[index] = DeviceMesh.from_group(handle, device_type)
            elif kind == "expert_data":
                found.expert_data[index] = handle
            else:
                found.context[index] = ContextGroup(handle, ranks.index(rank), len(ranks))
    return found
