"""One process runs every schedule: train_step under GPipe, 1F1B and interleaved equals the plain model."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree

from cost_model.analytic import AnalyticCostModel
from partitioner import PartitionError, partition
from tests import zoo
from tests.zoo import rel


def leaves(out: Any) -> list[torch.Tensor]:
    return [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]


def loss_fn(out: Any, targets: list[torch.Tensor]) -> torch.Tensor:
    """Mean over samples of a squared error on every floating output (so micro-batch weighting applies)."""
    return sum(((a - t) ** 2).flatten(1).sum(1).mean() if a.dim() > 1 else ((a - t) ** 2).mean()
               for a, t in zip(leaves(out), targets))  # type: ignore[return-value]



CASES = [
    ("mlp", "gpipe", 3), ("mlp", "1f1b", 3), ("mlp", "interleaved", 2),
    ("tiny_gpt", "gpipe", 3), ("tiny_gpt", "1f1b", 4), ("tiny_gpt", "interleaved", 2),
    ("keyword_dict", "1f1b", 2), ("keyword_dict", "interleaved", 2), ("inception", "1f1b", 3),
]


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("name,schedule,devices", CASES)
def test_train_step_equals_plain_model(name: str, schedule: str, devices: int, threads: bool) -> None:
    torch.manual_seed(0)
    model, args, kwargs = zoo.ZOO[name]()
    x = args[0]
    args = (torch.cat([x, x[:1]]),) + args[1:]  # batch 7 -> 8 samples: with 3 micro-batches, uneven
    kwargs = {k: torch.cat([v, v[:1]]) for k, v in kwargs.items()}
    reference = copy.deepcopy(model)
    with torch.no_grad():
        targets = [torch.randn_like(a) for a in leaves(reference(*args, **kwargs))]
    pipe = partition(model, ["cpu"] * devices, example_inputs=args, example_kwargs=kwargs,
                     micro_batches=4 if schedule == "interleaved" else 3,
                     schedule=schedule, threads=threads, cost_model=AnalyticCostModel())  # type: ignore[arg-type]
    assert pipe.plan.schedule == schedule
    loss = pipe.train_step(args, targets, loss_fn, input_kwargs=kwargs)
    ref_loss = loss_fn(reference(*args, **kwargs), targets)
    ref_loss.backward()
    assert rel(loss, ref_loss.detach()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, n
        assert rel(p.grad, q.grad) < 1e-5, n  # type: ignore[arg-type]
    with torch.no_grad():  # the forward-only programs of the same plan
        for a, b in zip(leaves(pipe(*args, **kwargs)), leaves(reference(*args, **kwargs))):
            assert rel(a, b) < 1e-5


def test_train_step_reuses_the_pipeline_across_steps_and_batch_sizes() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.mlp()
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=2, schedule="1f1b",
                     cost_model=AnalyticCostModel())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for batch in (x, torch.randn(5, x.shape[1]), x):
        y = [torch.randn(batch.shape[0], 10)]
        opt.zero_grad()
        ref_opt.zero_grad()
        pipe.train_step(batch, y, loss_fn)
        loss_fn(reference(batch), y).backward()
        opt.step()
        ref_opt.step()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.detach(), q.detach()) < 1e-5


def test_one_f_one_b_holds_at_most_the_pipeline_depth_in_flight() -> None:
    model, (x,), _ = zoo.mlp()
    pipe = partition(model, ["cpu"] * 3, example_inputs=(torch.cat([x, x]),), micro_batches=8, schedule="1f1b",
                     cost_model=AnalyticCostModel())
    live = {0: 0, 1: 0, 2: 0}
    peak = dict(live)
    for op in pipe.plan.programs[0].ops + pipe.plan.programs[1].ops + pipe.plan.programs[2].ops:
        if op.kind in ("F", "B"):
            live[op.stage] += 1 if op.kind == "F" else -1
            peak[op.stage] = max(peak[op.stage], live[op.stage])
    assert peak == {0: 3, 1: 2, 2: 1}  # stage s: p - s micro-batches, not m = 8


def test_a_failing_worker_fails_the_step_and_the_next_step_runs() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.mlp()
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=3, schedule="1f1b", threads=True,
                     cost_model=AnalyticCostModel())
    y = [torch.randn(x.shape[0], 10)]

    def broken(out: Any, targets: Any) -> torch.Tensor:
        raise ValueError("loss exploded")

    with pytest.raises(ValueError, match="loss exploded"):
        pipe.train_step(x, y, broken)
    model.zero_grad()
    pipe.train_step(x, y, loss_fn)
    loss_fn(reference(x), y).backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5  # type: ignore[arg-type]


def test_replicas_in_one_process_name_torchrun() -> None:
    model, (x,), _ = zoo.mlp()
    with pytest.raises(PartitionError, match="torchrun"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2, replicas=[1, 1])


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("schedule", ["zb1", "zbv"])
def test_zero_bubble_train_step_equals_plain_model_at_1f1b_memory(schedule: str, threads: bool) -> None:
    import dataclasses

    from partitioner.predict.program_run import in_flight
    from runtime.program import plan_programs

    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()  # tied embedding and LM head: one weight in the first and the last stage
    x = torch.cat([x, x[:1]])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        y = [torch.randn_like(a) for a in leaves(reference(x))]
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule=schedule,
                     threads=threads, cost_model=AnalyticCostModel())  # type: ignore[arg-type]
    stages = 2 if schedule == "zb1" else 4  # zbv: stages 0, 3 on rank 0 and 1, 2 on rank 1
    assert [s.ranks for s in pipe.plan.stages] == ([[0], [1]] if schedule == "zb1" else [[0], [1], [1], [0]])
    pipe.tracing = True
    loss = pipe.train_step(x, y, loss_fn)
    loss_fn(reference(x), y).backward()
    assert rel(loss, loss_fn(reference(x), y).detach()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < 1e-5, n  # type: ignore[arg-type]
    # every backward ran split: a B and a W per stage and micro-batch
    kinds = [e["kind"] for e in pipe.trace]
    assert kinds.count("backward") == kinds.count("weight") == stages * 4
    if schedule == "zb1":  # activations live F to W: never more micro-batches than 1F1B's peak
        one_f_one_b = plan_programs(dataclasses.replace(pipe.plan, schedule="1f1b", programs=[]))
        assert max(in_flight(pipe.plan.programs, stages)) <= max(in_flight(one_f_one_b, stages)) == 2
