"""The traced graph as a networkx DiGraph annotated with shapes, bytes and FLOPs per node.

One vertex per fx node (keyed by node name) carrying:
  name, op, target, module (owning module path), position (topological index),
  shapes, dtypes, out_bytes (bytes of the node's output tensors),
  input_ratio (bytes of its tensor arguments over out_bytes, where both are nonzero: a ratio, so it
  holds when a batch or a tensor split scales out_bytes; cost_model/ops.py prices reductions by it),
  param_bytes (parameters and buffers first used here), flops (forward),
  dropout_p (a dropout's probability, where the graph states it),
  requires_grad (whether autograd tracks its output in training: it reads a trainable parameter, directly or
  through its inputs, and is floating point; the graph runs under no_grad, so this is read off the graph).
Edges go producer -> consumer and carry `bytes`, the producer's output bytes.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import networkx as nx
import torch
import torch.fx
import torch.utils._pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["batch_outputs", "build_graph", "compute_nodes", "owning_module", "run_restored"]

# Nodes that do no work and are dropped from stages (export's guards and metadata asserts).
_NO_WORK = {"_guards_fn"}


def _tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def owning_module(node: torch.fx.Node) -> str:
    """Dotted path of the module whose forward produced `node` ('' for the root)."""
    if node.op == "call_module":
        return str(node.target)
    if node.op == "get_attr":
        return str(node.target).rpartition(".")[0]
    stack = node.meta.get("nn_module_stack")
    if stack:
        path = list(stack.values())[-1][0]
        return "" if path.startswith("_empty") else str(path)
    return ""


def compute_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    """Nodes that run in stages, in topological order: calls, not placeholders/attrs/output."""
    return [
        n
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and n.target not in _NO_WORK
    ]


class _Recorder(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm)
        self.info: dict[str, dict[str, Any]] = {}

    def run_node(self, n: torch.fx.Node) -> Any:
        read = 0
        if n.op in ("call_function", "call_method", "call_module"):
            args = self.fetch_args_kwargs_from_env(n)
            read = sum(_tensor_bytes(x) for x in pytree.tree_leaves(args) if isinstance(x, torch.Tensor))
        counter = FlopCounterMode(display=False)
        with counter:
            result = super().run_node(n)
        tensors = [x for x in pytree.tree_leaves(result) if isinstance(x, torch.Tensor)]
        out_bytes = sum(_tensor_bytes(t) for t in tensors)
        self.info[n.name] = {
            "shapes": [tuple(t.shape) for t in tensors],
            "dtypes": [str(t.dtype).replace("torch.", "") for t in tensors],
            "out_bytes": out_bytes,
            "flops": int(counter.get_total_flops()),
        }
        if read and out_bytes:
            self.info[n.name]["input_ratio"] = read / out_bytes
        p = _dropout_p(self.module, n)
        if p is not None:
            self.info[n.name]["dropout_p"] = p
        return result


_DROPOUT_FNS = {torch.nn.functional.dropout, torch.dropout, torch.ops.aten.dropout.default,
                torch.ops.aten.native_dropout.default}


def _dropout_p(gm: torch.nn.Module, n: torch.fx.Node) -> float | None:
    """A dropout's probability where the graph states it (a Dropout module's p, a dropout call's constant p);
    p = 0 returns its input, keeping no mask (cost_model.ops prices it as a view)."""
    if n.op == "call_module":
        module = gm.get_submodule(str(n.target))
        return float(module.p) if isinstance(module, torch.nn.modules.dropout._DropoutNd) else None
    if n.op == "call_function" and n.target in _DROPOUT_FNS:
        p = n.args[1] if len(n.args) > 1 else n.kwargs.get("p", 0.5)
        return float(p) if isinstance(p, (int, float)) else None
    return None


def _param_bytes(gm: torch.fx.GraphModule, node: torch.fx.Node, seen: set[int]) -> int:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        tensors = list(module.parameters()) + list(module.buffers())
    elif node.op == "get_attr":
        obj = operator.attrgetter(str(node.target))(gm)
        tensors = [obj] if isinstance(obj, torch.Tensor) else []
    else:
        return 0
    total = 0
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            total += _tensor_bytes(t)
    return total


def run_restored(gm: torch.fx.GraphModule, run: Any) -> Any:
    """`run()` with no grad and the RNG forked, the graph's buffers restored afterwards."""
    buffers = {name: b.detach().clone() for name, b in gm.named_buffers()}
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            return run()
    finally:
        with torch.no_grad():
            for name, b in gm.named_buffers():
                b.copy_(buffers[name])


def batch_outputs(
    gm: torch.fx.GraphModule, whole: Sequence[Any], chunk: Sequence[Any], sizes: tuple[int, int]
) -> list[bool]:
    """For every leaf of the graph's output: is its dim 0 the batch? Read off running the graph on
    the whole example (`sizes[0]` samples) and on its first micro-batch (`sizes[1]`): a leaf whose
    dim 0 follows the batch size is; a scalar, a fixed-size tensor or a Python value is not."""
    def leaves(inputs: Sequence[Any]) -> list[Any]:
        return pytree.tree_leaves(run_restored(gm, lambda: torch.fx.Interpreter(gm).run(*inputs)))

    big, small = leaves(whole), leaves(chunk)
    return [
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() > 0 and b.dim() > 0
        and a.shape[0] == sizes[0] and b.shape[0] == sizes[1] and sizes[0] != sizes[1]
        for a, b in zip(big, small)
    ]


# Calls whose output autograd does not track whatever they read.
_NO_GRAD_TARGETS = {"detach", "detach_", "argmax", "argmin", "argsort", "size", "dim", "numel", "zeros_like",
                    "ones_like", "empty_like", "full_like", "eq", "ne", "lt", "le", "gt", "ge", "sign", "floor_divide"}


def _requires_grad(gm: torch.fx.GraphModule, node: torch.fx.Node, graph: nx.DiGraph) -> bool:
    """Whether `node`'s output is tracked by autograd in training (see the module docstring); a placeholder (the
    model's input) is not, as a training batch is not."""
    if not any(str(d).startswith(("float", "bfloat", "complex")) for d in graph.nodes[node.name]["dtypes"]):
        return False
    if node.op == "get_attr":
        obj = operator.attrgetter(str(node.target))(gm)
        return isinstance(obj, torch.Tensor) and obj.requires_grad
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(str(node.target)).parameters()):
        return True
    name = str(getattr(node.target, "__name__", node.target)).split(".")[0]
    if name in _NO_GRAD_TARGETS:
        return False
    return any(graph.nodes[u.name].get("requires_grad", False) for u in node.all_input_nodes)


def build_graph(gm: torch.fx.GraphModule, flat_inputs: Sequence[Any]) -> nx.DiGraph:
    """Run `gm` once on `flat_inputs` (no grad, buffers restored) and build the annotated DiGraph."""
    recorder = _Recorder(gm)
    run_restored(gm, lambda: recorder.run(*flat_inputs))

    graph = nx.DiGraph()
    seen: set[int] = set()
    for position, node in enumerate(gm.graph.nodes):
        info = recorder.info.get(node.name, {"shapes": [], "dtypes": [], "out_bytes": 0, "flops": 0})
        graph.add_node(
            node.name,
            name=node.name,
            op=node.op,
            target=str(getattr(node.target, "__name__", node.target)),
            module=owning_module(node),
            position=position,
            param_bytes=_param_bytes(gm, node, seen),
            cut_before=bool(node.meta.get("cut_before", False)),  # a pipe_split() marker right before it
            **info,
        )
        for producer in node.all_input_nodes:
            graph.add_edge(producer.name, node.name, bytes=graph.nodes[producer.name]["out_bytes"])
        graph.nodes[node.name]["requires_grad"] = _requires_grad(gm, node, graph)
    return graph
