"""Exceptions raised by the partitioner for bad input, untraceable models and infeasible plans."""

from __future__ import annotations

__all__ = ["PartitionError", "TraceError"]


class PartitionError(ValueError):
    """The model, devices or options cannot be partitioned as asked; the message says how to fix it."""


class TraceError(PartitionError):
    """Neither torch.fx nor torch.export could turn the model into a graph."""
