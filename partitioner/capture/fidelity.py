"""What keeps a partitioned model equal to the plain one: merge rules, input split dims, PiPPy cut points."""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence, get_args

import networkx as nx
from torch import nn

from partitioner.capture.graph import batch_outputs, build_graph
from partitioner.capture.rejected import graph_rejects
from partitioner.capture.trace import Traced, where
from partitioner.errors import PartitionError, TraceError
from runtime.microbatch import InputSplitSpec, OutputMergeSpec, SplitDim, batch_size, check_merge_spec

__all__ = [
    "Cuts", "InputSplitSpec", "OutputMergeSpec", "SplitPoint", "SplitPoints", "auto_dims", "batched_outputs",
    "check_fidelity_arguments", "cuts_from", "exported_error", "forced_cuts", "input_dims", "shape_graph",
]

log = logging.getLogger(__name__)

SplitPoints = Literal["markers", "cost"]
_SPLIT_POINTS: tuple[str, ...] = get_args(SplitPoints)

try:
    from torch.distributed.pipelining import SplitPoint
except ImportError:  # torch without distributed: split_spec cannot be given
    import enum

    class SplitPoint(enum.Enum):  # type: ignore[no-redef]
        BEGINNING = 1
        END = 2

Dim = SplitDim  # one per placeholder


@dataclass
class Cuts:
    """Where the user asked for cuts: `mode` says whether markers count; `spec` is PiPPy's split_spec."""

    mode: str
    spec: Mapping[str, Any] = field(default_factory=dict)


def cuts_from(split_points: str, split_spec: Mapping[str, Any] | None) -> Cuts:
    return Cuts(split_points, dict(split_spec or {}))


def check_fidelity_arguments(
    model: nn.Module,
    output_merge_spec: OutputMergeSpec | None,
    input_split_spec: InputSplitSpec | None,
    split_points: str,
    split_spec: Mapping[str, Any] | None,
) -> None:
    """Every check of the fidelity arguments of plan() and partition(), before anything is traced."""
    try:
        check_merge_spec(output_merge_spec)
    except ValueError as exc:
        raise PartitionError(str(exc)) from None
    if output_merge_spec is not None and not isinstance(output_merge_spec, (str, tuple, Mapping)):
        raise PartitionError(f"output_merge_spec={output_merge_spec!r}; use a rule or {{output path: rule}}")
    if split_points not in _SPLIT_POINTS:
        raise PartitionError(f"split_points={split_points!r}; use one of {', '.join(map(repr, _SPLIT_POINTS))}")
    if input_split_spec is not None:
        names = list(inspect.signature(model.forward).parameters)
        for name, dim in dict(input_split_spec).items():
            if name not in names:
                raise PartitionError(f"input_split_spec names {name!r}, which is not an argument of "
                                     f"{type(model).__name__}.forward; use one of {', '.join(map(repr, names))}")
            if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int)):
                raise PartitionError(f"input_split_spec[{name!r}]={dim!r}; use a dim (int) or None (given whole)")
    modules = dict(model.named_modules())
    for path, point in dict(split_spec or {}).items():
        if path not in modules:
            raise PartitionError(f"split_spec names module {path!r}, which {type(model).__name__} does not have")
        if point not in (SplitPoint.BEGINNING, SplitPoint.END):
            raise PartitionError(f"split_spec[{path!r}]={point!r}; use SplitPoint.BEGINNING or SplitPoint.END")


def input_dims(model: nn.Module, traced: Traced, spec: InputSplitSpec | None) -> list[Dim] | None:
    """One split rule per placeholder: the spec's dim or None, "auto" (dim 0 if batch-sized) elsewhere."""
    if spec is None:
        return None
    if traced.method != "fx":
        raise PartitionError("input_split_spec needs the torch.fx trace, and this model was traced with torch.export; "
                             "split the inputs yourself or make forward traceable by torch.fx")
    return [spec.get(name, "auto") for name in inspect.signature(model.forward).parameters]


def auto_dims(values: Sequence[Any], dims: Sequence[Dim] | None) -> list[Any]:
    return [v for v, d in zip(values, dims or ["auto"] * len(values)) if d == "auto"] or list(values)


def exported_error(traced: Traced, exc: Exception) -> TraceError:
    return TraceError(
        f"the graph torch.export made of this model fails on a micro-batch, at {where(exc) or 'an unknown place'}: "
        f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}\n"
        "torch.export specialized it on the example (its batch size, a shape, a value). Fix: make that code "
        "independent of the batch size and of tensor values, or make forward traceable by torch.fx "
        "(tensor defaults in the signature are fine), or use micro_batches=1"
    )


def shape_graph(traced: Traced, chunk: Sequence[Any]) -> nx.DiGraph:
    """build_graph on a micro-batch; an fx graph that cannot run it is a PartitionError naming the input and
    the layer that rejects it (capture.rejected), an exported graph that cannot (export ran the example) a
    TraceError."""
    try:
        return build_graph(traced.graph_module, chunk)
    except Exception as exc:  # noqa: BLE001 - guards, data-dependent shapes: all say the trace is wrong
        if traced.method != "export":
            rejected = graph_rejects(traced.graph_module, chunk)
            if rejected is not None:
                raise rejected from exc
            raise
        raise exported_error(traced, exc) from None


def batched_outputs(
    traced: Traced, flat: Sequence[Any], chunk: Sequence[Any], dims: Sequence[Dim] | None, micro_batches: int
) -> list[bool] | None:
    """Which output leaves have the batch as dim 0 (see [Note: merging micro-batches never guesses])."""
    if micro_batches == 1:
        return None
    sizes = (batch_size(auto_dims(flat, dims)), batch_size(auto_dims(chunk, dims)))
    try:
        return batch_outputs(traced.graph_module, flat, chunk, sizes)
    except Exception as exc:  # noqa: BLE001
        if traced.method != "export":
            raise
        raise exported_error(traced, exc) from None


def forced_cuts(graph: nx.DiGraph, order: Sequence[str], cuts: Cuts) -> list[int]:
    """Positions in `order` that every split cuts before: pipe_split() markers and split_spec points."""
    markers = [i for i, name in enumerate(order) if graph.nodes[name].get("cut_before")]
    if cuts.mode == "cost":
        if markers or cuts.spec:
            log.info("split_points='cost': ignoring %d pipe_split() markers and %d split_spec points",
                     len(markers), len(cuts.spec))
        return []
    forced = set(markers)
    for path, point in cuts.spec.items():
        mine = [i for i, name in enumerate(order)
                if graph.nodes[name]["module"] == path or graph.nodes[name]["module"].startswith(path + ".")]
        if not mine:
            raise PartitionError(f"split_spec names module {path!r}, but no node of the traced graph belongs to it")
        forced.add(min(mine) if point == SplitPoint.BEGINNING else max(mine) + 1)
    return sorted(i for i in forced if 0 < i < len(order))
