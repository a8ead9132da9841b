"""How a value crosses a cut on torch's pipelining runtime: flattened into contiguous tensors, read back as it was."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils._pytree import TreeSpec, tree_flatten, tree_unflatten

from partitioner.errors import PartitionError

__all__ = ["Wire", "meta_args", "wire"]

_NUMBERS = {"bool": bool, "int": int, "float": float}


class _Handoff(torch.autograd.Function):
    """A tensor crossing a cut: the same values, contiguous, as a new tensor (not a view, saved by nothing); its
    gradient contiguous too. NCCL sends contiguous tensors only (a transpose's output, or the gradient of a
    received value, need not be), and torch's split backward detaches a stage's outputs in place after the
    inputs' gradients, which breaks an output that the weights' gradients still read, or a view."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.contiguous().detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def handoff(t: torch.Tensor) -> torch.Tensor:
    """`t` as it crosses a cut (see `_Handoff`)."""
    return _Handoff.apply(t) if t.requires_grad else t.contiguous()


@dataclass(frozen=True)
class Wire:
    """One value of the graph crossing a cut as `width` tensors: its structure and what each leaf was.

    A tensor crosses as itself; a Python number (a size) as a 0-d tensor; a `torch.Size` as a
    1-d int64 tensor; a tuple, list or dict (the `split` of a tensor) as its leaves, in order.
    """

    name: str
    spec: TreeSpec
    kinds: tuple[str, ...]  # per leaf: "tensor", "bool", "int", "float" or "size"

    @property
    def width(self) -> int:
        return len(self.kinds)

    def encode(self, value: Any) -> list[torch.Tensor]:
        """The tensors `value` crosses as."""
        return [_leaf_out(leaf) for leaf in tree_flatten(value, is_leaf=_is_size)[0]]

    def decode(self, tensors: Sequence[torch.Tensor]) -> Any:
        """The value back from its tensors (the inverse of `encode`)."""
        return tree_unflatten([_leaf_in(t, kind) for t, kind in zip(tensors, self.kinds)], self.spec)


def wire(name: str, value: Any) -> Wire:
    """How `value` (an example of the value `name`, meta tensors allowed) crosses a cut.

    Raises:
        PartitionError: a leaf that is neither a tensor, a number nor a `torch.Size`.
    """
    leaves, spec = tree_flatten(value, is_leaf=_is_size)
    kinds = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            kinds.append("tensor")
        elif isinstance(leaf, torch.Size):
            kinds.append("size")
        elif isinstance(leaf, (bool, int, float)):
            kinds.append(type(leaf).__name__)
        else:
            raise PartitionError(f"{name} ({type(value).__name__} holding a {type(leaf).__name__}) crosses a cut; "
                                 "torch.distributed.pipelining sends tensors (numbers, shapes and tuples of them "
                                 "travel as tensors here): cut where it does not cross")
    return Wire(name, spec, tuple(kinds))


def meta_args(wires: Sequence[Wire], values: Sequence[Any], grads: bool = True) -> tuple[torch.Tensor, ...]:
    """The tensors `values` cross as, on meta: what `PipelineStage` reads from `input_args` / `output_args`.

    With `grads`, floating-point ones require grad, so torch keeps a gradient buffer for each (a
    value that needs none gets zeros, as torch sends for an unused input).
    """
    sent = [t for w, v in zip(wires, values) for t in w.encode(v)]
    return tuple(torch.empty(t.shape, dtype=t.dtype, device="meta").requires_grad_(grads and t.is_floating_point())
                 for t in sent)


def _is_size(x: Any) -> bool:
    return isinstance(x, torch.Size)  # one leaf, read back as a torch.Size (not a tuple of ints)


def _leaf_out(leaf: Any) -> torch.Tensor:
    if isinstance(leaf, torch.Tensor):
        return handoff(leaf)
    if isinstance(leaf, torch.Size):
        return torch.tensor(list(leaf), dtype=torch.int64)
    if isinstance(leaf, bool):
        return torch.tensor(leaf)
    return torch.tensor(leaf, dtype=torch.int64 if isinstance(leaf, int) else torch.float64)


def _leaf_in(t: torch.Tensor, kind: str) -> Any:
    if kind == "tensor":
        return handoff(t) if t.requires_grad else t
    if kind == "size":
        return torch.Size(int(v) for v in t.tolist())
    return _NUMBERS[kind](t.item())
