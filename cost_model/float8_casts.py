"""The casts a float8 linear layer adds (torchao's Float8Linear, which torchtitan's float8 converter installs).

A float8 linear runs its three products (output, input gradient, weight gradient) in FP8, and before them casts
its input (M x K), its weight (K x N) and its output's gradient (M x N) from bf16 to float8: a scale from each
tensor's largest magnitude, then the scaled copy, in each layout a product reads. Those passes are memory-bound
and are what separates a float8 step from twice a bf16 one. Counted here kernel by kernel as torchao's own
roofline counts them (torchao/testing/training/roofline_utils.py, `get_tensor_memory_traffic_ovhd_s`, no fusion
with the producing op), each kernel at least one launch (`max(bytes / bandwidth, launch)`):

    recipe      tensor        kernels (bytes per element: read + write)                       runs in
    tensorwise  input         amax (2), cast to both layouts (2 + 2 x 1)                      forward
                weight        amax (2), cast (2 + 1); cast to the other layout (2 + 1)        forward; backward
                grad output   amax (2), cast to both layouts (2 + 2 x 1)                      backward
    rowwise     input         cast along rows, transposed bf16 copy (2 + 1 + 2); cast (2 + 1)  forward; backward
                weight        cast (2 + 1); transpose (2 + 2), cast (2 + 1)                    forward; backward
                grad output   cast along rows, transposed copy (2 + 1 + 2), cast (2 + 1)       backward

(the second stage of a tensorwise amax reads a few values: a launch only). Rowwise scales every row apart, so
each tensor is cast again along its other dimension for the weight gradient; its products are CUTLASS's
row-scaled kernel, priced here at the FP8 rate as tensorwise's cuBLAS one (torchao's roofline does the same; on
H100 most shapes reach 90-100% of it, pytorch/pytorch#147971). Transformer Engine's FP8 (Megatron-LM, the
DeepSeek recipes) fuses its casts into the norms and activations that make the inputs: no recipe, none priced.
benchmarks/float8_linear.py checks the result against torchao's measured float8 linear speedups on an H100.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["FLOAT8_RECIPES", "Float8Recipe", "cast_seconds"]

Float8Recipe = Literal["tensorwise", "rowwise"]
FLOAT8_RECIPES: tuple[str, ...] = get_args(Float8Recipe)

# per recipe and tensor: (forward kernels, backward kernels), each kernel its bytes per element
_KERNELS: dict[str, dict[str, tuple[tuple[float, ...], tuple[float, ...]]]] = {
    "tensorwise": {"input": ((2.0, 0.0, 4.0), ()), "weight": ((2.0, 0.0, 3.0), (3.0,)),
                   "grad_output": ((), (2.0, 0.0, 4.0))},
    "rowwise": {"input": ((5.0,), (3.0,)), "weight": ((3.0,), (4.0, 3.0)), "grad_output": ((), (5.0, 3.0))},
}


def cast_seconds(m: float, k: float, n: float, recipe: str, bytes_per_s: float,
                 launch_s: float) -> tuple[float, float]:
    """(forward, backward) seconds of the casts of one float8 linear of M x K input and K x N weight (the module
    docstring's kernels), each kernel `max(bytes / bytes_per_s, launch_s)`.

    Raises:
        ValueError: an unknown recipe or a bandwidth that is not positive.
    """
    if recipe not in _KERNELS:
        raise ValueError(f"float8 recipe {recipe!r}; use one of {', '.join(map(repr, FLOAT8_RECIPES))}")
    if bytes_per_s <= 0:
        raise ValueError(f"bytes_per_s={bytes_per_s}: memory bandwidth must be positive")
    numel = {"input": m * k, "weight": k * n, "grad_output": m * n}
    forward = backward = 0.0
    for role, (fwd, bwd) in _KERNELS[recipe].items():
        forward += sum(max(b * numel[role] / bytes_per_s, launch_s) for b in fwd)
        backward += sum(max(b * numel[role] / bytes_per_s, launch_s) for b in bwd)
    return forward, backward
