"""Split a batch of inputs into micro-batches along dim 0, and merge outputs back."""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

__all__ = ["batch_size", "gather", "graph_output", "plain_containers", "scatter", "to_device"]


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


def scatter(values: Sequence[Any], chunks: int) -> list[list[Any]]:
    """Split every tensor whose dim 0 equals the batch size into `chunks` parts.

    Sizes differ by at most one (10 samples in 4 chunks: 3, 3, 2, 2). Tensors of another
    size and non-tensors are given whole to every micro-batch.
    """
    if chunks == 1 and isinstance(chunks, int):
        return [list(values)]  # nothing to split (partition() checked the batch once)
    size = batch_size(values)
    if not 1 <= chunks <= size:
        raise ValueError(f"micro_batches={chunks} but the batch has {size} samples; use 1 <= micro_batches <= {size}")
    leaves, spec = pytree.tree_flatten(list(values))
    split = [
        torch.tensor_split(x, chunks) if isinstance(x, torch.Tensor) and x.dim() > 0 and x.shape[0] == size else None
        for x in leaves
    ]
    return [
        pytree.tree_unflatten([x if parts is None else parts[i] for x, parts in zip(leaves, split)], spec)
        for i in range(chunks)
    ]


def gather(outputs: Sequence[Any]) -> Any:
    """Concatenate micro-batch outputs leaf by leaf along dim 0, keeping the structure of the first.

    Raises:
        ValueError: a scalar tensor output (such as a loss) with several micro-batches,
            which cannot be merged without knowing how it was reduced.
    """
    if len(outputs) == 1:
        return outputs[0]
    flat = [pytree.tree_flatten(o) for o in outputs]
    spec = flat[0][1]
    merged = []
    for leaves in zip(*(f[0] for f in flat)):
        first = leaves[0]
        if isinstance(first, torch.Tensor):
            if first.dim() == 0:
                raise ValueError(
                    "the model returns a scalar tensor (a loss?) which cannot be merged across "
                    f"{len(outputs)} micro-batches; return per-sample values and reduce outside, or use micro_batches=1"
                )
            merged.append(torch.cat(leaves, dim=0))
        else:
            merged.append(first)
    return pytree.tree_unflatten(merged, spec)


def plain_containers(value: Any) -> Any:
    """fx's immutable_dict / immutable_list as the plain dict / list the model itself returns."""
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


def to_device(value: Any, device: torch.device) -> Any:
    """`value` (a tensor, a structure of them, or anything else) with its tensors on `device`."""
    if isinstance(value, torch.Tensor):
        return value if value.device == device else value.to(device, non_blocking=device.type == "cuda")
    if not isinstance(value, (list, tuple, dict)):
        return value

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device != device:
            return x.to(device, non_blocking=device.type == "cuda")
        return x

    return pytree.tree_map(move, value)
