"""The loss on logits left split by vocabulary over a tensor-parallel group (DTensor's loss_parallel).

An LM head split by output features gives each tensor rank 1/t of the vocabulary's logits. Gathering them
whole for the loss (b x s x V per micro-batch, and as much again for their gradient) is the largest value of
a step for a large vocabulary: 31 GiB of bf16 logits for Llama 3 70B at 16 x 8,192 tokens, 4 GiB a rank
split 8 ways. So, in a training step, the last stage leaves a model output split on its last dimension
(`ToPlain.keep_split` where the graph's output is the value's only reader) and the loss runs on it under
`torch.distributed.tensor.parallel.loss_parallel`: cross-entropy reduces over the vocabulary with
all-reduces of b x s numbers instead of gathering b x s x V. Any other loss runs on the DTensor as DTensor
runs every op (a sum leaves partial sums, all-reduced once it is a number).

A loss function DTensor cannot run (one that mixes the logits with plain tensors of their shape, or calls
an op DTensor has no rule for) runs again on the whole logits (`full_tensor`, which gathers them as
before), with a warning: results are the same, only the memory the plan counted on is not saved.

[Note: the same collectives on every tensor rank]
Every rank of a tensor group runs the same stage on values of the same shapes, so the same ops of the
loss, and its failure, if it fails, at the same op: the fallback is taken by all ranks or none. The
backward of the loss's ops must run under loss_parallel too (their custom backward rules); the last
stage's backward does (`SplitLogits.backward`).
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, ContextManager

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from runtime.context_parallel import ContextGather, ContextGroup
from runtime.loss_tokens import keep_tokens, reduce_over_tokens, token_loss
from runtime.tensor_parallel_ops import ToPlain

__all__ = ["SplitLogits", "mark_loss_outputs", "split_loss"]


def mark_loss_outputs(module: torch.fx.GraphModule) -> None:
    """On the stage's final graph (after every rewrite), leave `to_loss` only on the ToPlain call sites whose value
    the graph's output alone reads, directly or through a sequence gather (runtime.loss_tokens: in a training step
    it leaves each context rank's tokens, here still split by vocabulary)."""
    def to_output(node: torch.fx.Node, through: bool) -> bool:
        if node.op == "output":
            return True
        gather = node.op == "call_module" and isinstance(module.get_submodule(str(node.target)), ContextGather)
        return through and gather and bool(node.users) and all(to_output(u, False) for u in node.users)

    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        leaf = module.get_submodule(str(node.target))
        if isinstance(leaf, ToPlain) and leaf.to_loss:
            leaf.to_loss = bool(node.users) and all(to_output(u, True) for u in node.users)


def keep_loss_outputs(module: nn.Module, on: bool) -> None:
    """Turn leaving logits split on (a training step of the last stage) or off (any other call)."""
    for leaf in module.modules():
        if isinstance(leaf, ToPlain) and leaf.to_loss:
            leaf.keep_split = on


_warned: set[str] = set()


def split_loss(compute: Callable[[Any], torch.Tensor], output: Any) -> tuple[torch.Tensor, bool]:
    """`compute(output)` (the user's loss on one micro-batch's output) where `output` may hold logits split by
    vocabulary: under loss_parallel, else on the whole logits (module docstring). Returns the loss as a plain
    tensor and whether it ran split (its backward then runs under loss_parallel: `SplitLogits.backward`)."""
    if not any(isinstance(t, DTensor) for t in pytree.tree_leaves(output)):
        return compute(output), False
    try:
        with loss_parallel():
            loss = compute(output)
    except Exception as exc:  # noqa: BLE001 - any op DTensor refuses: run the loss as the plain model does
        kind = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        if kind not in _warned:
            _warned.add(kind)
            warnings.warn(
                "loss_fn could not run on logits split by vocabulary over the tensor-parallel ranks (DTensor's "
                f"loss_parallel; {kind}); it runs on the whole logits instead, which holds t times the memory the "
                "plan counted for them. torch.nn.functional.cross_entropy on the logits (viewed or sliced as "
                "needed) runs split", stacklevel=3)
        whole = pytree.tree_map_only(DTensor, lambda t: t.full_tensor(), output)
        return compute(whole), False
    if isinstance(loss, DTensor):  # partial sums all-reduced; a replicated value as it is
        loss = loss.full_tensor()
    return loss, True


class SplitLogits:
    """One rank's last stage through a step: its logits left split in training steps (`start(True)`), split by
    vocabulary (this module) and by the sequence (runtime.loss_tokens); each micro-batch's loss on them (`loss`);
    which of those backward must run under loss_parallel; the group the step's loss is summed over."""

    def __init__(self, last: nn.Module | None) -> None:
        self.last = last  # this rank's module of the last stage, or None
        self.split: set[int] = set()  # micro-batches whose loss ran split by vocabulary, their backward not run yet
        self.gathers: list[ContextGather] = []
        self.tokens: ContextGroup | None = None  # the context group whose ranks' losses covered their own tokens

    def start(self, train: bool) -> None:
        """A step starts (train: a training step on this rank's last stage) or ends (False)."""
        self.split.clear()
        if train:
            self.tokens = None
        if self.last is not None:
            keep_loss_outputs(self.last, train)
            self.gathers = keep_tokens(self.last, train)

    def loss(self, i: int, compute: Callable[[Any, Any], torch.Tensor], output: Any, targets: Any,
             reduction: str, per_token: bool) -> torch.Tensor:
        """Micro-batch i's loss `compute(output, targets)`, on what the last stage left split."""
        kept = [(g, g.local) for g in self.gathers]  # this micro-batch's tokens, again for a second try

        def on_tokens(out: Any) -> torch.Tensor:
            for g, local in kept:
                g.local = local
            value, group = token_loss(compute, out, targets, self.gathers, reduction, per_token)
            self.tokens = group or self.tokens
            return value

        loss, split = split_loss(on_tokens, output)
        if split:
            self.split.add(i)
        return loss

    def backward(self, i: int | None) -> ContextManager[Any]:
        """What micro-batch i's backward on the last stage runs under (None: no loss there)."""
        if i is None or i not in self.split:
            return contextlib.nullcontext()
        self.split.discard(i)
        return loss_parallel()

    def reduce(self, loss: torch.Tensor) -> None:
        """The step's loss (in place) summed over the context ranks whose losses covered their own tokens."""
        reduce_over_tokens(loss, self.tokens)
