"""The optimizer step's time: the bytes it moves per parameter of the shard a rank steps, at HBM bandwidth.

An optimizer step does no matrix products: every kernel of it (torch's foreach or fused Adam, Megatron's
multi-tensor apply) streams each state through HBM once, so its time is its bytes over the bandwidth the
memory-bound kernels run at (cost_model/analytic.py: the GPU table's peak x the copy efficiency). With p, g, s
the bytes of one master weight, gradient and optimizer-state element (cost_model.precision) and S the state
elements per parameter (Adam 2, SGD with momentum 1, SGD 0):

    step        reads  p + g + S s      (the weight, its gradient, each state)
                writes p + S s          (the weight and each state, updated in place)
    clipping    reads  g                (the global gradient norm: torch.nn.utils.clip_grad_norm_'s foreach norm)
                reads and writes g      (the gradients scaled by max_norm / norm, in place)

    seconds = P / d x (2 p + (4 if clipping else 1) g + 2 S s) / bandwidth

Mixed precision's default (fp32 weights, gradients and Adam moments): 28 bytes a parameter for the step, 12 more
for clipping, 40 in all; pure bf16: 20. Clipping is on by default because the trainers whose runs the benchmarks
reproduce clip at 1.0 (Megatron-LM's --clip-grad, torchtitan's training.max_norm). The compute copy (bf16
weights) is not written here: autocast casts in forward, FSDP2 in its all-gather.

d is the shard degree: zero1, zero2 and zero3 step only the shard each rank holds (1/d of the weights: FSDP2's
DTensor shards, ZeRO's partitions), replicas without sharding ("none") step the whole stage each. Adafactor's
factored state is counted as none (it depends on shapes). Everything broadcasts (numpy arrays of every cut).
"""

from __future__ import annotations

from typing import Any

from cost_model.precision import Precision

__all__ = ["step_bytes_per_param", "step_seconds"]


def step_bytes_per_param(precision: Precision, *, clip: bool = True) -> float:
    """Bytes one optimizer step moves through HBM per parameter it steps (module docstring)."""
    p, g, s = (float(precision.itemsize(x)) for x in ("param", "grad", "state"))
    states = precision.state_elements_per_param()
    return 2 * p + (4 if clip else 1) * g + 2 * states * s


def step_seconds(params: Any, precision: Precision, bytes_per_s: float, *, shards: int = 1, clip: bool = True) -> Any:
    """Seconds of one optimizer step over `params` elements split into `shards` (1: unsharded), or 0 where the
    bandwidth is not known (`bytes_per_s` <= 0: a device whose step time a calibration holds).

    Raises:
        ValueError: shards below 1.
    """
    if shards < 1:
        raise ValueError(f"shards={shards}; a rank steps 1/shards of its weights, shards >= 1")
    if bytes_per_s <= 0:
        return 0.0 * params
    return params / shards * step_bytes_per_param(precision, clip=clip) / bytes_per_s
