"""Weight gradients a model computes itself after backward: a per-micro-batch hook, and the error without it.

Some models (PyTorch's `MultiMLPWithDw` pipelining test model, zero-bubble experiments) run a custom
autograd Function whose backward returns the input's gradient only and keeps what the weight's
needs (the output gradient, the input) in a module; the user then calls the model's own code
(`model.compute_dW()`) after `loss.backward()`. A pipeline runs each stage's backward once per
micro-batch, so that code must run once per micro-batch and stage, as PyTorch's `dw_builder`
runs it (torch.distributed.pipelining.PipelineStage):

    pipe.set_weight_grad_hook(lambda module: [m.compute_dW() for m in module.modules() if isinstance(m, Block)])

The hook gets the stage's module, which holds the model's own submodules that run in that stage;
a module whose Function calls fall in two stages keeps context from both, so it is refused when
the hook is set: cut at its boundary (split_spec or pipe_split(), as PyTorch's stages are cut).
It runs after each micro-batch's backward of each stage (after W where a zero-bubble schedule
splits it), and, for `pipe(x)` then `loss.backward()`, once per micro-batch and stage when that
backward returns. With the hook set, do not call the model's code yourself after the step.

[Note: what can be detected]
A custom Function handed a module (where it can keep per-call context) and parameters that
come out of the step without a gradient is taken for such a model: with more than one
micro-batch and no hook, the step raises (gradients and statistics as they were; the
context the Function kept for that step stays in the model). Not detected: context kept
anywhere else (a global, a closure, the parameters themselves), parameters the Function
reaches other than as arguments, and weights that already had a gradient from an earlier
step (accumulation without `zero_grad()`).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.fx
from torch import nn

from runtime.errors import PartitionError

__all__ = ["SelfComputed", "WeightGradHook", "check_self_computed", "check_whole_modules", "self_computed"]

WeightGradHook = Callable[[nn.Module], None]  # called with a stage's module after each of its micro-batches' backward


@dataclass
class SelfComputed:
    """A custom Function call that may leave its weights' gradients to the model's own code."""

    stage: int
    function: str  # the Function class
    module: str  # the module it is handed (by its path in the stage)
    params: list[tuple[str, nn.Parameter]]  # (path in the stage, parameter) it is handed


def _function_name(target: Any) -> str | None:
    """The custom autograd Function a call_function target applies, or None."""
    cls = getattr(target, "autograd_function", None) or getattr(target, "__self__", None)
    if isinstance(cls, type) and issubclass(cls, torch.autograd.Function):
        return cls.__name__
    return None


def self_computed(stages: Sequence[Any]) -> list[SelfComputed]:
    """Custom Function calls in `stages` (runtime.stage.Stage) handed a module and parameters that require grad."""
    found = []
    for stage in stages:
        for gm in stage.module.modules():
            if not isinstance(gm, torch.fx.GraphModule):
                continue
            for node in gm.graph.nodes:
                name = _function_name(node.target) if node.op == "call_function" else None
                if name is None:
                    continue
                attrs = [a for a in node.all_input_nodes if a.op == "get_attr"]
                values = [(str(a.target), operator.attrgetter(str(a.target))(gm)) for a in attrs]
                modules = [path for path, v in values if isinstance(v, nn.Module)]
                params = [(path, v) for path, v in values if isinstance(v, nn.Parameter) and v.requires_grad]
                if modules and params:
                    found.append(SelfComputed(stage.index, name, modules[0], params))
    return found


def check_self_computed(found: Sequence[SelfComputed], micro_batches: int) -> None:
    """Raise where a step with several micro-batches left the weights of a `self_computed` call without
    gradients and no weight-gradient hook is set (see [Note: what can be detected])."""
    if micro_batches < 2:
        return
    for call in found:
        missing = [path for path, p in call.params if p.grad is None]
        if missing:
            raise PartitionError(
                f"{call.function} in stage {call.stage} is handed module {call.module} and left "
                f"{', '.join(missing)} without a gradient: the model computes those weight gradients itself "
                f"after backward, from context its Function keeps per call; with micro_batches={micro_batches} "
                "each stage runs one backward per micro-batch, so that code must run after each: "
                "pipe.set_weight_grad_hook(lambda module: ...) calls it with the stage's module (see "
                "runtime/weight_grads.py), or use micro_batches=1 (the context of this step is left in the model)"
            )


def check_whole_modules(found: Sequence[SelfComputed]) -> None:
    """Raise where one module is handed to `self_computed` calls in several stages: its own weight-gradient
    code runs per module, but each stage's hook would find only part of its context."""
    stages: dict[str, set[int]] = {}
    for call in found:
        stages.setdefault(call.module, set()).add(call.stage)
    split = {m: sorted(s) for m, s in stages.items() if len(s) > 1}
    if split:
        where = "; ".join(f"{m} in stages {', '.join(map(str, s))}" for m, s in split.items())
        raise PartitionError(
            f"a weight-gradient hook runs per stage, but the Functions that keep context in a module run in "
            f"several stages ({where}), so each stage's hook would find only part of it; cut at those modules' "
            "boundaries (split_spec={path: SplitPoint.BEGINNING} or pipe_split() in forward)"
        )
