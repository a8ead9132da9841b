"""Values at a stage boundary: detached leaves going forward, their gradients coming back.

In training, a stage reads the values it receives as fresh leaves (`as_leaves`), so its
backward stops at its own inputs and their `.grad` is what goes back upstream (`gradients`);
values kept for a stage on the same worker are detached (`detached`). The usual value is a
plain tensor, and these skip pytree's walk for it.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["as_leaves", "detached", "gradients", "leaves", "summed", "writable"]


def _is_none(x: Any) -> bool:
    return x is None


def _map(fn: Callable[[Any], Any], values: list[Any]) -> list[Any]:
    """`pytree.tree_map(fn, values)`, without the walk for a list of plain tensors."""
    if all(type(v) is torch.Tensor for v in values):
        return [fn(v) for v in values]
    result: list[Any] = pytree.tree_map(fn, values)
    return result


def _as_leaf(x: Any) -> Any:
    if isinstance(x, torch.Tensor) and x.is_floating_point() and torch.is_grad_enabled():
        return x.detach().requires_grad_(True)
    return x


def _detached(x: Any) -> Any:
    return x.detach() if isinstance(x, torch.Tensor) else x


def _grad_of(x: Any) -> Any:
    return x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None


def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if b is None:
        return a
    return a + b


def as_leaves(values: list[Any]) -> list[Any]:
    """Received values as leaves that record their gradients (floating-point tensors, with grad mode on)."""
    return _map(_as_leaf, values)


def detached(values: list[Any]) -> list[Any]:
    return _map(_detached, values)


def gradients(value: Any) -> Any:
    """`value` with each tensor replaced by its gradient (None where it has none)."""
    return _grad_of(value) if type(value) is torch.Tensor else pytree.tree_map(_grad_of, value, is_leaf=_is_none)


def leaves(tree: Any) -> list[Any]:
    """The leaves of `tree`, None counted as one (a missing gradient keeps its place)."""
    if tree is None or type(tree) is torch.Tensor:
        return [tree]
    return pytree.tree_flatten(tree, is_leaf=_is_none)[0]


def summed(a: Any, b: Any) -> Any:
    """Two gradients of one value (it had two readers), leaf by leaf; None adds nothing."""
    return pytree.tree_map(_add, a, b, is_leaf=_is_none)


def writable(value: Any) -> Any:
    """`value` with each tensor that records gradients cloned: a leaf cannot be written in place, its clone can."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) and t.requires_grad else t, value)
