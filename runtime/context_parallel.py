"""Split a stage's sequence over its context ranks: each runs its tokens, attention over all keys gathered.

`parallelize_sequence(gm, found, group, attentions)` rewrites a stage graph (runtime.stage) in place, by
what runtime.context_graph found in the whole graph ([Note: splitting the sequence of a graph]):

    stage input (whole, as the pipeline sends it) ─► ContextSlice: my tokens (two chunks, below)
      positions: arange(my length) ─► ContextPositions: the global positions of my tokens (RoPE, tables)
      attention:  q (mine) x K, V ─► ContextAttention: K and V all-gathered from the group, causal mask
                                     from the global positions of the queries and keys (a stage split by
                                     tensor ranks too: ContextHeads inside its per-head LocalAttention)
    stage output ◄─ ContextGather: every rank's tokens, back in sequence order (whole, as it was); the last
                    stage's in a training step: this rank's tokens, the loss over them (runtime.loss_tokens)

[Note: boundaries that stay split] Between two stages of one context and tensor degree the sequence
stays split: rank k of the writer's replica sends to rank k of the reader's (runtime/program.py), the
same context index, so the writer sends its own tokens and the reader takes them as they come, with
neither ContextGather nor ContextSlice (`split_boundaries` names those values). A boundary buffer then
holds 1/c of the sequence, as the planner prices it (partitioner/place/search/experts_context.py), not
the whole: Llama 3 405B at 131,072 tokens holds 4 GiB a boundary value whole. The model's output, the
caller's inputs and a value read by a stage of other degrees stay whole as above.

Load balance: the sequence is cut into 2c equal chunks and rank r of c holds chunks r and 2c - 1 - r
(torchtitan's "headtail"), so under a causal mask every rank attends over the same number of keys:

    c = 2, the sequence in 4 chunks:   | 0 | 1 | 2 | 3 |    rank 0 holds chunks 0, 3; rank 1 chunks 1, 2

Keys and values are all-gathered, not passed around a ring: one collective per attention in each
direction (backward: a reduce-scatter of their gradients), O(S) keys per rank; a ring (K/V in c - 1
steps overlapping compute) is not built. Each of a rank's two query chunks attends over the prefix of
the sequence its causal mask reaches (`causal_chunks`, the block's mask a boolean tensor: torch's
CausalBias tensor subclass failed to be made inside these stages), so a rank computes (2c + 1) / 4c of
its queries x every key: about the causal half the planner prices (cost_model/analytic.py halves a
causal attention), where one masked product over every key did all of it.

Gradients: a stage input's gradient is every rank's rows all-gathered (whole on every rank, as the
pipeline sends it back); an output's gradient is whole on every rank and each keeps its rows; weights
get the gradient of their rank's tokens, summed over the group at the end of the step
(runtime.axis_reduce).

[Note: one order of context collectives]
Every rank of a context group runs the same stage graph on the same micro-batch (its part of it) in the
same program, so each posts the same all-gathers in graph order (forward) and autograd's order
(backward), recomputation alike; nothing branches on the rank or on values.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Sequence, cast

import torch
import torch.distributed as dist
import torch.fx
import torch.nn.functional as F
from torch import nn

from runtime.context_graph import ATTENTION, ContextGraph, sequence_dims, token_dims

__all__ = ["ContextAttention", "ContextGather", "ContextGroup", "ContextHeads", "ContextPositions", "ContextSlice",
           "causal_chunks", "gather_tokens", "my_tokens", "parallelize_sequence", "positions", "split_boundaries"]


@dataclass(frozen=True)
class ContextGroup:
    """A context group: its process group, this rank's index in it and its size."""

    group: Any
    index: int
    degree: int


def positions(local: int, cg: ContextGroup, rank: int | None = None, device: Any = None) -> torch.Tensor:
    """The global positions of the `local` tokens of group rank `rank` (default: this one): chunks r, 2c - 1 - r."""
    r = cg.index if rank is None else rank
    if local % 2:
        raise ValueError(f"a rank's part of the sequence holds {local} tokens, not two equal chunks: use a sequence "
                         f"length that is a multiple of {2 * cg.degree} (2 x the context degree)")
    half = local // 2
    return torch.cat([torch.arange(r * half, (r + 1) * half, device=device),
                      torch.arange((2 * cg.degree - 1 - r) * half, (2 * cg.degree - r) * half, device=device)])


def _every(local: int, cg: ContextGroup, device: Any) -> torch.Tensor:
    """Global positions of the tokens of every rank, in group order (the order of an all-gather)."""
    return torch.cat([positions(local, cg, r, device) for r in range(cg.degree)])


def _gather(x: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
    """Every rank's `x` along `dim`, in group order."""
    moved = x.movedim(dim, 0).contiguous()
    out = moved.new_empty((moved.shape[0] * cg.degree, *moved.shape[1:]))
    dist.all_gather_into_tensor(out, moved, group=cg.group)
    return out.movedim(0, dim)


def _check_length(whole: int, cg: ContextGroup) -> None:
    if whole % (2 * cg.degree):
        raise ValueError(f"a sequence of {whole} tokens does not split into 2 x {cg.degree} equal chunks (context "
                         f"degree {cg.degree}); use a length that is a multiple of {2 * cg.degree}")


def my_tokens(x: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
    """This rank's rows of the whole sequence `x` along `dim` (chunks r and 2c - 1 - r), no gradient rule."""
    return x.index_select(dim, positions(x.shape[dim] // cg.degree, cg, device=x.device))


class _Slice(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
        _check_length(x.shape[dim], cg)
        ctx.dim, ctx.cg = dim, cg
        return my_tokens(x, dim, cg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        return _ordered(_gather(grad, ctx.dim, ctx.cg), ctx.dim, ctx.cg), None, None


def _ordered(gathered: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
    """Rows gathered in group order, put back in sequence order."""
    every = _every(gathered.shape[dim] // cg.degree, cg, gathered.device)
    return gathered.index_select(dim, torch.argsort(every))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
        ctx.dim, ctx.cg, ctx.local = dim, cg, x.shape[dim]
        return _ordered(_gather(x, dim, cg), dim, cg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:  # whole and equal on every rank: keep mine
        return grad.index_select(ctx.dim, positions(ctx.local, ctx.cg, device=grad.device)), None, None


class _GatherKeys(torch.autograd.Function):
    """Keys or values of every rank along dim -2, in group order; backward sums each rank's part's gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, cg: ContextGroup) -> torch.Tensor:
        ctx.cg = cg
        return _gather(x, x.dim() - 2, cg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        moved = grad.movedim(grad.dim() - 2, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // ctx.cg.degree, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved, group=ctx.cg.group)
        return out.movedim(0, grad.dim() - 2), None


class ContextSlice(nn.Module):
    """A whole stage input -> this rank's tokens along `dim`."""

    def __init__(self, dim: int, cg: ContextGroup) -> None:
        super().__init__()
        self.dim, self.cg = dim, cg

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cast(torch.Tensor, _Slice.apply(x, self.dim, self.cg))


class ContextGather(nn.Module):
    """This rank's tokens along `dim` -> the whole stage output, in sequence order. While `keep_split` is on (a
    training step of the last stage: runtime.loss_tokens) they leave as they are, for the loss over this rank's
    tokens, and `local` holds them until that loss reads them."""

    def __init__(self, dim: int, cg: ContextGroup) -> None:
        super().__init__()
        self.dim, self.cg = dim, cg
        self.keep_split = False
        self.local: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.keep_split:
            self.local = x
            return x
        return gather_tokens(x, self.dim, self.cg)


def gather_tokens(x: torch.Tensor, dim: int, cg: ContextGroup) -> torch.Tensor:
    """Every rank's tokens of `x` along `dim`, in sequence order (backward: this rank's rows of the gradient)."""
    return cast(torch.Tensor, _Gather.apply(x, dim, cg))


class ContextPositions(nn.Module):
    """`arange(start, end)` over this rank's part of the sequence -> the global positions of its tokens."""

    def __init__(self, cg: ContextGroup, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.cg, self.dtype, self.device = cg, dtype, device

    def forward(self, *bounds: Any) -> torch.Tensor:
        start, end = (0, bounds[0]) if len(bounds) == 1 else bounds[:2]
        return (positions(int(end) - int(start), self.cg, device=self.device) + int(start)).to(self.dtype)


class ContextTable(nn.Module):
    """`table[start:end]` along `dim` over this rank's part -> the table's rows at the global positions."""

    def __init__(self, cg: ContextGroup, dim: int) -> None:
        super().__init__()
        self.cg, self.dim = cg, dim

    def forward(self, table: torch.Tensor, dim: int, start: Any = 0, end: Any = None) -> torch.Tensor:
        start = int(start or 0)
        local = positions(int(end) - start, self.cg, device=table.device) + start
        return table.index_select(self.dim, local)


class ContextAttention(nn.Module):
    """Causal attention of this rank's queries over every rank's keys and values (module docstring)."""

    def __init__(self, cg: ContextGroup) -> None:
        super().__init__()
        self.cg = cg

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
        keys, values = _GatherKeys.apply(k, self.cg), _GatherKeys.apply(v, self.cg)
        return causal_chunks(q, keys, values, self.cg, scale=scale, enable_gqa=enable_gqa)


class ContextHeads(nn.Module):
    """ContextAttention where tensor parallelism already runs attention per head (runtime.tensor_parallel_ops
    LocalAttention calls it with this rank's heads, in scaled_dot_product_attention's arguments): the causal mask is
    rebuilt from the global positions, so a mask and is_causal are dropped; the scale and enable_gqa are kept."""

    def __init__(self, cg: ContextGroup) -> None:
        super().__init__()
        self.inner = ContextAttention(cg)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        scale = args[3] if len(args) > 3 else kwargs.get("scale")
        gqa = args[4] if len(args) > 4 else kwargs.get("enable_gqa", False)
        return cast(torch.Tensor, self.inner(q, k, v, scale=scale, enable_gqa=gqa))


def causal_chunks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cg: ContextGroup, *,
                  scale: float | None = None, enable_gqa: bool = False) -> torch.Tensor:
    """Causal attention of group rank cg.index's queries (its chunks r and 2c - 1 - r, along dim -2) over every
    rank's keys and values (gathered in group order): each chunk over the keys up to its own last position, in
    sequence order, with the causal mask of that block (module docstring)."""
    half = q.shape[-2] // 2
    keys, values = _ordered(keys, -2, cg), _ordered(values, -2, cg)  # sequence order
    out = []
    for chunk, queries in zip((cg.index, 2 * cg.degree - 1 - cg.index), q.split(half, dim=-2)):
        reach = (chunk + 1) * half  # the keys this chunk's last query sees
        seen = torch.arange(reach, device=q.device) <= torch.arange(reach - half, reach, device=q.device)[:, None]
        out.append(F.scaled_dot_product_attention(queries, keys[..., :reach, :], values[..., :reach, :],
                                                  attn_mask=seen, scale=scale, enable_gqa=enable_gqa))
    return torch.cat(out, dim=-2)


def _arg(node: torch.fx.Node, index: int, key: str, default: Any = None) -> Any:
    return node.args[index] if len(node.args) > index else node.kwargs.get(key, default)


def _call(gm: torch.fx.GraphModule, node: torch.fx.Node, name: str, module: nn.Module, args: tuple[Any, ...],
          kwargs: dict[str, Any] | None = None) -> torch.fx.Node:
    gm.add_submodule(name, module)
    with gm.graph.inserting_before(node):
        new = gm.graph.call_module(name, args, kwargs or {})
    new.meta = dict(node.meta)
    node.replace_all_uses_with(new)
    gm.graph.erase_node(node)
    return new


def split_boundaries(gm: torch.fx.GraphModule, stages: Sequence[Any]) -> frozenset[str]:
    """The values of the whole graph `gm` that cross a stage boundary split ([Note: boundaries that stay split]):
    written by a stage (runtime.plan.StagePlan) that splits its sequence, read only by other stages of the same
    context and tensor degrees, and not by the model output."""
    stage_of = {name: s for s in stages for name in s.nodes}
    kept = set()
    for node in gm.graph.nodes:
        writer = stage_of.get(node.name)
        if writer is None or writer.context <= 1 or any(u.op == "output" for u in node.users):
            continue
        readers = {id(r): r for u in node.users if (r := stage_of.get(u.name)) is not None and r is not writer}
        if readers and all((r.context, r.tensor) == (writer.context, writer.tensor) for r in readers.values()):
            kept.add(node.name)
    return frozenset(kept)


def parallelize_sequence(gm: torch.fx.GraphModule, found: ContextGraph, cg: ContextGroup,
                         attentions: Sequence[str], device: torch.device, split: Collection[str] = ()) -> None:
    """Split the sequence of the stage graph `gm` over `cg` (module docstring); in place.

    `found` is runtime.context_graph's reading of the whole traced graph; `attentions` the module paths
    of the attentions whose mask the plan checked to be causal (an attention with is_causal=True and no
    mask needs none); `split`: the stage inputs and outputs that cross their boundary split (`split_boundaries`),
    neither sliced nor gathered. Every rank of the group calls it with the same graph (see [Note: one order of
    context collectives]).

    Raises:
        ValueError: the graph has no sequence to split, an op of the stage mixes tokens, an attention
            whose mask is not known to be causal, dropout in attention, a value crossing the stage
            boundary that is not one sequence.
    """
    if found.symbol is None:
        raise ValueError(f"the stage's sequence cannot be split: {found.why_not}")
    symbol, names = found.symbol, {n.name for n in gm.graph.nodes}
    blocked = [f"{n} ({why})" for n, why in found.blocked.items() if n in names]
    if blocked:
        raise ValueError(f"the stage mixes tokens along the sequence at {', '.join(blocked[:4])}: these need the whole "
                         "sequence on one rank; cut the stage elsewhere or run it with context=1")
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            _entry(gm, node, found, cg, symbol, split)
        elif node.name in found.positions:
            dtype = node.meta["val"].dtype
            _call(gm, node, f"cp_{node.name}", ContextPositions(cg, dtype, device), tuple(node.args))
        elif node.name in found.tables:
            dim, _ = found.tables[node.name]
            _call(gm, node, f"cp_{node.name}", ContextTable(cg, dim), tuple(node.args))
        elif node.op == "call_function" and node.target in ATTENTION:
            _attention(gm, node, found, cg, attentions)
        elif node.op == "call_module" and hasattr(gm.get_submodule(str(node.target)), "attention") and \
                node.meta.get("tp_replaced") in found.attention:  # split by heads first (runtime.tensor_parallel)
            _attention(gm, node, found, cg, attentions, heads=True)
        elif node.op == "output":
            _exit(gm, node, found, cg, symbol, split)
    gm.graph.lint()
    gm.recompile()


def _entry(gm: torch.fx.GraphModule, node: torch.fx.Node, found: ContextGraph, cg: ContextGroup, symbol: Any,
           split: Collection[str]) -> None:
    value = found.values.get(node.name)  # the value of the node of the whole graph this input is
    dims, tokens = sequence_dims(value, symbol), token_dims(value, symbol)
    if not tokens or (len(dims) > 1 and node.name in found.mask_only):
        return  # no sequence, or a mask no attention reads (each rank's own, from its own part)
    if len(dims) != 1 or tokens != dims:
        raise ValueError(f"stage input {node.name} has shape {tuple(getattr(value, 'shape', ()))}, not one sequence "
                         "dim; cut the stage where values hold one (between layers)")
    if node.name in split:
        return  # this rank's tokens already, as the writer's rank of the same context index sent them
    users = list(node.users)
    with gm.graph.inserting_after(node):
        gm.add_submodule(f"cp_in_{node.name}", ContextSlice(dims[0], cg))
        local = gm.graph.call_module(f"cp_in_{node.name}", (node,))
    local.meta = dict(node.meta)
    for user in users:
        user.replace_input_with(node, local)


def _exit(gm: torch.fx.GraphModule, node: torch.fx.Node, found: ContextGraph, cg: ContextGroup, symbol: Any,
          split: Collection[str]) -> None:
    outputs = node.args[0]
    if not isinstance(outputs, (tuple, list)):
        return
    whole = []
    for k, value in enumerate(outputs):
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else None
        dims, tokens = sequence_dims(val, symbol), token_dims(val, symbol)
        if not tokens or (len(dims) > 1 and value.name in found.mask_only):
            whole.append(value)
            continue
        if len(dims) != 1 or tokens != dims:
            raise ValueError(f"stage output {value.name} has shape {tuple(getattr(val, 'shape', ()))}, not one "
                             "sequence dim; cut the stage where values hold one (between layers)")
        if value.meta.get("tp_of", value.name) in split:  # (a tensor split's output: the value it makes whole)
            whole.append(value)  # sent as it is: the reader's rank of this context index takes these tokens
            continue
        gm.add_submodule(f"cp_out{k}", ContextGather(dims[0], cg))
        with gm.graph.inserting_before(node):
            whole.append(gm.graph.call_module(f"cp_out{k}", (value,)))
    node.args = (type(outputs)(whole),)


def _attention(gm: torch.fx.GraphModule, node: torch.fx.Node, found: ContextGraph, cg: ContextGroup,
               attentions: Sequence[str], heads: bool = False) -> None:
    name = str(node.meta["tp_replaced"]) if heads else node.name  # the whole graph's name of the attention
    path = found.attention.get(name, "")
    if not found.causal.get(name) and path not in attentions:
        raise ValueError(f"attention {node.name} ({path or 'the root module'}) is not in the stage's "
                         f"context_attention {list(attentions)}: only an attention whose mask is the causal one "
                         "splits its sequence (partitioner.capture.sequence finds them)")
    dropout = _arg(node, 4, "dropout_p", 0.0)
    if dropout:
        raise ValueError(f"attention {node.name} ({path}) drops out with p={dropout}; the sequence split does not "
                         "reproduce it: train with attention dropout 0")
    if heads:  # LocalAttention runs this rank's heads through ContextHeads
        gm.get_submodule(str(node.target)).attention = ContextHeads(cg)
        return
    kwargs = {k: v for k, v in node.kwargs.items() if k in ("scale", "enable_gqa")}
    _call(gm, node, f"cp_{node.name}", ContextAttention(cg), tuple(node.args[:3]), kwargs)
