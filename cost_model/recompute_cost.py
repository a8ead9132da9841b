"""What activation recomputation saves and costs for one stage (runtime.recompute prices).

    mode        kept per micro-batch (made inside the stage)        forward run again in backward
    none        the tensors autograd saves                          0
    selective   outputs of matrix products (linear, matmul, conv)   every other node's forward
    full        0 (only the stage's inputs)                         the whole stage's forward

The stage's inputs (values it receives, the batch) are held in every mode and not counted here.
What autograd saves under "none" follows each operator's backward: a product keeps its inputs,
softmax, tanh, sigmoid and ReLU their output, GELU, norms and pooling their input, dropout its
mask, add and views nothing; each tensor counts once (views count as the tensor they view), and
an operator of unknown kind keeps its output (the old upper bound).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from cost_model.ops import classify

__all__ = ["ModeCost", "op_name", "recompute_costs"]

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
    """One recomputation mode of a stage: bytes kept per micro-batch, and forward seconds rerun in backward."""

    kept_bytes: int
    extra_forward_s: float


def op_name(node: Mapping[str, Any]) -> str:
    """'torch.nn.modules.linear.Linear' -> 'linear'; aten's 'addmm.default' -> 'addmm'; '__matmul__' -> 'matmul'."""
    raw = str(node.get("kind") or node.get("target") or "")
    if node.get("op") == "call_function" and "." in raw and not node.get("kind"):
        raw = raw.split(".", 1)[0]  # an OpOverload: name.overload
    return raw.rsplit(".", 1)[-1].lower().strip("_")


def recompute_costs(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> dict[str, ModeCost]:
    """Each mode's ModeCost for a stage (see the module docstring).

    Args:
        nodes: the stage's graph nodes in order, each a dict of the graph (`partitioner.graph`:
            op, target, out_bytes, shapes, dtypes, flops; `kind`, the module class or function
            name, where known) with two more keys: `inputs`, the (producer name, out_bytes) of
            each value the node reads, and `forward_s`, its forward time on the stage's device.
        device_type: "cpu" (dropout keeps a float mask) or an accelerator's (a byte per element).
    """
    own = {str(n["name"]): n for n in nodes}
    base: dict[str, str] = {}
    for n in nodes:  # a view is the tensor it views
        name, first = str(n["name"]), _first_input(n)
        base[name] = base.get(first, first) if classify(n) == "view" and first in own else name
    kept: dict[str, int] = {}
    extra = 0
    for n in nodes:
        values, more = _saved(n, device_type)
        extra += more
        for value in values:
            root = base.get(str(n["name"]) if value == _SELF else value)
            if root is not None:
                kept[root] = int(own[root].get("out_bytes", 0) or 0)
    forward = [float(n.get("forward_s", 0.0) or 0.0) for n in nodes]
    products = [classify(n) in ("gemm", "conv") for n in nodes]
    return {
        "none": ModeCost(sum(kept.values()) + extra, 0.0),
        "selective": ModeCost(sum(int(n.get("out_bytes", 0) or 0) for n, p in zip(nodes, products) if p),
                              sum(t for t, p in zip(forward, products) if not p)),
        "full": ModeCost(0, sum(forward)),
    }


def _first_input(node: Mapping[str, Any]) -> str:
    inputs = node.get("inputs") or []
    return str(inputs[0][0]) if inputs else ""


def _saved(node: Mapping[str, Any], device_type: str) -> tuple[list[str], int]:
    """The values (node names) `node`'s backward keeps, and bytes it keeps besides them (masks, statistics)."""
    name, cls = op_name(node), classify(node, node.get("kind"))
    tensors = [str(u) for u, nbytes in node.get("inputs") or [] if int(nbytes or 0) > 0]
    out = int(node.get("out_bytes", 0) or 0)
    dtypes = node.get("dtypes") or ["float32"]
    if cls in _NO_SAVES or name in _KEEP_NOTHING or not _floating(str(dtypes[0])):
        return [], 0
    if name in _PRODUCTS:
        return tensors + ([_SELF] if name == "scaled_dot_product_attention" else []), 0
    if name in _KEEP_OUTPUT or cls == "softmax":
        return [_SELF], 0
    if name in _SCALES:
        return (tensors if len(tensors) > 1 else []), 0
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


def _floating(dtype: str) -> bool:
    return any(k in dtype for k in ("float", "bfloat", "half", "complex"))


def _itemsize(dtype: str) -> int:
    for key, size in (("float64", 8), ("double", 8), ("complex", 8), ("int64", 8), ("long", 8), ("16", 2),
                      ("half", 2), ("bfloat", 2), ("int8", 1), ("uint8", 1), ("bool", 1)):
        if key in dtype:
            return size
    return 4
