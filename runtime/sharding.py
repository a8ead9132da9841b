"""Sharded data parallelism of one stage, run by PyTorch's FSDP2 (`fully_shard`) on the stage's data-parallel mesh.

A stage module (an fx GraphModule as runtime.stage builds it, holding the model's own submodules
and parameters) is cut into its repeated blocks (runtime.recompute_segments: the same segments a
recomputed stage checkpoints), each made one FSDP unit, then the stage's root (what is left:
embeddings, a tied weight read by two blocks, the final norm). FSDP2 all-gathers a unit's weights
before its forward and backward and reduce-scatters its gradients after its backward:

    rank r holds 1/d of every weight (a DTensor) ─► unit k's forward: all-gather k (prefetch k+1)
        ─► zero3: free k after its forward, all-gather it again for its backward
        ─► backward of k: gradients reduce-scattered to 1/d (when this micro-batch reduces)
        ─► optimizer.step() on the shards: Adam's moments are 1/d as well

Modes ([Note: sharding modes] in rules/sharding.py): "zero3" (reshard_after_forward=True),
"zero2" (False: a block stays gathered from its forward to its backward) and "zero1".

ZeRO-1 (only the optimizer state sharded) is not an FSDP2 option: FSDP2 always stores the shard
and reduce-scatters gradients to it. What runs instead is FSDP2 holding the gathered weights for
the whole step (reshard_after_forward=False, reshard_after_backward=False but on the last
micro-batch) and accumulating the gradients unsharded until the last backward: one all-gather and
one reduce-scatter a step (an all-reduce's volume, as ZeRO-1), full weights and gradients during
the step and 1/d optimizer state, as ZeRO-1 holds them; between steps a rank holds only its shard.
torch's ZeroRedundancyOptimizer (ZeRO-1 beside DDP) was not taken: it shards whole tensors (not
1/d of each), so its memory depends on how tensors pack, and it is a second mechanism to keep.

Micro-batches: call `before_backward(last=...)` before each micro-batch's backward, as
torch.distributed.pipelining's stages do (set_requires_gradient_sync, set_is_last_backward): with
gradient_sync "last" only the last micro-batch's backward reduce-scatters (FSDP2 accumulates the
others' gradients unsharded, the full gradients of the stage), with "every" each does. Under
zero3 and zero2 the weights are gathered again for every micro-batch (zero3: in its forward and
again in its backward); under zero1 once a step.

[Note: sharding a recomputed stage]
A stage that also recomputes (runtime.recompute) is sharded as torchtitan composes the two:
checkpoint each block, then make each checkpointed block one FSDP unit. runtime.stage wraps first
(tensor split, then recomputation, then FSDP2 here), so the segments runtime.recompute checkpoints
(runtime.recompute_segments) are the units; this module does not cut them again. A unit's
checkpoint reruns its forward inside the unit's backward, after FSDP2's pre-backward hook has
gathered its weights: under zero3 a block is gathered for its forward, freed, gathered again for
its backward and recomputed from that gather (what FSDP does); zero2 and zero1 recompute from the
copy they keep. A stage checkpointed whole (it writes in place, or is one block) is one unit.

[Note: fused weights under FSDP2]
A fused q/k/v weight split over tensor ranks holds each rank's part of q, of k and of v (a strided
split, DTensor's _StridedShard). FSDP2 shards a weight along dim 0 by default; cutting a strided split
again along the same dim gives a layout no DTensor placement describes (torch 2.13 names it
(_StridedShard(0, sf=t), _StridedShard(0, sf=3)), and `full_tensor()`, `get_model_state_dict(...,
full_state_dict=True)` and DCP's gather all return the rows permuted). So FSDP2 shards such a weight
along another dim (`shard_placement_fn`: its input features), where the two splits compose and torch's
own tools return the model's weight; a 1-D one (the fused bias) has no other dim and is left whole over
the replicas (FSDP2's ignored_params), its gradient summed over the data mesh by `reduce_whole` after
the step's backwards, as FSDP2 sums the others: a few kilobytes a layer.

Every rank of the mesh must run the same forwards and backwards in the same order (each unit's
all-gather and reduce-scatter is a collective of the mesh): a sharded stage's replicas each take
their own slice of every micro-batch, they do not deal micro-batches between them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Iterable, Mapping, Sequence, cast

import torch
import torch.distributed as dist
import torch.fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from rules.sharding import GradientSync, ShardingMode, mode_rule, reduces
from runtime.fsdp_warnings import explain_view_warning
from runtime.mode_units import ModeCell, ModeSwitch, pair_units, point_at
from runtime.recompute import RecomputedStage
from runtime.recompute_segments import split_segments
from runtime.tensor_parallel import rebind

__all__ = ["ShardedStage", "ShardingConfig", "data_mesh", "shard_stage"]


@dataclass(frozen=True)
class ShardingConfig:
    """How a stage is sharded: the mode, the dtypes FSDP2 computes and reduces in, when gradients reduce.

    compute_dtype: FSDP2's MixedPrecisionPolicy.param_dtype (the gathered weights, what forward and
        backward run in; None: the weights' own dtype). The stored shard keeps the weights' dtype
        (the master weights the optimizer steps on).
    reduce_dtype: the dtype gradients are reduced and accumulated in between micro-batches (None:
        compute_dtype); the shards the optimizer reads are in the weights' dtype.
    """

    mode: ShardingMode = "zero3"
    compute_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    gradient_sync: GradientSync = "last"

    def __post_init__(self) -> None:
        rule = mode_rule(self.mode, self.gradient_sync)
        if not rule.sharded:
            raise ValueError(f"mode {self.mode!r} is not sharded; a stage shards under 'zero1', 'zero2' or 'zero3'")

    @property
    def policy(self) -> MixedPrecisionPolicy:
        return MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=self.reduce_dtype)


def data_mesh(ranks: Sequence[int], *, replicate: int = 1, device_type: str = "cpu") -> DeviceMesh | None:
    """A stage's data-parallel mesh: its ranks as (replicate, shard) groups, shard innermost; 1-D when replicate == 1.

    With replicate > 1 the mesh is 2-D and FSDP2 runs HSDP: weights sharded within each row of
    len(ranks) // replicate consecutive ranks and replicated across rows (gradients reduce-scattered
    in the row, then all-reduced across rows). Every rank of the job calls this for every stage,
    in the same order (it creates process groups); ranks outside `ranks` get None.

    Raises:
        ValueError: replicate does not divide the ranks, or a rank repeats.
    """
    ranks = [int(r) for r in ranks]
    if len(set(ranks)) != len(ranks) or not ranks:
        raise ValueError(f"a stage's data-parallel ranks must be distinct and not empty, got {ranks}")
    if replicate < 1 or len(ranks) % replicate:
        raise ValueError(f"replicate={replicate} does not divide the stage's {len(ranks)} ranks {ranks}")
    shard = len(ranks) // replicate
    rows = [ranks[i * shard:(i + 1) * shard] for i in range(replicate)]
    me = dist.get_rank()
    shard_groups = [dist.new_group(row) for row in rows]
    if replicate == 1:
        return DeviceMesh.from_group(_joined(shard_groups[0]), device_type) if me in ranks else None
    columns = [[row[j] for row in rows] for j in range(shard)]
    replicate_groups = [dist.new_group(col) for col in columns]
    if me not in ranks:
        return None
    row = next(i for i, r in enumerate(rows) if me in r)
    col = rows[row].index(me)
    return DeviceMesh.from_group([_joined(replicate_groups[col]), _joined(shard_groups[row])], device_type,
                                 mesh=torch.tensor(rows), mesh_dim_names=("replicate", "shard"))


def _joined(group: Any) -> dist.ProcessGroup:
    """A group this rank is in (newer torch types new_group as a group or the non-member marker)."""
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(f"this rank ({dist.get_rank()}) is not in the group it builds a mesh from")
    return group


class ShardedStage(nn.Module):
    """A stage module sharded by FSDP2: call it as the stage module; `before_backward` before each backward.

    Attributes:
        root: the stage as a GraphModule calling one submodule per repeated block (or the stage
            itself where it is not cut), the FSDP root.
        units: the FSDP units inside the root (the blocks holding weights no other block reads).
    """

    def __init__(self, root: nn.Module, units: list[nn.Module], config: ShardingConfig,
                 keys: Mapping[str, list[str]], modes: ModeCell | None = None) -> None:
        super().__init__()
        self.root = root
        self.units = units
        self.config = config
        self._keys = dict(keys)  # the root's parameter and buffer paths -> the model's state_dict keys
        self.modes = modes  # which graph runs, where the stage has one per train/eval mode (runtime.mode_units)
        self.whole: tuple[DeviceMesh, list[nn.Parameter]] | None = None  # see reduce_whole

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.root(*args, **kwargs)

    @property
    def fsdp(self) -> FSDPModule:
        return cast(FSDPModule, self.root)

    def before_backward(self, *, last: bool) -> None:
        """Set what the next backward does: reduce-scatter (last micro-batch, or gradient_sync "every"),
        reshard (zero1: only after the last) and finish FSDP2's step (last)."""
        fsdp = self.fsdp
        fsdp.set_is_last_backward(last)
        fsdp.set_requires_gradient_sync(reduces(self.config.mode, self.config.gradient_sync, last))
        if mode_rule(self.config.mode).keep_gathered:
            fsdp.set_reshard_after_backward(last)

    def reduce_whole(self) -> None:
        """Sum the gradients of the weights FSDP2 left whole (fused 1-D weights split over tensor ranks) over the
        stage's data mesh, as FSDP2 sums the others; every rank of the mesh calls it after the step's backwards."""
        if self.whole is None:
            return
        mesh, params = self.whole
        grads = [p.grad for p in params if p.grad is not None]
        if len(grads) != len(params):
            raise RuntimeError(f"{len(params) - len(grads)} of the stage's {len(params)} whole fused weights have no "
                               "gradient after the step's backward; every rank of a data mesh must hold all")
        flat = torch.cat([(g.to_local() if isinstance(g, DTensor) else g).reshape(-1) for g in grads])
        with torch.no_grad():
            for dim in range(mesh.ndim):  # HSDP: the shard dimension, then the replicate one
                dist.all_reduce(flat, group=mesh.get_group(dim))
            at = 0
            for g in grads:
                part = g.to_local() if isinstance(g, DTensor) else g
                part.copy_(flat[at:at + part.numel()].view_as(part))
                at += part.numel()

    def reshard(self) -> None:
        """Free every gathered weight (after an evaluation forward under zero1 or zero2, which keeps them)."""
        for module in self.root.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def model_state_dict(self) -> dict[str, torch.Tensor]:
        """The stage's weights and buffers under the model's own `state_dict()` keys, between steps: DTensor shards
        for the weights (torch.distributed.checkpoint saves and loads them in place), plain tensors for buffers."""
        found: dict[str, torch.Tensor] = {}
        params = dict(self.root.named_parameters(remove_duplicate=False))
        buffers = dict(self.root.named_buffers(remove_duplicate=False))
        for path, keys in self._keys.items():
            tensor = params.get(path, buffers.get(path))
            if tensor is not None:
                for key in keys:
                    found[key] = tensor
        return found


def shard_stage(module: nn.Module, mesh: DeviceMesh, config: ShardingConfig = ShardingConfig(),
                model: nn.Module | None = None, unsharded: Collection[torch.Tensor] = (),
                owners: Sequence[nn.Module] = (), other: nn.Module | None = None) -> ShardedStage:
    """Shard a stage module over `mesh` with FSDP2: one unit per repeated block, then the stage's root.

    The module's weights (the model's own parameters, also reachable from `model`) become the FSDP2
    shards in place: build the optimizer on `ShardedStage.parameters()` after this. Give `model` for
    `model_state_dict` (checkpoints under the model's keys).

    Args:
        module: the stage module (runtime.stage.Stage.module): a GraphModule is cut into its blocks
            (runtime.recompute_segments.split_segments), one recomputed in segments keeps the segments
            runtime.recompute checkpoints ([Note: sharding a recomputed stage]); any other module is
            sharded as one unit.
        mesh: the stage's data-parallel mesh (`data_mesh`): 1-D shards, 2-D (replicate, shard) is HSDP.
        config: mode, mixed precision, gradient sync.
        model: the model whose submodules the stage holds.
        unsharded: weights FSDP2 leaves alone (whole on every rank, gradients not reduced): a weight
            tied to another stage, whose gradient the runtime all-reduces over both stages' ranks.
        owners: more modules pointed at the shards wherever they hold a weight FSDP2 replaced (the
            traced graph, whose attributes hold a weight it reads directly: a tied head), so what
            they hold is what the stage trains.
        other: the same stage built from the model's other train/eval graph (forward reads
            `self.training`): both graphs share one set of units ([Note: sharding both modes of a
            stage] in runtime.mode_units); `ShardedStage.modes` then says which one runs.

    Raises:
        ValueError: the module has no parameters.
    """
    if not any(True for _ in module.parameters()):
        raise ValueError("the stage holds no parameters: there is nothing to shard; leave it unsharded")
    root, blocks = _cut(module)
    units = _units(blocks)
    cell, graphs = None, [blocks]
    if other is not None:  # see [Note: sharding both modes of a stage]
        cell = ModeCell()
        other_root, other_blocks = _cut(other)
        graphs.append(other_blocks)
        pairs = pair_units(units, _units(other_blocks))
        units = [ModeSwitch(a, b, cell) for a, b in pairs]
        for unit, (a, b) in zip(units, pairs):
            point_at(blocks, a, unit)
            point_at(other_blocks, b, unit)
        root = ModeSwitch(root, other_root, cell)
    keys = _model_keys(root, model) if model is not None else {}
    rule = mode_rule(config.mode, config.gradient_sync)
    ignored = {p for p in root.parameters() if any(p is t for t in unsharded) or _kept_whole(p)}
    unsplit = dict(root.named_parameters(remove_duplicate=False))
    explain_view_warning(graphs, [*units, root])  # see [Note: FSDP2's view warning]
    for unit in [*units, root]:
        fully_shard(unit, mesh=mesh, reshard_after_forward=rule.reshard_after_forward, mp_policy=config.policy,
                    ignored_params=ignored, shard_placement_fn=_shard_dim)
    # Backward prefetch by forward order within one micro-batch: FSDP2's default follows its record of every
    # forward since the last "last backward", so a later micro-batch's backward would end by gathering the
    # previous micro-batch's last block for nothing. The first block's backward "prefetches" the root (already
    # gathered for the whole backward): an empty list would bring the default back.
    chain = [cast(FSDPModule, m) for m in [root, *units]]
    for before, block in zip(chain, chain[1:]):
        block.set_modules_to_backward_prefetch([before])
    sharded = ShardedStage(root, units, config, keys, cell)
    whole = list({id(p): p for p in unsplit.values()  # in the module's order: one order on every rank
                  if _kept_whole(p) and not any(p is t for t in unsharded)}.values())
    if whole:
        sharded.whole = (mesh, whole)
    if model is not None:
        _rebind(model, sharded.model_state_dict())
    after = dict(root.named_parameters(remove_duplicate=False))
    rebind(owners, {id(p): after[path] for path, p in unsplit.items() if path in after})
    return sharded


def _strided_dim(p: torch.Tensor) -> int | None:
    """The dim a fused weight is split along over tensor ranks (a strided split: its part of q, of k and of v)."""
    if isinstance(p, DTensor):
        for placement in p.placements:
            if isinstance(placement, _StridedShard):
                return int(placement.dim)
    return None


def _shard_dim(p: nn.Parameter) -> Shard | None:
    """FSDP2's dim for `p` (None: its default, dim 0). See [Note: fused weights under FSDP2]."""
    dim = _strided_dim(p)
    if dim is None or p.ndim < 2:
        return None
    return Shard(next(d for d in range(p.ndim) if d != dim))


def _kept_whole(p: torch.Tensor) -> bool:
    """A fused 1-D weight split over tensor ranks (q/k/v's bias): left whole over the replicas, its gradient
    all-reduced by `ShardedStage.reduce_whole` ([Note: fused weights under FSDP2])."""
    return _strided_dim(p) is not None and p.ndim == 1


def _cut(module: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(root, blocks): the FSDP root and the GraphModule inside it that calls one submodule per block.

    See [Note: sharding a recomputed stage]. A bare stage graph is cut here (root and blocks are one
    module); a stage runtime.recompute cut into checkpointed segments keeps its cut (each segment,
    checkpoint and all, is a block); a whole-stage wrapper that does not recompute ("none": a stage beside
    recomputing ones) has its inner graph cut; one checkpoint over the whole stage stays one unit.
    """
    if not isinstance(module, torch.fx.GraphModule):
        return module, module
    wrapped = [c for c in module.children() if isinstance(c, RecomputedStage)]
    if not wrapped:
        root = split_segments(module) or module  # the same tensors, under new paths
        return root, root
    if len(wrapped) == 1 and wrapped[0].mode == "none":
        inner = split_segments(wrapped[0].inner)
        if inner is not None:
            wrapped[0].inner = inner
            return module, inner
    return module, module


def _units(root: nn.Module) -> list[nn.Module]:
    """The blocks the root calls that hold weights no other block holds (FSDP2 refuses a weight in two
    units; such blocks stay in the root's unit, as do weights the root reads itself: a tied embedding)."""
    if not isinstance(root, torch.fx.GraphModule):
        return []
    called = dict.fromkeys(str(n.target) for n in root.graph.nodes if n.op == "call_module")
    children = [root.get_submodule(t) for t in called]
    children = [c for c in children if any(True for _ in c.parameters())]
    if len(children) < 2:
        return []
    holders: dict[int, int] = {id(p): 1 for p in root.parameters(recurse=False)}
    for _, child in root.named_children():  # called blocks and the holders of what the root reads itself
        for p in child.parameters():
            holders[id(p)] = holders.get(id(p), 0) + 1
    return [c for c in children if all(holders[id(p)] == 1 for p in c.parameters())]


def _tensors(module: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from module.named_parameters(remove_duplicate=False)
    yield from module.named_buffers(remove_duplicate=False)


def _model_keys(module: nn.Module, model: nn.Module) -> dict[str, list[str]]:
    """Each of the stage's parameter and buffer paths -> the model's state_dict keys of that tensor."""
    by_id: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        by_id.setdefault(id(tensor), []).append(key)
    return {path: by_id[id(t)] for path, t in _tensors(module) if id(t) in by_id}



def _rebind(model: nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Point the model's own attributes at the stage's shards where the model still holds the full weight (a tied
    weight the trace read as a plain tensor, so FSDP2 swapped it in the stage only): the full copy is freed, and
    `model.state_dict()` gives the shards."""
    for key, tensor in state.items():
        path, _, name = key.rpartition(".")
        owner = model.get_submodule(path)
        if isinstance(tensor, nn.Parameter) and name in owner._parameters and owner._parameters[name] is not tensor:
            setattr(owner, name, tensor)
