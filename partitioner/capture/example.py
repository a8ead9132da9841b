"""The traced example: the model traced on its example inputs, their flat values and first micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from partitioner.capture.fidelity import InputSplitSpec, input_dims
from partitioner.capture.meta import is_meta, shapes_only
from partitioner.capture.trace import Traced, trace
from partitioner.errors import PartitionError
from rules.progress import say
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
    input_split_spec: InputSplitSpec | None = None,
) -> Example:
    """Trace the model on its example inputs (see `Example`).

    Raises:
        PartitionError: the model cannot be traced, or the example cannot be split into `micro_batches`.
    """
    say(f"tracing {type(model).__name__}")
    traced = trace(model, args, kwargs)
    flat = [x.detach().clone() if isinstance(x, torch.Tensor) else x for x in traced.flatten_inputs(args, kwargs)]
    dims = input_dims(model, traced, input_split_spec)
    try:
        batch_size([v for v, d in zip(flat, dims or ["auto"] * len(flat)) if d == "auto"] or flat)
        first_chunk = scatter(flat, micro_batches, dims)[0]
    except ValueError as exc:
        raise PartitionError(f"example_inputs: {exc}") from None
    return Example(traced, flat, first_chunk, dims)
