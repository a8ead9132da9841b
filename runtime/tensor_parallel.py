"""Split a stage module's layers across its tensor-parallel group with DTensor (issue 26).

`parallelize_stage(module, mesh, groups)` takes a stage GraphModule (runtime.stage), the TP mesh of
its ranks and the groups to split (runtime.tensor_parallel_spec: parameter names and shardings) and
rewrites it in place:

- a group's parameters become DTensors: where the graph calls a torch.nn Linear or Embedding,
  `parallelize_module` with DTensor's own `ColwiseParallel` / `RowwiseParallel` (use_local_output=False,
  so heads viewed, transposed and attended stay DTensors); elsewhere (functional ops: the export
  path, Hugging Face Conv1D, a tied LM head) `distribute_tensor` with the same placements; a fused
  q/k/v weight as a strided shard (each rank: its heads of q, of k and of v), its Linear run block by
  block (`FusedLinear`);
- the group's region is every node on a path from a colwise (or vocab) parameter's use to a rowwise
  one's, and those uses: values entering it become replicated DTensors (`ToDTensor`), values leaving
  it plain whole tensors (`ToPlain`: DTensor's redistribute, so an all-reduce after a rowwise layer or
  a vocabulary lookup, an all-gather after an LM head), so stage inputs and outputs stay plain and
  pipeline transfers are unchanged; a model output (the graph's output its only reader: an LM head's logits)
  leaves through a ToPlain of its own, which training steps of the last stage turn off for values split by
  vocabulary: the loss reads them split (runtime.loss_split);
- inside a region, `scaled_dot_product_attention` runs per head (`LocalAttention`) and the split of a
  fused q/k/v output keeps each rank's heads (`FusedSplit`), see runtime.tensor_parallel_ops.

`print(module.code)` shows the result: `self.tp0_in(x)` where a group starts, `self.tp0_out(y)` where
it ends; the forward collectives run there (or in the rowwise nn.Linear's own output hook just before).

Gradients of split parameters are DTensors (`.full_tensor()` gathers one); every other parameter gets
the same gradient on every TP rank. `checkpoint_state` is what a TP stage writes with
torch.distributed.checkpoint, keyed like the model (and reads: `restore_state` after `dcp.load`).

[Note: one order of TP collectives]
NCCL runs the collectives of a group in the order they are posted and hangs if two ranks post them in
different orders. Here that order is the same on every TP rank by construction:
- every rank of the group runs the same stage graph (same nodes, same groups, same rewrite), on
  values of the same shapes (stage inputs and everything outside a region are replicated);
- DTensor decides each collective from the placements, which depend only on the spec, the graph
  and the shapes, never on values or rank: forward posts them in graph order (the conversions sit at
  fixed nodes), backward in autograd's order for that one graph on one device;
- setting up (`distribute_tensor` scatters each parameter from the group's first rank) walks the
  groups and their parameters in the given order, and `checkpoint_state` its keys sorted.
No code path here branches on the rank (whether logits leave split depends on the step's mode, the same on
every rank of the group); random ops on split values (dropout with p > 0 inside a
region) use DTensor's own RNG tracker and are not bitwise equal to the plain model.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from runtime.dtensor_save import savable, unsaved
from runtime.tensor_parallel_ops import FusedLinear, FusedSplit, LocalAttention, ToDTensor, ToPlain
from runtime.tensor_parallel_spec import ShardedParam, TensorParallelGroup

__all__ = ["as_mesh", "checkpoint_state", "parallelize_stage", "placement", "rebind", "region", "restore_state"]

_CALLS = ("call_function", "call_method", "call_module")
_ATTENTION = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}
_SPLITS_FN = {torch.split, torch.chunk, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
              torch.ops.aten.chunk.default}
_SPLITS_METHOD = {"split", "chunk"}


def as_mesh(group: DeviceMesh | ProcessGroup, device_type: str) -> DeviceMesh:
    """The one-dimensional TP mesh of `group` (a DeviceMesh is returned as it is)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(f"a tensor-parallel mesh has one dimension, got {group.ndim} ({group}); pass "
                             "the tensor dimension of the job's mesh, mesh['tensor']")
        return group
    return DeviceMesh.from_group(group, device_type)


def placement(param: ShardedParam) -> Placement:
    """The DTensor placement of a parameter of a group."""
    if param.dim is None:
        return Replicate()
    if param.fused > 1:
        return _StridedShard(param.dim, split_factor=param.fused)
    return Shard(param.dim)


def _aliases(module: nn.Module) -> dict[str, list[str]]:
    """Each parameter name -> every name of that tensor in `module` (tied weights have several)."""
    by_id: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return {name: names for names in by_id.values() for name in names}


def _leaf_calls(gm: torch.fx.GraphModule) -> dict[str, list[torch.fx.Node]]:
    calls: dict[str, list[torch.fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module":
            calls.setdefault(str(node.target), []).append(node)
    return calls


def _users(gm: torch.fx.GraphModule, names: list[str], calls: dict[str, list[torch.fx.Node]]) -> set[torch.fx.Node]:
    """The compute nodes that read a parameter known by `names`: its get_attr's users, or calls of its module."""
    found: set[torch.fx.Node] = set()
    for node in gm.graph.nodes:
        if node.op == "get_attr" and str(node.target) in names:
            found.update(u for u in node.users if u.op in _CALLS)
    for name in names:
        found.update(calls.get(name.rpartition(".")[0], []))
    return found


Step = Callable[[torch.fx.Node], Iterable[torch.fx.Node]]


def _closure(start: Iterable[torch.fx.Node], step: Step) -> set[torch.fx.Node]:
    seen: set[torch.fx.Node] = set()
    todo = list(start)
    while todo:
        for nxt in step(todo.pop()):
            if nxt.op in _CALLS and nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def region(gm: torch.fx.GraphModule, group: TensorParallelGroup) -> set[torch.fx.Node]:
    """The nodes of `gm` that run on DTensors for `group`: its parameters' uses and every node on a
    path from a colwise (or vocab) use to a rowwise one."""
    aliases, calls = _aliases(gm), _leaf_calls(gm)
    split: set[torch.fx.Node] = set()
    summed: set[torch.fx.Node] = set()
    for p in group.params:
        if p.name not in aliases:
            raise KeyError(f"group {group.name!r}: the stage has no parameter {p.name!r}; a group names the "
                           "parameters of this stage's module (the model's state_dict keys)")
        (summed if p.style == "rowwise" else split).update(_users(gm, aliases[p.name], calls))
    between = _closure(split, lambda n: n.users) & _closure(summed, lambda n: n.all_input_nodes)
    return split | summed | between


def _style(module: nn.Module, specs: dict[str, ShardedParam]) -> ParallelStyle | None:
    """DTensor's own style for a torch.nn leaf whose parameters the group splits the standard way."""
    weight, bias = specs.get("weight"), specs.get("bias")
    if weight is None or weight.fused != 1 or set(specs) - {"weight", "bias"}:
        return None
    has_bias = getattr(module, "bias", None) is not None
    if isinstance(module, nn.Linear):
        if weight.style in ("colwise", "vocab") and weight.dim == 0 and (
                not has_bias or (bias is not None and bias.dim == 0 and bias.fused == 1)):
            return ColwiseParallel(use_local_output=False)
        if weight.style == "rowwise" and weight.dim == 1 and (not has_bias or (bias is not None and bias.dim is None)):
            return RowwiseParallel(use_local_output=False)
    if isinstance(module, nn.Embedding) and weight.style == "vocab" and weight.dim == 0:
        return RowwiseParallel(input_layouts=Replicate(), use_local_output=False)
    return None


def _distribute(gm: torch.fx.GraphModule, mesh: DeviceMesh, params: list[ShardedParam]) -> None:
    """Make every parameter of `params` a DTensor in `gm`: DTensor's own styles where the graph calls a torch.nn
    Linear or Embedding split the standard way, `distribute_tensor` elsewhere (the leaf's other weights whole)."""
    aliases, calls = _aliases(gm), _leaf_calls(gm)
    by_leaf: dict[str, dict[str, ShardedParam]] = {}
    loose: list[tuple[str, Placement]] = []
    for p in params:
        owner, _, attr = p.name.rpartition(".")
        if owner in calls and len(aliases[p.name]) == 1:
            by_leaf.setdefault(owner, {})[attr] = p
        else:
            loose.append((p.name, placement(p)))
    for owner, specs in by_leaf.items():
        leaf = gm.get_submodule(owner)
        if any(isinstance(p, DTensor) for p in leaf.parameters(recurse=False)):
            continue  # split already, by the other train/eval mode's stage sharing this leaf (and its hooks)
        style = _style(leaf, specs)
        if style is not None:
            parallelize_module(leaf, mesh, style)
            continue
        for attr, _ in leaf.named_parameters(recurse=False):
            spec = specs.get(attr)
            loose.append((f"{owner}.{attr}", placement(spec) if spec is not None else Replicate()))
    for name, where in loose:
        old = gm.get_parameter(name)
        if isinstance(old, DTensor):
            continue
        new = nn.Parameter(distribute_tensor(old.detach(), mesh, [where]), requires_grad=old.requires_grad)
        for alias in aliases[name]:
            owner, _, attr = alias.rpartition(".")
            setattr(gm.get_submodule(owner), attr, new)


_LINEAR = {F.linear, torch.ops.aten.linear.default}
_ADDMM = {torch.addmm, torch.ops.aten.addmm.default}


def _unfuse(gm: torch.fx.GraphModule, group: TensorParallelGroup, prefix: str) -> None:
    """Run the Linears (and Conv1D addmms) of fused parameters block by block (see FusedLinear)."""
    aliases, calls = _aliases(gm), _leaf_calls(gm)
    for p in group.params:
        if p.fused == 1 or not p.name.endswith("weight"):  # a fused bias is read with its weight
            continue
        for node in sorted(_users(gm, aliases[p.name], calls), key=lambda n: n.name):
            name = f"{prefix}_fused_{node.name}"
            if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), nn.Linear):
                leaf = str(node.target)
                with gm.graph.inserting_before(node):
                    weight = gm.graph.get_attr(f"{leaf}.weight")
                    bias = gm.graph.get_attr(f"{leaf}.bias") if gm.get_submodule(leaf).bias is not None else None
                gm.add_submodule(name, FusedLinear(p.fused, "linear"))
                _replace(gm, node, name, (node.args[0], weight, bias))
            elif node.op == "call_function" and node.target in _LINEAR and not node.kwargs:
                gm.add_submodule(name, FusedLinear(p.fused, "linear"))
                _replace(gm, node, name, tuple(node.args))
            elif node.op == "call_function" and node.target in _ADDMM and not node.kwargs and len(node.args) == 3:
                gm.add_submodule(name, FusedLinear(p.fused, "addmm"))
                _replace(gm, node, name, (node.args[1], node.args[2], node.args[0]))


def _shape_only(node: torch.fx.Node) -> bool:
    """A value that is sizes, not a tensor (x.shape, x.size(1), sym_size, arithmetic on them)."""
    if node.op == "call_function" and node.target is getattr:
        return len(node.args) > 1 and node.args[1] in ("shape", "dtype", "device", "ndim")
    if node.op == "call_method" and node.target in ("size", "dim"):
        return True
    if node.op == "call_function" and "sym_size" in str(node.target):
        return True
    arithmetic = (operator.getitem, operator.floordiv, operator.mul, operator.add, operator.sub)
    if node.op == "call_function" and (node.target in arithmetic or getattr(node.target, "__module__", "") == "math"):
        return bool(node.all_input_nodes) and all(_shape_only(n) for n in node.all_input_nodes)
    return False


def _replace(gm: torch.fx.GraphModule, node: torch.fx.Node, target: str, args: tuple[Any, ...]) -> torch.fx.Node:
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(target, args, dict(node.kwargs))
    new.meta = dict(node.meta)
    new.meta.setdefault("tp_replaced", node.name)  # the traced node it runs (a sequence split finds it by name)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def _method(name: str) -> Callable[..., Any]:
    def call(value: Any, *args: Any, **kwargs: Any) -> Any:
        return getattr(value, name)(*args, **kwargs)

    call.__name__ = name
    return call


def _rewrite(gm: torch.fx.GraphModule, group: TensorParallelGroup, mesh: DeviceMesh, index: int) -> None:
    prefix = f"tp{index}"
    _unfuse(gm, group, prefix)
    nodes = region(gm, group)
    gm.add_submodule(f"{prefix}_in", ToDTensor(mesh))
    gm.add_submodule(f"{prefix}_out", ToPlain())
    order = [n for n in gm.graph.nodes if n in nodes]
    for k, node in enumerate(order):  # ops DTensor cannot run split as they are
        if node.op == "call_function" and node.target in _ATTENTION:
            gm.add_submodule(f"{prefix}_attention{k}", LocalAttention(node.target))
            order[k] = _replace(gm, node, f"{prefix}_attention{k}", node.args)
        elif (node.op == "call_function" and node.target in _SPLITS_FN) or (
                node.op == "call_method" and node.target in _SPLITS_METHOD):
            split = node.target if node.op == "call_function" else _method(str(node.target))
            gm.add_submodule(f"{prefix}_split{k}", FusedSplit(split))
            order[k] = _replace(gm, node, f"{prefix}_split{k}", node.args)
    inside = set(order)
    for node in order:  # values leaving the group: whole plain tensors
        outside = [u for u in node.users if u not in inside]
        if outside:
            target = f"{prefix}_out"
            if all(u.op == "output" for u in outside):  # a model output: the loss may take it split
                target = f"{prefix}_loss_out{node.name}"
                gm.add_submodule(target, ToPlain(to_loss=True))
            with gm.graph.inserting_after(node):
                plain = gm.graph.call_module(target, (node,))
            plain.meta = {**node.meta, "tp_of": node.name}  # the whole value, as traced (a sequence split reads
            # its shape and, at a stage boundary, its name)
            plain.meta.pop("tp_replaced", None)
            for user in outside:
                user.replace_input_with(node, plain)
    distributed = {id(p) for p in gm.parameters() if isinstance(p, DTensor)}
    lifted: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in order:  # values entering it: replicated DTensors
        for producer in list(node.all_input_nodes):
            if producer in inside or _shape_only(producer):
                continue
            if producer.op == "get_attr" and id(operator.attrgetter(str(producer.target))(gm)) in distributed:
                continue
            if producer not in lifted:
                with gm.graph.inserting_before(node):
                    lifted[producer] = gm.graph.call_module(f"{prefix}_in", (producer,))
            node.replace_input_with(producer, lifted[producer])


def parallelize_stage(
    module: torch.fx.GraphModule, mesh: DeviceMesh | ProcessGroup, groups: Sequence[TensorParallelGroup]
) -> torch.fx.GraphModule:
    """Split `groups` of the stage `module` across the TP `mesh` (see the module docstring); in place.

    Every rank of the mesh calls it with the same module and groups (see [Note: one order of TP
    collectives]); each parameter's values are taken from the mesh's first rank.

    Raises:
        KeyError: a group names a parameter the stage does not have.
        ValueError: a parameter is in two groups, or the mesh has more than one dimension.
    """
    seen: dict[str, str] = {}
    for g in groups:
        for p in g.params:
            if p.name in seen:
                raise ValueError(f"parameter {p.name!r} is in groups {seen[p.name]!r} and {g.name!r}; a parameter "
                                 "is split one way")
            seen[p.name] = g.name
    regions = [region(module, g) for g in groups]  # before any rewrite: the uses as traced
    for a in range(len(groups)):
        for b in range(a + 1, len(groups)):
            shared = regions[a] & regions[b]
            if shared:
                raise ValueError(f"groups {groups[a].name!r} and {groups[b].name!r} share nodes "
                                 f"{sorted(n.name for n in shared)[:3]}; split them as one group or not at all")
    tp = as_mesh(mesh, next((p.device.type for p in module.parameters()), "cpu"))
    _distribute(module, tp, [p for g in groups for p in g.params])
    for index, g in enumerate(groups):
        _rewrite(module, g, tp, index)
    module.graph.lint()
    module.recompile()
    return module


def rebind(roots: Iterable[nn.Module], swaps: Mapping[int, nn.Parameter]) -> list[tuple[nn.Module, str, Any]]:
    """Point every attribute of `roots`' modules holding a parameter that `parallelize_stage` replaced (by id) at
    its DTensor, so the model's own modules (its state_dict, its optimizer) hold what the split stage holds;
    returns (module, name, old parameter) to put back."""
    undo: list[tuple[nn.Module, str, Any]] = []
    for root in roots:
        for module in root.modules():
            for name, p in list(module._parameters.items()):
                if p is not None and id(p) in swaps and swaps[id(p)] is not p:
                    undo.append((module, name, p))
                    module._parameters[name] = swaps[id(p)]
    return undo


def checkpoint_state(module: nn.Module, model: nn.Module | None = None) -> dict[str, torch.Tensor]:
    """The state a TP stage writes with torch.distributed.checkpoint (DCP): split parameters as DTensors
    in placements DCP saves (a fused q/k/v weight's strided split is redistributed to a plain row split),
    keyed by the module's names, or, with `model`, by every key of `model.state_dict()` the stage holds
    (a tied weight under each of its names), so the plain model loads it with its own keys.

    Every TP rank calls it, in the same order as the other collectives (it may redistribute).
    """
    held = dict(module.state_dict(keep_vars=True))
    if model is not None:
        keys: dict[int, list[str]] = {}
        for key, t in model.state_dict(keep_vars=True).items():
            keys.setdefault(id(t), []).append(key)
        named = {}
        for names in keys.values():
            source = next((k for k in names if k in held), None)
            if source is not None:
                named.update(dict.fromkeys(names, held[source]))
        held = named
    return {key: savable(held[key].detach()) for key in sorted(held)}


def restore_state(module: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """After torch.distributed.checkpoint loaded into `state = checkpoint_state(module, ...)`, copy what it
    loaded into redistributed copies (fused q/k/v weights) back into the module; the rest loaded in place.

    Every TP rank calls it, like `checkpoint_state`.
    """
    live = module.state_dict(keep_vars=True)
    with torch.no_grad():
        for key in sorted(set(live) & set(state)):
            t = live[key]
            if isinstance(t, DTensor) and any(isinstance(p, _StridedShard) for p in t.placements):
                loaded = state[key]
                if not isinstance(loaded, DTensor):
                    raise TypeError(f"{key}: expected the DTensor checkpoint_state gave, got {type(loaded).__name__}")
                t.copy_(unsaved(loaded, t))
