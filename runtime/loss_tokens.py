"""The loss over a context rank's own tokens: a split sequence's output is not gathered for the loss.

A stage whose sequence is split over c ranks (runtime.context_parallel) gathers its output whole on every
rank. For the last stage that is the logits, b x S x V on each of the c ranks: 33.6 GB of bf16 logits for one
131,072-token sample of a Llama 3 vocabulary, as much again for their gradient, where the planner counts
1/c of them (partitioner/place/search/experts_context.py). So, in a training step, the last stage's outputs
leave as each rank's tokens (`ContextGather.keep_split`), the targets are cut as the sequence was (chunks r and
2c - 1 - r of every target tensor with the sequence's length along the output's sequence dimension), and each
rank runs `loss_fn` on its tokens, where the caller says the loss adds up over tokens
(`train_step(..., loss_per_token=True)`: a loss that shifts its targets or picks positions inside loss_fn would
read other tokens on a rank's two chunks than on the whole sequence, so this is never assumed):

    loss_reduction "mean"   the rank's loss / c: a loss that averages over tokens (cross-entropy with
                            reduction "mean", nothing ignored) is the mean of the c ranks' losses, each over
                            S / c tokens
    loss_reduction "sum"    the rank's loss as it is: a sum over tokens is the sum of the ranks' sums

The weights' gradients are summed over the context ranks at the end of the step as before (runtime.axis_reduce);
the step's loss is the sum over them (`reduce_over_tokens`, one all-reduce on the context group). As with
micro-batches, this holds for a loss that adds up over tokens (mean or sum); a mean over the tokens a mask
keeps (ignore_index) weighs each rank's tokens by its share of the sequence, not of the tokens kept.

Where the split cannot be followed (a target tensor without the sequence's length at that dimension, or a
model output left whole beside the split ones), the outputs are gathered as before and `loss_fn` sees what it
sees on the plain model, with a warning. Every rank of the group decides alike (the same shapes everywhere),
so every rank posts the same collectives.
"""

from __future__ import annotations

import warnings
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from runtime.context_parallel import ContextGather, ContextGroup, gather_tokens, my_tokens

__all__ = ["keep_tokens", "reduce_over_tokens", "token_loss"]


def keep_tokens(module: nn.Module, on: bool) -> list[ContextGather]:
    """Turn the last stage's sequence gathers off (a training step) or back on; the gathers."""
    gathers = [m for m in module.modules() if isinstance(m, ContextGather)]
    for g in gathers:
        g.keep_split, g.local = on, None
    return gathers


def _cut_targets(targets: Any, dim: int, local: int, cg: ContextGroup) -> Any | None:
    """Each target tensor's rows of this rank's tokens along `dim`; None if one has no sequence there."""
    whole = local * cg.degree
    cut = True

    def rows(t: torch.Tensor) -> torch.Tensor:
        nonlocal cut
        if t.dim() > dim and t.shape[dim] == whole:
            return my_tokens(t, dim, cg)
        cut = False
        return t

    out = pytree.tree_map_only(torch.Tensor, rows, targets)
    return out if cut else None


_warned: set[str] = set()


def token_loss(compute: Callable[[Any, Any], torch.Tensor], output: Any, targets: Any, gathers: list[ContextGather],
               reduction: str, per_token: bool) -> tuple[torch.Tensor, ContextGroup | None]:
    """`compute(output, targets)` on this rank's tokens where `gathers` left them split and the caller said the loss
    adds up over tokens (`per_token`; module docstring): the loss, weighted for the sum over the group, and the
    group; else on the whole outputs and None."""
    kept = {id(g.local): g for g in gathers if g.local is not None}
    for g in gathers:
        g.local = None
    if not kept:
        return compute(output, targets), None
    first = next(iter(kept.values()))
    leaves = [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    split = per_token and all(id(t) in kept and t.is_floating_point() for t in leaves)
    cut = _cut_targets(targets, first.dim, int(first_local(leaves, kept)), first.cg) if split else None
    if cut is None:
        why = ("pass train_step(..., loss_per_token=True) if loss_fn adds up over tokens (targets aligned with the "
               "outputs, nothing shifted inside it)" if not per_token else
               "a model output is not split by the sequence beside those that are" if not split else
               "a target tensor has no dimension of the sequence's length where the output has it")
        if why not in _warned:
            _warned.add(why)
            warnings.warn(f"the loss runs on the whole outputs, gathered over the context ranks ({why}); they hold "
                          "c times the memory the plan counted for them", stacklevel=3)

        def whole(t: torch.Tensor) -> torch.Tensor:
            g = kept.get(id(t))
            if g is None:
                return t
            if isinstance(t, DTensor):  # logits split by vocabulary too: gather each rank's part of it
                local = gather_tokens(t.to_local(), g.dim, g.cg)
                return DTensor.from_local(local, t.device_mesh, t.placements, run_check=False)
            return gather_tokens(t, g.dim, g.cg)

        return compute(pytree.tree_map_only(torch.Tensor, whole, output), targets), None
    loss = compute(output, cut)
    return (loss / first.cg.degree if reduction == "mean" else loss), first.cg


def first_local(leaves: list[torch.Tensor], kept: dict[int, ContextGather]) -> int:
    """This rank's token count: the first split output's length along its sequence dimension."""
    t = leaves[0]
    return int(t.shape[kept[id(t)].dim])


def reduce_over_tokens(loss: torch.Tensor, group: ContextGroup | None) -> None:
    """The step's loss summed over the context ranks whose losses covered their own tokens (in place)."""
    if group is not None:
        dist.all_reduce(loss, group=group.group)
