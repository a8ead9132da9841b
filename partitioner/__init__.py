"""Partition a PyTorch model across devices as a cost-balanced pipeline: `partition(model, devices)`."""

from partitioner.api import partition
from partitioner.errors import PartitionError, TraceError
from runtime.pipeline import Pipeline
from partitioner.visualizer import Plan
from runtime.plan import StagePlan

__all__ = ["Pipeline", "PartitionError", "Plan", "StagePlan", "TraceError", "partition"]
