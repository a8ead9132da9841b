"""The traced example: the model traced on its example inputs, their flat values and first micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from cost_model.progress import say
from partitioner.capture.cross_batch import check_cross_batch
from partitioner.capture.fidelity import InputSplitSpec, input_dims
from partitioner.capture.meta import is_meta, shapes_only
from partitioner.capture.trace import Traced, trace
from partitioner.errors import PartitionError
from partitioner.request import CrossBatchChoice
from runtime.microbatch import batch_size, scatter

__all__ = ["Example", "shaped", "trace_example"]

_T = TypeVar("_T")


def shaped(model: nn.Module, traced: Traced | None, fn: Callable[..., _T], *args: Any, shapes: bool = False) -> _T:
    """`fn(*args)`; for a model on meta (or with `shapes`), on meta tensors only (capture.meta.shapes_only)."""
    if not shapes and not is_meta(model):
        return fn(*args)
    with shapes_only(model) as swaps:
        if traced is not None:
            swaps.add(model, [g for g in (traced.graph_module, traced.other_mode) if g is not None])
        return fn(*args)


@dataclass
class Example:
    """The model traced on its example: the trace, the example's placeholder values (copies: shape
    propagation and profiling run the model, and the caller's tensors stay as they are), the first
    micro-batch of them, and each placeholder's split dim (None: the defaults)."""

    traced: Traced
    flat: list[Any]
    first_chunk: list[Any]
    dims: list[Any] | None

    @property
    def graph_module(self) -> torch.fx.GraphModule:
        return self.traced.graph_module


def trace_example(
    model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], micro_batches: int,
    input_split_spec: InputSplitSpec | None = None, cross_batch: CrossBatchChoice = "refuse",
    traced: Traced | None = None,
) -> Example:
    """Trace the model on its example inputs (see `Example`), and look for operations that mix samples across
    the batch (capture.cross_batch) where there are several micro-batches.

    `traced`: the trace of this model on this example made for another micro-batch count, taken as it is: a
    trace is made on the whole example whatever the count, and only the first micro-batch and the cross-batch
    check below depend on it, so a search over counts traces once (partitioner.make.plan.plan_counts).

    Raises:
        PartitionError: the model cannot be traced, the example cannot be split into `micro_batches`, or
            (`cross_batch="refuse"`) forward mixes samples across the batch.
    """
    if traced is None:
        say(f"tracing {type(model).__name__}")
        traced = trace(model, args, kwargs)
    flat = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in traced.flatten_inputs(args, kwargs)]
    dims = input_dims(model, traced, input_split_spec)
    try:
        batch_size([v for v, d in zip(flat, dims or ["auto"] * len(flat)) if d == "auto"] or flat)
        first_chunk = scatter(flat, micro_batches, dims)[0]
    except ValueError as exc:
        raise PartitionError(f"example_inputs: {exc}") from None
    graphs = [g for g in (traced.graph_module, traced.other_mode) if g is not None]
    check_cross_batch(graphs, flat, first_chunk, micro_batches, cross_batch)
    return Example(traced, flat, first_chunk, dims)
