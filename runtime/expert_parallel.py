"""Split each layer's experts over a stage's replicas: tokens dispatched to the experts' ranks and back by all-to-all.

A stack of experts is a module holding its experts' weights stacked along dim 0 (E, ...), called as
`experts(hidden (T, H), index (T, k), weights (T, k)) -> (T, H)`, the sum over each token's k slots of
weight x expert_index(token): Hugging Face's MixtralExperts, Qwen3MoeExperts, GptOssExperts (under any
of their experts implementations) and a plain PyTorch MoE written the same way. Its call is one node of
the stage graph (partitioner/capture/whole.py: `run_whole` on the torch.export path, the module called
as a leaf on the fx path). `parallelize_experts` replaces each such call by an `ExpertDispatch` over
the stage's expert group of e replicas; the rank at position p of the group holds experts
p E/e .. (p + 1) E/e - 1 of each stack (a DTensor sharded on dim 0 over the group's mesh):

    every rank: its T tokens x k slots, sorted by expert ─► counts per rank ─► all-to-all (counts)
      ─► all-to-all (token rows, each slot's expert)       rows for my experts, from every rank
      ─► the model's own experts module on them, over my experts (num_experts = E/e, weight 1)
      ─► all-to-all back (rows of results)                 each slot's expert output, home again
      ─► sum over slots of routing weight x output         = the stack's output, dropless

Nothing is dropped or padded (no capacity factor), so the output and every gradient equal the plain
model's up to the order of floating-point sums. Backward runs the same all-to-alls with the counts
swapped (`_AllToAll`).

[Note: one order of expert all-to-alls]
Every rank of an expert group runs the same stage graph on its own slice of the same micro-batch, in
the same program (sliced replicas run in lockstep), so each posts the dispatch of layer l before that
of layer l + 1, forward in graph order and backward in autograd's order for that graph; recomputation
reruns a forward inside its backward on every rank alike. No path branches on the rank or the values.
Under the NCCL rules each all-to-all is checked first (runtime.nccl_rules.check_all_to_all): the same
exchange on every rank, the counts each peer expects.
"""

from __future__ import annotations

import copy
import operator
from typing import Any, Callable, Sequence, cast

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from runtime.nccl_rules import check_all_to_all

__all__ = ["ExpertDispatch", "expert_calls", "expert_inputs", "parallelize_experts"]


class _AllToAll(torch.autograd.Function):
    """`dist.all_to_all_single` along dim 0 with autograd: backward sends the gradients back the way rows came."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, sends: list[int], expects: list[int], group: Any, label: str,
                checked: bool) -> torch.Tensor:
        ctx.sends, ctx.expects, ctx.group, ctx.label, ctx.checked = sends, expects, group, label, checked
        return _exchange(x, sends, expects, group, label, checked)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        back = _exchange(grad.contiguous(), ctx.expects, ctx.sends, ctx.group, f"{ctx.label} (backward)", ctx.checked)
        return back, None, None, None, None, None


def _exchange(x: torch.Tensor, sends: list[int], expects: list[int], group: Any, label: str,
              checked: bool) -> torch.Tensor:
    if checked:
        check_all_to_all(group, label, sends, expects, tuple(x.shape[1:]), x.dtype)
    out = x.new_empty((sum(expects), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), expects, sends, group=group)
    return out


class ExpertDispatch(nn.Module):
    """A stack of experts split over an expert group (module docstring); holds this rank's experts as DTensors.

    Args:
        experts: the model's module of the stack (its forward is run on this rank's experts).
        params: its stacked parameters by attribute name, each a DTensor sharded on dim 0 over `mesh`.
        mesh: the expert group's one-dimensional mesh (its ranks in group order).
        label: the stack's module path, naming its all-to-alls.
        checked: check each all-to-all under the NCCL rules first.
    """

    def __init__(self, experts: nn.Module, params: dict[str, nn.Parameter], mesh: DeviceMesh, label: str,
                 checked: bool = False) -> None:
        super().__init__()
        total = {int(p.shape[0]) for p in params.values()}
        if len(total) != 1:
            raise ValueError(f"{label}: its stacked weights hold {sorted(total)} experts; a stack holds one count")
        self.experts, self.degree = int(total.pop()), mesh.size()
        if self.experts % self.degree:
            raise ValueError(f"{label}: {self.experts} experts do not split over {self.degree} ranks; use an expert "
                             f"degree that divides {self.experts}")
        self.per_rank, self.label, self.checked = self.experts // self.degree, label, checked
        self.group = mesh.get_group()
        for name, p in params.items():
            self.register_parameter(name, p)
        self._names = list(params)
        self._local = _local_copy(experts, self.per_rank)  # a list: not a submodule (no parameters of its own)

    def forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        tokens, slots = index.shape
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)  # slots sorted by expert, so by the rank holding it
        expert = flat.index_select(0, order)
        dest = torch.div(expert, self.per_rank, rounding_mode="floor")
        sends = torch.bincount(dest, minlength=self.degree)
        expects = _exchange(sends, [1] * self.degree, [1] * self.degree, self.group, f"{self.label} counts",
                            self.checked)
        out_n, in_n = sends.tolist(), expects.tolist()
        rows = hidden.index_select(0, torch.div(order, slots, rounding_mode="floor"))
        rows = cast(torch.Tensor, _AllToAll.apply(rows, out_n, in_n, self.group, f"{self.label} dispatch",
                                                  self.checked))
        mine = _exchange(expert - dest * self.per_rank, out_n, in_n, self.group, f"{self.label} experts",
                         self.checked)
        local = {n: _to_local(getattr(self, n)) for n in self._names}
        done = _run(self._local[0], local, rows, mine)
        back = cast(torch.Tensor, _AllToAll.apply(done, in_n, out_n, self.group, f"{self.label} combine",
                                                  self.checked))
        per_slot = back.index_select(0, torch.argsort(order)).view(tokens, slots, -1)
        return (per_slot * weights.unsqueeze(-1).to(per_slot.dtype)).sum(1).to(hidden.dtype)


def _to_local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if isinstance(p, DTensor) else p


def _local_copy(experts: nn.Module, per_rank: int) -> list[nn.Module]:
    """A shallow copy of `experts` without its parameters, counting `per_rank` experts (set per call)."""
    local = copy.copy(experts)
    local._parameters = {}
    local._buffers = dict(experts._buffers)
    local._modules = dict(experts._modules)
    local.__dict__["num_experts"] = per_rank
    return [local]


def _run(local: nn.Module, params: dict[str, torch.Tensor], rows: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
    """The model's experts module on `rows`, each through its expert of this rank (weight 1)."""
    local.__dict__.update(params)
    try:
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        out: torch.Tensor = local(rows, expert.unsqueeze(1), ones)
    finally:
        for name in params:
            local.__dict__.pop(name, None)
    if rows.shape[0] == 0:  # no token for my experts: their gradients are zeros, as the plain model's
        out = out + sum(p.sum() for p in params.values()) * 0.0
    return out


def expert_calls(gm: torch.fx.GraphModule, layers: Sequence[str]) -> dict[torch.fx.Node, str]:
    """The nodes of `gm` calling a stack of experts of `layers` (module paths) -> that path."""
    wanted, found = set(layers), {}
    for node in gm.graph.nodes:
        path = node.meta.get("whole") if node.op == "call_function" else str(node.target)
        if node.op in ("call_function", "call_module") and path in wanted:
            found[node] = path
    return found


def expert_inputs(node: torch.fx.Node, path: str) -> tuple[list[torch.fx.Node], list[str]]:
    """(hidden, index, weights) of a call of the stack at `path`, and its stacked parameters' attribute names."""
    if node.op == "call_module":
        args = list(node.args)
        if len(args) != 3 or node.kwargs or not all(isinstance(a, torch.fx.Node) for a in args):
            raise ValueError(f"{path} is called with {len(args)} arguments and {sorted(node.kwargs)}; a stack of "
                             "experts is called as experts(hidden, index, weights)")
        return args, []  # type: ignore[return-value]
    params = [a for a in node.args[1:] if isinstance(a, torch.fx.Node) and a.op == "get_attr"
              and str(a.target).startswith(path + ".")]
    tensors = [a for a in node.args[1:] if isinstance(a, torch.fx.Node) and a not in params
               and isinstance(a.meta.get("val"), torch.Tensor)]
    index = [a for a in tensors if not a.meta["val"].is_floating_point()]
    floats = [a for a in tensors if a.meta["val"].is_floating_point()]
    if len(index) == 1 and len(floats) == 2:
        slots = index[0].meta["val"].shape[-1]
        weights = [a for a in floats if a.meta["val"].shape[-1] == slots]
        hidden = [a for a in floats if a.meta["val"].shape[-1] != slots]
        if len(weights) == 1 and len(hidden) == 1:
            return [hidden[0], index[0], weights[0]], [str(p.target).rpartition(".")[2] for p in params]
    raise ValueError(f"{path}: its call reads {[a.name for a in tensors]}, not one token matrix, one index and one "
                     "weight matrix of k slots; expert parallelism needs experts(hidden, index, weights)")


def parallelize_experts(gm: torch.fx.GraphModule, layers: Sequence[str], mesh: DeviceMesh,
                        module_of: Callable[[str], nn.Module], checked: bool = False) -> dict[int, nn.Parameter]:
    """Replace every call of the stacks `layers` in the stage `gm` by an ExpertDispatch over `mesh`; in place.

    `module_of(path)` is the model's module of a stack. Each stacked parameter becomes this rank's experts
    as a DTensor (one already a DTensor, split by the other train/eval graph's stage, is shared). Returns
    {id(old parameter): new} so the model's modules can point at them (runtime.tensor_parallel.rebind).
    """
    calls = expert_calls(gm, layers)
    missing = sorted(set(layers) - set(calls.values()))
    if missing:
        raise ValueError(f"expert_layers names {missing}, which the stage does not call; name the stacks of experts "
                         "its nodes call (partitioner.capture.experts)")
    swaps: dict[int, nn.Parameter] = {}
    for k, (node, path) in enumerate(sorted(calls.items(), key=lambda c: c[0].name)):
        (hidden, index, weights), names = expert_inputs(node, path)
        module = module_of(path)
        names = names or [n for n, p in module.named_parameters(recurse=False) if p.dim() >= 2]
        params = {}
        for name in names:
            old = _param(gm, module, node, f"{path}.{name}", name)
            params[name] = old if isinstance(old, DTensor) else nn.Parameter(
                DTensor.from_local(_shard(old, mesh), mesh, [Shard(0)], run_check=False),
                requires_grad=old.requires_grad)
            swaps[id(old)] = params[name]
        gm.add_submodule(f"ep{k}", ExpertDispatch(module, params, mesh, path, checked))
        with gm.graph.inserting_before(node):
            new = gm.graph.call_module(f"ep{k}", (hidden, index, weights))
        new.meta = dict(node.meta)
        if node.op == "call_function":  # run_whole returns its region's outputs as a tuple: the stack's one output
            pieces = list(node.users)
            if any(p.target is not operator.getitem or p.args[1] != 0 for p in pieces):
                raise ValueError(f"{path}: values inside its call are read outside it; a stack of experts split "
                                 "over ranks gives its output only")
            for piece in pieces:
                piece.replace_all_uses_with(new)
                gm.graph.erase_node(piece)
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):  # the stacks' weights are read by the dispatch now
        if node.op == "get_attr" and not node.users and any(str(node.target).startswith(p + ".") for p in layers):
            gm.graph.erase_node(node)
            owner, _, attr = str(node.target).rpartition(".")
            if hasattr(gm.get_submodule(owner), attr):
                delattr(gm.get_submodule(owner), attr)
    for path in layers:  # an fx leaf: the model's module, which must not hold its whole weights in the stage
        owner, _, attr = path.rpartition(".")
        try:
            if isinstance(gm.get_submodule(path), nn.Module) and not isinstance(gm.get_submodule(path),
                                                                                 ExpertDispatch):
                delattr(gm.get_submodule(owner), attr)
        except AttributeError:
            pass
    gm.graph.lint()
    gm.recompile()
    return swaps


def _param(gm: torch.fx.GraphModule, module: nn.Module, node: torch.fx.Node, qualified: str,
           name: str) -> nn.Parameter:
    """The stage's parameter `qualified` (its own attribute on the export path, the model's module's on fx)."""
    try:
        found = operator.attrgetter(qualified)(gm) if node.op == "call_function" else getattr(module, name)
    except AttributeError:
        found = getattr(module, name)
    if not isinstance(found, nn.Parameter):
        raise ValueError(f"{qualified} is not a parameter; expert parallelism splits a stack's parameters")
    return found


def _shard(p: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """This rank's rows of `p` along dim 0 (its experts), a copy."""
    per = p.shape[0] // mesh.size()
    at = mesh.get_local_rank()
    return p.detach()[at * per:(at + 1) * per].clone()
