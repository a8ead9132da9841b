"""The mixture-of-experts layers of a traced graph that expert parallelism can split, and those it cannot, with why.

Found from the graph and the modules it calls, not from model names. A layer is a stack of experts
(partitioner/capture/whole.py: a module holding two or more parameters of 3+ dims with one leading
size, the experts; one node of the graph on both trace paths) called as
`experts(hidden (T, H), index (T, k), weights (T, k))`, with `num_experts` experts, its index read off a
top-k over a router's scores. Such a layer splits: its experts over e ranks (e divides the count), the
tokens sent to their experts' ranks and back by all-to-all (runtime.expert_parallel); the router, the
top-k and everything else of the block stay whole (replicated, as data parallelism holds them). What
cannot split is reported with the reason (another call signature, no expert count, called twice).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Collection

import torch
import torch.fx
from torch import nn

from partitioner.capture.graph import owning_module
from partitioner.capture.shardable_groups import divisors
from partitioner.capture.whole import expert_stacks
from runtime.expert_parallel import expert_calls, expert_inputs

__all__ = ["ExpertLayer", "Experts", "WholeExperts", "find_experts"]


@dataclass(frozen=True)
class ExpertLayer:
    """One layer's stack of experts that splits: where, how many, how routed, what it holds."""

    path: str  # the stack's module (the plan's StagePlan.expert_layers)
    node: str  # the graph node calling it
    experts: int
    top_k: int | None  # slots per token, where the index comes from a top-k
    router: str | None  # the module whose scores the top-k reads
    params: tuple[str, ...]  # the stacked parameters split along dim 0
    param_bytes: int
    degrees: tuple[int, ...]  # expert degrees that split it evenly

    def describe(self) -> str:
        routed = f"top-{self.top_k} of {self.router or 'a router'}" if self.top_k else "routed"
        return (f"{self.path}: {self.experts} experts ({', '.join(self.params)}, {self.param_bytes / 2**20:.1f} MiB), "
                f"{routed}; splits over {'/'.join(map(str, self.degrees[1:])) or 'no'} ranks, the router stays whole")


@dataclass(frozen=True)
class WholeExperts:
    """A stack of experts left whole on every rank, and why."""

    path: str
    reason: str


@dataclass
class Experts:
    """Everything find_experts found in one graph."""

    layers: list[ExpertLayer] = field(default_factory=list)
    whole: list[WholeExperts] = field(default_factory=list)

    def within(self, nodes: Collection[str]) -> list[ExpertLayer]:
        """The layers whose call is one of `nodes` (a pipeline stage's)."""
        inside = set(nodes)
        return [layer for layer in self.layers if layer.node in inside]

    def degrees(self) -> tuple[int, ...]:
        """Expert degrees that split every layer evenly."""
        common = set.intersection(*(set(layer.degrees) for layer in self.layers)) if self.layers else {1}
        return tuple(sorted(common))

    def report(self) -> str:
        lines = [f"splits: {layer.describe()}" for layer in self.layers]
        lines += [f"whole: {w.path}: {w.reason}" for w in self.whole]
        return "\n".join(lines) or "no stack of experts"


def _top_k(index: torch.fx.Node) -> tuple[int | None, str | None]:
    """(k, router module) where `index` is a top-k's indices (through a getitem), else (None, None)."""
    node = index
    for _ in range(4):
        if "topk" in str(node.target):
            k = node.args[1] if len(node.args) > 1 else node.kwargs.get("k")
            router = None
            seen = list(node.all_input_nodes)
            while seen and router is None:  # the nearest module with a weight upstream of the scores
                n = seen.pop(0)
                path = owning_module(n)
                if n.op == "call_module" or ("linear" in str(n.target)):
                    router = path or None
                seen += n.all_input_nodes[:1]
                if len(seen) > 16:
                    break
            return (int(k) if isinstance(k, int) else None), router
        if not node.all_input_nodes:
            break
        node = node.all_input_nodes[0]
    return None, None


def find_experts(gm: torch.fx.GraphModule, model: nn.Module) -> Experts:
    """The stacks of experts `gm` (traced from `model`) calls, split or left whole with the reason."""
    found = Experts()
    paths = expert_stacks(model)
    calls = expert_calls(gm, paths)
    counts = Counter(calls.values())
    for path in paths:
        if path not in counts:
            found.whole.append(WholeExperts(path, "no single node of the graph calls it (its nodes stay inlined: "
                                                  "another module's nodes interleave with them)"))
    for node, path in sorted(calls.items(), key=lambda c: c[0].name):
        module = model.get_submodule(path)
        stacked = [(n, p) for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
        total = int(stacked[0][1].shape[0]) if stacked else 0
        if counts[path] > 1:
            found.whole.append(WholeExperts(path, f"called {counts[path]} times; a split stack is called once"))
            continue
        if getattr(module, "num_experts", None) != total:
            found.whole.append(WholeExperts(path, f"its num_experts ({getattr(module, 'num_experts', None)}) is not "
                                                  f"the {total} experts its weights stack; each rank runs the "
                                                  "module over its own experts by that count"))
            continue
        try:
            (_, index, _), _ = expert_inputs(node, path)
        except ValueError as exc:
            found.whole.append(WholeExperts(path, str(exc)))
            continue
        k, router = _top_k(index)
        found.layers.append(ExpertLayer(
            path, node.name, total, k, router, tuple(n for n, _ in stacked),
            sum(p.numel() * p.element_size() for _, p in stacked), divisors(total)))
    return found
