"""Turn one call's inputs (and targets) into the micro-batches a step runs."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Mapping, Protocol, Sequence

import torch

from runtime.microbatch import SplitDim, batch_size, scatter

__all__ = ["StepInputs", "forward_step", "step_sizes", "train_step_inputs", "transaction", "write_back"]


@dataclass
class StepInputs:
    """One step's micro-batches: input values by placeholder name, and (training) targets and loss."""

    envs: list[dict[str, Any]]
    mode: Literal["train", "forward"]
    targets: list[Any] = field(default_factory=list)
    weights: list[float] = field(default_factory=list)
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None
    written: dict[str, torch.Tensor] = field(default_factory=dict)  # caller's inputs the graph writes into


def forward_step(
    flatten: Callable[[Sequence[Any], Mapping[str, Any]], list[Any]],
    input_names: list[str],
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    micro_batches: int,
    mutated: Sequence[str] = (),
    dims: Sequence[SplitDim] | None = None,
) -> StepInputs:
    flat = flatten(args, kwargs)
    return StepInputs(_envs(flat, input_names, micro_batches, mutated, dims), "forward",
                      written=_written(flat, input_names, mutated))


def step_sizes(step: StepInputs, dims: Sequence[SplitDim] | None = None) -> list[int]:
    """Each micro-batch's number of samples (of the inputs split along dim 0 by default)."""
    sizes = []
    for env in step.envs:
        values = list(env.values())
        auto = [v for v, d in zip(values, dims or ["auto"] * len(values)) if d == "auto"]
        sizes.append(batch_size(auto or values))
    return sizes


def _envs(flat: list[Any], names: list[str], micro_batches: int, mutated: Sequence[str],
          dims: Sequence[SplitDim] | None = None) -> list[dict[str, Any]]:
    """Each micro-batch's inputs by name; inputs the graph writes into get their own storage
    (views of one batch share a version counter, so a write in one would break another's backward)."""
    envs = [dict(zip(names, c)) for c in scatter(flat, micro_batches, dims)]
    if micro_batches > 1:
        for env in envs:
            for name in mutated:
                if isinstance(env.get(name), torch.Tensor):
                    env[name] = env[name].clone()
    return envs


def _written(flat: list[Any], names: list[str], mutated: Sequence[str]) -> dict[str, torch.Tensor]:
    if not mutated:
        return {}
    return {n: v for n, v in zip(names, flat) if n in mutated and isinstance(v, torch.Tensor)}


def write_back(step: StepInputs) -> None:
    """Copy what the model wrote into its inputs' micro-batches back into the caller's tensors,
    as the plain model writes into them (with one micro-batch the model wrote in place already)."""
    if len(step.envs) < 2:
        return
    with torch.no_grad():
        for name, original in step.written.items():
            parts = [env[name] for env in step.envs]
            if all(isinstance(p, torch.Tensor) for p in parts) and parts[0].dim() > 0:
                original.copy_(torch.cat(parts).to(original.device))


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
) -> StepInputs:
    """Micro-batches of inputs and targets; each micro-batch's loss weighted so gradients equal
    `loss_fn(model(inputs), targets).backward()` on the whole batch ("mean": by its share of
    the batch, for losses that average over samples; "sum": not at all)."""
    if loss_reduction not in ("mean", "sum"):
        raise ValueError(f"loss_reduction must be 'mean' or 'sum', got {loss_reduction!r}")
    args = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    flat = flatten(args, dict(input_kwargs or {}))
    envs = _envs(flat, input_names, micro_batches, mutated, dims)
    target_chunks = scatter([targets], micro_batches)
    sizes = [batch_size(c[0]) for c in target_chunks]
    weights = [n / sum(sizes) if loss_reduction == "mean" else 1.0 for n in sizes]
    targets_of = [c[0] for c in target_chunks]
    return StepInputs(envs, "train", targets_of, weights, loss_fn, _written(flat, input_names, mutated))


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
