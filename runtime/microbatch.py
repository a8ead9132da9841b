"""Split a batch of inputs into micro-batches along dim 0, and merge outputs back."""

from __future__ import annotations

from typing import Any, Callable, Literal, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = [
    "MergeRule", "OutputMergeSpec", "InputSplitSpec", "batch_size", "check_merge_spec", "gather", "graph_output",
    "SplitDim", "output_builder", "output_paths", "plain_containers", "scatter", "split_sizes", "tensors_in",
    "to_device",
]

# [Note: merging micro-batches never guesses]
# An output whose dim 0 is the batch (known from running the graph on two batch sizes, see
# partitioner.capture.graph.batch_outputs) is concatenated along dim 0. Any other output (a scalar, a
# fixed-size tensor, a Python value) is merged by the rule the user gave for it, else returned
# once if every micro-batch gave the same value, else refused with an error naming the output
# and the `output_merge_spec` to pass. "mean" weights micro-batches by their sizes, so a
# per-micro-batch mean over samples merges to the whole batch's mean.
MergeRule = Literal["sum", "mean", "first", "cat"] | tuple[Literal["cat"], int]
MERGE_RULES = ("sum", "mean", "first", "cat")
# One rule for every output without a batch dimension, or {output path: rule}; paths as
# `output_paths` names them: "" for a lone tensor, "[1]", "['aux']", "[0]['loss']".
OutputMergeSpec = MergeRule | Mapping[str, MergeRule]
# {argument name: dim to split along, or None to give it whole to every micro-batch}.
InputSplitSpec = Mapping[str, int | None]


def batch_size(values: Any) -> int:
    """Size of dim 0 of the first tensor in `values`; the batch every tensor of that size shares.

    Raises:
        ValueError: no tensor, or the first tensor is a scalar.
    """
    tensors = [x for x in pytree.tree_leaves(values) if isinstance(x, torch.Tensor)]
    if not tensors:
        raise ValueError("the inputs hold no tensor, so there is no batch to split into micro-batches")
    if tensors[0].dim() == 0:
        raise ValueError(
            "the first input tensor is a scalar (shape ()), so it has no batch dimension; "
            "pass inputs whose dim 0 is the batch"
        )
    return int(tensors[0].shape[0])


SplitDim = int | None | Literal["auto"]  # a dim, None (whole), "auto" (dim 0 where it is the batch)


def scatter(values: Sequence[Any], chunks: int, dims: Sequence[SplitDim] | None = None) -> list[list[Any]]:
    """Split every tensor whose dim 0 equals the batch size into `chunks` parts.

    Sizes differ by at most one (10 samples in 4 chunks: 3, 3, 2, 2). Tensors of another
    size and non-tensors are given whole to every micro-batch. `dims` (one per value) says
    otherwise: an int splits the value's tensors along that dim, None gives them whole.
    """
    if chunks == 1 and isinstance(chunks, int):
        return [list(values)]  # nothing to split (partition() checked the batch once)
    dims = list(dims) if dims is not None else ["auto"] * len(values)
    size = batch_size([v for v, d in zip(values, dims) if d == "auto"] or list(values))
    if not 1 <= chunks <= size:
        raise ValueError(f"micro_batches={chunks} but the batch has {size} samples; use 1 <= micro_batches <= {size}")
    split: list[Any] = []
    leaves: list[Any] = []
    for value, dim in zip(values, dims):
        for x in pytree.tree_leaves(value):
            leaves.append(x)
            if not isinstance(x, torch.Tensor) or dim is None:
                split.append(None)
            elif dim == "auto":
                split.append(torch.tensor_split(x, chunks) if x.dim() > 0 and x.shape[0] == size else None)
            else:
                if not -x.dim() <= dim < max(x.dim(), 1) or x.shape[dim] < chunks:
                    raise ValueError(f"input_split_spec splits a tensor of shape {tuple(x.shape)} along dim {dim} "
                                     f"into {chunks} micro-batches; give a dim of at least {chunks} entries")
                split.append(torch.tensor_split(x, chunks, dim=dim))
    _, spec = pytree.tree_flatten(list(values))
    return [
        pytree.tree_unflatten([x if parts is None else parts[i] for x, parts in zip(leaves, split)], spec)
        for i in range(chunks)
    ]


def output_paths(value: Any) -> list[str]:
    """The path of every leaf of `value` as `output_merge_spec` names it ("[1]", "['aux']"; "" for a lone leaf)."""
    return [pytree.keystr(path) for path, _ in pytree.tree_flatten_with_path(value)[0]]


def check_merge_spec(spec: OutputMergeSpec | None) -> None:
    """Raise ValueError naming the choices if `spec` holds a rule that is not one."""
    rules = [] if spec is None else list(spec.values()) if isinstance(spec, Mapping) else [spec]
    for rule in rules:
        ok = rule in MERGE_RULES or (
            isinstance(rule, tuple) and len(rule) == 2 and rule[0] == "cat" and isinstance(rule[1], int)
        )
        if not ok:
            raise ValueError(f"output_merge_spec rule {rule!r}; use one of {', '.join(map(repr, MERGE_RULES))} "
                             "or ('cat', dim)")


def _same(values: Sequence[Any]) -> bool:
    first = values[0]
    if isinstance(first, torch.Tensor):
        return all(isinstance(v, torch.Tensor) and v.shape == first.shape and torch.equal(v, first) for v in values)
    try:
        return all(bool(v == first) for v in values)
    except Exception:  # noqa: BLE001 - values that cannot be compared are not known to be the same
        return False


def _merge(values: Sequence[Any], rule: MergeRule, sizes: Sequence[int]) -> Any:
    if rule == "first":
        return values[0]
    if rule == "sum":
        return sum(values[1:], values[0])
    if rule == "mean":
        total = sum(sizes)
        return sum((v * (n / total) for v, n in zip(values[1:], sizes[1:])), values[0] * (sizes[0] / total))
    dim = 0 if rule == "cat" else rule[1]
    return torch.cat(list(values), dim=dim)


def gather(
    outputs: Sequence[Any],
    sizes: Sequence[int] | None = None,
    batched: Sequence[bool] | None = None,
    spec: OutputMergeSpec | None = None,
) -> Any:
    """Merge micro-batch outputs leaf by leaf, keeping the structure of the first
    (see [Note: merging micro-batches never guesses]).

    `sizes` are the micro-batches' sizes; `batched[k]` whether leaf k's dim 0 is the batch
    (default: a tensor whose dim 0 equals each micro-batch's size while the sizes differ).

    Raises:
        ValueError: an output without a batch dimension that differs between micro-batches
            and has no rule in `spec`; the message names it and the spec to pass.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec_tree = flat[0][1]
    paths = output_paths(outputs[0])
    merged = []
    for k, leaves in enumerate(zip(*(f[0] for f in flat))):
        first, path = leaves[0], paths[k]
        rule = spec.get(path) if isinstance(spec, Mapping) else None
        if rule is not None:
            merged.append(_merge(leaves, rule, sizes or [1] * len(leaves)))
            continue
        if isinstance(first, torch.Tensor) and _batched(leaves, k, sizes, batched):
            merged.append(torch.cat(leaves, dim=0))
            continue
        if spec is not None and not isinstance(spec, Mapping):
            merged.append(_merge(leaves, spec, sizes or [1] * len(leaves)))
        elif _same(leaves):
            merged.append(first)
        else:
            shown = f"a tensor of shape {tuple(first.shape)}" if isinstance(first, torch.Tensor) else repr(first)
            raise ValueError(
                f"output {path or '(the output)'} is {shown} without a batch dimension and differs between the "
                f"{len(outputs)} micro-batches, so it cannot be merged without a rule: pass "
                f"output_merge_spec={{{path!r}: 'sum'}} (or 'mean', 'first', 'cat', ('cat', dim)), or micro_batches=1"
            )
    return pytree.tree_unflatten(merged, spec_tree)


def _batched(
    leaves: Sequence[torch.Tensor], k: int, sizes: Sequence[int] | None, batched: Sequence[bool] | None
) -> bool:
    if any(not isinstance(x, torch.Tensor) or x.dim() == 0 for x in leaves):
        return False
    if batched is not None and k < len(batched):
        return batched[k]
    if sizes is None:
        return True
    return all(x.shape[0] == n for x, n in zip(leaves, sizes))


def split_sizes(size: int, chunks: int) -> list[int]:
    """The micro-batch sizes `scatter` makes of `size` samples (torch.tensor_split's)."""
    return [size // chunks + (i < size % chunks) for i in range(chunks)]


def plain_containers(value: Any) -> Any:
    """fx's immutable_dict / immutable_list as the plain dict / list the model itself returns."""
    if type(value) is torch.Tensor:
        return value
    if isinstance(value, dict):
        return {k: plain_containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_containers(v) for v in value]
    if type(value) is tuple:
        return tuple(plain_containers(v) for v in value)
    return value


def graph_output(output_node: torch.fx.Node, values: dict[str, Any], constants: dict[str, Any]) -> Any:
    """The graph's output for one micro-batch, in the model's own structure.

    `values` holds computed values by node name; get_attr nodes come from `constants`.
    """
    return plain_containers(
        torch.fx.node.map_arg(output_node.args[0], lambda n: values[n.name] if n.name in values else constants[n.name])
    )


def output_builder(output_node: torch.fx.Node, constants: dict[str, Any]) -> Callable[[dict[str, Any]], Any]:
    """`graph_output` of `output_node` as a function of the computed values, its structure read once: a step
    builds its output without walking the node's arguments again (a tensor or a tuple of them, usually)."""
    arg = output_node.args[0]
    if isinstance(arg, torch.fx.Node):
        name: str = arg.name
        return lambda values: plain_containers(values[name] if name in values else constants[name])
    if type(arg) is tuple and all(isinstance(a, torch.fx.Node) for a in arg):
        names: list[str] = [a.name for a in arg if isinstance(a, torch.fx.Node)]
        return lambda values: tuple(plain_containers(values[n] if n in values else constants[n]) for n in names)
    return lambda values: graph_output(output_node, values, constants)


def tensors_in(value: Any) -> list[torch.Tensor]:
    """The tensors of `value` (a tensor or a structure of them), in pytree order."""
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


def to_device(value: Any, device: torch.device) -> Any:
    """`value` (a tensor, a structure of them, or anything else) with its tensors on `device`."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=device.type == "cuda")
    if not isinstance(value, (list, tuple, dict)):
        return value
    if type(value) in (list, tuple):  # the values a stage sends: usually tensors already there
        for x in value:
            if not (isinstance(x, torch.Tensor) and x.device == device):
                break
        else:
            return value

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device, non_blocking=device.type == "cuda")
        return x

    return pytree.tree_map(move, value)
