"""Bounded staleness: the rule on fake all-reduces, argument errors, torchrun against a direct implementation."""

from __future__ import annotations

import datetime
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from partitioner import PartitionError, partition
from runtime.staleness import Reduction, StaleReductions, check_staleness
from tests import zoo
from tests.test_distributed import results, torchrun as distributed_torchrun

WORKER = str(Path(__file__).resolve().parent / "staleness_worker.py")


def torchrun(ranks: int, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """The worker on `ranks` gloo processes under NCCL's rules (runtime.nccl_rules); a hang fails the test."""
    return distributed_torchrun(ranks, *args, timeout=timeout, worker=WORKER)


class FakeWork:
    """A finished all-reduce that counts how often it is waited for."""

    def __init__(self) -> None:
        self.waits = 0

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        self.waits += 1
        return True


def test_each_step_gets_the_sum_of_step_t_minus_s_and_none_in_warm_up() -> None:
    p = nn.Parameter(torch.zeros(3))
    for s in (0, 1, 2):
        queue, works = StaleReductions(s), []
        for t in range(5):
            works.append(FakeWork())
            queue.step([Reduction(works[-1], torch.full((3,), float(t)), [p])], [p], lambda w: w.wait())
            if t < s:
                assert p.grad is None, (s, t)
            else:
                assert torch.equal(p.grad, torch.full((3,), float(t - s))), (s, t)  # type: ignore[arg-type]
            assert queue.in_flight == min(t + 1, s)
        assert [w.waits for w in works] == [1] * (5 - s) + [0] * s  # the last s are still in flight
        queue.drain(lambda w: w.wait())
        queue.drain(lambda w: w.wait())
        assert [w.waits for w in works] == [1] * 5  # drain waits once for each, and keeps them queued
        assert queue.in_flight == s
        queue.reset(lambda w: w.wait())
        assert queue.in_flight == 0 and [w.waits for w in works] == [1] * 5


def test_buckets_of_several_weights_land_in_each_weight() -> None:
    a, b = nn.Parameter(torch.zeros(2, 2)), nn.Parameter(torch.zeros(3))
    queue = StaleReductions(1)
    queue.step([Reduction(FakeWork(), torch.arange(7.0), [a, b])], [a, b], lambda w: None)
    assert a.grad is None and b.grad is None
    queue.step([Reduction(FakeWork(), torch.zeros(7), [a, b])], [a, b], lambda w: None)
    assert torch.equal(a.grad, torch.arange(4.0).view(2, 2)) and torch.equal(b.grad, torch.tensor([4.0, 5, 6]))  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "1"])
def test_bad_staleness_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="use an integer >= 0"):
        check_staleness(bad)
    model, args, _ = zoo.mlp()
    with pytest.raises(PartitionError, match="use an integer >= 0"):
        partition(model, ["cpu", "cpu"], example_inputs=args, staleness=bad)


def test_staleness_in_one_process_names_torchrun() -> None:
    model, args, _ = zoo.mlp()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(PartitionError, match="staleness=1 .* launch with torchrun"):
        partition(model, ["cpu", "cpu"], example_inputs=args, staleness=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert partition(model, ["cpu", "cpu"], example_inputs=args, staleness=0).plan.schedule == "gpipe"


def test_staleness_with_asynchronous_pipeline_updates_is_refused() -> None:
    model, args, _ = zoo.mlp()
    with pytest.raises(PartitionError, match="staleness=2 .* update='2bw' runs every weight on one rank"):
        partition(model, ["cpu", "cpu"], example_inputs=args, micro_batches=2, schedule="1f1b", update="2bw",
                  staleness=2)


@pytest.mark.timeout(600)
def test_three_ranks_two_replicas_equal_the_rule_on_the_plain_model() -> None:
    # under NCCL's rules (tests.test_distributed.torchrun): the background all-reduces keep one order per group
    run = torchrun(3, "0", "1", "2", timeout=540)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 9, run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
