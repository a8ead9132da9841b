"""The traced example: the model traced on its example inputs, their flat values and first micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import torch
from torch import nn

from partitioner.capture.cross_batch import Shape, batch_shapes, check_cross_batch
from partitioner.capture.fidelity import InputSplitSpec, input_dims
from partitioner.capture.meta import is_meta, on_meta, shapes_only
from partitioner.capture.trace import Traced, trace
from partitioner.errors import PartitionError
from partitioner.request import CrossBatchChoice
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
    input_split_spec: InputSplitSpec | None = None, cross_batch: CrossBatchChoice = "refuse",
) -> Example:
    """Trace the model on its example inputs (see `Example`), and look for operations that mix samples across
    the batch (capture.cross_batch) where there are several micro-batches.

    Raises:
        PartitionError: the model cannot be traced, the example cannot be split into `micro_batches`, or
            (`cross_batch="refuse"`) forward mixes samples across the batch.
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
    graphs = [g for g in (traced.graph_module, traced.other_mode) if g is not None]
    check_cross_batch(graphs, flat, first_chunk, micro_batches, cross_batch, _shapes_of(model, traced))
    return Example(traced, flat, first_chunk, dims)


def _shapes_of(model: nn.Module, traced: Traced) -> Callable[..., dict[str, Shape]]:
    """capture.cross_batch.batch_shapes on meta tensors (no values to compute), or on the values where forward
    needs them (`.item()`, data-dependent shapes, devices written into an exported graph)."""
    def of(gm: torch.fx.GraphModule, whole: list[Any], chunk: list[Any]) -> dict[str, Shape]:
        if not is_meta(model):  # a model on meta runs on meta tensors already (see `shaped`)
            try:
                return shaped(model, traced, batch_shapes, gm, on_meta(whole), on_meta(chunk), shapes=True)
            except Exception:  # noqa: BLE001 - forward needs values: run it on them
                pass
        return batch_shapes(gm, whole, chunk)
    return of
