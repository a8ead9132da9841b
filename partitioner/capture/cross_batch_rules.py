"""Which graph operations mix samples across the batch: one rule per kind of operation, read from shapes.

A node's `Shape` is its output's shape on the whole example and the dims that hold the batch there
(they change size with it: capture.cross_batch runs the graph on the example and on one micro-batch).
An operation mixes samples when it

- reduces, scans, sorts, normalizes or takes a loss over a batch dim (`h.mean(0)`, `x.sum()`,
  `softmax(h, 0)`, `cumsum(h, 0)`, `F.mse_loss(out, y)`, functional `batch_norm` in training);
- indexes, slices, splits, flips or rolls a batch dim (`h[0]`, `h[1:]`, `h.flip(0)`, `h.chunk(2)`),
  other than by an index that itself comes from the batch (`h[torch.arange(b), last]`, `h[mask]`);
- contracts a batch dim in a matmul, einsum or attention (`h.T @ h`);
- reshapes the batch into another dim (`(b, t, c)` viewed as `(t, b, c)`);
- pairs two samples: its output holds the batch in two dims, and none of its inputs did (`x[:, None] - x`).

Each rule names what it found ("mean over dim 0 (the batch)"), or says None. Module BatchNorm is no
rule's: the runtime defers its statistics (runtime.batchnorm). Convolutions are not checked (a grouped
convolution over samples folded into channels is per-sample). A batch-sized index of arbitrary values
(`h[labels]`) counts as coming from the batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.fx
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["Shape", "mixing", "op_name"]


@dataclass(frozen=True)
class Shape:
    """A tensor's shape on the whole example and the dims that hold the batch (change size with it)."""

    shape: tuple[int, ...]
    batch: frozenset[int]


Shapes = Mapping[str, Shape]
_ALL = frozenset({-1})  # "every dim" (a reduction without dim)

# name -> (position of dim, default when absent): reductions, scans, sorts and normalizations over dims.
_OVER: dict[str, tuple[int, Any]] = {
    **dict.fromkeys(("sum", "mean", "nansum", "nanmean", "prod", "var", "std", "var_mean", "std_mean", "amax",
                     "amin", "aminmax", "max", "min", "argmax", "argmin", "logsumexp", "median", "nanmedian",
                     "all", "any", "count_nonzero"), (1, None)),
    **dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "log_softmax",
                     "softmin"), (1, None)),
    **dict.fromkeys(("sort", "argsort", "mode", "glu"), (1, -1)),
    **dict.fromkeys(("topk", "kthvalue"), (2, -1)),
    **dict.fromkeys(("norm", "vector_norm"), (2, None)),
    **dict.fromkeys(("normalize", "cosine_similarity"), (2, 1)),
    "msort": (99, 0), "unique": (4, None), "unique_consecutive": (3, None), "unique_dim": (1, None),
    **dict.fromkeys(("chunk", "split", "tensor_split", "split_with_sizes"), (2, 0)),
    "unbind": (1, 0),
}
_SOFTMAX = {"softmax", "log_softmax", "softmin"}
_SPLITS = {"chunk", "split", "tensor_split", "split_with_sizes", "unbind", "glu"}
_RESHAPES = {"view", "reshape", "unsafe_view", "flatten", "unflatten", "view_as", "reshape_as"}
# name -> (position of dim, position of index): an index along one dim.
_ALONG = {"index_select": (1, 2), "gather": (1, 2), "scatter": (1, 2), "scatter_add": (1, 2),
          "scatter_reduce": (1, 2), "index_add": (1, 2), "index_copy": (1, 2), "index_fill": (1, 2),
          "index_reduce": (1, 2), "take_along_dim": (2, 1)}
_LOSSES = {"cross_entropy", "nll_loss", "nll_loss_nd", "nll_loss2d", "cross_entropy_loss", "binary_cross_entropy",
           "binary_cross_entropy_with_logits", "kl_div", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
           "soft_margin_loss", "multilabel_soft_margin_loss", "multi_margin_loss", "multilabel_margin_loss",
           "poisson_nll_loss", "gaussian_nll_loss", "hinge_embedding_loss", "margin_ranking_loss",
           "cosine_embedding_loss", "triplet_margin_loss", "ctc_loss"}
_BATCH_NORMS = {"batch_norm", "native_batch_norm", "native_batch_norm_legit", "native_batch_norm_legit_functional",
                "batch_norm_with_update", "cudnn_batch_norm"}


def op_name(node: torch.fx.Node) -> str:
    """What `node` calls, as torch spells the operation: 'mean', 'softmax', 'getitem', 'index_add' (in-place
    and private spellings folded: `index_add_`, aten's `_softmax` and `linalg_vector_norm` too)."""
    target = node.target
    if node.op == "call_method":
        name = str(target)
    elif isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
    else:
        name = str(getattr(target, "__name__", target))
    name = name.removeprefix("linalg_").lstrip("_")
    return name[:-1] if name.endswith("_") and not name.endswith("__") else name


class _Args:
    """A node's arguments by position (torch's Python signatures) or, for aten operations, by schema name."""

    def __init__(self, node: torch.fx.Node) -> None:
        self.args, self.kwargs = node.args, node.kwargs
        target = node.target
        self.schema = list(target._schema.arguments) if isinstance(target, torch._ops.OpOverload) else None

    def get(self, pos: int, name: str, default: Any = None) -> Any:
        for key in (name, "axis" if name == "dim" else ""):
            if key in self.kwargs:
                return self.kwargs[key]
        if self.schema is None:
            return self.args[pos] if pos < len(self.args) else default
        names = [a.name for a in self.schema]
        if name not in names:
            return default
        k = names.index(name)
        if k < len(self.args):
            return self.args[k]
        return self.schema[k].default_value if self.schema[k].has_default_value() else default


def _dims(value: Any, ndim: int) -> frozenset[int]:
    """The dims an argument names (an int or a list of them; None or [] is every dim), as non-negative ints."""
    if value is None or (isinstance(value, (list, tuple)) and not value):
        return _ALL
    values = value if isinstance(value, (list, tuple)) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values) or ndim == 0:
        return frozenset()  # computed at run time: not read here
    return frozenset(v % ndim for v in values)


def _hit(dims: frozenset[int], shape: Shape) -> frozenset[int]:
    return shape.batch if dims == _ALL else dims & shape.batch


def _over(what: str, dims: frozenset[int], shape: Shape) -> str | None:
    hit = _hit(dims, shape)
    if not hit:
        return None
    where = "every dim" if dims == _ALL else f"dim {', '.join(map(str, sorted(dims)))}"
    return f"{what} over {where}, the batch being dim {', '.join(map(str, sorted(hit)))} of shape {shape.shape}"


class _Rules:
    """The rules, with the node's inputs' shapes at hand (see the module docstring)."""

    def __init__(self, shapes: Shapes, root: nn.Module) -> None:
        self.shapes = shapes
        self.root = root
        self._derived: dict[str, bool] = {}

    def of(self, value: Any) -> Shape | None:
        return self.shapes.get(value.name) if isinstance(value, torch.fx.Node) else None

    def from_batch(self, value: Any) -> bool:
        """Whether an index (a node, or a list of them) comes from the batch: holds it, or is computed from it."""
        if isinstance(value, (list, tuple)):
            return any(self.from_batch(v) for v in value)
        if not isinstance(value, torch.fx.Node):
            return False
        if value.name not in self._derived:
            self._derived[value.name] = False  # a cycle cannot happen in a graph; this only bounds the walk
            shape = self.shapes.get(value.name)
            self._derived[value.name] = bool(shape and shape.batch) or any(
                self.from_batch(p) for p in value.all_input_nodes)
        return self._derived[value.name]

    def mixes(self, node: torch.fx.Node) -> str | None:
        if node.op == "call_module":
            return self._module(node, self.root.get_submodule(str(node.target)))
        if node.op not in ("call_function", "call_method"):
            return None
        name, args = op_name(node), _Args(node)
        first = self.of(node.args[0]) if node.args else None
        found = None
        if first is not None and first.batch:
            found = self._on_input(node, name, args, first)
        return found or self._contracts(node, name, args) or self._pairs(node)

    def _on_input(self, node: torch.fx.Node, name: str, args: _Args, x: Shape) -> str | None:
        ndim = len(x.shape)
        if name in ("max", "min") and isinstance(args.get(1, "other"), torch.fx.Node):
            return None  # elementwise max(a, b)
        if name in _OVER:
            pos, default = _OVER[name]
            dim = args.get(pos, "dim", default)
            if name in _SPLITS and self.from_batch(args.get(1, "split_size")):
                return None  # split sizes computed from the batch (per-sample groups)
            if name in ("var", "std") and isinstance(dim, bool):
                dim = None  # var(x, unbiased)
            if name in _SOFTMAX and dim is None:
                dim = 0 if ndim in (0, 1, 3) else 1  # torch's legacy implicit dim
            return _over(name, _dims(dim, ndim), x)
        if name in ("layer_norm", "rms_norm"):
            normalized = args.get(1, "normalized_shape", ())
            count = len(normalized) if isinstance(normalized, (list, tuple)) else 1
            return _over(name, frozenset(range(ndim - count, ndim)), x)
        if name in _LOSSES:
            reduction = args.get(99, "reduction", "mean")
            return None if reduction in ("none", 0) else _over(f"{name} (reduction={reduction!r})", _ALL, x)
        if name in _BATCH_NORMS:
            return self._batch_norm(node, name, args, x)
        if name in _RESHAPES:
            return self._reshape(node, x)
        return self._indexes(node, name, args, x)

    def _indexes(self, node: torch.fx.Node, name: str, args: _Args, x: Shape) -> str | None:
        ndim = len(x.shape)
        if name in ("getitem", "setitem", "index", "index_put"):
            index = args.get(1, "indices")
            return self._subscript(name, index if isinstance(index, (tuple, list)) else (index,), x)
        if name in _ALONG:
            dim_pos, index_pos = _ALONG[name]
            dims = _dims(args.get(dim_pos, "dim", None), ndim)
            index = args.get(index_pos, "index", None)
            return None if self.from_batch(index) else _over(f"{name} (an index not from the batch)", dims, x)
        if name in ("select", "narrow"):
            return _over(name, _dims(args.get(1, "dim"), ndim), x)
        if name == "slice":
            dim = args.get(1, "dim", 0)
            whole = self._full(slice(args.get(2, "start"), args.get(3, "end"), args.get(4, "step", 1)), dim, x)
            return None if whole else _over("slice", _dims(dim, ndim), x)
        if name in ("flip", "fliplr", "flipud", "rot90", "roll", "take", "diagonal", "tril", "triu", "unfold"):
            positions = {"flip": (1, "dims", None), "roll": (2, "dims", None), "rot90": (2, "dims", [0, 1]),
                         "fliplr": (99, "", 1), "flipud": (99, "", 0), "take": (99, "", None),
                         "diagonal": (99, "", [args.get(2, "dim1", 0), args.get(3, "dim2", 1)]),
                         "tril": (99, "", [-2, -1]), "triu": (99, "", [-2, -1]), "unfold": (1, "dimension", 0)}
            pos, key, default = positions[name]
            return _over(name, _dims(args.get(pos, key, default) if key else default, ndim), x)
        return None

    def _full(self, item: slice, dim: Any, x: Shape) -> bool:
        if not isinstance(dim, int):
            return True
        size = x.shape[dim % len(x.shape)]
        start, stop, step = item.start, item.stop, item.step
        return start in (None, 0) and step in (None, 1) and (stop is None or (isinstance(stop, int) and stop >= size))

    def _subscript(self, name: str, items: Any, x: Shape) -> str | None:
        """x[items] (or a write into it): an int, a partial slice or an index not from the batch on a batch dim."""
        taken = [i for i in items if i is not None and i is not Ellipsis]
        dim = 0
        for item in items:
            if item is None:
                continue
            if item is Ellipsis:
                dim += len(x.shape) - len(taken)
                continue
            if dim in x.batch:
                if isinstance(item, slice) and self._full(item, dim, x):
                    pass
                elif not (isinstance(item, torch.fx.Node) and self.from_batch(item)):
                    return f"{name} [{item!r}] on dim {dim}, the batch of shape {x.shape}"
            dim += 1
        return None

    def _batch_norm(self, node: torch.fx.Node, name: str, args: _Args, x: Shape) -> str | None:
        training = args.get(5, "training", False)
        mean = args.get(1, "running_mean")  # F.batch_norm's second argument; aten's by its schema name
        deferred = (node.target is torch.ops.aten.batch_norm.default and isinstance(mean, torch.fx.Node)
                    and mean.op == "get_attr")  # runtime.stage defers these (DeferredBatchNormOp)
        if training is True and not deferred:
            return f"{name} in training mode (statistics over dim 0, the batch of shape {x.shape})"
        return None

    def _reshape(self, node: torch.fx.Node, x: Shape) -> str | None:
        out = self.shapes.get(node.name)
        if out is None or len(x.batch) != 1 or len(out.batch) != 1:
            return None  # two batch dims in the output: _pairs says so
        (d_in,), (d_out,) = x.batch, out.batch
        if math.prod(x.shape[:d_in]) == math.prod(out.shape[:d_out]):
            return None  # the batch stays outermost of its samples' elements
        return f"{op_name(node)} of shape {x.shape} (batch in dim {d_in}) to {out.shape} (dim {d_out}) regroups samples"

    def _contracts(self, node: torch.fx.Node, name: str, args: _Args) -> str | None:
        """Matmul, einsum and attention over a batch dim (contracted dims of each operand)."""
        pairs: list[tuple[Any, list[int]]] = []
        if name in ("matmul", "mm", "bmm", "linear", "addmm", "baddbmm", "addbmm", "mv", "dot", "inner", "vdot"):
            offset = 1 if name in ("addmm", "baddbmm", "addbmm") else 0
            a, b = args.get(offset, "input"), args.get(offset + 1, "other")
            pairs = [(a, [-1])]
            b_shape = self.of(b)
            if b_shape is not None:
                pairs.append((b, [-1] if name == "linear" else [-2] if len(b_shape.shape) >= 2 else [0]))
        elif name == "scaled_dot_product_attention":
            q, k, v = (args.get(i, n) for i, n in enumerate(("query", "key", "value")))
            pairs = [(q, [-1]), (k, [-1, -2]), (v, [-2])]
        elif name == "einsum":
            return self._einsum(node)
        for operand, dims in pairs:
            shape = self.of(operand)
            if shape is not None and shape.shape:
                found = _over(f"{name} contracting", _dims(dims, len(shape.shape)), shape)
                if found:
                    return found
        return None

    def _einsum(self, node: torch.fx.Node) -> str | None:
        equation = node.args[0] if node.args else node.kwargs.get("equation")
        operands = list(node.args[1:])
        if len(operands) == 1 and isinstance(operands[0], (list, tuple)):
            operands = list(operands[0])
        if not isinstance(equation, str):
            return None
        inputs, _, output = equation.replace(" ", "").partition("->")
        terms = inputs.split(",")
        if not _ and not output:
            letters = [c for c in inputs if c.isalpha()]
            output = "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
        for term, operand in zip(terms, operands):
            shape = self.of(operand)
            if shape is None:
                continue
            head, dots, tail = term.partition("...")
            labels = list(head) + ["."] * (len(shape.shape) - len(head) - len(tail)) * bool(dots) + list(tail)
            summed = frozenset(d for d, c in enumerate(labels) if c != "." and c not in output)
            found = _over(f"einsum {equation!r} summing", summed, shape) if summed else None
            if found:
                return found
        return None

    def _pairs(self, node: torch.fx.Node) -> str | None:
        out = self.shapes.get(node.name)
        if out is None or len(out.batch) < 2:
            return None
        if any(len(s.batch) >= 2 for s in (self.of(p) for p in node.all_input_nodes) if s is not None):
            return None
        return f"{op_name(node)} pairs samples: its output of shape {out.shape} has the batch in dims " \
               f"{', '.join(map(str, sorted(out.batch)))}"

    def _module(self, node: torch.fx.Node, module: nn.Module) -> str | None:
        x = self.of(node.args[0]) if node.args else None
        if x is None or not x.batch or isinstance(module, _BatchNorm):
            return self._pairs(node)  # BatchNorm: deferred by the runtime (runtime.batchnorm)
        ndim, kind = len(x.shape), type(module).__name__
        dim: Any = getattr(module, "dim", None)
        if isinstance(module, (nn.Softmax, nn.LogSoftmax, nn.Softmin)):
            return _over(kind, _dims(dim if dim is not None else 0 if ndim in (0, 1, 3) else 1, ndim), x)
        if isinstance(module, (nn.GLU, nn.CosineSimilarity)):
            return _over(kind, _dims(dim, ndim), x)
        if isinstance(module, nn.modules.loss._Loss) and getattr(module, "reduction", "mean") != "none":
            return _over(f"{kind} (reduction={module.reduction!r})", _ALL, x)
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
            return _over(kind, frozenset(range(ndim - len(module.normalized_shape), ndim)), x)
        if isinstance(module, (nn.Flatten, nn.Unflatten)):
            return self._reshape(node, x)
        return self._pairs(node)


def mixing(gm: torch.fx.GraphModule, shapes: Shapes) -> list[tuple[torch.fx.Node, str]]:
    """Every node of `gm` that mixes samples across the batch (see the module docstring), with what it does."""
    rules = _Rules(shapes, gm)
    found = [(n, rules.mixes(n)) for n in gm.graph.nodes]
    return [(n, what) for n, what in found if what is not None]
