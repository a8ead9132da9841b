"""Activation recomputation of a stage: keep less for backward, run its forward again in backward.

    mode        kept between a micro-batch's forward and its backward    run again in backward
    none        what autograd saves                                      nothing
    selective   the stage's inputs + matmul/convolution/attention outputs element-wise ops, norms, softmax, dropout
    full        the stage's inputs                                       the whole stage forward

Both modes are `torch.utils.checkpoint` (non-reentrant); "selective" adds a policy
(`create_selective_checkpoint_contexts`) that caches the outputs of `KEPT_OPS`. `wrap` puts a
stage's GraphModule inside a small GraphModule that calls it through `RecomputedStage`, so the
runtimes call stages as before. A forward without grad (`pipe(x)` under `no_grad`) runs plainly.

[Note: recomputation replays the stage's random numbers]
A recomputed forward must draw the random numbers the first forward drew (dropout masks), so
the stage stashes the RNG state (CPU, and its own device's) when its forward starts and sets it
back for the recomputation, restoring the current state afterwards. In one process the workers'
threads share those generators: another thread drawing between the stash and the stage's own
draws would shift them, and the recomputation would make other masks than the forward used.
So, once any stage of a pipeline recomputes, every stage's forward and every recomputation runs
under one process-wide lock (`RNG_LOCK`): forwards of stages on different threads no longer
overlap on the host (their device work still does); torchrun ranks have one thread each.

Two more things a recomputation must not repeat or miss:
- Deferred BatchNorm (runtime.batchnorm) records each micro-batch's statistics in forward; the
  recomputation records none, so running statistics are updated once, as without it.
- A stage that writes into its inputs (`Stage.writes`) would recompute from the written values:
  those inputs are copied before the forward writes them, and the recomputation starts from the
  copies. Selective recomputation cannot run a stage that writes in place into a kept output
  (`kept_output_writes` names those writes; the stage is refused when it is built).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Iterator, Sequence

import torch
import torch.fx
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    SelectiveCheckpointContext,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from runtime.batchnorm import DeferredBatchNorm, DeferredBatchNormOp
from runtime.microbatch import tensors_in
from runtime.mutation import mutated_arg
from runtime.plan import RecomputeMode
from runtime.recompute_segments import split_segments

__all__ = [
    "KEPT_OPS", "RNG_LOCK", "RecomputedStage", "kept_bytes", "kept_output_writes", "selective_policy", "wrap",
]

aten = torch.ops.aten
# Operators whose outputs selective recomputation keeps: the products (most FLOPs per byte kept).
KEPT_OPS: frozenset[Any] = frozenset(
    op
    for name in ("mm", "addmm", "bmm", "baddbmm", "convolution", "_convolution", "_scaled_mm",
                 "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
                 "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention",
                 "_flash_attention_forward", "_efficient_attention_forward")
    if (op := getattr(getattr(aten, name, None), "default", None)) is not None
)
# Graph calls whose results are KEPT_OPS outputs (or views of them): writing into them in place breaks
# selective recomputation (see kept_output_writes).
_KEPT_CALLS = {"linear", "conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
               "convolution", "matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "scaled_dot_product_attention",
               "scaled_dot_product_flash_attention", "scaled_dot_product_efficient_attention",
               "scaled_dot_product_flash_attention_for_cpu", "scaled_dot_product_cudnn_attention"}
_VIEWS = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "unsqueeze", "squeeze", "expand",
          "expand_as", "narrow", "select", "slice", "flatten", "unflatten", "unbind", "split", "split_with_sizes",
          "chunk", "as_strided", "detach", "diagonal", "movedim", "swapaxes", "contiguous", "getitem", "unsafe_view",
          "alias", "after"}
_KEPT_MODULES = (nn.Linear, nn.modules.conv._ConvNd, nn.Bilinear)

RNG_LOCK = threading.RLock()  # see [Note: recomputation replays the stage's random numbers]
_ledger = threading.local()  # kept_bytes: the outputs selective recomputation cached, while measuring

Deferred = DeferredBatchNorm | DeferredBatchNormOp


def selective_policy(ctx: SelectiveCheckpointContext, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Keep the outputs of `KEPT_OPS`, recompute everything else.

    An operator that draws random numbers is always recomputed (an attention with dropout too):
    a kept one would not draw in the recomputation, and every later draw would shift.
    """
    if op in KEPT_OPS and (torch.Tag.nondeterministic_seeded not in op.tags or _dropout_p(op, args, kwargs) == 0):
        cached = getattr(_ledger, "tensors", None)
        if cached is not None:
            cached.extend(t for t in tensors_in(ctx.op_output))
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _dropout_p(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> float:
    for k, argument in enumerate(op._schema.arguments):
        if argument.name == "dropout_p":
            value = args[k] if k < len(args) else kwargs.get("dropout_p", argument.default_value)
            return float(value or 0.0)
    return 0.0


class RecomputedStage(nn.Module):
    """Runs a stage's GraphModule so that its backward recomputes what `mode` does not keep.

    `written`: positions of the inputs the stage writes into; `bns`: its deferred BatchNorms.
    Mode "none" only takes `RNG_LOCK` (a stage beside recomputing ones in a threaded pipeline).
    """

    def __init__(self, module: torch.fx.GraphModule, mode: RecomputeMode, device: torch.device,
                 bns: Sequence[Deferred] = (), written: Sequence[int] = ()) -> None:
        super().__init__()
        self.inner = module
        self.mode = mode
        self.device = torch.device(device)
        self.bns = list(bns)
        self.written = list(written)

    def forward(self, *inputs: Any) -> Any:
        if not torch.is_grad_enabled():  # nothing is saved for a backward that cannot come
            return self.inner(*inputs)
        with RNG_LOCK:
            if self.mode == "none":
                return self.inner(*inputs)
            replay = _Replay(self.inner, self.device, self.bns, inputs)
            pristine = [x.clone() if k in self.written and isinstance(x, torch.Tensor) else x
                        for k, x in enumerate(inputs)]
            kwargs: dict[str, Any] = {}
            if self.mode == "selective":
                kwargs["context_fn"] = functools.partial(create_selective_checkpoint_contexts, selective_policy)
            return checkpoint(replay, *pristine, use_reentrant=False, preserve_rng_state=False, **kwargs)

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}, device={self.device}"


class _Replay:
    """The function checkpoint runs: first the forward (on the stage's own inputs, stashing the RNG
    state), then each recomputation (on checkpoint's copies, with that RNG state and no BatchNorm
    statistics recorded)."""

    def __init__(self, module: torch.fx.GraphModule, device: torch.device, bns: Sequence[Deferred],
                 inputs: Sequence[Any]) -> None:
        self.module = module
        self.device = device
        self.bns = bns
        self.inputs: Sequence[Any] | None = inputs
        self.state: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def __call__(self, *args: Any) -> Any:
        if self.inputs is not None:  # the forward: the stage writes into the caller's inputs, as without recompute
            inputs, self.inputs = self.inputs, None
            self.state = (torch.get_rng_state(), _device_rng_state(self.device))
            return self.module(*inputs)
        if self.state is None:
            raise RuntimeError("a stage was recomputed before its forward ran; this is a bug in runtime.recompute")
        cpu, own = self.state
        devices = [self.device] if own is not None else []
        with RNG_LOCK, torch.random.fork_rng(devices=devices, device_type=self.device.type), _quiet(self.bns):
            torch.set_rng_state(cpu)
            if own is not None:
                torch.get_device_module(self.device.type).set_rng_state(own, self.device)
            return self.module(*args)


def _device_rng_state(device: torch.device) -> torch.Tensor | None:
    """The RNG state of the stage's accelerator, if it has one that is initialized."""
    if device.type in ("cpu", "meta"):
        return None
    module = torch.get_device_module(device.type)
    if not getattr(module, "is_initialized", lambda: True)():
        return None
    state: torch.Tensor = module.get_rng_state(device)
    return state


@contextlib.contextmanager
def _quiet(bns: Sequence[Deferred]) -> Iterator[None]:
    """Deferred BatchNorms record nothing (the forward recorded this micro-batch's statistics) and
    take the deferred path even after the step (a caller's backward), so running buffers stay put."""
    saved = [(bn.deferring, bn._stats) for bn in bns]
    for bn in bns:
        bn.deferring, bn._stats = True, []
    try:
        yield
    finally:
        for bn, (deferring, stats) in zip(bns, saved):
            bn.deferring, bn._stats = deferring, stats


def wrap(module: torch.fx.GraphModule, mode: RecomputeMode, device: torch.device, bns: Sequence[Deferred] = (),
         writes: Sequence[str] = ()) -> torch.fx.GraphModule:
    """`module` as a GraphModule that calls it through a RecomputedStage (same inputs, same outputs),
    one per segment where "selective" or "full" can cut it (runtime.recompute_segments).

    Raises:
        ValueError: selective recomputation of a stage that writes in place into a kept output.
    """
    if mode == "selective":
        bad = [f"{write} into {product}" for write, product in kept_output_writes(module)]
        if bad:
            raise ValueError(f"{module.__class__.__name__} writes in place into the output of a matmul or convolution "
                             f"({', '.join(bad[:3])}), which selective recomputation keeps; use recompute='full' "
                             "for this stage, or write out of place (h = h * 2 rather than h.mul_(2))")
    segmented = split_segments(module) if mode != "none" and not writes else None
    if segmented is not None:  # one checkpoint per segment: see runtime.recompute_segments
        for name, part in list(segmented.named_children()):
            if name.startswith("submod_"):
                setattr(segmented, name, RecomputedStage(part, mode, device, bns))  # type: ignore[arg-type]
        return segmented
    names = [n.name for n in module.graph.nodes if n.op == "placeholder"]
    written = [k for k, name in enumerate(names) if name in writes]
    graph = torch.fx.Graph()
    args = tuple(graph.placeholder(name) for name in names)
    graph.output(graph.call_module("recomputed", args))
    stage = RecomputedStage(module, mode, device, bns, written)
    return torch.fx.GraphModule({"recomputed": stage}, graph, module.__class__.__name__)


def kept_output_writes(gm: torch.fx.GraphModule) -> list[tuple[str, str]]:
    """(write, product) for each node that writes in place into the output of a product (Linear,
    convolution, matmul, ...) of the graph, directly, through views or after other in-place writes."""
    found = []
    for node in gm.graph.nodes:
        target = mutated_arg(node, gm)
        while target is not None and not _is_kept(gm, target):
            written = mutated_arg(target, gm)
            target = written if written is not None else _viewed(target)
        if target is not None:
            found.append((node.name, target.name))
    return found


def _call_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    return str(getattr(node.target, "__name__", node.target)).split(".")[0]  # aten: 'view.default' -> 'view'


def _viewed(node: torch.fx.Node) -> torch.fx.Node | None:
    """The tensor `node` is a view of (or may be: reshape), else None."""
    first = node.args[0] if node.args else None
    views = node.op in ("call_method", "call_function") and _call_name(node).lstrip("_") in _VIEWS
    return first if views and isinstance(first, torch.fx.Node) else None


def _is_kept(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), _KEPT_MODULES)
    return node.op in ("call_function", "call_method") and _call_name(node).strip("_") in _KEPT_CALLS


def kept_bytes(module: nn.Module, *inputs: Any) -> int:
    """Bytes one forward of `module` on `inputs` keeps for its backward, measured.

    Every tensor autograd saves (`saved_tensors_hooks`) and every output selective recomputation
    caches, each storage once; the module's own parameters and buffers are not counted.
    """
    own = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}
    storages: dict[int, int] = {}

    def count(t: torch.Tensor) -> None:
        try:
            storage = t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested, ...)
            return
        if storage.data_ptr() not in own:
            storages[storage.data_ptr()] = max(storages.get(storage.data_ptr(), 0), storage.nbytes())

    def pack(t: torch.Tensor) -> torch.Tensor:
        count(t)
        return t

    _ledger.tensors = []
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module(*inputs)
        for t in _ledger.tensors:
            count(t)
    finally:
        _ledger.tensors = None
    return sum(storages.values())
