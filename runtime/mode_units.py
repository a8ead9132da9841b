"""One set of FSDP2 units for a stage with two graphs (forward reads `self.training`: one graph per mode).

[Note: sharding both modes of a stage]
A model whose forward reads `self.training` is traced twice (partitioner.capture.trace), and each of
its stages is built from both graphs. Both graphs read the same parameters, but FSDP2 shards a
parameter once, inside one FSDP module, and swaps its gathered and sharded forms on exactly the
modules that hold it. So the two graphs of a stage share their units instead of each being sharded:

    stage (traced mode)  root_a ─ calls ─ block_a0, block_a1, ...      (runtime.sharding._cut)
    stage (other mode)   root_b ─ calls ─ block_b0, block_b1, ...
                               │
    FSDP units:   ModeSwitch(block_a0, block_b0), ModeSwitch(block_a1, block_b1), ...
    FSDP root:    ModeSwitch(root_a, root_b)      (each root now calls the shared units)

A `ModeSwitch` holds both graphs (so FSDP2 gathers into, and frees from, the attributes of both)
and runs the one its `ModeCell` names; the stage's runner for each mode sets the cell before every
call. Blocks are paired by the parameters they hold: a pair is one unit only where both blocks hold
exactly the same parameters; a block without such a partner is left to the root's unit (its
weights are gathered with the root's), which is what a stage cut into no blocks does anyway.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch import nn

__all__ = ["ModeCell", "ModeSwitch", "pair_units", "point_at"]


class ModeCell:
    """Which graph of a two-graph stage runs now: 0 (the traced mode's) or 1 (the other mode's)."""

    def __init__(self) -> None:
        self.graph = 0


class ModeSwitch(nn.Module):
    """Both modes' versions of one stage part (a block or the root), run by the cell's choice.

    The cell is held outside the module tree (a plain attribute), so FSDP2 sees only the two graphs.
    """

    def __init__(self, traced: nn.Module, other: nn.Module, cell: ModeCell) -> None:
        super().__init__()
        self.traced = traced
        self.other = other
        self._cell = cell

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.traced if self._cell.graph == 0 else self.other)(*args, **kwargs)


def _weights(module: nn.Module) -> frozenset[int]:
    return frozenset(id(p) for p in module.parameters())


def pair_units(traced: Sequence[nn.Module], other: Sequence[nn.Module]) -> list[tuple[nn.Module, nn.Module]]:
    """The blocks of the two graphs that hold exactly the same parameters, paired in the traced graph's order."""
    by_weights = {_weights(b): b for b in other}
    return [(a, by_weights[_weights(a)]) for a in traced if _weights(a) in by_weights]


def point_at(parent: nn.Module, child: nn.Module, replacement: nn.Module) -> None:
    """Make every attribute of `parent`'s modules that holds `child` hold `replacement` instead.

    Raises:
        ValueError: no module under `parent` holds `child`.
    """
    found = False
    for module in parent.modules():
        for name, held in list(module._modules.items()):
            if held is child and module is not replacement:
                module._modules[name] = replacement
                found = True
    if not found:
        raise ValueError(f"{type(child).__name__} is not a block of {type(parent).__name__}")
