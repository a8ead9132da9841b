"""The modules a tensor-parallel stage graph calls at a group's edges and where DTensor has no rule of its own."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

__all__ = ["FusedLinear", "FusedSplit", "LocalAttention", "ToDTensor", "ToPlain", "split_classes"]


class ToDTensor(nn.Module):
    """A plain tensor entering a group becomes a replicated DTensor (no communication).

    Every TP rank holds the same value here (stage inputs and values outside groups are replicated), so
    `from_local` needs no check. In backward its gradient, partial on each rank after a colwise layer,
    is summed over the group: the group's one all-reduce going in. DTensors and non-tensors pass as they are.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        super().__init__()
        self.mesh = mesh

    def forward(self, value: Any) -> Any:
        def lift(t: torch.Tensor) -> torch.Tensor:
            if isinstance(t, DTensor):
                return t
            return DTensor.from_local(t, self.mesh, [Replicate()], run_check=False)

        return pytree.tree_map_only(torch.Tensor, lift, value)


class ToPlain(nn.Module):
    """A DTensor leaving a group becomes the whole plain tensor: partial sums are all-reduced (rowwise,
    vocab lookups), split values all-gathered (an LM head); a replicated one costs nothing.

    `to_loss` marks one whose value is a model output (the graph's output reads it, nothing else): while
    `keep_split` is on (a training step of the last stage, runtime.loss_split), a value split on its last
    dimension (logits split by vocabulary) leaves as it is, for the loss to run on DTensor's loss_parallel."""

    def __init__(self, to_loss: bool = False) -> None:
        super().__init__()
        self.to_loss = to_loss
        self.keep_split = False

    def forward(self, value: Any) -> Any:
        def lower(t: torch.Tensor) -> torch.Tensor:
            if not isinstance(t, DTensor):
                return t
            if self.keep_split and split_classes(t):
                return t
            whole = [Replicate()] * t.device_mesh.ndim
            return t.redistribute(t.device_mesh, whole).to_local()

        return pytree.tree_map_only(torch.Tensor, lower, value)


def split_classes(t: DTensor) -> bool:
    """A DTensor split on its last dimension alone (an LM head's logits: by vocabulary), as loss_parallel takes."""
    return t.dim() > 0 and len(t.placements) == 1 and type(t.placements[0]) is Shard \
        and t.placements[0].dim % t.dim() == t.dim() - 1


class LocalAttention(nn.Module):
    """`scaled_dot_product_attention` on DTensors split by heads: each rank attends with its own heads.

    Attention is independent per head, so this is DTensor's `local_map` pattern written out: q, k and v
    split on the heads dim (redistributed there if not), a mask split alike where it has one row per
    head and whole where it broadcasts over heads, the local kernel, the output split by heads. DTensor
    registers this op's rule for CUDA's kernels but not for the CPU kernel, which it would refuse.
    """

    def __init__(self, attention: Callable[..., torch.Tensor] = F.scaled_dot_product_attention) -> None:
        super().__init__()
        self.attention = attention

    def forward(self, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(query, DTensor):
            return self.attention(query, key, value, *args, **kwargs)
        mesh = query.device_mesh
        heads = query.dim() - 3
        split = [Shard(heads)]

        def local(t: Any, placements: list[Any]) -> Any:
            if not isinstance(t, DTensor):
                return t
            return t.redistribute(mesh, placements).to_local()

        def mask(t: Any) -> Any:
            per_head = isinstance(t, torch.Tensor) and t.dim() == query.dim() and t.shape[heads] != 1
            return local(t, split if per_head else [Replicate()])

        args = tuple(mask(a) if i == 0 else a for i, a in enumerate(args))  # attn_mask is the 4th argument
        if "attn_mask" in kwargs:
            kwargs = {**kwargs, "attn_mask": mask(kwargs["attn_mask"])}
        out = self.attention(local(query, split), local(key, split), local(value, split), *args, **kwargs)
        return DTensor.from_local(out, mesh, split, run_check=False)


def _strided_dim(t: DTensor) -> tuple[int, int] | None:
    """(dim, blocks) of a DTensor split as `fused` equal blocks (a fused q/k/v Linear's output)."""
    for p in t.placements:
        if isinstance(p, _StridedShard):
            return p.dim % t.dim(), int(p.split_factor)
    return None


class FusedLinear(nn.Module):
    """A Linear whose weight holds `blocks` equal blocks (q, k and v), run block by block.

    The weight is split as a strided shard (each rank: its heads of every block). DTensor runs the
    forward of one matmul on it but, in backward, gathers the gradient and the weight to compute the
    input's gradient; taking the blocks apart first (views, no communication) makes each block a plain
    colwise Linear, whose input gradients add up to one partial sum: the group's one all-reduce.
    The blocks' outputs are put back side by side as the fused output (a strided shard again).
    `layout` is "linear" (weight [out, in], `F.linear(x, w, b)`) or "addmm" (Hugging Face Conv1D:
    weight [in, out], `addmm(b, x, w)`); `forward` takes (x, weight, bias) for both.
    """

    def __init__(self, blocks: int, layout: str) -> None:
        super().__init__()
        self.blocks = blocks
        self.layout = layout

    def _run(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.layout == "linear":
            return F.linear(x, weight, bias)
        return x @ weight if bias is None else torch.addmm(bias, x, weight)

    def forward(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None and bias.dtype != weight.dtype:  # a bias FSDP2 leaves whole is not cast by its mixed
            bias = bias.to(weight.dtype)  # precision: compute in the gathered weight's dtype ([Note: fused weights
            # under FSDP2] in runtime.sharding); its gradient flows back to the stored bias
        if not isinstance(weight, DTensor):
            return self._run(x, weight, bias)
        dim = 0 if self.layout == "linear" else 1
        weights = weight.unflatten(dim, (self.blocks, weight.shape[dim] // self.blocks)).unbind(dim)
        biases: list[torch.Tensor | None] = [None] * self.blocks
        if bias is not None:
            biases = list(bias.unflatten(0, (self.blocks, bias.shape[0] // self.blocks)).unbind(0))
        outputs = [self._run(x, w, b) for w, b in zip(weights, biases)]
        return torch.stack(outputs, dim=-2).flatten(-2)


class FusedSplit(nn.Module):
    """`split`/`chunk` of a fused projection's output into its equal blocks (q, k, v), without communication.

    The output of a fused q/k/v Linear is split as its weight is: each rank holds its heads of q, of k
    and of v (a strided shard of the whole). DTensor would all-gather to split it; splitting the blocks
    into a dimension of their own (`unflatten`) and taking them apart (`unbind`) leaves each block split
    by heads on every rank, as DTensor's view rules show. Any other split runs as written.
    """

    def __init__(self, split: Callable[..., Any]) -> None:
        super().__init__()
        self.split = split

    def forward(self, value: Any, *args: Any, **kwargs: Any) -> Any:
        fused = _strided_dim(value) if isinstance(value, DTensor) else None
        if fused is None:
            return self.split(value, *args, **kwargs)
        dim, blocks = fused
        pieces = self.split(torch.empty(value.shape, device="meta"), *args, **kwargs)
        sizes = [p.shape[dim] for p in pieces]
        if len(sizes) != blocks or len(set(sizes)) != 1 or sum(sizes) != value.shape[dim]:
            return self.split(value, *args, **kwargs)
        return tuple(value.unflatten(dim, (blocks, sizes[0])).unbind(dim))
