"""Profiling a model larger than the device: runs of graph nodes that fit a memory budget,
placed on the device one run (chunk) at a time.

    graph order:  n0 n1 n2 | n3 | n4 n5 ...      each chunk: its modules' weights (and their
                  chunk 0   c1    chunk 2        gradients), the values its nodes read and write

The profiler computes every node's value once where the model lives, then for each chunk
copies the modules its nodes call and the values they read to the device, times them, and
drops the copies before the next chunk. The caller's modules are never moved; tensors
already on the device are shared, not copied.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch import nn

from cost_model.rounds import Recorded, Rounds, record
from cost_model.timing import is_out_of_memory, release_cached

__all__ = ["Chunk", "ChunkModules", "default_budget", "measure_chunks", "model_bytes", "move_value", "node_bytes",
           "plan_chunks", "to_device"]  # fmt: skip

# Kept free on a GPU beyond what a chunk is counted to need: the allocator's rounding and
# fragmentation, cuBLAS/cuDNN workspaces, the backward's temporaries.
_MARGIN_BYTES = 1 << 30
_MARGIN_FRACTION = 0.1


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device`: `t` itself when it is there, else a copy that keeps its requires_grad
    and its Parameter type. The one place tensors are moved (tests replace it to simulate OOM)."""
    if t.device == device:
        return t
    moved = t.detach().to(device)
    if isinstance(t, nn.Parameter):
        return nn.Parameter(moved, requires_grad=t.requires_grad)
    return moved.requires_grad_(True) if t.requires_grad else moved


def move_value(value: Any, device: torch.device, home: torch.device) -> Any:
    """A node's value on `device`: tensors moved, and `home` (a torch.device value) read as `device`."""

    def move(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return to_device(x, device)
        if isinstance(x, torch.device) and x == home:
            return device
        return x

    return pytree.tree_map(move, value)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _module_tensors(gm: torch.fx.GraphModule, node: torch.fx.Node) -> list[torch.Tensor]:
    if node.op != "call_module":
        return []
    module = gm.get_submodule(str(node.target))
    return list(module.parameters()) + list(module.buffers())


def node_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, values: Mapping[str, Any]) -> int:
    """What timing `node` holds on the device: its module's weights (twice for trainable ones:
    their gradients), the values it reads and the value it writes."""
    seen: set[int] = set()
    total = 0
    for t in _module_tensors(gm, node):
        if id(t) not in seen:
            seen.add(id(t))
            total += _nbytes(t) * (2 if t.requires_grad else 1)
    for name in [n.name for n in node.all_input_nodes] + [node.name]:
        for x in pytree.tree_leaves(values.get(name)):
            if isinstance(x, torch.Tensor) and id(x) not in seen:
                seen.add(id(x))
                total += _nbytes(x)
    return total


def model_bytes(gm: torch.fx.GraphModule, device: torch.device | None = None) -> int:
    """Bytes of the model's weights (twice for trainable ones) and buffers; only those on `device` if given."""
    params = [(p, 2 if p.requires_grad else 1) for p in gm.parameters()]
    tensors = params + [(b, 1) for b in gm.buffers()]
    return sum(_nbytes(t) * k for t, k in tensors if device is None or t.device == device)


@dataclass
class Chunk:
    """Consecutive compute nodes timed together; `too_big`: one node alone over the budget (not timed)."""

    nodes: list[torch.fx.Node] = field(default_factory=list)
    nbytes: int = 0
    too_big: bool = False


def plan_chunks(
    gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], values: Mapping[str, Any], budget: int
) -> list[Chunk]:
    """Split `nodes` (graph order) greedily into chunks of at most `budget` bytes (see `node_bytes`).

    A node over the budget alone is a chunk of its own marked `too_big`.
    """
    chunks: list[Chunk] = []
    current = Chunk()
    for node in nodes:
        cost = node_bytes(gm, node, values)
        if current.nodes and (cost > budget or current.nbytes + cost > budget):
            chunks.append(current)
            current = Chunk()
        if cost > budget:
            chunks.append(Chunk([node], cost, too_big=True))
            continue
        current.nodes.append(node)
        current.nbytes += cost
    if current.nodes:
        chunks.append(current)
    return chunks


def default_budget(gm: torch.fx.GraphModule, device: torch.device) -> int | None:
    """Bytes a chunk may use on `device`: free memory, plus the model's tensors already there,
    less a margin; None (no limit) where the device reports no free memory (CPU)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    margin = _MARGIN_BYTES + int(total * _MARGIN_FRACTION)
    return max(int(free) + model_bytes(gm, device) - margin, 0)


class ChunkModules:
    """Device copies of the modules a chunk's nodes call; a module whose tensors are all on
    the device already is used as it is. Copies share one memo, so a tied weight is copied once.
    """

    def __init__(self, gm: torch.fx.GraphModule, nodes: Sequence[torch.fx.Node], device: torch.device) -> None:
        memo: dict[int, Any] = {}
        self._modules: dict[str, nn.Module] = {}
        for node in nodes:
            target = str(node.target)
            if node.op != "call_module" or target in self._modules:
                continue
            module = gm.get_submodule(target)
            tensors = list(module.parameters()) + list(module.buffers())
            for t in tensors:
                if id(t) not in memo:
                    memo[id(t)] = to_device(t, device)
            same = all(memo[id(t)] is t for t in tensors)
            self._modules[target] = module if same else copy.deepcopy(module, memo)

    def get_submodule(self, target: str) -> nn.Module:
        """The device copy of the module at `target` (a chunk node's call_module target)."""
        try:
            return self._modules[target]
        except KeyError:
            raise KeyError(f"module {target!r} is not called by this chunk's nodes; place its node's chunk") from None


def measure_chunks(
    gm: torch.fx.GraphModule,
    flat_inputs: Sequence[Any],
    device: torch.device,
    home: torch.device,
    nodes: list[torch.fx.Node],
    budget: int | None,
    rounds: Rounds,
) -> dict[str, str]:
    """Time `nodes` chunk by chunk into `rounds`: every node's value computed once where the
    model lives (`home`), then each chunk's modules and inputs copied to `device` in turn.

    Returns the nodes not timed, each with the reason (over the budget, out of memory, or an
    error running it alone: the whole graph is not on the device to time it inside a forward).
    """
    skipped: dict[str, str] = {}
    recorded: Recorded | None
    try:
        recorded = _values(gm, flat_inputs, home)
    except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raised
        if not is_out_of_memory(exc):
            raise
        recorded = None
    if recorded is None:
        release_cached(home)
        rounds.progress.advance(len(nodes))
        return dict.fromkeys((n.name for n in nodes), f"out of memory running the model on {home}")
    limit = budget if budget is not None else sys.maxsize
    for chunk in plan_chunks(gm, nodes, recorded.values, limit):
        if chunk.too_big:
            skipped[chunk.nodes[0].name] = f"a node alone needs more than the memory budget of {limit / 2**20:.1f} MiB"
            rounds.progress.advance(len(chunk.nodes))
            continue
        try:
            failed = _measure_chunk(gm, chunk.nodes, recorded, device, home, rounds)
            skipped.update((name, f"it cannot run alone ({why})") for name, why in failed.items())
        except Exception as exc:  # noqa: BLE001 - only out-of-memory is handled; the rest re-raised
            if not is_out_of_memory(exc):
                raise
            skipped.update((n.name, f"out of memory on {device}") for n in chunk.nodes)
            rounds.progress.advance(len(chunk.nodes))
        release_cached(device)  # the chunk's copies are gone: give their blocks back before the next
    return skipped


def _measure_chunk(
    gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], recorded: Recorded, device: torch.device,
    home: torch.device, rounds: Rounds,
) -> dict[str, str]:
    """One chunk: its modules and the values its nodes read copied to `device`, timed, dropped on return.
    Returns the chunk's nodes that raised when run alone (see `Rounds.time`)."""
    modules = ChunkModules(gm, nodes, device)
    values = recorded.values
    local = {n.name: values[n.name] for n in nodes}  # outputs: NodeRunner reads only their flags
    reads = {i.name for n in nodes for i in n.all_input_nodes}
    local.update((name, move_value(values[name], device, home)) for name in reads)
    seen = {n.name: move_value(recorded.seen[n.name], device, home) for n in nodes if n.name in recorded.seen}
    return rounds.time(modules, nodes, Recorded(local, seen, recorded.writes))


def _values(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any], home: torch.device) -> Recorded:
    """Every node's value from one run of the model where it lives, detached but still flagged requires_grad
    (with the inputs nodes read before a later in-place op changed them, `rounds.record`)."""
    inputs = [move_value(x, home, home) for x in flat_inputs]
    recorded = record(gm, inputs, home)
    return Recorded(
        {name: pytree.tree_map(_keep_grad_flag, v) for name, v in recorded.values.items()},
        {name: pytree.tree_map(_keep_grad_flag, dict(v)) for name, v in recorded.seen.items()},
        recorded.writes,
    )


def _keep_grad_flag(x: Any) -> Any:
    """A value detached from the graph that made it (freeing that graph), still flagged requires_grad."""
    if isinstance(x, torch.Tensor):
        return x.detach().requires_grad_(True) if x.requires_grad else x.detach()
    return x
