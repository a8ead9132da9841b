"""Exceptions raised by the partitioner for bad input, untraceable models and infeasible plans."""

from __future__ import annotations

__all__ = ["PartitionError", "TraceError"]


from runtime.errors import PartitionError  # defined there so the runtime raises it too


class TraceError(PartitionError):
    """Neither torch.fx nor torch.export could turn the model into a graph."""
