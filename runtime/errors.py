"""The error users see for bad input, from planning or from running (partitioner.errors re-exports it)."""

from __future__ import annotations

__all__ = ["PartitionError"]


class PartitionError(ValueError):
    """The model, devices or options cannot be partitioned or run as asked; the message says how to fix it."""
