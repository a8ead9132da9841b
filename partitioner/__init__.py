"""Partition a PyTorch model across devices as a cost-balanced pipeline: `partition(model, devices)`."""

from partitioner.api import describe_model, partition, plan
from partitioner.errors import PartitionError, TraceError
from partitioner.show.visualizer import DrawablePlan as Plan
from runtime.pipeline import Pipeline
from runtime.plan import StagePlan

__all__ = ["PartitionError", "Pipeline", "Plan", "StagePlan", "TraceError", "describe_model", "partition", "plan"]
