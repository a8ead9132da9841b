"""The point-to-point and collective calls the runtime makes, behind one small interface.

`TorchComm` is torch.distributed itself: every batch of sends and receives goes out as one
`batch_isend_irecv` (one NCCL group on GPUs) without tags. `runtime.nccl_rules.NcclRulesComm`
has the same interface and imposes NCCL's point-to-point rules on gloo, so CI proves on CPU
that a protocol cannot hang under NCCL (see ../shared/design.md and [Note: one agreed order]
in runtime.program).
"""

from __future__ import annotations

import datetime
from typing import Any, Literal, NamedTuple, Protocol, Sequence

import torch
import torch.distributed as dist

__all__ = ["Comm", "P2P", "TorchComm", "Work"]


class P2P(NamedTuple):
    """One send or receive of a whole tensor to or from `peer` (a global rank)."""

    op: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class Work(Protocol):
    """A posted operation: wait for it once; False (or an exception) means it did not finish in time."""

    def wait(self, timeout: datetime.timedelta) -> bool: ...

    def is_completed(self) -> bool: ...


class Comm(Protocol):
    """What the peer-to-peer transport and the gradient all-reduce need from a backend."""

    def batch(self, ops: Sequence[P2P]) -> Work:
        """Post `ops` together (they progress together) and return one handle for all of them."""
        ...

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> Work:
        """Start summing `tensor` over `group` (a process group) in place."""
        ...


class _Works:
    """Several works waited on as one; each underlying work is waited on once (gloo needs that)."""

    def __init__(self, works: Sequence[Any]) -> None:
        self._works = list(works)

    def wait(self, timeout: datetime.timedelta) -> bool:
        while self._works:
            if self._works[0].wait(timeout) is False:
                return False
            self._works.pop(0)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)


class TorchComm:
    """torch.distributed on `group` (the default group when None): no tags, one batch per call."""

    def __init__(self, group: Any = None) -> None:
        self.group = group

    def batch(self, ops: Sequence[P2P]) -> Work:
        if not ops:
            return _Works([])
        p2p = [
            dist.P2POp(dist.isend if op.op == "send" else dist.irecv, op.tensor, op.peer, group=self.group)
            for op in ops
        ]
        return _Works(dist.batch_isend_irecv(p2p))

    def all_reduce(self, tensor: torch.Tensor, group: Any) -> Work:
        work = dist.all_reduce(tensor, group=group, async_op=True)
        return _Works([work])
