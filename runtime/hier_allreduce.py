"""The gradient all-reduce of a replica group, issued the way cost_model/cluster_shape.py prices it.

A group whose ranks sit on H >= 2 hosts with the same g >= 2 ranks on each (ranks are
host-major: host = rank // plan.gpus_per_host) is reduced hierarchically; any other group
(one host, one rank per host, uneven counts, or no host layout known) runs the flat all-reduce.

    host 0: ranks a0 a1    host 1: ranks b0 b1           buffer = [shard 0 | shard 1] (padded to g shards)
    1. reduce-scatter in each host:   a0 holds sum_host0(shard 0), a1 sum_host0(shard 1), b0, b1 alike
    2. all-reduce across hosts:       {a0, b0} sum shard 0, {a1, b1} sum shard 1 (one NIC per GPU)
    3. all-gather in each host:       every rank holds the whole sum

The result equals the flat all-reduce (the same sum, grouped differently). Every rank calls
`replica_group` for every group in the same order (torch needs every rank in every
`new_group`), and each group's sub-groups serve only it, so its collectives are posted in one
order on every rank (NCCL rule 5). Steps 1-2 are waited for before the next is posted: on
NCCL a wait is a stream dependency (the CPU goes on), on gloo it blocks the caller; step 3's
handle is returned. Gloo and NCCL both run the tensor reduce-scatter and all-gather
(reduce_scatter_single / all_gather_single, before torch 2.13 reduce_scatter_tensor /
all_gather_into_tensor), so one code path serves both: no gloo-only fallback is needed.
"""

from __future__ import annotations

import collections
import datetime
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import torch
import torch.distributed as dist

from runtime.comm import Comm, Work

__all__ = ["Algorithm", "ReplicaGroup", "algorithm", "all_reduce", "hosts_of", "replica_group"]

Algorithm = Literal["flat", "hierarchical"]
_STEP_TIMEOUT = datetime.timedelta(minutes=30)  # a gloo step that hangs this long fails (dead peers fail sooner)
# torch 2.13 renames reduce_scatter_tensor / all_gather_into_tensor (the old names warn); same calls, same kernels
_REDUCE_SCATTER: Any = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
_ALL_GATHER: Any = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


def hosts_of(ranks: Sequence[int], *, gpus_per_host: int) -> list[list[int]]:
    """The group's ranks per host, hosts in order, ranks sorted (one host when `gpus_per_host` is 0)."""
    if gpus_per_host <= 0:
        return [sorted(ranks)]
    by_host: dict[int, list[int]] = collections.defaultdict(list)
    for r in sorted(ranks):
        by_host[r // gpus_per_host].append(r)
    return [by_host[h] for h in sorted(by_host)]


def algorithm(ranks: Sequence[int], *, gpus_per_host: int) -> Algorithm:
    """"hierarchical" for H >= 2 hosts holding the same g >= 2 ranks of the group each, else "flat"."""
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"replica group {sorted(ranks)} names a rank twice; name each rank once")
    hosts = hosts_of(ranks, gpus_per_host=gpus_per_host)
    counts = {len(h) for h in hosts}
    return "hierarchical" if len(hosts) >= 2 and len(counts) == 1 and counts.pop() >= 2 else "flat"


@dataclass(frozen=True)
class ReplicaGroup:
    """A replica group's process groups: `flat` over all ranks, and this rank's host and shard groups."""

    ranks: tuple[int, ...]
    flat: Any  # the process group over every rank of the group
    algorithm: Algorithm
    intra: Any = None  # hierarchical: this rank's host's ranks of the group
    inter: Any = None  # hierarchical: one rank per host, at this rank's position in its host
    per_host: int = 1  # g: ranks of the group on each host


def replica_group(ranks: Sequence[int], *, gpus_per_host: int, flat: Any) -> ReplicaGroup:
    """The group's reducer; creates its sub-groups, so call it on every rank, in the same order.

    Args:
        ranks: the global ranks holding the weights.
        gpus_per_host: `Plan.gpus_per_host` (0: the layout is unknown, so the flat all-reduce).
        flat: the process group over `ranks` (already created on every rank).
    """
    ordered = tuple(sorted(ranks))
    kind = algorithm(ordered, gpus_per_host=gpus_per_host)
    if kind == "flat":
        return ReplicaGroup(ordered, flat, kind)
    hosts = hosts_of(ordered, gpus_per_host=gpus_per_host)
    me = dist.get_rank()
    intra = inter = None
    for members in hosts:  # every rank creates every sub-group, hosts first, then shard positions
        handle = dist.new_group(members)
        intra = handle if me in members else intra
    for position in range(len(hosts[0])):
        members = [host[position] for host in hosts]
        handle = dist.new_group(members)
        inter = handle if me in members else inter
    return ReplicaGroup(ordered, flat, kind, intra, inter, len(hosts[0]))


def all_reduce(comm: Comm, tensor: torch.Tensor, group: Any) -> Work:
    """Start summing `tensor` in place over `group`: a ReplicaGroup as it is priced, a process group flat."""
    if not isinstance(group, ReplicaGroup):
        return comm.all_reduce(tensor, group)
    if group.algorithm == "flat":
        return comm.all_reduce(tensor, group.flat)
    return _hierarchical(tensor, group)


class _Gathered:
    """Step 3's handle: once it completes, the padded buffer's sum is copied back into the caller's tensor."""

    def __init__(self, work: Any, buffer: torch.Tensor, tensor: torch.Tensor) -> None:
        self._work, self._buffer, self._tensor = work, buffer, tensor
        self._copied = buffer.data_ptr() == tensor.data_ptr()

    def wait(self, timeout: datetime.timedelta = _STEP_TIMEOUT) -> bool:
        if self._work.wait(timeout) is False:
            return False
        if not self._copied:
            self._tensor.copy_(self._buffer[: self._tensor.numel()])
            self._copied = True
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())


def _hierarchical(tensor: torch.Tensor, group: ReplicaGroup) -> Work:
    """Reduce-scatter in the host, all-reduce the shard across hosts, all-gather in the host."""
    if tensor.dim() != 1 or not tensor.is_contiguous():
        raise ValueError(f"the hierarchical all-reduce sums a flat contiguous buffer, got shape {tuple(tensor.shape)}")
    g = group.per_host
    shard = -(-tensor.numel() // g)
    buffer = tensor
    if shard * g != tensor.numel():  # reduce_scatter_tensor needs g equal shards: pad with zeros
        buffer = torch.zeros(shard * g, dtype=tensor.dtype, device=tensor.device)
        buffer[: tensor.numel()].copy_(tensor)
    part = torch.empty(shard, dtype=tensor.dtype, device=tensor.device)
    _step(_REDUCE_SCATTER(part, buffer, group=group.intra, async_op=True), tensor)
    _step(dist.all_reduce(part, group=group.inter, async_op=True), tensor)
    work = _ALL_GATHER(buffer, part, group=group.intra, async_op=True)
    return _Gathered(work, buffer, tensor)


def _step(work: Any, tensor: torch.Tensor) -> None:
    """Order the next step after `work`: a stream dependency on CUDA, a bounded wait on the CPU."""
    if tensor.is_cuda:
        work.wait()
    elif work.wait(_STEP_TIMEOUT) is False:
        raise RuntimeError(f"a step of the hierarchical all-reduce did not finish within {_STEP_TIMEOUT}")
