"""The kernel sets a plan is priced for: what runs each operation of the model (one rule: planned, priced, exported).

    "eager"   this project's runtime: each operation its own kernel, autograd keeping what it keeps
    "fused"   the engines a plan is exported to (torchtitan with torch.compile, Megatron-LM with Transformer
              Engine): flash attention (no score matrix), fused SwiGLU and GeLU, fused norms and rotary

cost_model/fused_kernels.py prices the difference; Plan.kernels names the set; the torchtitan export says it.

`WORKING_OUTPUTS`: how many values of the widest output's size one micro-batch's backward holds beside what is
kept, at the loss over the model's output (and, eager, at an attention softmax):

    "eager"   3   torch's cross-entropy keeps its log-probabilities; their gradient and the logits' are made
    "fused"   2   a fused cross-entropy (torch.compile's, flash-attn's xentropy that llm-foundry trains MPT with,
                  Megatron-LM's) keeps the logits and one log-sum-exp per row and writes the logits' gradient;
                  flash attention writes no probabilities
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["KERNEL_SETS", "KernelSet", "WORKING_OUTPUTS"]

KernelSet = Literal["eager", "fused"]
KERNEL_SETS: tuple[str, ...] = get_args(KernelSet)
WORKING_OUTPUTS: dict[str, int] = {"eager": 3, "fused": 2}
