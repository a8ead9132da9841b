"""Hooks on a stage's backward that runs under the caller's autograd (`pipe(x)`, then `loss.backward()`).

In forward mode the pipeline returns outputs still attached to every stage's graph, so each
stage's backward for each micro-batch runs inside the caller's `backward()`. Two things hook it:

    loss.backward() ─► stage s, micro-batch i: first output gradient ──► ... ──► inputs' gradients done
                            │ `trace_backward`: a mark                           │ the event (start, end)
                            └ `at_backward_end`: queue fn ─────────────────────────────────► fn() when
                                                                                   backward() returns
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils._pytree as pytree

__all__ = ["at_backward_end", "trace_backward"]


def _requiring_grad(values: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(values) if isinstance(t, torch.Tensor) and t.requires_grad]


def trace_backward(inputs: list[Any], outputs: Any, start: Callable[[], Any], done: Callable[[Any], None]) -> None:
    """Call `done(start())` once the backward from `outputs` has reached `inputs` (`start` when its first
    output gradient arrives); stages whose inputs need no gradient have no event."""
    outs, ins = _requiring_grad(outputs), _requiring_grad(inputs)
    if not outs or not ins or not torch.is_grad_enabled():
        return
    began: list[Any] = []

    def first(_: Any) -> None:
        began.append(start())

    def last(_: Any) -> None:
        if began:
            done(began[0])

    torch.autograd.graph.register_multi_grad_hook(outs, first, mode="any")
    torch.autograd.graph.register_multi_grad_hook(ins, last, mode="all")


def at_backward_end(outputs: Any, fn: Callable[[], None]) -> None:
    """Call `fn()` when the caller's backward that reaches `outputs` has finished (once per backward;
    nothing when no output records gradients)."""
    outs = _requiring_grad(outputs)
    if not outs or not torch.is_grad_enabled():
        return

    def queue(_: Any) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(fn)

    torch.autograd.graph.register_multi_grad_hook(outs, queue, mode="any")
