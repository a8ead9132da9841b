"""Run a Plan: stage modules, micro-batches and pipeline schedules (never imports the planner)."""

from runtime.pipeline import Pipeline
from runtime.plan import Plan, StagePlan

__all__ = ["Pipeline", "Plan", "StagePlan"]
