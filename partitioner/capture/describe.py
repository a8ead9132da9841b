"""describe_model: a printable report of a model's fork/join regions, critical path and cut points."""

from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from partitioner.capture.analysis import describe
from partitioner.capture.graph import build_graph
from partitioner.capture.trace import trace

__all__ = ["describe_model"]


def describe_model(model: nn.Module, example_inputs: Any, example_kwargs: Mapping[str, Any] | None = None) -> str:
    """A printable report of the model's structure: fork/join regions (parallel branches,
    nested), the critical path and the cheapest cut points. The model is left untouched."""
    args = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else tuple(example_inputs)
    traced = trace(model, args, dict(example_kwargs or {}))
    return describe(build_graph(traced.graph_module, traced.flatten_inputs(args, dict(example_kwargs or {}))))
