"""Operations that mix samples across the batch, found before a model is cut into micro-batches.

A pipeline runs forward on each micro-batch alone. An operation that reads several samples at once
(`h - h.mean(0)`, `softmax(h, 0)`, `h[0]`, `h.T @ h`) then sees only its micro-batch's, and the
result differs from the plain model's with nothing to say so. Before planning, with micro_batches > 1,
the graph runs on the whole example and on its first micro-batch: the dims whose sizes follow the
batch are its batch dims, node by node (`batch_shapes`), and capture.cross_batch_rules names each
operation that mixes them. One is left alone where the runtime already answers for it: a value that
reaches only outputs without a batch dim (a scalar loss, `h.sum()`) is merged by `output_merge_spec`
or refused by name when the micro-batches disagree (see [Note: merging micro-batches never guesses]),
and module BatchNorm is deferred (runtime.batchnorm). The rest is refused (`cross_batch="refuse"`,
the default) with the node, its source line and the fix, or logged as accepted (`cross_batch="allow"`).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree

from partitioner.capture.cross_batch_rules import Shape, mixing
from partitioner.capture.graph import run_restored
from partitioner.errors import PartitionError
from partitioner.request import CrossBatchChoice
from runtime.mutation import mutated_arg

__all__ = ["Mixing", "batch_shapes", "check_cross_batch", "find_mixing", "source_line"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mixing:
    """A node that mixes samples across the batch: its name, what it does, and where forward does it."""

    node: str
    what: str
    where: str

    def __str__(self) -> str:
        return f"node {self.node!r}: {self.what}" + (f", at {self.where}" if self.where else "")


class _Shapes(torch.fx.Interpreter):
    """Records each node's tensor shapes (one per tensor of its output)."""

    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.shapes: dict[str, list[tuple[int, ...]]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        result = super().run_node(n)
        if isinstance(result, torch.Tensor):
            self.shapes[n.name] = [tuple(result.shape)]
        return result


def _run(gm: torch.fx.GraphModule, inputs: Sequence[Any]) -> dict[str, list[tuple[int, ...]]]:
    recorder = _Shapes(gm)
    copies = [pytree.tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x, v) for v in inputs]
    run_restored(gm, lambda: recorder.run(*copies))  # copies: a model writing into its inputs writes into those
    return recorder.shapes


def batch_shapes(gm: torch.fx.GraphModule, whole: Sequence[Any], chunk: Sequence[Any]) -> dict[str, Shape]:
    """Each tensor node's shape on the `whole` example and its batch dims: those whose size differs on `chunk`,
    a micro-batch of it (a dim holding the batch merged with others, such as b * t, differs too)."""
    big, small = _run(gm, whole), _run(gm, chunk)
    found = {}
    for name, (shape,) in big.items():
        other = small.get(name, [None])[0]
        if other is not None and len(other) == len(shape):
            found[name] = Shape(shape, frozenset(d for d, (a, b) in enumerate(zip(shape, other)) if a != b))
    return found


def _writes_state(node: torch.fx.Node) -> bool:
    """Whether `node` writes in place into a buffer or parameter of the model (through views)."""
    target = mutated_arg(node, node.graph.owning_module)
    for _ in range(64):
        if target is None or target.op == "get_attr":
            return target is not None
        target = mutated_arg(target) or (target.args[0] if target.op == "call_method" and target.args and
                                          isinstance(target.args[0], torch.fx.Node) else None)
    return False


def _reaches_samples(node: torch.fx.Node, shapes: dict[str, Shape]) -> bool:
    """Whether `node`'s value reaches a value with a batch dim, or the model's state; else it reaches only
    outputs without one, which the runtime merges by rule or refuses (see the module docstring)."""
    seen: set[str] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n.name in seen:
            continue
        seen.add(n.name)
        shape = shapes.get(n.name)
        if (shape is not None and shape.batch) or _writes_state(n):
            return True
        stack.extend(u for u in n.users if u.op != "output")
    return False


_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)\n\s*(.*)')
_OURS = ("/torch/", "/partitioner/", "/runtime/", "/transformers/utils/")  # frames that are not the model's


def source_line(node: torch.fx.Node) -> str:
    """Where forward does `node`: "`code` (file:line in function)" from fx's recorded stack (node.meta
    'stack_trace'), the innermost frame outside torch and this package; "" where none was recorded."""
    frames = _FRAME.findall(node.meta.get("stack_trace") or "")
    mine = [f for f in frames if not any(part in f[0] for part in _OURS)] or frames
    if not mine:
        return ""
    path, line, function, code = mine[-1]
    return f"`{code.strip()}` ({path}:{line} in {function})"


def find_mixing(gm: torch.fx.GraphModule, shapes: dict[str, Shape]) -> list[Mixing]:
    """The nodes of `gm` that mix samples across the batch where it changes a result (see the module docstring)."""
    return [Mixing(n.name, what, source_line(n)) for n, what in mixing(gm, shapes) if _reaches_samples(n, shapes)]


def check_cross_batch(graphs: Sequence[torch.fx.GraphModule], whole: Sequence[Any], chunk: Sequence[Any],
                      micro_batches: int, choice: CrossBatchChoice) -> list[Mixing]:
    """The operations of `graphs` (the traced model, and its other train/eval mode) that mix samples across
    the batch, found on the example (`whole`) and its first micro-batch (`chunk`; on meta tensors for a model
    on meta, see capture.example.shaped); none with one micro-batch.

    Raises:
        PartitionError: with `choice` "refuse", one or more found: each named with its source line, and the fix.
    """
    if micro_batches == 1:
        return []
    found: list[Mixing] = []
    for gm in graphs:
        try:
            shapes = batch_shapes(gm, whole, chunk)
        except Exception as exc:  # noqa: BLE001 - the planner runs the micro-batch next and names what fails
            log.warning("the cross-batch check could not run the graph on the example and a micro-batch (%s: %s); "
                        "operations mixing samples across the batch are not looked for", type(exc).__name__, exc)
            return []
        found += [m for m in find_mixing(gm, shapes) if m not in found]
    if not found:
        return found
    listed = "\n".join(f"- {m}" for m in found)
    if choice == "allow":
        log.warning("cross_batch='allow': these operations mix samples across the batch and run on each of the %d "
                    "micro-batches alone, so their results differ from the plain model's:\n%s", micro_batches, listed)
        return found
    raise PartitionError(
        f"micro_batches={micro_batches} would change what the model computes: these operations mix samples "
        f"across the batch, and each micro-batch would see only its own samples:\n{listed}\n"
        "Fix: compute them outside forward (over the whole output, in the loss), use micro_batches=1, or pass "
        "cross_batch='allow' to accept results computed per micro-batch (README: equivalence contract)")
