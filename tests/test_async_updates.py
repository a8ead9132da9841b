"""Asynchronous updates (PipeDream-2BW, PipeDream weight stashing) against direct implementations of their rules.

The references below train an un-partitioned copy of the model sequentially, step by step,
with the rule written out: 2BW's W(t+1) = W(t) - lr * grad f(W(t-1)), and PipeDream's stashing,
where micro-batch k's forward on stage s of p reads the weights after the updates of the
max(0, k - (p - s) + 1) backwards that 1F1B runs before it on that stage.
"""

from __future__ import annotations

import copy
from typing import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import pipe_split

from partitioner import PartitionError, partition
from runtime.flushless import Stream
from tests.zoo import rel

M, P, K, BATCH = 4, 2, 5, 8  # micro-batches per step, stages, steps, samples per step
Opt = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Opt] = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
}


class Tiny(nn.Module):
    """Four Linear layers with Tanh, cut after the second (stage 0: l1, l2; stage 1: l3, l4) and, for
    three stages, after the third too (stage 1: l3; stage 2: l4)."""

    def __init__(self, stages: int = P) -> None:
        super().__init__()
        self.stages = stages
        self.l1, self.l2, self.l3, self.l4 = nn.Linear(6, 12), nn.Linear(12, 12), nn.Linear(12, 12), nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.l2(torch.tanh(self.l1(x))))
        pipe_split()
        h = torch.tanh(self.l3(h))
        if self.stages == 3:
            pipe_split()
        return self.l4(h)


STAGE_OF = {2: {"l1": 0, "l2": 0, "l3": 1, "l4": 1}, 3: {"l1": 0, "l2": 0, "l3": 1, "l4": 2}}


def data(steps: int = K) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)) for _ in range(steps)]


Made = tuple[nn.Module, nn.Module, torch.optim.Optimizer, torch.optim.Optimizer, nn.Module]


def models(update: str, opt: str, p: int = P) -> Made:
    torch.manual_seed(0)
    model = Tiny(p)
    ref = copy.deepcopy(model)
    x = data(1)[0][0]
    pipe = partition(model, ["cpu"] * p, example_inputs=(x,), micro_batches=M, schedule="1f1b", update=update)
    return model, ref, OPTIMIZERS[opt](list(model.parameters())), OPTIMIZERS[opt](list(ref.parameters())), pipe


def stage_params(model: nn.Module, s: int) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if STAGE_OF[model.stages][n.split(".")[0]] == s}


def step_stage(model: nn.Module, opt: torch.optim.Optimizer, s: int, grads: dict[str, torch.Tensor]) -> None:
    """One optimizer step of stage s's weights only (the other stages' hold no gradient)."""
    for n, p in stage_params(model, s).items():
        p.grad = grads[n].clone()
    opt.step()
    opt.zero_grad(set_to_none=True)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def grads_at(model: nn.Module, weights: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    leaves = {n: w.clone().requires_grad_(True) for n, w in weights.items()}
    loss = F.mse_loss(torch.func.functional_call(model, leaves, (x,)), y)
    return loss.detach(), dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))


def reference_2bw(ref: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
                  ) -> list[torch.Tensor]:
    """V_0 = V_1 = W; V_t+1 = V_t - step(grad f_t-1(V_t-1)); after the last batch, the two pending updates."""
    losses, grads, p = [], [], ref.stages
    for t, (x, y) in enumerate(batches):
        if t >= 2:
            for s in range(p):
                step_stage(ref, opt, s, grads[t - 2])
        loss, g = grads_at(ref, snapshot(ref), x, y)
        losses.append(loss)
        grads.append(g)
    for g in grads[max(0, len(grads) - 2):]:  # flush: the updates still pending
        for s in range(p):
            step_stage(ref, opt, s, g)
    return losses


def reference_stash(ref: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
                    ) -> list[torch.Tensor]:
    """PipeDream: every micro-batch's backward updates each stage with the gradient at the weights its forward
    read; on stage s, micro-batch k's forward reads the version after max(0, k - (p - s) + 1) updates."""
    p = ref.stages
    versions = [[{n: w.detach().clone() for n, w in stage_params(ref, s).items()}] for s in range(p)]
    losses = []
    for x, y in batches:
        total = torch.zeros(())
        for xs, ys in zip(x.chunk(M), y.chunk(M)):
            k = len(versions[0]) - 1  # micro-batches done so far
            weights = {n: w for s in range(p) for n, w in versions[s][max(0, k - (p - s) + 1)].items()}
            loss, g = grads_at(ref, weights, xs, ys)
            total += loss * len(xs) / len(x)
            for s in range(p):
                step_stage(ref, opt, s, g)
                versions[s].append({n: w.detach().clone() for n, w in stage_params(ref, s).items()})
        losses.append(total)
    return losses


def run_pipe(pipe: nn.Module, opt: torch.optim.Optimizer, batches: list[tuple[torch.Tensor, torch.Tensor]]
             ) -> list[torch.Tensor]:
    """Train K steps; call t returns batch t-1's loss, flush the last one's."""
    returned = [pipe.train_step(x, y, F.mse_loss, optimizer=opt) for x, y in batches]
    assert returned[0] is None
    last = pipe.flush()
    assert pipe.flush() is None  # nothing left in flight
    return [*returned[1:], last]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("update", "opt", "p"), [
    ("2bw", "sgd", 2), ("2bw", "adam", 2), ("stash", "sgd", 2), ("stash", "adam", 2), ("2bw", "adam", 3),
    ("stash", "sgd", 3),
])
def test_matches_direct_rule(update: str, opt: str, p: int) -> None:
    """Three stages: the middle stage takes in one call gradients sent at the end of the call before."""
    model, ref, opt_pipe, opt_ref, pipe = models(update, opt, p)
    batches = data()
    losses = run_pipe(pipe, opt_pipe, batches)
    expected = (reference_2bw if update == "2bw" else reference_stash)(ref, opt_ref, batches)
    for t, (got, want) in enumerate(zip(losses, expected)):
        assert rel(got, want) < 1e-5, (t, float(got), float(want))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert rel(p, q) < 1e-5, name
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.timeout(120)
def test_differs_from_sync_and_threads_agree() -> None:
    """The async rules are not sync training in disguise; one thread and a thread per stage agree."""
    batches = data(3)
    finals = {}
    for update, threads in (("sync", False), ("2bw", False), ("2bw", True)):
        torch.manual_seed(0)
        model = Tiny()
        pipe = partition(model, ["cpu", "cpu"], example_inputs=(batches[0][0],), micro_batches=M, schedule="1f1b",
                         update=update, threads=threads)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in batches:
            if update == "sync":
                pipe.train_step(x, y, F.mse_loss)
                opt.step()
                opt.zero_grad()
            else:
                pipe.train_step(x, y, F.mse_loss, optimizer=opt)
        pipe.flush()
        finals[(update, threads)] = torch.cat([p.detach().flatten() for p in model.parameters()])
    assert rel(finals[("2bw", True)], finals[("2bw", False)]) < 1e-6
    assert rel(finals[("2bw", False)], finals[("sync", False)]) > 1e-4


@pytest.mark.timeout(120)
def test_in_flight_guards_and_errors() -> None:
    model, _, opt, _, pipe = models("2bw", "sgd")
    (x, y), (x2, y2) = data(2)
    with pytest.raises(PartitionError, match="optimizer=opt"):
        pipe.train_step(x, y, F.mse_loss)
    pipe.train_step(x, y, F.mse_loss, optimizer=opt)
    for call in (lambda: pipe(x), pipe.state_dict, pipe.eval, lambda: pipe.load_state_dict(model.state_dict())):
        with pytest.raises(PartitionError, match=r"pipe\.flush\(\)"):
            call()
    with pytest.raises(PartitionError, match="another optimizer"):
        pipe.train_step(x2, y2, F.mse_loss, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    pipe.flush()
    assert pipe(x).shape == (BATCH, 3)  # after the flush everything works again
    pipe.eval()
    pipe.train()
    sync = partition(Tiny(), ["cpu", "cpu"], example_inputs=(x,), micro_batches=M, schedule="1f1b")
    with pytest.raises(PartitionError, match="update='2bw' or 'stash'"):
        sync.train_step(x, y, F.mse_loss, optimizer=opt)
    with pytest.raises(PartitionError, match="schedule='1f1b'"):
        partition(Tiny(), ["cpu", "cpu"], example_inputs=(x,), micro_batches=M, schedule="gpipe", update="2bw")
    with pytest.raises(PartitionError, match="update="):
        partition(Tiny(), ["cpu", "cpu"], example_inputs=(x,), micro_batches=M, update="async")  # type: ignore[arg-type]


def test_stream_cuts_calls() -> None:
    """Literal calls of m=2 over 2 stages; later calls are shifts; m < p - 1 is refused with the fix."""
    stream = Stream(2, [0, 1], [[], [0]], ["cpu", "cpu"])

    def compute(segment: list[list]) -> list[str]:
        return [" ".join(f"{op.kind}{op.microbatch}" for op in ops if op.is_compute) for ops in segment]

    assert compute(stream.step(0)) == ["F0 F1 B0", "F0 B0 F1"]
    assert compute(stream.step(1)) == ["F2 B1 F3 B2", "B1 F2 B2 F3"]
    assert compute(stream.step(4)) == ["F8 B7 F9 B8", "B7 F8 B8 F9"]
    assert compute(stream.drain(4)) == ["B9", "B9"]
    for t in range(6):  # every message is sent and received in the same call
        sends = {(op.key(), op.tick) for ops in stream.step(t) for op in ops if op.kind == "SEND"}
        recvs = {(op.key(), op.tick) for ops in stream.step(t) for op in ops if op.kind == "RECV"}
        assert sends == recvs
    with pytest.raises(ValueError, match="micro_batches >= 2"):
        Stream(1, [0, 1, 2], [[], [0], [1]], ["cpu"] * 3)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [2, 3])
def test_torchrun_equals_direct_rule(ranks: int) -> None:
    """Under torchrun (NCCL's rules imposed on gloo) 2bw and stash equal the rules the one-process runs match;
    with 3 ranks a message received at the end of one call is taken in the next."""
    from pathlib import Path

    from tests.test_distributed import results, torchrun

    run = torchrun(ranks, timeout=240, worker=str(Path(__file__).resolve().parent / "async_worker.py"))
    out, lines = run.stdout, results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 * ranks, out[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)


@pytest.mark.timeout(120)
def test_plan_carries_and_prices_update() -> None:
    """The plan holds `update` through JSON; the planner prices the stream without flush and the versions' memory."""
    from partitioner import plan as make_plan
    from runtime.plan import Plan

    x = data(1)[0][0]
    plans = {u: make_plan(Tiny(), ["cpu", "cpu"], example_inputs=(x,), micro_batches=M, schedule="1f1b", update=u)
             for u in ("sync", "2bw", "stash")}  # type: ignore[arg-type]
    assert Plan.from_json(plans["2bw"].to_json()).update == "2bw"
    sync = plans["sync"]
    f = [s.forward_ms + s.backward_ms for s in sync.stages]
    for u in ("2bw", "stash"):
        # no flush: a batch costs about the bottleneck stage's m micro-batches, well under fill + drain
        assert plans[u].predicted_step_ms < sync.predicted_step_ms
        assert plans[u].predicted_step_ms >= M * max(f) * 0.99
    extra = [a.memory_bytes - b.memory_bytes for a, b in zip(plans["2bw"].stages, sync.stages)]
    assert extra == [3 * s.param_bytes for s in sync.stages]
    extra = [a.memory_bytes - b.memory_bytes for a, b in zip(plans["stash"].stages, sync.stages)]
    assert extra == [(P - s.index) * s.param_bytes for s in sync.stages]
    bad = Plan.from_json(sync.to_json())
    bad.update, bad.schedule = "2bw", "gpipe"
    with pytest.raises(ValueError, match="schedule='1f1b'"):
        bad.check()
