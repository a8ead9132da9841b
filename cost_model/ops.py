"""Operator classes and their per-class costs for the analytic model (roofline inputs).

Each graph vertex falls in one class, from its FLOPs and its kind (module class or function
name). A class says how many bytes its forward and backward move at the device's copy
bandwidth, in units of the vertex's output bytes O and of its tensor inputs' bytes I, and how
many fixed op overheads (kernel launches) each pays:

    forward  = overhead_fwd * op_overhead + (fwd_bytes * O + fwd_in * I + mask * elements) / bandwidth
    backward = overhead_bwd * op_overhead + (bwd_bytes * O + bwd_in * I + mask * elements) / bandwidth

I is the graph's record (`input_ratio` x O: partitioner/capture/graph.py), else `inputs` x O; a
reduction (sum, mean, the loss over a vocabulary) reads far more than it writes, so its input
prices it. See [Note: eager kernel bytes] for how each accelerator figure is counted.

Matrix products ("gemm") instead run at the device's matmul rate scaled by an efficiency
that falls for thin matrices (see `gemm_efficiency`). The CPU numbers were fitted once on
synthetic single-op sweeps (not on the benchmark's models); "cpu" kernels such as max
pooling are far from the memory roofline, GPU kernels much closer to it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["OpCost", "classify", "gemm_dims", "gemm_efficiency", "op_costs"]


@dataclass(frozen=True)
class OpCost:
    """Bytes moved per output byte (and per input byte, per output element), and fixed overheads, of one class."""

    fwd_bytes: float  # per output byte
    bwd_bytes: float
    fwd_overhead: float  # in units of the device's op_overhead_s
    bwd_overhead: float
    fwd_in: float = 0.0  # per byte of the tensor inputs
    bwd_in: float = 0.0
    mask: float = 0.0  # per output element, forward and backward each (dropout's bool mask: 1 byte)
    inputs: float = 1.0  # input bytes per output byte where the graph recorded none


_CPU: dict[str, OpCost] = {
    "gemm": OpCost(0.0, 0.0, 8.0, 8.0),
    "conv": OpCost(0.0, 0.0, 12.0, 12.0),
    "elementwise": OpCost(3.3, 4.0, 5.0, 6.0),
    "add": OpCost(3.3, 4.0, 5.0, 6.0),  # the CPU fit had one elementwise class: add, mul and the loss keep it
    "mul": OpCost(3.3, 4.0, 5.0, 6.0),
    "loss": OpCost(3.3, 4.0, 5.0, 6.0),
    "pointwise_loss": OpCost(3.3, 4.0, 5.0, 6.0),
    "activation": OpCost(3.0, 3.0, 5.0, 5.0),
    "transcendental": OpCost(8.0, 11.0, 5.0, 6.0),
    "softmax": OpCost(8.5, 3.5, 5.0, 5.0),
    "layernorm": OpCost(4.2, 5.0, 8.0, 8.0),
    "batchnorm": OpCost(18.0, 9.5, 16.0, 8.0),
    "maxpool": OpCost(210.0, 12.0, 8.0, 6.0),
    "avgpool": OpCost(72.0, 83.0, 8.0, 8.0),
    "dropout": OpCost(60.0, 4.0, 8.0, 4.0),
    "concat": OpCost(2.4, 4.0, 5.0, 8.0),
    "copy": OpCost(8.0, 10.0, 4.0, 6.0),
    "reduction": OpCost(2.0, 2.0, 6.0, 6.0),
    "embedding": OpCost(3.0, 1.0, 6.0, 8.0),  # backward also writes a dense weight gradient
    "view": OpCost(0.0, 0.0, 2.0, 1.0),
    "python": OpCost(0.0, 0.0, 0.5, 0.0),  # arithmetic on sizes: no tensor at all
}

# [Note: eager kernel bytes]
# The accelerator figures count the HBM bytes of PyTorch's eager CUDA kernels for one call, in units of the
# output O and the tensor inputs I (I = O for a unary op of one dtype, 2 O for a binary op of two same-shaped
# operands); a weight vector, a row's statistics and a scalar are left out (a row of 1k-16k elements makes
# them < 1%). dy is the output's gradient (O), dx an input's (I). Reads of a value another kernel just wrote
# are counted: eager kernels do not share a cache line across launches at these sizes.
_ACCELERATOR: dict[str, OpCost] = {
    "gemm": OpCost(0.0, 0.0, 4.0, 4.0),
    "conv": OpCost(0.0, 0.0, 4.0, 4.0),
    # where, masked_fill, ... : read the inputs, write y | backward: read dy, read an input, write dx (I + I)
    "elementwise": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=2.0, inputs=2.0),
    # a + b (residual): read a and b, write y (3 O) | backward passes dy through to both (no kernel); the
    # residual stream forks at the add's input, and autograd sums the fork's two gradients: read 2, write 1
    "add": OpCost(1.0, 3.0, 2.0, 1.0, fwd_in=1.0, inputs=2.0),
    # a * b (SwiGLU's gate, a norm's scale): read a and b, write y | backward: da = dy * b, db = dy * a, two
    # kernels each reading dy and the other operand and writing a gradient: 2 O + 2 I (6 O same-shaped)
    "mul": OpCost(1.0, 2.0, 2.0, 3.0, fwd_in=1.0, bwd_in=2.0, inputs=2.0),
    # relu, clamp: read x, write y | backward (threshold_backward): read dy and x (or y), write dx
    "activation": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=2.0),
    # gelu, silu, tanh, exp: as activations (GeluCUDAKernelImpl, silu_backward: dy and x in, dx out); the
    # transcendental math hides under the memory time at bf16/fp32 on A100 and H100
    "transcendental": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=2.0),
    # softmax over rows that fit on chip (attention's 1k-16k): read x once, write y (cunn_SoftMaxForwardSmem,
    # the persistent warp softmax) | backward: read dy and y, write dx
    "softmax": OpCost(1.0, 3.0, 2.0, 3.0, fwd_in=1.0),
    # layer_norm / rms_norm: read x, write y (and a mean and rstd per row) | backward: the dx kernel reads dy
    # and x and writes dx, the dgamma/dbeta kernel reads dy and x again: 2 O + 3 I (5 O)
    "layernorm": OpCost(1.0, 2.0, 3.0, 4.0, fwd_in=1.0, bwd_in=3.0),
    "batchnorm": OpCost(4.0, 6.0, 4.0, 4.0),
    "maxpool": OpCost(4.0, 4.0, 2.0, 3.0),
    "avgpool": OpCost(3.0, 3.0, 2.0, 3.0),
    # native_dropout: read x, write y and a bool mask (1 byte an element) | backward: read dy and the mask,
    # write dx
    "dropout": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=1.0, mask=1.0),
    "concat": OpCost(2.0, 2.0, 2.0, 3.0),
    # casts (.float(), .to(bf16)), contiguous, clone: read x, write y | backward: the gradient cast or copied
    # back: read dy, write dx
    "copy": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=1.0),
    # sum, mean, amax, var over a dim: read x, write the reduced y | backward: dy broadcast to x's shape
    # and written once (mean's division, amax's mask; sum's expand is a view its reader reads): dx
    "reduction": OpCost(1.0, 1.0, 3.0, 3.0, fwd_in=1.0, bwd_in=1.0),
    # F.cross_entropy = log_softmax + nll_loss over the logits (I; the targets are 1/V of it): log_softmax
    # reads the logits and writes log-probabilities (2 I), nll_loss reads one entry a row | backward:
    # nll_loss_backward writes a zero-filled gradient of the logits' size (I), log_softmax_backward reads it
    # and the log-probabilities and writes the logits' gradient (3 I): 4 I
    "loss": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=2.0, bwd_in=4.0),
    # nll_loss, mse_loss, l1_loss reduced to a scalar: read the inputs once, write the scalar | backward: the
    # input-sized gradient written once
    "pointwise_loss": OpCost(1.0, 1.0, 2.0, 3.0, fwd_in=1.0, bwd_in=1.0),
    "embedding": OpCost(2.0, 1.0, 2.0, 4.0),
    "view": OpCost(0.0, 0.0, 1.0, 1.0),
    "python": OpCost(0.0, 0.0, 0.5, 0.0),
}

# Matrix products reach peak / (1 + m0/M + n0/N + k0/K) of the measured matmul rate, by
# (device type, family): (peak, m0, n0, k0). "matmul" is normalized so the measured square
# product itself has efficiency 1; CPU convolutions (oneDNN) beat plain matmul when large.
_GEMM = {
    ("cpu", "matmul"): (None, 16.0, 16.0, 16.0),
    ("cpu", "conv"): (1.3, 64.0, 16.0, 32.0),
    ("accelerator", "matmul"): (None, 128.0, 128.0, 64.0),
    ("accelerator", "conv"): (None, 128.0, 64.0, 64.0),
}

_NAMES: list[tuple[str, tuple[str, ...]]] = [
    ("embedding", ("embedding",)),
    ("maxpool", ("maxpool", "max_pool", "adaptivemax", "adaptive_max")),
    ("avgpool", ("avgpool", "avg_pool", "adaptiveavg", "adaptive_avg", "lppool")),
    ("batchnorm", ("batchnorm", "batch_norm", "instancenorm", "instance_norm", "groupnorm", "group_norm")),
    ("layernorm", ("layernorm", "layer_norm", "rmsnorm", "rms_norm")),
    ("loss", ("cross_entropy", "crossentropy")),
    ("softmax", ("softmax",)),
    ("dropout", ("dropout",)),
    ("activation", ("relu", "hardtanh", "threshold", "clamp", "clip", "abs", "neg", "hardsigmoid")),
    ("transcendental", ("gelu", "silu", "swish", "mish", "tanh", "sigmoid", "exp", "log", "erf", "softplus",
                        "elu", "celu", "hardswish", "sin", "cos", "pow", "rsqrt", "sqrt")),
    ("concat", ("cat", "stack", "concat", "hstack", "vstack")),
    ("copy", ("reshape", "contiguous", "flatten", "clone", "to", "type", "float", "half", "bfloat16",
              "copy", "repeat", "tile", "roll", "pad", "interpolate", "upsample")),
    ("pointwise_loss", ("nll_loss", "nllloss", "mse_loss", "mseloss", "l1_loss", "l1loss")),
    ("reduction", ("mean", "sum", "amax", "amin", "max", "min", "var", "std", "norm", "logsumexp", "prod", "argmax")),
    ("view", ("view", "view_as", "transpose", "permute", "getitem", "split", "chunk", "unbind", "unsqueeze",
              "squeeze", "expand", "expand_as", "narrow", "select", "unflatten", "detach", "as_strided", "t",
              "identity", "movedim", "swapaxes", "split_with_sizes", "alias")),
    ("add", ("add", "iadd", "radd", "sub", "isub", "rsub", "subtract")),
    ("mul", ("mul", "imul", "rmul", "multiply", "div", "truediv", "divide")),
]
_EXACT = {"flatten": "copy", "t": "view", "to": "copy", "type": "copy", "float": "copy", "half": "copy"}
_SHORT = {name for _, names in _NAMES for name in names if len(name) <= 3}


@functools.lru_cache(maxsize=4096)
def _normalize(kind: str, op: str) -> str:
    """'torch.nn.modules.conv.Conv2d' -> 'conv2d'; aten's 'relu.default' -> 'relu'; '__iadd__' -> 'iadd'."""
    if op == "call_function" and "." in kind:
        kind = kind.split(".", 1)[0]  # an OpOverload: name.overload
    return kind.rsplit(".", 1)[-1].lower().strip("_")


def classify(node: Mapping[str, Any], kind: str | None = None) -> str:
    """The operator class of a graph vertex: 'gemm' when it counts FLOPs, else by its kind.

    `kind` is the module class ('Conv2d') or function name ('relu'); without it the vertex's
    own 'kind' attribute, then its 'target', is used. Unknown kinds with tensor output are
    'elementwise'; vertices with no tensor output are 'python' (arithmetic on sizes).
    """
    name = _normalize(
        str(kind or node.get("kind") or node.get("target") or ""), "" if kind else str(node.get("op", ""))
    )
    if float(node.get("flops", 0) or 0) > 0:
        shapes = node.get("shapes") or [()]
        is_conv = (
            "conv" in name if (kind or node.get("kind") or node.get("op") == "call_function") else len(shapes[0]) >= 4
        )
        return "conv" if is_conv else "gemm"
    if name in _EXACT:
        return _EXACT[name]
    if node.get("dropout_p") == 0:  # returns its input: no kernel, no mask
        return "view"
    if not node.get("shapes") and not node.get("out_bytes"):
        return "python"
    return _named_class(name)


@functools.lru_cache(maxsize=4096)
def _named_class(name: str) -> str:
    """The class of a normalized kind by the name table (cached: a graph repeats a few names thousands of times)."""
    for cls, names in _NAMES:
        for n in names:
            if name == n or (n not in _SHORT and n in name):
                return cls
    return "elementwise"


def op_costs(device_kind: str) -> Mapping[str, OpCost]:
    """The class table for a device type: 'cpu', or anything else (accelerators)."""
    return _CPU if device_kind == "cpu" else _ACCELERATOR


def gemm_dims(shape: Sequence[int], flops: float, kind: str = "") -> tuple[float, float, float, float]:
    """(batch, M, N, K) of a matrix product from its output shape and forward FLOPs.

    Convolutions (kind contains 'conv', or a 4-D/5-D output when the kind is unknown) have
    channels in dim 1: M = batch * spatial, N = out channels, K = FLOPs / (2 M N). Batched
    products ('matmul', 'bmm', 'einsum', 'attention') keep their leading dims as batch;
    the rest ('linear', 'addmm', 'mm') fold them into M.
    """
    dims = [int(d) for d in shape] or [1]
    numel = float(math.prod(dims))
    name = kind.lower()
    if "conv" in name or (not name and len(dims) >= 4):
        n = float(dims[1]) if len(dims) > 1 else 1.0
        batch, m = 1.0, numel / max(n, 1.0)
    elif any(k in name for k in ("matmul", "bmm", "einsum", "attention", "baddbmm")) and len(dims) >= 2:
        m, n = float(dims[-2]), float(dims[-1])
        batch = numel / max(m * n, 1.0)
    else:
        n = float(dims[-1])
        batch, m = 1.0, numel / max(n, 1.0)
    k = flops / max(2.0 * numel, 1.0)
    return batch, max(m, 1.0), max(n, 1.0), max(k, 1.0)


def gemm_efficiency(m: float, n: float, k: float, device_kind: str, reference: float, family: str = "matmul") -> float:
    """Fraction of the measured matmul rate (a reference-sized square product) that an
    M x K by K x N product reaches: peak / (1 + m0/M + n0/N + k0/K); family 'matmul' or 'conv'."""
    peak, m0, n0, k0 = _GEMM[("cpu" if device_kind == "cpu" else "accelerator", family)]

    def raw(mm: float, nn: float, kk: float) -> float:
        return 1.0 / (1.0 + m0 / mm + n0 / nn + k0 / kk)

    if peak is None:  # normalized: the reference product runs at the measured rate
        return raw(m, n, k) / raw(reference, reference, reference)
    return peak * raw(m, n, k)
