"""The schedule registry: one ScheduleSpec per schedule; a toy registered here plans, runs, simulates and draws.

The toy, "fifo", is GPipe with its backwards in forward order (oldest micro-batch first): valid,
and unlike every built-in. It is defined and registered in this file only; nothing in the package
names it. tests/schedule_registry_worker.py imports `FIFO` from here to run it under torchrun.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Iterator

import pytest
import torch

from partitioner import partition, plan
from partitioner.predict.schedule_sim import check_schedule
from partitioner.predict.simulator import simulate
from rules.actions import Action, peak_in_flight
from rules.schedules import (
    ScheduleSpec,
    auto_layouts,
    in_flight,
    register,
    schedule_names,
    schedule_spec,
    stage_ranks,
    unregister,
    virtual_stages,
)
from runtime.plan import Plan
from runtime.schedule_ranks import rank_schedule
from tests import zoo
from tests.dist_worker import lm_loss
from tests.test_distributed import results, torchrun
from tests.zoo import rel

BUILT_IN = ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")
WORKER = str(Path(__file__).resolve().parent / "schedule_registry_worker.py")


def fifo(micro_batches: int, stages: int, _per_rank: int) -> list[list[Action]]:
    """Per stage: every forward, then every backward in forward order (GPipe drains newest first)."""
    return [[Action(s, "F", i) for i in range(micro_batches)] + [Action(s, "B", i) for i in range(micro_batches)]
            for s in range(stages)]


FIFO = ScheduleSpec("fifo", fifo, in_flight=lambda stage, stages, m, r: -(-m // r), doc="GPipe, oldest backward first")


@pytest.fixture
def toy() -> Iterator[ScheduleSpec]:
    """FIFO registered for one test (other tests list the built-ins alone)."""
    register(FIFO)
    try:
        yield FIFO
    finally:
        unregister(FIFO.name)


def test_built_ins_in_registration_order_and_lookup_errors() -> None:
    assert schedule_names() == BUILT_IN
    assert schedule_spec("zbv").layout == "v" and schedule_spec("interleaved").layout == "loop"
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'; use 'gpipe', '1f1b', 'interleaved', 'zb1', "
                                         "'zbv' or 'dualpipev'"):
        schedule_spec("zigzag")
    with pytest.raises(ValueError, match="'gpipe' is registered already"):
        register(ScheduleSpec("gpipe", fifo))
    with pytest.raises(ValueError, match="one replica per stage on its own layout"):
        ScheduleSpec("bad", fifo, "v")
    with pytest.raises(ValueError, match="other than 'auto'"):
        ScheduleSpec("auto", fifo)


def test_closed_forms_equal_the_counted_lists() -> None:
    """Each built-in's in-flight closed form is what its lists hold (replicas: each runs its own share)."""
    for name in ("gpipe", "1f1b", "zb1"):
        for p in (1, 2, 4):
            for m in (1, 3, 8):
                for r in (1, 2):
                    if m < r:
                        continue
                    layout = [[s * r + j for j in range(r)] for s in range(p)]
                    lists = rank_schedule(name, m, layout, [[s - 1] if s else [] for s in range(p)])
                    counted = peak_in_flight(([(a.stage, a.kind, _split(lists, a)) for a in li] for li in lists), p)
                    assert counted == [in_flight(name, s, p, m, r) for s in range(p)], (name, p, m, r)
    with pytest.raises(ValueError, match="no closed form"):
        in_flight("zbv", 0, 4, 4)


def _split(lists: list[list[Action]], a: Action) -> bool:
    return Action(a.stage, "W", a.microbatch) in {b for li in lists for b in li}


@pytest.mark.parametrize("name", BUILT_IN)
def test_every_built_in_spec_says_what_its_lists_do(name: str) -> None:
    spec = schedule_spec(name)
    p, m = 2, 4
    ranks = stage_ranks(name, p, None, 2)
    lists = rank_schedule(name, m, ranks, [[s - 1] if s else [] for s in range(len(ranks))])
    assert any(a.kind == "W" for li in lists for a in li) == spec.splits_backward
    check_schedule(lists, len(ranks), m)  # complete and deadlock-free
    assert virtual_stages(name, ranks) == (1 if spec.layout == "chain" else 2)
    assert name in auto_layouts([[0], [1]], m)


def test_toy_plans_simulates_and_draws(toy: ScheduleSpec, tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.mlp()
    made = plan(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="fifo")
    assert made.schedule == "fifo" and made.virtual_stages == 1 and "fifo" not in auto_layouts([[0], [1]], 4)
    computes = [[str(op) .split(" t")[0] for op in prog.ops if op.kind in ("F", "B")] for prog in made.programs]
    assert computes[1] == [f"{k} s1 mb{i}" for k in "FB" for i in range(4)]  # backwards oldest first
    again = Plan.from_json(made.to_json())  # a saved plan naming a registered schedule loads
    assert again.schedule == "fifo" and [p.ops for p in again.programs] == [p.ops for p in made.programs]
    timeline = simulate(made)
    assert timeline.makespan_ms > 0 and timeline.peak_in_flight == [4, 4]
    page = made.visualize(tmp_path / "fifo.html")
    assert page.exists() and "fifo" in page.read_text()


def test_toy_trains_like_the_plain_model_in_one_process(toy: ScheduleSpec) -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    x = torch.cat([x, x[:1]])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        y = torch.randint(0, model(x).shape[-1], x.shape)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="fifo")
    assert pipe.plan.schedule == "fifo"
    loss = pipe.train_step(x, y, lm_loss)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    assert rel(loss, ref_loss.detach()) < 1e-5
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and q.grad is not None and rel(p.grad, q.grad) < 1e-5, n
    assert math.isfinite(pipe.plan.predicted_step_ms)


def test_toy_trains_like_the_plain_model_under_torchrun() -> None:
    run = torchrun(2, worker=WORKER)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2, run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
