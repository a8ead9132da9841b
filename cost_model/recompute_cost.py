"""What activation recomputation saves and costs for one stage (runtime.recompute prices).

    mode        kept per micro-batch (made inside the stage)        forward run again in backward
    none        the tensors autograd saves                          0
    selective   outputs of matrix products (linear, matmul, conv)   every other node's forward
    full        0 (only the stage's inputs)                         the whole stage's forward

One micro-batch's backward holds more than what it kept (`ModeCost.peak_bytes`, the worst moment
of a walk through the nodes in reverse): walking back through node n, it holds
- kept values whose first reader's backward has not run yet (autograd frees a saved tensor
  once every node saving it ran its backward);
- for "selective" and "full", what the checkpoint of n's segment recomputed (torch.utils.checkpoint
  recomputes a segment's forward at its first saved tensor the backward needs) and n's backward
  has not yet consumed: the values saved by nodes of that segment at or before n, less the kept;
- the gradient of n's output and the gradients of its inputs (n's backward makes them).
The largest such moment is usually the backward of the widest node (attention scores: their
softmax output saved, the gradient of the probabilities and of the scores).

The stage's inputs (values it receives, the batch) are held in every mode and not counted here.
What autograd saves under "none" follows each operator's backward: a product keeps its inputs,
softmax, tanh, sigmoid and ReLU their output, GELU, norms and pooling their input, dropout its
mask, add and views nothing; each tensor counts once (views count as the tensor they view; a view
of a stage input is that input), a node of unknown kind that counts FLOPs is a product (a Conv2d or
Linear module whose class the graph does not record) that keeps its inputs and its output (what reads
the output may keep it: unknown too), and any other of unknown kind keeps its output (upper bounds).
`saved_bytes_per_node` gives the same bytes node by node, each tensor at the node that made it: the
hybrid planner's per-node array, and `cost_model.memory.saved_activation_bytes`. Checked against
`torch.autograd.graph.saved_tensors_hooks` in tests/test_saved_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from cost_model.ops import classify
from rules.segments import segment_key, segments

__all__ = ["ModeCost", "graph_nodes", "op_name", "recompute_costs", "saved_by", "saved_bytes_per_node", "segment_key"]

# Names (module classes or functions, lower case) by what their backward keeps.
_PRODUCTS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum", "bilinear", "conv1d", "conv2d",
             "conv3d", "convolution", "convtranspose1d", "convtranspose2d", "convtranspose3d", "conv_transpose1d",
             "conv_transpose2d", "conv_transpose3d", "scaled_dot_product_attention", "matmul_", "rmatmul"}
_KEEP_OUTPUT = {"tanh", "sigmoid", "exp", "sqrt", "rsqrt", "relu", "relu_", "relu6", "threshold", "softmax",
                "log_softmax", "logsoftmax", "safe_softmax", "elu", "selu", "celu", "hardtanh_"}
_KEEP_NOTHING = {"add", "add_", "iadd", "radd", "sub", "sub_", "isub", "rsub", "neg", "positive", "sum", "mean",
                 "eq", "ne", "lt", "le", "gt", "ge", "invert", "bitwise_not", "logical_not", "and_", "or_", "xor",
                 "floordiv", "getattr", "size", "identity", "zeros_like", "ones_like", "full_like", "arange"}
_SCALES = {"mul", "mul_", "imul", "rmul", "div", "div_", "truediv", "itruediv", "rtruediv"}
_NO_SAVES = ("python", "view", "copy", "concat")
_SELF = "\0self"  # the node's own output


@dataclass(frozen=True)
class ModeCost:
    """One recomputation mode of a stage: bytes kept per micro-batch, forward seconds rerun in backward,
    and the most one micro-batch holds during its backward (kept, recomputed and gradients; >= kept)."""

    kept_bytes: int
    extra_forward_s: float
    peak_bytes: int = 0

    @property
    def rerun_bytes(self) -> int:
        """What one micro-batch's backward holds at its worst beyond what it kept."""
        return max(0, self.peak_bytes - self.kept_bytes)


def op_name(node: Mapping[str, Any]) -> str:
    """'torch.nn.modules.linear.Linear' -> 'linear'; aten's 'addmm.default' -> 'addmm'; '__matmul__' -> 'matmul'."""
    raw = str(node.get("kind") or node.get("target") or "")
    if node.get("op") == "call_function" and "." in raw and not node.get("kind"):
        raw = raw.split(".", 1)[0]  # an OpOverload: name.overload
    return raw.rsplit(".", 1)[-1].lower().strip("_")


def recompute_costs(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> dict[str, ModeCost]:
    """Each mode's ModeCost for a stage (see the module docstring).

    Args:
        nodes: the stage's graph nodes in order, each a dict of the graph (`partitioner.capture.graph`:
            op, target, out_bytes, shapes, dtypes, flops; `kind`, the module class or function
            name, where known) with two more keys: `inputs`, the (producer name, out_bytes) of
            each value the node reads, and `forward_s`, its forward time on the stage's device.
        device_type: "cpu" (dropout keeps a float mask) or an accelerator's (a byte per element).
    """
    own = {str(n["name"]): n for n in nodes}
    base, saved, extra = _kept(nodes, device_type)
    segment = _segments(nodes)
    names = [str(n["name"]) for n in nodes]
    crossing: set[str] = set()  # values a later segment reads: each segment's checkpoint keeps its inputs
    for n, name in zip(nodes, names):
        crossing.update(r for u, _ in n.get("inputs") or []
                        if u in own and segment[str(u)] < segment[name] and (r := base[str(u)]) is not None)

    def size(roots: set[str]) -> int:
        return sum(int(own[r].get("out_bytes", 0) or 0) for r in roots)

    grads = [_gradient_bytes(n, own) for n in nodes]
    forward = [float(n.get("forward_s", 0.0) or 0.0) for n in nodes]
    products = [classify(n) in ("gemm", "conv") for n in nodes]
    everything = set().union(*saved)
    selective = crossing | {name for name, p in zip(names, products) if p}
    walk = _Walk(names, segment, saved, extra, grads, size)
    return {
        "none": ModeCost(size(everything) + sum(extra), 0.0, walk.peak(everything, recompute=False)),
        "selective": ModeCost(size(selective), sum(t for t, p in zip(forward, products) if not p),
                              walk.peak(selective, recompute=True)),
        "full": ModeCost(size(crossing), sum(forward), walk.peak(crossing, recompute=True)),
    }


def saved_bytes_per_node(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> dict[str, int]:
    """Bytes autograd saves for backward under "none", per node of a stage (or of a whole graph).

    Each saved tensor counts once, at the node that made it (a view at the tensor it views), saved
    by one reader or several; a node's masks and statistics count at that node. Values made outside
    `nodes` (the stage's inputs, weights) count nowhere. The values sum to
    `recompute_costs(nodes, device_type)["none"].kept_bytes`: one rule (`_saved`) for both.

    Args:
        nodes: graph nodes in order, with `inputs` as for `recompute_costs` (`graph_nodes` makes them).
        device_type: "cpu" or an accelerator's (the size of a dropout mask).
    """
    own = {str(n["name"]): n for n in nodes}
    _, saved, extra = _kept(nodes, device_type)
    out = {str(n["name"]): more for n, more in zip(nodes, extra)}
    for root in set().union(*saved):
        out[root] += int(own[root].get("out_bytes", 0) or 0)
    return out


def saved_by(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> dict[str, list[str]]:
    """Each saved tensor (the node that made it, as `saved_bytes_per_node` counts it) -> the nodes whose backward
    keeps it, in order: the same rule (`_saved`), read the other way (cost_model/fused_kernels.py asks it)."""
    _, saved, _ = _kept(nodes, device_type)
    out: dict[str, list[str]] = {}
    for n, roots in zip(nodes, saved):
        for root in sorted(roots):
            out.setdefault(root, []).append(str(n["name"]))
    return out


def graph_nodes(graph: Any, names: Sequence[str]) -> list[dict[str, Any]]:
    """The nodes `names` of a graph (networkx-like: `.nodes[name]`, `.predecessors(name)`) as `recompute_costs`
    and `saved_bytes_per_node` read them: each vertex's attributes and its `inputs` (producer, out_bytes)."""
    return [{**graph.nodes[n], "name": n,
             "inputs": [(u, graph.nodes[u].get("out_bytes", 0)) for u in graph.predecessors(n)],
             "constant_inputs": [u for u in graph.predecessors(n) if graph.nodes[u].get("requires_grad") is False]}
            for n in names]


def _kept(nodes: Sequence[Mapping[str, Any]],
          device_type: str) -> tuple[dict[str, str | None], list[set[str]], list[int]]:
    """The rule of what autograd saves, for each node: the tensor each value is (a view: the one it views;
    None: a view of a value made outside `nodes`, the stage's input), the values (those tensors) its
    backward keeps, and the bytes it keeps besides (masks, statistics)."""
    own = {str(n["name"]): n for n in nodes}
    base: dict[str, str | None] = {}
    for n in nodes:  # a view is the tensor it views
        name, first = str(n["name"]), _first_input(n)
        base[name] = (base.get(first, first) if first in own else None) if classify(n) == "view" else name
    saved: list[set[str]] = []
    extra: list[int] = []
    for n in nodes:
        name = str(n["name"])
        values, more = _saved(n, device_type)
        saved.append({r for v in values if (r := base.get(name if v == _SELF else v)) is not None})
        extra.append(more)
    return base, saved, extra


class _Walk:
    """One micro-batch's backward walked node by node in reverse (see the module docstring)."""

    def __init__(self, names: list[str], segment: Mapping[str, int], saved: list[set[str]], extra: list[int],
                 grads: list[int], size: Callable[[set[str]], int]) -> None:
        self.names, self.segment, self.saved, self.extra, self.grads, self.size = \
            names, segment, saved, extra, grads, size
        index = {name: i for i, name in enumerate(names)}
        self.release: dict[str, int] = {}  # a kept value is alive while the walk is at or after this node
        for i, roots in enumerate(saved):
            for r in roots:
                self.release.setdefault(r, i)
        for r, i in index.items():
            self.release.setdefault(r, i)  # kept but saved by none (a checkpoint's input): its producer

    def peak(self, kept: set[str], *, recompute: bool) -> int:
        """The most bytes alive at any node's backward (at least the kept ones, before the walk starts)."""
        kept_size = self.size(kept) + (0 if recompute else sum(self.extra))
        best = kept_size
        if recompute:  # kept values of earlier segments, and what i's segment's recomputation saved up to i
            by_segment: dict[int, int] = {}  # bytes of the kept values made in each segment
            for r in kept:
                by_segment[self.segment[r]] = by_segment.get(self.segment[r], 0) + self.size({r})
            current: int | None = None
            earlier, extra, held = 0, 0, set[str]()  # one pass forward: the sums grow within a segment
            for i, name in enumerate(self.names):
                seg = self.segment[name]
                if seg != current:
                    current, held, extra = seg, set(), 0
                    earlier = sum(b for k, b in by_segment.items() if k < seg)
                new = {r for r in self.saved[i] - held if not (r in kept and self.segment[r] < seg)}
                held |= self.saved[i]
                earlier += self.size(new)  # counted once: not already kept from an earlier segment
                extra += self.extra[i]
                best = max(best, earlier + extra + self.grads[i])
            return best
        freed = [0] * max(1, len(self.names))  # kept values some node at or before i needs, by when freed
        for r in kept:
            freed[min(self.release.get(r, 0), len(freed) - 1)] += self.size({r})
        alive = 0
        for i in range(len(self.names)):
            alive += freed[i] + self.extra[i]
            best = max(best, alive + self.grads[i])
        return best


def _segments(nodes: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Each node's recomputation segment: consecutive nodes of one segment key (none: the one before); one
    segment for a stage that writes in place (`h.mul_(2)`), which the runtime checkpoints whole."""
    if any(_in_place(n) for n in nodes):
        return {str(n["name"]): 0 for n in nodes}
    return segments((str(n["name"]), str(n.get("module") or "")) for n in nodes)


def _in_place(node: Mapping[str, Any]) -> bool:
    """A method or function named as an in-place write ('mul_', 'add_'; not '__add__')."""
    name = str(node.get("target") or "").rsplit(".", 1)[-1]
    return node.get("op") in ("call_method", "call_function") and name.endswith("_") and not name.endswith("__")


def _gradient_bytes(node: Mapping[str, Any], own: Mapping[str, Any]) -> int:
    """Bytes a node's backward makes: the gradient of its output and of each floating input made in the stage."""
    if classify(node) in _NO_SAVES or not _floating(str((node.get("dtypes") or ["float32"])[0])):
        return 0
    inputs = {str(u): int(nbytes or 0) for u, nbytes in node.get("inputs") or [] if str(u) in own}
    return int(node.get("out_bytes", 0) or 0) + sum(inputs.values())


def _tensor_inputs(node: Mapping[str, Any]) -> list[str]:
    """The producers of `node`'s inputs that are tensors (bytes > 0; sizes and flags have none)."""
    return [str(u) for u, nbytes in node.get("inputs") or [] if int(nbytes or 0) > 0]


def _first_input(node: Mapping[str, Any]) -> str:
    """The tensor a view views: its first input that is a tensor (a copied graph lists a view's inputs in its
    producers' order, so the sizes `view(b, t, ...)` reads can come before the tensor), else its first input."""
    inputs = node.get("inputs") or []
    tensors = _tensor_inputs(node)
    return tensors[0] if tensors else str(inputs[0][0]) if inputs else ""


def _saved(node: Mapping[str, Any], device_type: str) -> tuple[list[str], int]:
    """The values (node names) `node`'s backward keeps, and bytes it keeps besides them (masks, statistics)."""
    name, cls = op_name(node), classify(node, node.get("kind"))
    tensors = _tensor_inputs(node)
    out = int(node.get("out_bytes", 0) or 0)
    dtypes = node.get("dtypes") or ["float32"]
    if cls in _NO_SAVES or name in _KEEP_NOTHING or not _floating(str(dtypes[0])) or node.get("requires_grad") is False:
        return [], 0
    constant = {str(u) for u in node.get("constant_inputs") or []}
    if name == "scaled_dot_product_attention":
        return tensors + [_SELF], 0
    if name in _PRODUCTS or name in _SCALES:  # [Note: what a product keeps]
        kept = _operands_kept(tensors, constant, divide=name in _DIVIDES)
        squared = len(tensors) == 1 and float(node.get("input_ratio", 1.0) or 1.0) > 1.5  # x * x: one value read twice
        return (kept if name in _PRODUCTS or len(tensors) > 1 or squared else []), 0
    if cls in ("gemm", "conv"):  # a product of unknown kind: its inputs, and its output for whatever reads it
        return tensors + [_SELF], 0
    if name in _KEEP_OUTPUT or cls == "softmax":
        return [_SELF], 0
    if name == "masked_fill":
        return tensors[1:2], 0
    if name == "where":
        return tensors[:1], 0
    if cls == "dropout":
        return [], out if device_type == "cpu" else out // max(1, _itemsize(str(dtypes[0])))
    if cls == "layernorm":  # the input, and a mean and inverse deviation per row
        shape = (node.get("shapes") or [[1]])[0] or [1]
        return tensors[:1], 8 * out // max(1, _itemsize(str(dtypes[0])) * int(shape[-1]))
    if cls == "maxpool":  # the input and int64 indices of the output's size
        return tensors[:1], 8 * out // max(1, _itemsize(str(dtypes[0])))
    if cls in ("batchnorm", "avgpool", "embedding", "transcendental", "activation", "reduction"):
        return tensors[:1], 0
    return [_SELF], 0  # unknown: its output, as an upper bound


# [Note: what a product keeps]
# a * b and a @ b: the gradient of a needs b, that of b needs a, so autograd keeps b only where a is tracked and a
# only where b is (a constant operand, a buffer such as a rotary table or a mask, is kept, the tracked one is
# not: checked with saved_tensors_hooks in tests/test_saved_memory.py); a / b keeps b for either gradient. A
# product with one tensor operand (a Linear module: its weight is no graph value) keeps it for the weight's
# gradient, as x * x keeps x (one graph input read twice: `input_ratio` 2); a scale by a Python number keeps
# nothing.
_DIVIDES = {"div", "div_", "truediv", "itruediv", "rtruediv"}


def _operands_kept(tensors: list[str], constant: set[str], *, divide: bool) -> list[str]:
    if len(tensors) != 2:
        return tensors
    a, b = tensors
    kept = ([b] if a not in constant or divide else []) + ([a] if b not in constant else [])
    return kept


def _floating(dtype: str) -> bool:
    return any(k in dtype for k in ("float", "bfloat", "half", "complex"))


def _itemsize(dtype: str) -> int:
    for key, size in (("float64", 8), ("double", 8), ("complex", 8), ("int64", 8), ("long", 8), ("16", 2),
                      ("half", 2), ("bfloat", 2), ("int8", 1), ("uint8", 1), ("bool", 1)):
        if key in dtype:
            return size
    return 4
