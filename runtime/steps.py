"""Turn one call's inputs (and targets) into the micro-batches a step runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Iterator, Literal, Mapping, Protocol, Sequence

import torch
import torch.utils._pytree as pytree

from runtime.errors import PartitionError
from runtime.microbatch import SplitDim, batch_size, scatter, to_device

__all__ = ["StepInputs", "check_leaf_writes", "forward_step", "micro_batch_loss", "step_sizes", "train_step_inputs",
           "transaction", "write_back"]


@dataclass
class StepInputs:
    """One step's micro-batches: input values by placeholder name, and (training) targets and loss."""

    envs: list[dict[str, Any]]
    mode: Literal["train", "forward"]
    targets: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    written: dict[str, torch.Tensor] = field(default_factory=dict)  # caller's inputs the graph writes into
    reduction: Literal["mean", "sum"] = "mean"  # train_step's loss_reduction
    per_token: bool = False  # train_step's loss_per_token (runtime.loss_tokens)


def forward_step(
    flatten: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
    input_names: list[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    micro_batches: int,
    mutated: Sequence[str] = (),
    dims: Sequence[SplitDim] | None = None,
    *,
    leaf_writes: Collection[str] = (),
) -> StepInputs:
    """One call's micro-batches (`pipe(x)`); `leaf_writes`: see `check_leaf_writes`."""
    flat = flatten(args, kwargs)
    if leaf_writes:
        check_leaf_writes(flat, input_names, leaf_writes)
    envs = [dict(zip(input_names, flat))] if micro_batches == 1 else _envs(flat, input_names, micro_batches, dims)
    return StepInputs(envs, "forward", written=_written(flat, input_names, mutated) if mutated else {})


def step_sizes(step: StepInputs, dims: Sequence[SplitDim] | None = None) -> list[int]:
    """Each micro-batch's number of samples (of the inputs split along dim 0 by default)."""
    sizes = []
    for env in step.envs:
        values = list(env.values())
        auto = [v for v, d in zip(values, dims or ["auto"] * len(values)) if d == "auto"]
        sizes.append(batch_size(auto or values))
    return sizes


def _envs(flat: list[Any], names: list[str], micro_batches: int, dims: Sequence[SplitDim] | None = None
          ) -> list[dict[str, Any]]:
    """Each micro-batch's inputs by name (a stage that writes into one writes into its own copy: views
    of one batch share a version counter, so a write into one would break another's backward)."""
    return [dict(zip(names, c)) for c in scatter(flat, micro_batches, dims)]


def check_leaf_writes(flat: list[Any], names: list[str], leaf_writes: Collection[str]) -> None:
    """Refuse, as the plain model does, an input that is a leaf requiring grad when the graph writes into it
    in place with grad mode on (`leaf_writes`, runtime.mutation.inputs_written_with_grad): each micro-batch
    works on its own copy, which autograd would let the write through."""
    if not leaf_writes or not torch.is_grad_enabled():
        return
    for name, value in zip(names, flat):
        if name in leaf_writes and isinstance(value, torch.Tensor) and value.is_leaf and value.requires_grad:
            raise RuntimeError(
                "a leaf Variable that requires grad is being used in an in-place operation "
                f"(the model writes into its input {name!r} in place, which requires grad); as with the plain "
                "model, pass a tensor that does not require grad, a non-leaf (x.clone()), or write out of place"
            )


def _written(flat: list[Any], names: list[str], mutated: Sequence[str]) -> dict[str, torch.Tensor]:
    if not mutated:
        return {}
    return {n: v for n, v in zip(names, flat) if n in mutated and isinstance(v, torch.Tensor)}


def write_back(step: StepInputs) -> None:
    """Copy what the model wrote into its inputs back into the caller's tensors, as the plain model writes
    into them: a stage writes into its own copy of an input (runtime.mutation.own_copies), which the
    interpreter leaves in the step's micro-batch in place of the caller's part."""
    for name, original in step.written.items():
        parts = [env[name] for env in step.envs]
        if not all(isinstance(p, torch.Tensor) for p in parts) or all(p is original for p in parts):
            continue
        ptr = original.untyped_storage().data_ptr()
        if all(p.untyped_storage().data_ptr() == ptr for p in parts):  # the caller's own parts: not written
            continue
        # A caller's tensor inside its autograd graph takes the write's history, as the plain model's write gives it.
        with torch.set_grad_enabled(torch.is_grad_enabled() and original.requires_grad and not original.is_leaf):
            if len(parts) > 1 and parts[0].dim() > 0 and sum(p.shape[0] for p in parts) == original.shape[0]:
                original.copy_(torch.cat(parts).to(original.device))
            elif parts[-1].shape == original.shape:  # given whole to every micro-batch: each wrote the same
                original.copy_(parts[-1].to(original.device))


def train_step_inputs(
    flatten: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
    input_names: list[str],
    inputs: Any,
    targets: Any,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    input_kwargs: Mapping[str, Any] | None,
    micro_batches: int,
    loss_reduction: Literal["mean", "sum"],
    mutated: Sequence[str] = (),
    dims: Sequence[SplitDim] | None = None,
    *,
    leaf_writes: Collection[str] = (),
    per_token: bool = False,
) -> StepInputs:
    """Micro-batches of inputs and targets; each micro-batch's loss weighted so gradients equal
    `loss_fn(model(inputs), targets).backward()` on the whole batch ("mean": by its share of
    the batch, for losses that average over samples; "sum": not at all).

    Raises:
        PartitionError: targets whose batch is not the inputs' (the plain model's loss would fail on them).
    """
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    flat = flatten(args, dict(input_kwargs or {}))
    check_leaf_writes(flat, input_names, leaf_writes)
    envs = _envs(flat, input_names, micro_batches, dims)
    if micro_batches == 1:  # the whole batch: loss_fn sees what it sees on the plain model
        return StepInputs(envs, "train", [targets], [1.0], loss_fn, _written(flat, input_names, mutated),
                          loss_reduction, per_token)
    tensors = [t for t in pytree.tree_leaves(targets) if isinstance(t, torch.Tensor)]
    if not tensors:  # nothing to split (say targets=None): every micro-batch's loss gets them whole
        sizes = step_sizes(StepInputs(envs, "train"), dims)
        targets_of = [targets] * micro_batches
    else:
        _check_target_batch(tensors[0], _input_batch(flat, dims))
        target_chunks = scatter([targets], micro_batches)
        sizes = [batch_size(c[0]) for c in target_chunks]
        targets_of = [c[0] for c in target_chunks]
    weights = [n / sum(sizes) if loss_reduction == "mean" else 1.0 for n in sizes]
    return StepInputs(envs, "train", targets_of, weights, loss_fn, _written(flat, input_names, mutated),
                      loss_reduction, per_token)


def _input_batch(flat: list[Any], dims: Sequence[SplitDim] | None) -> int | None:
    """The batch the inputs are split along (as `scatter` splits them); None when none is split."""
    dims = list(dims) if dims is not None else ["auto"] * len(flat)
    auto = [v for v, d in zip(flat, dims) if d == "auto"]
    if any(isinstance(t, torch.Tensor) for t in pytree.tree_leaves(auto)):
        return batch_size(auto)
    for value, dim in zip(flat, dims):
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor) and isinstance(dim, int) and t.dim() > 0:
                return int(t.shape[dim])
    return None


def _check_target_batch(first: torch.Tensor, batch: int | None) -> None:
    """Targets are split along dim 0 with the inputs' micro-batches: their batch must be the inputs'."""
    if first.dim() == 0:
        raise PartitionError("the targets' first tensor is a scalar (shape ()), so it has no batch to split into "
                             "micro-batches; pass targets whose dim 0 is the batch, one per input sample")
    if batch is not None and first.shape[0] != batch:
        raise PartitionError(
            f"the targets have a batch of {first.shape[0]} (dim 0 of their first tensor, shape "
            f"{tuple(first.shape)}) but the inputs have a batch of {batch}; the plain model's loss would fail "
            "or broadcast on them: pass one target per input sample"
        )


def micro_batch_loss(step: StepInputs, j: int, output: Any, device: torch.device, targets: Any = None
                     ) -> torch.Tensor:
    """`loss_fn` on micro-batch j's output and targets (`targets`: those, cut as the output was: runtime.loss_tokens;
    unweighted), checked to be one number.

    Raises:
        PartitionError: the loss is not a tensor of one element (backward needs a scalar).
    """
    assert step.loss_fn is not None  # a training step always has one
    loss = step.loss_fn(output, to_device(step.targets[j] if targets is None else targets, device))
    if isinstance(loss, torch.Tensor) and loss.numel() == 1:
        return loss if loss.dim() == 0 else loss.reshape(())
    got = f"a tensor of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else f"a {type(loss).__name__}"
    raise PartitionError(f"loss_fn returned {got}, not a scalar tensor: train_step runs backward from each "
                         "micro-batch's loss, which needs one number (as loss.backward() does); reduce it inside "
                         "loss_fn, e.g. with .mean() or .sum() or reduction='mean'")


class Deferred(Protocol):
    """What a step needs of a deferred BatchNorm (runtime.batchnorm): defer, then commit or discard."""

    deferring: bool

    def commit(self) -> None: ...

    def discard(self) -> None: ...


@contextlib.contextmanager
def transaction(params: Sequence[torch.nn.Parameter], bns: Sequence[Deferred], *, grads: bool) -> Iterator[None]:
    """A step that changes parameters' gradients (`grads`) and BatchNorm statistics only if it succeeds.

    Gradients already there (accumulated over earlier steps) are set aside, the step computes
    its own, and on success they are added back (into the same tensor, as autograd would);
    on failure they are put back as they were and the step's BatchNorm statistics dropped.
    """
    for bn in bns:
        bn.deferring = True
    held = [(p, p.grad) for p in params] if grads else []
    for p, _ in held:
        p.grad = None
    try:
        yield
    except BaseException:
        for p, g in held:
            p.grad = g
        for bn in bns:
            bn.discard()
        raise
    _add_back(held)
    for bn in bns:
        bn.commit()


def _add_back(held: Sequence[tuple[torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """Each parameter's gradient is the one set aside plus the step's, in the tensor set aside."""
    dense: list[tuple[torch.Tensor, torch.Tensor]] = []
    with torch.no_grad():
        for p, g in held:
            if g is None:
                continue
            new = p.grad
            if new is not None:
                if g.layout == torch.strided and new.layout == torch.strided:
                    dense.append((g, new))
                else:
                    g.add_(new)
            p.grad = g
        if dense:  # one call for every parameter: a step adds to dozens of them
            torch._foreach_add_([g for g, _ in dense], [new for _, new in dense])
