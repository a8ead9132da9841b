"""How one graph node carries a value split on one dimension (tensor parallelism), read off its op and shapes.

`carry(node, name, states, shapes)` answers, for a node some of whose inputs are split across the
ranks of a tensor-parallel group (each holds a slice of one dimension, e.g. its heads), whether the node
can run on the slices with no communication, and on which dimension of its output the split lands:
element-wise ops keep it (broadcast inputs are read whole), views move it where the sizes before it
match (a hidden dimension into heads, heads back into hidden), transposes permute it, reductions,
softmax and norms must not run over it, attention runs per head, a split of a fused q/k/v output
into its equal blocks keeps each rank's heads of each. Anything else is `Blocked` with the reason.
The ops are named as torch.fx (functions, methods, torch.nn modules) and torch.export (aten) write them.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Collection, Sequence

import torch
import torch.fx
from torch import nn

__all__ = ["Blocked", "Carried", "Split", "State", "carry", "op_name"]

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Split:
    """A value split across the group on `dim`; `seed` is the Linear whose whole output features it still is."""

    group: int
    dim: int
    seed: str | None = None
    origin: str | None = None  # the Linear it comes from, until its features are viewed as heads


State = Split | None | tuple[Any, ...]  # a tuple: one state per element of a node's tuple output


class Blocked(Exception):
    """The node cannot run on split values without communication; the message says why."""


@dataclass
class Carried:
    """What a node does with split inputs: its output's state, groups it joins, sizes it splits, fused blocks."""

    state: State = None
    joins: list[int] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    fused: tuple[str, int] | None = None  # (seed Linear, blocks): its output is split into equal blocks here
    heads: tuple[str, int] | None = None  # (Linear, heads): its output features are viewed as that many heads


_ELEMENTWISE = {
    "add", "sub", "mul", "div", "truediv", "floordiv", "neg", "pow", "rsqrt", "sqrt", "exp", "log", "tanh",
    "sigmoid", "relu", "gelu", "silu", "elu", "selu", "leaky_relu", "softplus", "mish", "hardswish", "hardtanh",
    "clamp", "clamp_min", "clamp_max", "abs", "sign", "erf", "cos", "sin", "dropout", "native_dropout", "masked_fill",
    "where", "to", "float", "half", "bfloat16", "double", "type", "type_as", "contiguous", "clone", "detach", "alias",
    "to_copy", "lift_fresh_copy", "reciprocal", "maximum", "minimum", "bitwise_not", "invert", "eq", "ne", "lt",
    "le", "gt", "ge", "logical_not", "and", "or", "iadd", "imul", "isub", "itruediv", "square", "addcmul",
    "radd", "rsub", "rmul", "rtruediv", "mul_scalar", "new_zeros", "zeros_like", "ones_like",
}
_MODULES_ELEMENTWISE = (nn.GELU, nn.ReLU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Dropout, nn.Identity, nn.LeakyReLU,
                        nn.ELU, nn.Mish, nn.Hardswish, nn.Softplus, nn.ReLU6, nn.SELU, nn.GLU)
_VIEWS = {"view", "reshape", "unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as"}
_SHAPES = {"size", "dim", "sym_size", "numel", "stride"}
_REDUCE = {"sum", "mean", "amax", "amin", "var", "std", "norm", "logsumexp", "prod", "max", "min"}


def op_name(node: torch.fx.Node, gm: torch.fx.GraphModule) -> str:
    """The op of `node` without its namespace, overload or in-place underscore: 'linear', 'view', 'GELU'."""
    if node.op == "call_module":
        return type(gm.get_submodule(str(node.target))).__name__
    if node.op == "call_method":
        return str(node.target).strip("_")
    target = node.target
    name = getattr(target, "_opname", None) or getattr(target, "__name__", str(target))
    return str(name).strip("_")


def _arg(node: torch.fx.Node, index: int, key: str, default: Any = None) -> Any:
    if len(node.args) > index:
        return node.args[index]
    return node.kwargs.get(key, default)


def _norm(dim: Any, rank: int) -> int:
    return int(dim) % rank if rank else 0


def _first(states: dict[torch.fx.Node, State], node: torch.fx.Node) -> tuple[torch.fx.Node, Split] | None:
    """The first input of `node` that is split, and its split."""
    for n in node.all_input_nodes:
        s = states.get(n)
        if isinstance(s, Split):
            return n, s
    return None


def view_dim(before: Shape, after: Shape, dim: int) -> int | None:
    """Where a split on `dim` of `before` lands in the view `after`, or None if it is not one dimension there.

    Contiguous slices of `before[dim]` are contiguous slices of `after[d]` when the dimensions in front
    hold as many elements (so `after[d]` starts where `before[dim]` does), e.g. hidden 32 -> (4 heads, 8)
    puts it on the heads, (4 heads, 8) -> 32 back on the hidden; t must then divide `after[d]`.
    """
    outer = math.prod(before[:dim])
    for d in range(len(after)):
        if math.prod(after[:d]) == outer and after[d] != 1:
            return d if math.prod(after[d:]) == math.prod(before[dim:]) else None
        if math.prod(after[:d]) > outer:
            return None
    return None


def _elementwise(node: torch.fx.Node, states: dict[torch.fx.Node, State], shapes: dict[str, list[Shape]],
                 out: Shape, learned: Collection[torch.fx.Node]) -> Carried:
    dims: set[int] = set()
    groups: list[int] = []
    seeds: set[str | None] = set()
    origins: set[str | None] = set()
    for n in node.all_input_nodes:
        s = states.get(n)
        if not isinstance(s, Split):
            continue
        shape = shapes[n.name][0]
        d = s.dim + len(out) - len(shape)
        if d < 0 or out[d] != shape[s.dim]:
            raise Blocked(f"{node.name} broadcasts the split dimension of {n.name}")
        dims.add(d)
        groups.append(s.group)
        seeds.add(s.seed)
        origins.add(s.origin)
    if len(dims) != 1:
        raise Blocked(f"{node.name} combines values split on different dimensions {sorted(dims)}")
    d = dims.pop()
    for n in node.all_input_nodes:  # a whole value read across the split: its gradient would come back split
        shape = shapes[n.name][0] if shapes.get(n.name) else ()
        k = d - (len(out) - len(shape))
        if not isinstance(states.get(n), Split) and n in learned and 0 <= k < len(shape) and shape[k] == out[d] > 1:
            raise Blocked(f"{node.name} reads {n.name} whole across the split dimension (its gradient would need "
                          "an all-gather)")
    seed = seeds.pop() if len(seeds) == 1 else None
    origin = origins.pop() if len(origins) == 1 else None
    return Carried(Split(groups[0], d, seed, origin), joins=groups, sizes=[out[d]])


def _matmul(node: torch.fx.Node, states: dict[torch.fx.Node, State], shapes: dict[str, list[Shape]],
            out: Shape) -> Carried:
    a, b = node.all_input_nodes[0], node.all_input_nodes[-1]
    sa, sb = states.get(a), states.get(b)
    ra, rb = len(shapes[a.name][0]), len(shapes[b.name][0])
    found: set[int] = set()
    groups: list[int] = []
    for s, rank, contracted, kept in ((sa, ra, ra - 1, ra - 2), (sb, rb, rb - 2, rb - 1)):
        if not isinstance(s, Split):
            continue
        if s.dim == contracted or rank < 2:
            raise Blocked(f"{node.name} multiplies over the split dimension (a partial sum needs an all-reduce)")
        groups.append(s.group)
        if s.dim == kept:
            found.add(len(out) - 2 if s is sa else len(out) - 1)
        else:
            found.add(s.dim + len(out) - rank)  # a batch dimension (heads)
    if len(found) != 1:
        raise Blocked(f"{node.name} multiplies values split on different dimensions")
    d = found.pop()
    return Carried(Split(groups[0], d), joins=groups, sizes=[out[d]])


def _split(node: torch.fx.Node, name: str, s: Split, before: Shape, pieces: Sequence[Shape]) -> Carried:
    if name == "unbind":
        dim = _norm(_arg(node, 1, "dim", 0), len(before))
        if dim == s.dim:
            raise Blocked(f"{node.name} takes apart the split dimension")
        return Carried(tuple(Split(s.group, s.dim - (dim < s.dim), None, s.origin) for _ in pieces))
    dim = _norm(_arg(node, 2, "dim", 0), len(before))
    if dim != s.dim:
        return Carried(tuple(Split(s.group, s.dim, None, s.origin) for _ in pieces), sizes=[before[s.dim]])
    sizes = [p[dim] for p in pieces]
    if s.seed is None or len(set(sizes)) != 1:
        what = "unequal parts (q, k and v of grouped-query attention in one Linear)" if len(set(sizes)) > 1 else \
            "parts that are not a Linear's whole output"
        raise Blocked(f"{node.name} splits the split dimension into {what}")
    pieces_state = tuple(Split(s.group, s.dim, None, s.origin) for _ in pieces)
    return Carried(pieces_state, sizes=[sizes[0]], fused=(s.seed, len(pieces)))


def _view(node: torch.fx.Node, s: Split, before: Shape, out: Shape) -> Carried:
    """A view: the split moves to the dimension that starts where it did; a Linear's features viewed
    as (heads, head size) put it on the heads."""
    d = view_dim(before, out, s.dim)
    if d is None:
        raise Blocked(f"{node.name} folds the split dimension into another (not the first of those it merges)")
    if out[d] == before[s.dim]:
        return Carried(Split(s.group, d, s.seed, s.origin), sizes=[out[d]])
    heads = (s.origin, out[d]) if s.origin is not None and out[d] < before[s.dim] else None
    return Carried(Split(s.group, d), sizes=[out[d]], heads=heads)


def _module(node: torch.fx.Node, module: nn.Module, s: Split, before: Shape, out: Shape) -> Carried:
    if isinstance(module, _MODULES_ELEMENTWISE):
        return Carried(Split(s.group, s.dim, s.seed, s.origin), sizes=[out[s.dim]])
    if isinstance(module, (nn.Softmax, nn.LogSoftmax)):
        if module.dim is None or _norm(module.dim, len(before)) == s.dim:
            raise Blocked(f"{node.name} normalizes over the split dimension")
        return Carried(Split(s.group, s.dim), sizes=[out[s.dim]])
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        if s.dim >= len(before) - len(module.normalized_shape):
            raise Blocked(f"{node.name} normalizes over the split dimension")
        return Carried(Split(s.group, s.dim), sizes=[out[s.dim]])
    if isinstance(module, (nn.Flatten, nn.Unflatten)):
        return _view(node, s, before, out)
    raise Blocked(f"{node.name} runs {type(module).__name__} on a split value")


def carry(node: torch.fx.Node, gm: torch.fx.GraphModule, states: dict[torch.fx.Node, State],
          shapes: dict[str, list[Shape]], learned: Collection[torch.fx.Node] = ()) -> Carried:
    """The state of `node`'s output given its inputs' `states` (see the module docstring); `learned` are the
    nodes whose values depend on a parameter (a whole one of those may not meet a split one).

    Raises:
        Blocked: the node would need communication (or is not understood) on its split input.
    """
    name = op_name(node, gm)
    first = _first(states, node)
    if first is None:  # a tuple element taken apart, or nothing split
        producer = node.args[0] if node.args else None
        if name == "getitem" and isinstance(producer, torch.fx.Node) and isinstance(states.get(producer), tuple):
            index = node.args[1]
            return Carried(states[producer][index] if isinstance(index, int) else None)  # type: ignore[index]
        return Carried()
    src, s = first
    if name in _SHAPES or (name == "getattr" and len(node.args) > 1 and node.args[1] in ("shape", "dtype", "device")):
        return Carried()
    out_shapes = shapes.get(node.name, [])
    before = shapes[src.name][0]
    if node.op == "output":
        raise Blocked(f"{src.name} is an output of the graph while split")
    if not out_shapes:
        raise Blocked(f"{node.name} ({name}) turns the split value {src.name} into a non-tensor")
    out = out_shapes[0]
    if node.op == "call_module":
        return _module(node, gm.get_submodule(str(node.target)), s, before, out)
    if name in _ELEMENTWISE:
        return _elementwise(node, states, shapes, out, learned)
    if name in ("split", "split_with_sizes", "chunk", "tensor_split", "unbind"):
        return _split(node, name, s, before, out_shapes)
    if name in _VIEWS or name == "getitem" and node.target is operator.getitem and len(out) != len(before):
        carried = _view(node, s, before, out)
        if name == "getitem" and isinstance(carried.state, Split) and out[carried.state.dim] != before[s.dim]:
            raise Blocked(f"{node.name} indexes the split dimension")
        return carried
    if name in ("transpose", "swapaxes", "t", "permute", "movedim"):
        if name == "t":
            order = [1, 0]
        elif name == "permute":
            dims = node.args[1:] if len(node.args) > 2 or not isinstance(_arg(node, 1, "dims"), (list, tuple)) \
                else _arg(node, 1, "dims")
            order = [_norm(d, len(before)) for d in dims]
        else:
            a, b = _norm(_arg(node, 1, "dim0"), len(before)), _norm(_arg(node, 2, "dim1"), len(before))
            order = list(range(len(before)))
            order[a], order[b] = order[b], order[a]
        d = order.index(s.dim)
        return Carried(Split(s.group, d), sizes=[out[d]])
    if name in ("expand", "expand_as", "slice", "narrow", "getitem", "repeat_interleave"):
        d = s.dim + len(out) - len(before)
        if out[d] != before[s.dim]:
            raise Blocked(f"{node.name} ({name}) changes the size of the split dimension")
        return Carried(Split(s.group, d, s.seed, s.origin), sizes=[out[d]])
    if name == "select":
        dim = _norm(_arg(node, 1, "dim"), len(before))
        if dim == s.dim:
            raise Blocked(f"{node.name} selects along the split dimension")
        return Carried(Split(s.group, s.dim - (dim < s.dim)), sizes=[before[s.dim]])
    if name in ("cat", "concat", "concatenate", "stack"):
        dim = _norm(_arg(node, 1, "dim", 0), len(out))
        if name != "stack" and dim == s.dim:
            raise Blocked(f"{node.name} concatenates along the split dimension")
        carried = _elementwise(node, states, shapes, out, learned) if name != "stack" else \
            Carried(Split(s.group, s.dim + (dim <= s.dim)), joins=[s.group])
        return carried
    if name in ("matmul", "bmm", "mm"):
        return _matmul(node, states, shapes, out)
    if name in ("softmax", "log_softmax"):
        if _norm(_arg(node, 1, "dim"), len(before)) == s.dim:
            raise Blocked(f"{node.name} normalizes over the split dimension")
        return Carried(Split(s.group, s.dim), sizes=[out[s.dim]])
    if name in ("layer_norm", "rms_norm"):
        normalized = _arg(node, 1, "normalized_shape")
        if s.dim >= len(before) - len(normalized):
            raise Blocked(f"{node.name} normalizes over the split dimension")
        return Carried(Split(s.group, s.dim), sizes=[out[s.dim]])
    if name in _REDUCE:
        dims = _arg(node, 1, "dim")
        dims = [dims] if isinstance(dims, int) else dims
        if dims is None or s.dim in {_norm(d, len(before)) for d in dims}:
            raise Blocked(f"{node.name} ({name}) reduces over the split dimension")
        kept = view_dim(before, out, s.dim) if len(out) != len(before) else s.dim
        if kept is None:
            raise Blocked(f"{node.name} ({name}) reduces next to the split dimension")
        return Carried(Split(s.group, kept), sizes=[out[kept]])
    if name == "scaled_dot_product_attention":
        heads = len(before) - 3
        groups = []
        for n in node.all_input_nodes[:3]:
            st = states.get(n)
            if isinstance(st, Split):
                if st.dim != len(shapes[n.name][0]) - 3:
                    raise Blocked(f"{node.name} attends over values split on a dimension other than the heads")
                groups.append(st.group)
        return Carried(Split(s.group, heads), joins=groups, sizes=[out[heads]])
    raise Blocked(f"{node.name} runs {name} on the split value {src.name}")
