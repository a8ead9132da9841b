"""What the fused kernel set saves and runs instead of eager PyTorch's, node by node (issue 37 item 2).

A plan's kernel set (`Plan.kernels`, rules/kernels.py) is "eager" (this project's runtime: each operation its
own kernel, autograd keeping what cost_model/recompute_cost.py counts) or "fused" (the engines a plan is
exported to: flash attention, fused SwiGLU and GeLU, fused norms and rotary embeddings, torch.compile).
Three rules turn the eager count into the fused one:

    attention scores     values of s x s per head (the last two dims equal, shaped as a softmax of them:
                         q k^T, its mask and scale, the softmax, its dropout) are never written: flash
                         attention keeps one fp32 log-sum-exp per row (4 bytes x elements / s, at the softmax)
                         and draws its dropout again from the seed
    recomputed outputs   a pointwise activation (silu, gelu, ...) whose output only pointwise readers keep
                         (SwiGLU's silu(gate) * up) while its input is kept: the fused kernel recomputes it
    layout copies        a copy (a transpose made contiguous) of a value kept anyway: the fused kernel writes
                         the layout its reader reads

Llama 3's layer (bf16, t = 1): eager 40.3 bytes per s*b*h element, fused 31.8 (q and k kept once, rotated: the
rotary table is no tracked value, so its product keeps the table, not q or k); the silu output (6.5, as ffn =
3.25 h) and the attention output's copy (2) go. Korthikanti et al. (2022, https://arxiv.org/abs/2205.05198,
section 4.1) count 34 s b h + 5 a s^2 b for GPT's layer, the second term gone under flash attention.

Time (`fused_away`): a node of the scores (but the two products, whose FLOPs flash attention runs too) and a
pointwise node all of whose readers are pointwise (the reader's kernel computes it in the same pass) cost
nothing of their own: no launch, no pass over memory.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from cost_model.ops import classify
from cost_model.recompute_cost import saved_by, saved_bytes_per_node

__all__ = ["attention_core", "fused_away", "fused_outputs", "fused_saved"]

_POINTWISE = ("elementwise", "add", "mul", "transcendental", "activation", "dropout")
_ACTIVATIONS = ("transcendental", "activation")


def _shape(node: Mapping[str, Any]) -> tuple[int, ...]:
    shapes = node.get("shapes") or [()]
    return tuple(int(x) for x in (shapes[0] or ()))


def _scores(nodes: Sequence[Mapping[str, Any]]) -> set[str]:
    """The nodes whose output is attention scores: shaped as a softmax over its last dim of a square [..., s, s]."""
    square = {_shape(n) for n in nodes
              if classify(n) == "softmax" and len(_shape(n)) >= 3 and _shape(n)[-1] == _shape(n)[-2] > 1}
    return {str(n["name"]) for n in nodes if _shape(n) in square}


def attention_core(nodes: Sequence[Mapping[str, Any]]) -> tuple[set[str], set[str]]:
    """(the score nodes, the attention core): the core is what Megatron-LM's selective recomputation (Korthikanti
    et al. 2022, section 4.2) runs again in backward, the scores (q k^T, its mask and scale, softmax, dropout) and
    the product reading them (probabilities @ v), or a fused attention call (which keeps no scores); the scores are
    what it no longer keeps."""
    scores = _scores(nodes)
    core = set(scores) | {str(n["name"]) for n in nodes if "scaled_dot_product_attention" in str(
        n.get("kind") or n.get("target") or "") or (classify(n) == "gemm" and any(
            str(u) in scores for u, _ in n.get("inputs") or []))}
    return scores, core


def _readers(nodes: Sequence[Mapping[str, Any]]) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {str(n["name"]): [] for n in nodes}
    for n in nodes:
        for u, _ in n.get("inputs") or []:
            if str(u) in out:
                out[str(u)].append(str(n["name"]))
    return out


def fused_saved(nodes: Sequence[Mapping[str, Any]], device_type: str = "cpu") -> dict[str, int]:
    """Bytes the fused kernel set keeps for backward, per node, counted as `saved_bytes_per_node` counts eager's
    (`nodes`: recompute_cost.graph_nodes of a stage or of the whole graph; module docstring for the rules)."""
    eager = saved_bytes_per_node(nodes, device_type)
    keepers = saved_by(nodes, device_type)
    kind = {str(n["name"]): classify(n) for n in nodes}
    own = {str(n["name"]): n for n in nodes}
    out = dict(eager)
    for name in _scores(nodes):
        out[name] = 0
        if kind[name] == "softmax":  # the log-sum-exp of each row, fp32
            shape = _shape(own[name])
            elements = 1
            for x in shape:
                elements *= x
            out[name] = 4 * elements // max(1, shape[-1])
    def root(name: str) -> str:  # the tensor a view views (what saved_by is keyed by)
        while kind[name] == "view" and (first := [str(u) for u, _ in own[name].get("inputs") or [] if str(u) in own]):
            name = first[0]
        return name

    for name, node in own.items():
        inputs = [root(str(u)) for u, _ in node.get("inputs") or [] if str(u) in own]
        kept_input = bool(inputs) and bool(keepers.get(inputs[0]))
        if kind[name] in _ACTIVATIONS and keepers.get(name) and kept_input and \
                all(kind.get(k) in _POINTWISE for k in keepers[name]):
            out[name] = 0  # recomputed from its kept input inside the fused kernel
        elif kind[name] == "copy" and inputs and keepers.get(inputs[0]):
            out[name] = 0  # the reader reads the kept value in the layout the kernel wrote
    return out


def fused_outputs(nodes: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Bytes each node's output takes under the fused kernel set: the scores none (a log-sum-exp per row at the
    softmax), every other output its own (what a backward's working set holds: search/recompute.py)."""
    out = {str(n["name"]): int(n.get("out_bytes", 0) or 0) for n in nodes}
    own = {str(n["name"]): n for n in nodes}
    for name in _scores(nodes):
        shape = _shape(own[name])
        elements = 1
        for x in shape:
            elements *= x
        out[name] = 4 * elements // max(1, shape[-1]) if classify(own[name]) == "softmax" else 0
    return out


def fused_away(nodes: Sequence[Mapping[str, Any]]) -> set[str]:
    """Nodes whose own time the fused kernel set does not pay (module docstring)."""
    kind = {str(n["name"]): classify(n) for n in nodes}
    scores = {name for name in _scores(nodes) if kind[name] not in ("gemm", "conv")}
    readers = _readers(nodes)
    pointwise = {name for name, cls in kind.items()
                 if cls in _POINTWISE and readers[name] and all(kind[r] in _POINTWISE for r in readers[name])}
    return scores | pointwise
