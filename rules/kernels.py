"""The kernel sets a plan is priced for: what runs each operation of the model (one rule: planned, priced, exported).

    "eager"   this project's runtime: each operation its own kernel, autograd keeping what it keeps
    "fused"   the engines a plan is exported to (torchtitan with torch.compile, Megatron-LM with Transformer
              Engine): flash attention (no score matrix), fused SwiGLU and GeLU, fused norms and rotary

cost_model/fused_kernels.py prices the difference; Plan.kernels names the set; the torchtitan export says it.
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["KERNEL_SETS", "KernelSet"]

KernelSet = Literal["eager", "fused"]
KERNEL_SETS: tuple[str, ...] = get_args(KernelSet)
