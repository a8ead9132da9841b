"""One traced graph of the model as the runtime runs it (its stages, output and plan), and the one of a mode."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, TypeVar

import torch.fx

from runtime.errors import PartitionError
from runtime.plan import Plan
from runtime.routes import Routes
from runtime.stage import Stage

__all__ = ["StageGraph", "for_mode"]


@dataclass
class StageGraph:
    """One traced graph of the model as the runtime runs it: its stages, output, plan and programs.

    A model whose forward reads `self.training` has one per mode, cut alike (see Pipeline).
    """

    stages: list[Stage]  # this process's (all of them in one process)
    output_node: torch.fx.Node
    constants: Mapping[str, Any]
    plan: Plan
    io: list[tuple[list[str], list[str]]] | None = None  # every stage's input and output names; default: `stages`'

    def routes(self) -> Routes:
        return Routes.of(self.io if self.io is not None else [(s.inputs, s.outputs) for s in self.stages],
                         self.output_node)


T = TypeVar("T")


def for_mode(modes: Mapping[bool, T], training: bool, traced: bool, error: str | None) -> T:
    """What runs in the model's mode now: its own graph where forward reads `self.training`, else the
    one traced graph (the same in both modes); a PartitionError if that mode could not be traced."""
    found = modes.get(training)
    if found is not None:
        return found
    if error is not None:
        raise PartitionError(
            f"the model is in {'training' if training else 'eval'} mode, but its forward could not be traced in "
            f"that mode ({error}); partition the model in the mode you run it in"
        )
    return modes[traced]
