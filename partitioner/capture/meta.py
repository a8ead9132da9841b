"""Models on `meta`: detect them, plan them from shapes alone, and build them with real buffers.

A model whose weights are on `meta` has shapes and no values. `partition` traces and plans it
like any other (shape propagation runs on meta tensors: see `shapes_only`), with the analytic
cost model by default since profiling needs values, then materializes each stage's weights on
its own device (runtime.materialize) from `weights=` or `init=`. Users build one with
partitioner.meta.empty_weights.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.fx
from torch import nn

from partitioner.errors import PartitionError
from runtime.materialize import swap
from runtime.microbatch import to_device

__all__ = ["is_meta", "on_meta", "shapes_only"]


def is_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of `model` is on meta (has no storage)."""
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def on_meta(value: Any) -> Any:
    """`value` (a tree of inputs) with every tensor replaced by a meta tensor of its shape and dtype."""
    return to_device(value, torch.device("meta"))


def _real_tensors(model: nn.Module, graphs: list[torch.fx.GraphModule]) -> list[torch.Tensor]:
    seen: set[int] = set()
    found: list[torch.Tensor] = []
    holders: list[Any] = [*model.parameters(), *model.buffers()]
    for gm in graphs:
        holders += [t for _, t in gm.named_parameters()] + [t for _, t in gm.named_buffers()]
        holders += [v for v in vars(gm).values() if isinstance(v, torch.Tensor)]  # fx's tensor constants
    for t in holders:
        if isinstance(t, torch.Tensor) and not t.is_meta and id(t) not in seen:
            seen.add(id(t))
            found.append(t)
    return found


class _Swaps:
    """Real tensors swapped for meta stand-ins, in order; `add` takes more (graphs traced later)."""

    def __init__(self) -> None:
        self.swapped: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.seen: set[int] = set()

    def add(self, model: nn.Module, graphs: list[torch.fx.GraphModule] | None = None) -> None:
        for t in _real_tensors(model, graphs or []):
            if id(t) in self.seen:
                continue
            self.seen.add(id(t))
            stand_in = torch.empty_like(t, device="meta")
            if isinstance(t, nn.Parameter):
                stand_in = nn.Parameter(stand_in, requires_grad=t.requires_grad)
            try:
                torch.utils.swap_tensors(t, stand_in)
            except RuntimeError:
                continue  # held elsewhere (a weak reference): left real; planning may then mix devices
            self.swapped.append((t, stand_in))

    def restore(self) -> None:
        """Every swapped tensor back, even where one fails (that one is raised after)."""
        failed: RuntimeError | None = None
        for t, stand_in in reversed(self.swapped):
            try:
                swap(t, stand_in)
            except RuntimeError as exc:
                failed = exc
        self.swapped = []
        if failed is not None:
            raise failed


@contextlib.contextmanager
def shapes_only(model: nn.Module) -> Iterator[_Swaps]:
    """Trace and plan a meta model on meta tensors only: tensors created in forward default to
    meta, and the model's real tensors (buffers; fx constants, once the graphs are given to the
    yielded object's `add`) are swapped for meta ones of the same shape for the duration (their
    identity and values come back after), so nothing mixes devices. A forward that needs values
    (`.item()`, data-dependent shapes) fails here with a PartitionError that says so."""
    swaps = _Swaps()
    try:
        swaps.add(model)
        with torch.device("meta"):
            yield swaps
    except PartitionError:
        raise
    except (RuntimeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise PartitionError(
            f"planning a model on meta runs it on meta tensors, which have shapes but no values, and it failed: "
            f"{type(exc).__name__}: {first}. Make forward independent of tensor values (no .item(), no "
            "data-dependent shapes), or build the model on a real device"
        ) from exc
    finally:
        swaps.restore()
