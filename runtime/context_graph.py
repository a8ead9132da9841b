"""Where a graph's sequence can be split: its sequence dims, the positions it builds, its attention, what mixes tokens.

[Note: splitting the sequence of a graph]
torch.export keeps a sequence's length symbolic (partitioner/capture/export.py, [Note: exported
dimensions]), so every value's shape says which of its dims run along the sequence: those whose size
is the sequence's symbol s (a value of a few tokens' worth per token: s x batch, the tokens of an MoE
layer). Context parallelism runs such a graph unchanged on each rank's part of the sequence (its
sizes read off its inputs then say that part's length), except where that would differ from running
the whole:
- positions: `arange(s)` gives each token its position (RoPE, learned position tables, masks); it
  becomes the global positions of the rank's tokens, and a table read `table[:s]` is read at them;
- attention (scaled_dot_product_attention with the sequence at dim -2): every query attends to every
  key of the sequence, so keys and values are gathered from all ranks and the causal mask is made from
  the global positions (runtime.context_parallel). The model's own mask is not used: the plan lists
  the attentions whose mask was checked to be the causal one (partitioner/capture/sequence.py);
- anything else that mixes tokens (a reduction, scan, sort, convolution or matmul over the sequence, a
  slice or gather of some of its tokens, a reshape that is not tokens merged with other dims) is
  `blocked`, named with the reason, unless it only computes an attention mask (`mask_only`: unused).
Ops not known to mix tokens (element-wise, linear layers, norms over features, views, embeddings,
a stack of experts) act on each token alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import sympy  # type: ignore[import-untyped]
import torch
import torch.fx

__all__ = ["ATTENTION", "ContextGraph", "module_path", "read_sequence", "sequence_dims", "token_dims"]

aten = torch.ops.aten
ATTENTION = {aten.scaled_dot_product_attention.default, torch.nn.functional.scaled_dot_product_attention}
_ARANGE = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_FACTORY = {aten.zeros.default, aten.ones.default, aten.full.default, aten.empty.memory_format, aten.new_ones.default,
            aten.new_zeros.default, aten.new_full.default, aten.new_empty.default, aten.zeros_like.default,
            aten.ones_like.default, aten.full_like.default, aten.empty_like.default, aten.scalar_tensor.default}
_BROADCAST = {aten.expand.default, aten.unsqueeze.default, aten.view.default, aten.reshape.default,
              aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default, aten.clone.default}
# ops that combine tokens along a dim: where their dim argument is (position, default)
_ALONG = {**dict.fromkeys(("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "softmax", "_softmax",
                           "log_softmax", "_log_softmax", "sum", "mean", "amax", "amin", "max", "min", "std", "var",
                           "var_mean", "std_mean", "prod", "any", "all", "logsumexp", "median", "mode", "flip",
                           "select", "index_select", "gather", "narrow", "unfold", "scatter", "scatter_add",
                           "index_add", "index_copy"), (1, None)),
          **dict.fromkeys(("sort", "argsort"), (1, -1)), **dict.fromkeys(("cat", "unbind"), (1, 0)),
          **dict.fromkeys(("topk", "kthvalue", "diff"), (2, -1)), **dict.fromkeys(("norm", "linalg_vector_norm",
                                                                                  "roll", "repeat_interleave"),
                                                                                 (2, None)),
          **dict.fromkeys(("split", "split_with_sizes", "chunk"), (2, 0))}
_LAST_TWO = {"tril", "triu"}
_CONTRACT = {"mm": (1, 0), "bmm": (-1, -2), "matmul": (-1, -2), "baddbmm": (-1, -2), "addmm": (-1, 0)}
_MIXING = {"convolution", "conv1d", "conv2d", "conv3d", "avg_pool1d", "max_pool1d", "adaptive_avg_pool1d",
           "constant_pad_nd", "pad", "einsum", "index", "index_put", "_unsafe_index"}
_PER_TOKEN_CALLS = {"run_whole"}  # a stack of experts kept whole: per token (partitioner/capture/whole.py)


def module_path(node: torch.fx.Node) -> str:
    """The module a node's op belongs to (its nn_module_stack's innermost path; '' for the root)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    return "" if path.startswith("_empty") else path


def _dims(value: Any, symbol: sympy.Symbol, exact: bool) -> list[int]:
    if not isinstance(value, torch.Tensor):
        return []
    found = []
    for d, size in enumerate(value.shape):
        expr = _expr(size)
        if (expr == symbol) if exact else (symbol in expr.free_symbols):
            found.append(d)
    return found


def _expr(size: Any) -> Any:
    """A dim's size as a sympy expression (a SymInt's own, or the integer)."""
    node = getattr(size, "node", None)
    return node.expr if node is not None else sympy.Integer(int(size))


def sequence_dims(value: Any, symbol: sympy.Symbol) -> list[int]:
    """The dims of a tensor value whose size is the sequence's length."""
    return _dims(value, symbol, True)


def token_dims(value: Any, symbol: sympy.Symbol) -> list[int]:
    """The dims whose size depends on the sequence's length (its own dims and tokens merged with others)."""
    return _dims(value, symbol, False)


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, torch.fx.Node) else None


def _op(node: torch.fx.Node) -> str:
    target = node.target
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = target.overloadpacket.__name__
    return name.removesuffix("_") if name.endswith("_") and not name.startswith("_") else name


def _arg(node: torch.fx.Node, index: int, key: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(key, default)


def read_sequence(gm: torch.fx.GraphModule) -> tuple[sympy.Symbol | None, str]:
    """The symbol of the sequence the graph's attention runs over, or None and why."""
    found = set()
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in ATTENTION:
            q = _val(node.args[0])
            if not isinstance(q, torch.Tensor) or q.dim() < 3:
                return None, f"{node.name}: its query has no recorded shape"
            size = q.shape[-2]
            expr = _expr(size)
            if not isinstance(expr, sympy.Symbol):
                return None, (f"{node.name}: its sequence has the fixed length {size}; the graph was traced with the "
                              "sequence fixed (torch.fx, or code that needs its length): only a graph torch.export "
                              "traced with the sequence free splits it")
            found.add(expr)
    if not found:
        return None, "the graph has no scaled_dot_product_attention"
    if len(found) > 1:
        return None, f"its attentions run over sequences of different lengths {sorted(map(str, found))}"
    return found.pop(), ""


@dataclass
class ContextGraph:
    """What splitting the sequence of a graph changes (see [Note: splitting the sequence of a graph])."""

    symbol: sympy.Symbol | None
    why_not: str = ""  # set where the graph has no sequence to split
    attention: dict[str, str] = field(default_factory=dict)  # node -> module path
    causal: dict[str, bool] = field(default_factory=dict)  # node -> is_causal=True and no mask
    positions: dict[str, Any] = field(default_factory=dict)  # arange node -> its start
    tables: dict[str, tuple[int, Any]] = field(default_factory=dict)  # slice node -> (dim, start)
    mask_only: set[str] = field(default_factory=set)
    blocked: dict[str, str] = field(default_factory=dict)  # node -> why it mixes tokens
    values: dict[str, Any] = field(default_factory=dict)  # node -> its recorded value (a stage's inputs have none)

    @classmethod
    def of(cls, gm: torch.fx.GraphModule) -> ContextGraph:
        symbol, why = read_sequence(gm)
        found = cls(symbol, why)
        if symbol is None:
            return found
        nodes = list(gm.graph.nodes)
        for node in nodes:
            if node.op == "call_function" and node.target in ATTENTION:
                found.attention[node.name] = module_path(node)
                found.causal[node.name] = _arg(node, 3, "attn_mask") is None and bool(_arg(node, 5, "is_causal"))
        found.mask_only = _mask_only(nodes)
        found.values = {n.name: n.meta.get("val") for n in nodes}
        for node in nodes:
            if node.op.startswith("call") and node.name not in found.mask_only and node.name not in found.attention:
                found._look(node, symbol)
        return found

    def _look(self, node: torch.fx.Node, symbol: sympy.Symbol) -> None:
        out = _val(node)
        carried = [a for a in node.all_input_nodes if _carries(_val(a), symbol)]
        name = _op(node)
        if name in _PER_TOKEN_CALLS or name == "getitem" or node.op == "call_module" and node.target == "_guards_fn":
            return  # a stack of experts (per token), a piece of a tuple (as the tuple was), export's guards
        if not carried:
            if _carries(out, symbol):
                self._source(node, symbol, name)
            return
        if not isinstance(out, (torch.Tensor, tuple, list)):
            return  # a size read off a value (sym_size), an assertion
        if isinstance(out, torch.Tensor) and not token_dims(out, symbol):
            self.blocked[node.name] = f"{name} reduces over the sequence"
            return
        head = node.args[0] if node.args else None
        first = _val(head[0] if isinstance(head, (list, tuple)) and head else head)  # cat, stack: a list
        along = token_dims(first, symbol) if isinstance(first, torch.Tensor) else []
        if name in _ALONG and along:
            at, default = _ALONG[name]
            dim = _arg(node, at, "dims" if name in ("flip", "roll") else "dim", default)
            dims = [dim] if isinstance(dim, int) else list(dim) if isinstance(dim, (list, tuple)) else []
            if any(d % first.dim() in along for d in dims if isinstance(d, int)):
                self.blocked[node.name] = f"{name} along the sequence (dim {dims})"
        elif name in _LAST_TWO and {first.dim() - 2, first.dim() - 1} & set(along):
            self.blocked[node.name] = f"{name} over the sequence"
        elif name == "slice" and along:
            dim, start, end = _arg(node, 1, "dim", 0), _arg(node, 2, "start"), _arg(node, 3, "end")
            if dim % first.dim() in along and not (start in (None, 0) and _whole_end(end, first, dim)):
                self.blocked[node.name] = f"slice of some of the sequence's tokens ({start}:{end})"
        elif name in _CONTRACT:
            a, b = (_val(node.args[i]) if len(node.args) > i else None for i in ((1, 2) if name in (
                "baddbmm", "addmm") else (0, 1)))
            da, db = _CONTRACT[name]
            if (isinstance(a, torch.Tensor) and da % a.dim() in token_dims(a, symbol)) or (
                    isinstance(b, torch.Tensor) and db % b.dim() in token_dims(b, symbol)):
                self.blocked[node.name] = f"{name} sums over the sequence (attention written out by hand)"
        elif name in _MIXING:
            self.blocked[node.name] = f"{name} on values along the sequence"
        elif name in ("view", "reshape", "_unsafe_view", "expand") and isinstance(out, torch.Tensor):
            for d in token_dims(out, symbol):
                expr = _expr(out.shape[d])
                if symbol in (expr / symbol).free_symbols or not (expr / symbol).is_polynomial():
                    self.blocked[node.name] = f"{name} regroups the sequence's tokens (a dim of size {expr})"

    def _source(self, node: torch.fx.Node, symbol: sympy.Symbol, name: str) -> None:
        """A node that makes a value along the sequence from none (a position range, a table read, a constant)."""
        out = _val(node)
        if node.target in _ARANGE and isinstance(out, torch.Tensor) and sequence_dims(out, symbol) == [0]:
            step = _arg(node, 2, "step", 1) if node.target is aten.arange.start_step else 1
            if step == 1:
                self.positions[node.name] = node.args[0] if node.target is not aten.arange.default else 0
                return
        if name == "slice" and isinstance(out, torch.Tensor):
            dim = _arg(node, 1, "dim", 0) % out.dim()
            if sequence_dims(out, symbol) == [dim]:
                self.tables[node.name] = (dim, _arg(node, 2, "start") or 0)
                return
        if node.target in _FACTORY or node.target in _BROADCAST:
            return  # the same value at every position
        self.blocked[node.name] = f"{name} makes a value along the sequence that is not a range of positions"


def _carries(value: Any, symbol: sympy.Symbol) -> bool:
    """Whether a value (a tensor, or a tuple of them) has a dim along the sequence."""
    if isinstance(value, (tuple, list)):
        return any(_carries(v, symbol) for v in value)
    return bool(token_dims(value, symbol))


def _whole_end(end: Any, value: torch.Tensor, dim: int) -> bool:
    if end is None or (isinstance(end, int) and end >= 2 ** 62):
        return True
    size = value.shape[dim]
    end_val = _val(end) if isinstance(end, torch.fx.Node) else end
    return bool(end_val is not None and (end_val == size if not isinstance(size, int) else end_val >= size))


def _mask_only(nodes: list[torch.fx.Node]) -> set[str]:
    """Nodes computed only for the masks of attentions (their `attn_mask`, or values feeding only those)."""
    only: set[str] = set()
    for node in reversed(nodes):
        if not node.op.startswith("call") or not node.users or node.target in ATTENTION:
            continue
        if all(_masks(user, node) or user.name in only or _checks(user) for user in node.users):
            only.add(node.name)
    return only


def _checks(node: torch.fx.Node) -> bool:
    """An assertion on a value (torch.export's _assert_tensor_metadata): no value of its own."""
    return node.op == "call_function" and not node.users and "assert" in str(node.target)


def _masks(user: torch.fx.Node, node: torch.fx.Node) -> bool:
    """Whether `user` is an attention reading `node` as its mask only."""
    if user.op != "call_function" or user.target not in ATTENTION:
        return False
    return _arg(user, 3, "attn_mask") is node and node not in user.args[:3]

