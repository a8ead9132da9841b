"""The one-thread order (runtime.inline) against a literal table and against op-by-op execution; the per-step
shortcuts of the one-process runtime (gradients added back, stage state restored) keep their meaning."""

from __future__ import annotations

import copy
from typing import Any, Sequence, cast

import pytest
import torch
from torch import nn

from partitioner import partition
from rules.schedules import schedule_names, schedule_spec
from runtime.inline import InlineOrders, run_inline, tick_order
from runtime.interpreter import Interpreter
from runtime.ops import Op
from runtime.plan import Plan, StagePlan
from runtime.program import plan_programs
from runtime.stage import switches_state
from runtime.steps import transaction


def chain_plan(stages: int, micro_batches: int, schedule: str) -> Plan:
    return Plan([StagePlan(s, "cpu", [f"n{s}"], ranks=[s], reads_from=[s - 1] if s else []) for s in range(stages)],
                micro_batches=micro_batches, schedule=schedule)


class Recorder:
    """A worker that records what it is asked to do; `execute` and `flush_batch` are the interpreter's own."""

    def __init__(self, rank: int, log: list[tuple[int, str]]) -> None:
        self.rank, self.log, self.tracing = rank, log, True
        self._batch: list[Op] = []

    def execute(self, op: Op) -> None:
        Interpreter.execute(cast(Interpreter, self), op)

    def flush_batch(self) -> None:
        Interpreter.flush_batch(cast(Interpreter, self))

    def compute(self, op: Op) -> None:
        self.log.append((self.rank, str(op)))

    def post(self, batch: Sequence[Op]) -> None:
        self.log.append((self.rank, " + ".join(map(str, batch))))


def test_gpipe_two_ranks_literal() -> None:
    order = tick_order(plan_programs(chain_plan(2, 2, "gpipe")))
    assert [(rank, item if isinstance(item, tuple) else (item,)) for rank, item in order] == [
        (rank, tuple(Op.parse(t) for t in texts)) for rank, texts in [
            (0, ["F s0 mb0 t0"]), (0, ["SEND s0->s1 mb0 r1 t0"]), (1, ["RECV s0->s1 mb0 r0 t0"]),
            (0, ["F s0 mb1 t1"]), (1, ["F s1 mb0 t1"]), (0, ["SEND s0->s1 mb1 r1 t1"]), (1, ["RECV s0->s1 mb1 r0 t1"]),
            (1, ["F s1 mb1 t2"]),
            (1, ["B s1 mb1 t3"]), (0, ["RECV s1->s0 mb1 r1 t3"]), (1, ["SEND s1->s0 mb1 r0 t3"]),
            (0, ["B s0 mb1 t4"]), (1, ["B s1 mb0 t4"]), (0, ["RECV s1->s0 mb0 r1 t4"]), (1, ["SEND s1->s0 mb0 r0 t4"]),
            (0, ["B s0 mb0 t5"]),
        ]
    ]


@pytest.mark.parametrize("schedule", [n for n in schedule_names() if schedule_spec(n).layout == "chain"])
@pytest.mark.parametrize("stages,micro_batches", [(2, 1), (3, 4), (4, 8)])
def test_the_order_is_what_executing_op_by_op_does(schedule: str, stages: int, micro_batches: int) -> None:
    """The order worked out once equals the one the runtime followed before: each tick's ops through
    `execute`, then every worker's pending batch."""
    programs = plan_programs(chain_plan(stages, micro_batches, schedule))
    expected: list[tuple[int, str]] = []
    workers = [Recorder(p.rank, expected) for p in programs]
    by_tick: dict[int, list[tuple[int, Op]]] = {}
    for p in programs:
        for op in p.ops:
            if op.kind != "STEP":
                by_tick.setdefault(op.tick, []).append((p.rank, op))
    for t in sorted(by_tick):
        for rank, op in by_tick[t]:
            workers[rank].execute(op)
        for w in workers:
            w.flush_batch()
    got: list[tuple[int, str]] = []
    orders = InlineOrders()
    run_inline(orders.of(programs), [Recorder(p.rank, got) for p in programs])
    assert got == expected
    assert orders.of(programs) is orders.of(programs)  # worked out once


def test_receives_are_posted_only_while_tracing() -> None:
    programs = plan_programs(chain_plan(2, 1, "gpipe"))
    log: list[tuple[int, str]] = []
    workers = [Recorder(p.rank, log) for p in programs]
    for w in workers:
        w.tracing = False
    run_inline(InlineOrders().of(programs), workers)
    assert not any(text.startswith("RECV") for _, text in log)
    assert sum(text.startswith("SEND") for _, text in log) == 2


def test_gradients_set_aside_are_added_back_into_the_same_tensors() -> None:
    dense = nn.Linear(3, 2)
    sparse = nn.Embedding(5, 2, sparse=True)
    params = [*dense.parameters(), *sparse.parameters()]
    x = torch.randn(4, 3)
    (dense(x).sum() + sparse(torch.tensor([1, 2])).sum()).backward()
    before = [p.grad for p in params]
    values = [g.to_dense().clone() for g in before if g is not None]
    with transaction(params, [], grads=True):
        (dense(x).sum() + sparse(torch.tensor([1, 2])).sum()).backward()
    assert all(p.grad is g for p, g in zip(params, before))  # as autograd accumulates: into the tensor there
    assert all(torch.equal(p.grad.to_dense(), 2 * v) for p, v in zip(params, values))  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="boom"), transaction(params, [], grads=True):
        dense(x).sum().backward()
        raise RuntimeError("boom")
    assert all(p.grad is g for p, g in zip(params, before))
    assert all(torch.equal(p.grad.to_dense(), 2 * v) for p, v in zip(params, values))  # type: ignore[union-attr]


class NoGradRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.no_grad():
            h = self.b(h)
        return self.c(h)


def test_only_stages_that_switch_grad_mode_restore_it() -> None:
    x = torch.randn(2, 4)
    plain = partition(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), ["cpu", "cpu"], example_inputs=(x,))
    assert not any(switches_state(s.module) for s in plain.stages)
    model = NoGradRegion()
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,))
    assert any(switches_state(s.module) for s in pipe.stages)
    assert torch.allclose(pipe(x), reference(x))
    assert torch.is_grad_enabled()


def test_threads_run_the_last_program_in_the_callers_thread() -> None:
    """A threaded step hands all programs but one to the workers' threads; results stay exact."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    pipe: Any = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=3, threads=True)
    for _ in range(2):
        pipe(x).square().sum().backward()
        reference(x).square().sum().backward()
    assert len(pipe._pools) == len(pipe.plan.programs) - 1
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)  # type: ignore[arg-type]


def test_a_step_keeps_no_activations_and_a_traced_step_records_its_messages() -> None:
    """Stages on one device hand values over directly, and let go of them when the step ends; a traced
    step sends them through the mailbox, so its trace has the sends and receives calibration reads."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    pipe: Any = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=2)
    pipe(x).square().sum().backward()
    assert all(not w.envs and not w.local for w in pipe._workers)
    pipe.tracing = True
    pipe(x).square().sum().backward()
    assert {"send", "recv"} <= {e["kind"] for e in pipe.trace}
    for _ in range(2):
        reference(x).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)  # type: ignore[arg-type]


class _Skips(nn.Module):
    """A stage reads from two earlier ones (a skip), and the model returns a tuple with a value of the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.a(x))
        g = torch.tanh(self.b(h)) + h
        return self.c(g), h.sum(dim=1)


def test_the_short_way_and_the_traced_way_give_the_plain_models_results_in_turn() -> None:
    """pipe(x) in one thread takes a short path (values through the shared dict, worked out per set of shared
    pairs); turning the trace on and off between calls switches paths, and every call equals the plain model."""
    torch.manual_seed(0)
    model = _Skips()
    x = torch.randn(6, 4)
    pipe: Any = partition(model, ["cpu"] * 3, example_inputs=(x,))
    for tracing in (False, True, False, True, False):
        pipe.tracing = tracing
        pipe.clear_trace()
        for grad in (True, False):
            with torch.set_grad_enabled(grad):
                got, want = pipe(x), model(x)
            assert isinstance(got, tuple) and len(got) == 2
            for g, w in zip(got, want):
                assert torch.equal(g, w) and g.requires_grad == w.requires_grad
        assert bool(pipe.trace) == tracing
        model.zero_grad()
        pipe(x)[0].sum().backward()
        grads = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]
        model.zero_grad()
        model(x)[0].sum().backward()
        assert all(p.grad is not None and torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
