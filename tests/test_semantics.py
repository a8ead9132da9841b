"""Eager semantics: what the plain model does when called, the pipeline does (issue: eager semantics).

Every case runs at 2 and 3 stages, threads on and off, GPipe and 1F1B (train_step) and the
plain call (`pipe(x)` + backward), and is compared with the un-partitioned model: outputs,
gradients, buffers, and the caller's tensors.
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from partitioner import partition
from tests import zoo
from tests.zoo import rel

SETTINGS = [(stages, threads) for stages in (2, 3) for threads in (False, True)]


def build(model: nn.Module, x: torch.Tensor, stages: int, threads: bool, schedule: str = "gpipe", m: int = 4) -> Any:
    return partition(model, ["cpu"] * stages, example_inputs=(x,), micro_batches=m, schedule=schedule, threads=threads,  # type: ignore[arg-type]
                     cost_model=AnalyticCostModel())


def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel(p.grad, q.grad) < 1e-5, name  # type: ignore[arg-type]


class MutatesInput(nn.Module):
    """Writes into its input: micro-batch views of one batch must not break each other's backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)  # the caller's tensor: the plain model writes into it too
        h = torch.tanh(self.a(x))  # saves x (at its new version) for backward
        h = torch.tanh(self.b(h))
        return self.c(h) + x  # a later stage reads the written x


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_model_writing_into_its_input(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = MutatesInput()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = build(model, x.clone(), stages, threads, schedule)
    mine, theirs = x.clone(), x.clone()
    out = pipe(mine)
    ref = reference(theirs)
    assert rel(out, ref) < 1e-5 and torch.equal(mine, theirs)  # the same write into the caller's tensor
    out.square().mean().backward()
    ref.square().mean().backward()
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    y = torch.randn(8, 8)
    mine, theirs = x.clone(), x.clone()
    loss = pipe.train_step(mine, y, F.mse_loss)
    ref_loss = F.mse_loss(reference(theirs), y)
    ref_loss.backward()
    assert loss is not None and rel(loss, ref_loss) < 1e-5 and torch.equal(mine, theirs)
    assert_same_grads(model, reference)


@pytest.mark.parametrize("stages,threads", [(stages, threads) for stages in (2, 3, 4) for threads in (False, True)])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_in_place_result_unused_is_ordered_before_later_readers(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = zoo.InPlace()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = build(model, x, stages, threads, schedule)
    for _ in range(3):  # threads: a race would show on some run
        out = pipe(x)
        ref = reference(x)
        assert rel(out, ref) < 1e-5
    model.zero_grad()
    reference.zero_grad()
    out.sum().backward()
    ref.sum().backward()
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    y = torch.randn(8, 8)
    assert rel(pipe.train_step(x, y, F.mse_loss), F.mse_loss(reference(x), y)) < 1e-5
    F.mse_loss(reference(x), y).backward()
    assert_same_grads(model, reference)


def test_partition_leaves_the_callers_tensors_and_the_model_untouched(tmp_path: Any, monkeypatch: Any) -> None:
    from cost_model.profiler import ProfiledCostModel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # a cold profile cache, then a warm one
    torch.manual_seed(0)
    for attempt in ("cold", "warm"):
        model = MutatesInput()
        x = torch.randn(8, 8)
        before_x = x.clone()
        before = {k: v.clone() for k, v in model.state_dict().items()}
        pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2, cost_model=ProfiledCostModel())
        assert torch.equal(x, before_x), attempt
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), attempt
        assert all(p.grad is None for p in model.parameters()), attempt
        reference = copy.deepcopy(model)
        mine, theirs = x.clone(), x.clone()  # the README's pattern: the example is the first input
        assert rel(pipe(mine), reference(theirs)) < 1e-5


class BN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.bn(self.a(x))))


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_failed_step_changes_no_state_and_the_next_step_is_exact(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = BN()
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = build(model, x, stages, threads, schedule, m=2)
    pipe.train_step(x, y, F.mse_loss)  # gradients to accumulate into
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}  # type: ignore[union-attr]
    calls = [0]

    def fails_on_the_second_micro_batch(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 2:
            raise RuntimeError("loss failed")
        return F.mse_loss(out, target)

    with pytest.raises(RuntimeError, match="loss failed"):
        pipe.train_step(x, y, fails_on_the_second_micro_batch)
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p.grad, grads[n]) for n, p in model.named_parameters())  # type: ignore[arg-type]
    reference = copy.deepcopy(model)  # now the next step must equal the plain model's, accumulating
    for p, q in zip(model.parameters(), reference.parameters()):
        q.grad = p.grad.clone()  # type: ignore[union-attr]
    pipe.train_step(x, y, F.mse_loss)
    for chunk_x, chunk_y in zip(x.chunk(2), y.chunk(2)):  # BatchNorm normalizes each micro-batch alone
        (F.mse_loss(reference(chunk_x), chunk_y) / 2).backward()
    assert_same_grads(model, reference)
    assert int(model.bn.num_batches_tracked) == 2


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_write_in_a_middle_stage_is_seen_by_a_later_stage(threads: bool, schedule: str) -> None:
    from partitioner import Plan, StagePlan, plan

    torch.manual_seed(0)
    model = zoo.InPlace()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    whole = plan(model, ["cpu"], example_inputs=(x,), cost_model=AnalyticCostModel())
    names = [n for s in whole.stages for n in s.nodes]
    # stage 0 makes h and writes h *= 2; stage 1 writes h += 1; stage 2 reads h (from stage 0 as a skip, unless ordered)
    first = names.index("mul_") + 1
    second = names.index("add_") + 1
    while names[first].startswith("after"):
        first += 1
    while names[second].startswith("after"):
        second += 1
    cuts = [names[:first], names[first:second], names[second:]]
    custom = Plan(stages=[StagePlan(s, "cpu", nodes) for s, nodes in enumerate(cuts)], micro_batches=2,
                  schedule=schedule)  # type: ignore[arg-type]
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), plan=custom, threads=threads)
    loss = pipe.train_step(x, y, F.mse_loss)
    ref_loss = F.mse_loss(reference(x), y)
    ref_loss.backward()
    assert rel(loss, ref_loss) < 1e-5
    assert_same_grads(model, reference)


class ReadBeforeWrite(nn.Module):
    """`r = h * 1` reads h before `h.mul_(2)` writes into it; nothing in the graph orders the two."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        r = h * 1
        h.mul_(2)
        g = torch.tanh(self.layers[1](h))
        out: torch.Tensor = self.layers[2](g) + r
        return out


@pytest.mark.parametrize("threads", [False, True])
def test_a_plan_running_a_read_after_the_write_forward_runs_after_it_is_refused(threads: bool) -> None:
    from partitioner import PartitionError, Plan, StagePlan, plan

    torch.manual_seed(0)
    model = ReadBeforeWrite()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    names = [n for s in plan(model, ["cpu"], example_inputs=(x,), cost_model=AnalyticCostModel()).stages
             for n in s.nodes]
    assert names[:3] == ["layers_0", "mul", "mul_"]
    moved = ["layers_0", "mul_", "mul", *names[3:]]  # `mul` listed after the write: it would read 2h
    for cuts in ([moved], [moved[:2], moved[2:]]):  # the write's stage sends its h, or runs the read after it
        bad = Plan([StagePlan(s, "cpu", nodes) for s, nodes in enumerate(cuts)], micro_batches=2)
        with pytest.raises(PartitionError, match=r"mul \(stage \d\) reads layers_0 before mul_ \(stage 0\) writes"):
            partition(model, ["cpu"] * len(cuts), example_inputs=(x,), plan=bad, threads=threads)
    # a later stage may read h where the write's stage writes into its own copy: as the plain model
    cuts = [moved[:1], moved[1:2], moved[2:]]
    good = Plan([StagePlan(s, "cpu", nodes) for s, nodes in enumerate(cuts)], micro_batches=2)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), plan=good, threads=threads)
    out, ref = pipe(x), reference(x)
    assert rel(out, ref) < 1e-5
    out.square().mean().backward()
    ref.square().mean().backward()
    assert_same_grads(model, reference)


@pytest.mark.parametrize("threads", [False, True])
def test_a_hand_edited_plan_holds_every_node_once(threads: bool) -> None:
    from partitioner import PartitionError, Plan, StagePlan, plan

    torch.manual_seed(0)
    model = zoo.InPlace()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    made = plan(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2, cost_model=AnalyticCostModel())
    first, second = made.stages[0].nodes, made.stages[1].nodes
    dropped = Plan([StagePlan(0, "cpu", first), StagePlan(1, "cpu", second[:-1])], micro_batches=2)
    with pytest.raises(PartitionError, match=rf"nodes '{second[-1]}' \(1 in all\) are in no stage"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), plan=dropped, threads=threads)  # was: KeyError at the call
    twice = Plan([StagePlan(0, "cpu", first), StagePlan(1, "cpu", [first[-1], *second])], micro_batches=2)
    with pytest.raises(PartitionError, match=rf"node '{first[-1]}' is in stages 0, 1"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), plan=twice, threads=threads)
    assert all(p.grad is None for p in model.parameters())
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), plan=made, threads=threads)  # as made: exact
    assert rel(pipe(x), reference(x)) < 1e-5


class Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: int = 2, mask: torch.Tensor | None = None) -> torch.Tensor:
        self.calls += 1  # a Python side effect: runs at trace time only
        h = self.a(x) * scale
        if mask is not None:
            h = h * mask
        return self.b(h)


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_non_tensor_argument_other_than_the_examples_is_a_named_error(stages: int, threads: bool,
                                                                        schedule: str) -> None:
    from partitioner import PartitionError

    model = Scaled()
    x, mask = torch.randn(6, 4), torch.ones(6, 4)
    with pytest.warns(UserWarning, match=r"set calls while being traced: Python side effects"):
        pipe = partition(model, ["cpu"] * stages, example_inputs=(x,), example_kwargs={"scale": 3, "mask": mask},
                         micro_batches=2, schedule=schedule, threads=threads,  # type: ignore[arg-type]
                         cost_model=AnalyticCostModel())
    reference = copy.deepcopy(model)
    assert rel(pipe(x, scale=3, mask=mask), reference(x, scale=3, mask=mask)) < 1e-5
    with pytest.raises(PartitionError, match=r"argument 'scale' is 2, but the pipeline was traced with 3"):
        pipe(x, scale=2, mask=mask)
    with pytest.raises(PartitionError, match=r"argument 'mask' is None, but the pipeline was traced with a tensor"):
        pipe(x, scale=3)
    with pytest.raises(PartitionError, match="scale"):
        pipe.train_step(x, torch.zeros(6, 4), F.mse_loss, input_kwargs={"scale": 4, "mask": mask})
    y = torch.randn(6, 4)
    loss = pipe.train_step(x, y, F.mse_loss, input_kwargs={"scale": 3, "mask": mask})
    assert rel(loss, F.mse_loss(reference(x, scale=3, mask=mask), y)) < 1e-5


class GradRegions(nn.Module):
    """A frozen middle (no_grad), a region that wants gradients even under the caller's no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(6, 6) for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        with torch.no_grad():
            h = torch.tanh(self.layers[1](h))
            h = self.layers[2](h)
        with torch.enable_grad():
            h = torch.tanh(self.layers[3](h))
        return self.layers[4](h)


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_grad_mode_regions_inside_forward_run_as_written(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = GradRegions()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = build(model, x, stages, threads, schedule)
    pipe(x).square().mean().backward()
    reference(x).square().mean().backward()
    assert model.layers[1].weight.grad is None and model.layers[0].weight.grad is None  # cut off by no_grad
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    loss = pipe.train_step(x, y, F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    assert rel(loss, F.mse_loss(reference(x), y)) < 1e-5
    assert_same_grads(model, reference)
    with torch.no_grad():  # the caller's no_grad; enable_grad inside still records a graph
        out, ref = pipe(x), reference(x)
    assert out.requires_grad == ref.requires_grad and rel(out, ref) < 1e-5
    assert torch.is_grad_enabled()  # the caller's mode is back


class SharedBN(nn.Module):
    """One BatchNorm called twice: the plain model updates its statistics twice per step."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn(self.a(x)))
        h = torch.relu(self.bn(self.b(h)))
        return self.c(h)


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("m", [1, 4])
def test_a_batchnorm_called_twice_updates_once_per_call_and_step(stages: int, threads: bool, m: int) -> None:
    torch.manual_seed(0)
    model = SharedBN()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = build(model, x, stages, threads, "1f1b", m=m)
    pipe.train_step(x, y, F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    assert int(model.bn.num_batches_tracked) == int(reference.bn.num_batches_tracked) == 2
    if m == 1:  # one micro-batch: exactly the plain model, statistics included
        assert_same_grads(model, reference)
        assert rel(model.bn.running_mean, reference.bn.running_mean) < 1e-5
        assert rel(model.bn.running_var, reference.bn.running_var) < 1e-5
    pipe.eval()
    reference.eval()
    reference.load_state_dict(model.state_dict())
    assert rel(pipe(x), reference(x)) < 1e-5  # eval uses the running statistics


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("start", ["train", "eval"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_train_and_eval_follow_the_module(stages: int, threads: bool, start: str, schedule: str) -> None:
    torch.manual_seed(0)
    model = zoo.ModeDependent().train(start == "train")
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6)
    pipe = build(model, x, stages, threads, schedule, m=2 if threads else 1)
    for mode in ("eval", "train", "eval", "train"):
        pipe.train(mode == "train")
        reference.train(mode == "train")
        if mode == "eval":  # deterministic: exactly the plain model, twice
            assert rel(pipe(x), reference(x)) < 1e-5 and rel(pipe(x), reference(x)) < 1e-5
        else:  # dropout on: random outputs, and with one micro-batch on one thread the plain model's RNG stream
            if not threads:
                torch.manual_seed(1)
                out = pipe(x)
                torch.manual_seed(1)
                assert rel(out, reference(x)) < 1e-5
            with torch.no_grad():
                assert rel(pipe(x), copy.deepcopy(reference).eval()(x)) > 0.05  # not the eval graph
    model.eval()  # the model's own switch counts too
    assert rel(pipe(x), reference.eval()(x)) < 1e-5
    y = torch.randn(8, 6)  # a training step in eval mode runs the eval graph (no dropout): exact
    model.zero_grad()
    reference.zero_grad()
    assert rel(pipe.train_step(x, y, F.mse_loss), F.mse_loss(reference(x), y)) < 1e-5
    F.mse_loss(reference(x), y).backward()
    assert_same_grads(model, reference)


class AutocastRegion(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.layers[0](x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.layers[1](h)  # bfloat16, as written
            low = self.layers[2](torch.relu(low))
        return self.layers[3](low.float()), low


@pytest.mark.parametrize("stages,threads", SETTINGS)
def test_autocast_inside_forward_and_around_the_call(stages: int, threads: bool) -> None:
    torch.manual_seed(0)
    model = AutocastRegion()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    pipe = build(model, x, stages, threads)
    out, ref = pipe(x), reference(x)
    assert [t.dtype for t in out] == [t.dtype for t in ref] == [torch.float32, torch.bfloat16]
    assert all(rel(a.float(), b.float()) < 1e-2 for a, b in zip(out, ref))
    out[0].sum().backward()
    ref[0].sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 2e-2  # type: ignore[arg-type]
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the caller's autocast reaches every worker thread
        out, ref = pipe(x), reference(x)
    assert [t.dtype for t in out] == [t.dtype for t in ref] == [torch.bfloat16, torch.bfloat16]
    assert not torch.is_autocast_enabled("cpu")


class ExportOnlyBN(nn.Module):
    """`range(h.shape[1] // 3)` stops torch.fx, so torch.export traces it: BatchNorm becomes aten ops, called twice."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.bn = nn.BatchNorm1d(6)
        self.b = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        for _ in range(h.shape[1] // 3):
            h = torch.relu(self.bn(h))
        return self.b(h)


@pytest.mark.parametrize("m", [1, 4])
@pytest.mark.parametrize("threads", [False, True])
def test_batchnorm_in_an_export_graph_updates_once_per_call_and_step(m: int, threads: bool) -> None:
    torch.manual_seed(0)
    model = ExportOnlyBN()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6), torch.randn(8, 6)
    pipe = build(model, x, 2, threads, "1f1b", m=m)
    pipe.train_step(x, y, F.mse_loss)
    F.mse_loss(reference(x), y).backward()
    assert int(model.bn.num_batches_tracked) == int(reference.bn.num_batches_tracked) == 2
    if m == 1:
        assert_same_grads(model, reference)
        assert rel(model.bn.running_mean, reference.bn.running_mean) < 1e-5
        assert rel(model.bn.running_var, reference.bn.running_var) < 1e-5
    pipe.eval()
    reference.eval()
    reference.load_state_dict(model.state_dict())
    assert rel(pipe(x), reference(x)) < 1e-5
    assert int(model.bn.num_batches_tracked) == 2  # eval leaves the statistics alone


class ExportOnlyRegions(nn.Module):
    """Traced by torch.export (fx stops at `range(h.shape[1] // 4)`): grad-mode and autocast regions there."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = torch.tanh(self.layers[0](x))
        for _ in range(h.shape[1] // 4):
            h = h + 1
        with torch.no_grad():
            h = self.layers[1](h)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = self.layers[2](h)
        return self.layers[3](low.float()), low


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_regions_in_an_export_graph(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = ExportOnlyRegions()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8)
    pipe = build(model, x, stages, threads, schedule)
    out, ref = pipe(x), reference(x)
    assert [t.dtype for t in out] == [t.dtype for t in ref] == [torch.float32, torch.bfloat16]
    out[0].sum().backward()
    ref[0].sum().backward()
    assert model.layers[0].weight.grad is None and model.layers[1].weight.grad is None  # behind no_grad
    for p, q in zip(model.parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None)
        if q.grad is not None:
            assert rel(p.grad, q.grad) < 2e-2  # type: ignore[arg-type]


class ViewWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        g = torch.tanh(self.b(x))
        h[:, :4].add_(1)  # written through a view of h
        return self.c(g) + h


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_write_through_a_view_is_ordered_or_its_cut_refused(threads: bool, schedule: str) -> None:
    from partitioner import Plan, StagePlan, plan

    torch.manual_seed(0)
    model = ViewWrite()
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    names = [n for s in plan(model, ["cpu"], example_inputs=(x,), cost_model=AnalyticCostModel()).stages
             for n in s.nodes]

    def cut_before(name: str) -> Plan:
        k = names.index(name)
        return Plan(stages=[StagePlan(0, "cpu", names[:k]), StagePlan(1, "cpu", names[k:])], micro_batches=2,
                    schedule=schedule)  # type: ignore[arg-type]

    # safe: h, its view and the write in stage 0; the reader of h in stage 1 gets the written h
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), plan=cut_before("c"), threads=threads)
    assert rel(pipe.train_step(x, y, F.mse_loss), F.mse_loss(reference(x), y)) < 1e-5
    F.mse_loss(reference(x), y).backward()
    assert_same_grads(model, reference)
    # unsafe: the view made in stage 0, written in stage 1: a copy would miss the write, so it is refused
    with pytest.raises(ValueError, match="add_ .stage 1. writes into a through a view made in another stage"):
        partition(copy.deepcopy(reference), ["cpu"] * 2, example_inputs=(x,), plan=cut_before("add_"),
                  threads=threads)


@pytest.mark.parametrize("stages,threads", SETTINGS)
def test_caller_saved_tensor_hooks_and_inference_mode_reach_every_worker(stages: int, threads: bool) -> None:
    """torch.autograd.graph.saved_tensors_hooks (save_on_cpu and the like) and inference_mode are thread-local."""
    torch.manual_seed(0)
    model = AutocastRegion()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    pipe = build(model, x, stages, threads)
    packed: list[int] = []
    seen: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(1)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pipe(x)
    mine = len(packed)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(1) or t, lambda t: t):
        ref = reference(x)
    assert mine >= len(seen) > 0  # each micro-batch of every stage saved through the caller's hooks
    out[0].sum().backward()
    ref[0].sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 2e-2  # type: ignore[arg-type]
    with torch.inference_mode():
        out = pipe(x)
    assert all(t.is_inference() and not t.requires_grad for t in out)


# ---- torchgpipe's last differences (issue 25 item 7): each at 2 and 3 stages, threads on and off ----


class ReadThenWrite(nn.Module):
    """Reads its input, then writes into it in place (the result unused): a stage that only writes
    shares no edge with the stage that read first, so on another thread it could write before that read."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = torch.tanh(self.layers[0](x * 1))  # x read before the write (x * 1 saves nothing for backward)
        g = torch.tanh(self.layers[1](g))
        x.add_(1)
        g = torch.tanh(self.layers[2](g))
        out: torch.Tensor = self.layers[3](g) + x  # read after the write
        return out


def _cut_around(model: nn.Module, x: torch.Tensor, stages: int, node: str, schedule: str) -> Any:
    """A plan whose stage boundaries fall right before and (3 stages) right after `node`."""
    from partitioner import Plan, StagePlan, plan

    names = [n for s in plan(model, ["cpu"], example_inputs=(x.clone(),), cost_model=AnalyticCostModel()).stages
             for n in s.nodes]
    k = names.index(node)
    cuts = [names[:k], names[k:]] if stages == 2 else [names[:k], names[k:k + 1], names[k + 1:]]
    return Plan(stages=[StagePlan(s, "cpu", nodes) for s, nodes in enumerate(cuts)], micro_batches=4,
                schedule=schedule)


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_an_in_place_write_waits_for_the_reads_before_it_on_every_thread(stages: int, threads: bool,
                                                                         schedule: str) -> None:
    torch.manual_seed(0)
    model = ReadThenWrite()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = partition(model, ["cpu"] * stages, example_inputs=(x.clone(),), threads=threads,
                     plan=_cut_around(model, x, stages, "add_", schedule))
    out = ref = torch.empty(())
    for _ in range(5):  # threads: a race would show on some run
        mine, theirs = x.clone(), x.clone()
        out, ref = pipe(mine), reference(theirs)
        assert rel(out, ref) < 1e-5 and torch.equal(mine, theirs)  # the caller's tensor written alike
    out.square().mean().backward()
    ref.square().mean().backward()
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    mine, theirs = x.clone(), x.clone()
    loss = pipe.train_step(mine, y, F.mse_loss)
    ref_loss = F.mse_loss(reference(theirs), y)
    ref_loss.backward()
    assert loss is not None and rel(loss, ref_loss) < 1e-5 and torch.equal(mine, theirs)
    assert_same_grads(model, reference)


class WritesUnderNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.clamp_(-1, 1)  # autograd lets a leaf be written here
        out: torch.Tensor = self.b(torch.tanh(self.a(x)))
        return out


@pytest.mark.parametrize("stages,threads", SETTINGS)
def test_an_in_place_write_into_a_leaf_input_that_requires_grad_raises_as_in_the_plain_model(stages: int,
                                                                                             threads: bool) -> None:
    torch.manual_seed(0)
    model = MutatesInput()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    pipe = build(model, x.clone(), stages, threads)
    message = "a leaf Variable that requires grad is being used in an in-place operation"
    leaf = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match=message):
        reference(leaf)
    with pytest.raises(RuntimeError, match=message):
        pipe(leaf)
    with pytest.raises(RuntimeError, match=message):
        pipe.train_step(leaf, y, F.mse_loss)
    assert torch.equal(leaf, x) and leaf.grad is None and all(p.grad is None for p in model.parameters())
    with torch.no_grad():  # no grad mode: the write is allowed, in both
        mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
        assert rel(pipe(mine), reference(theirs)) < 1e-5 and torch.equal(mine, theirs)
    torch.manual_seed(0)  # a write inside forward's own no_grad region: allowed, gradients reach the leaf
    clamps, x = WritesUnderNoGrad(), 3 * torch.randn(8, 8)
    plain = copy.deepcopy(clamps)
    pipe = build(clamps, x.clone(), stages, threads)
    mine, theirs = x.clone().requires_grad_(), x.clone().requires_grad_()
    pipe(mine).square().mean().backward()
    plain(theirs).square().mean().backward()
    assert torch.equal(mine, theirs) and rel(mine.grad, theirs.grad) < 1e-5  # type: ignore[arg-type]
    assert_same_grads(clamps, plain)


def _live_activations(pipe: Any, model: nn.Module, run: Any, keep: list[torch.Tensor]) -> int:
    """Storages of stage outputs and of tensors autograd saved during `run()` that are still alive after it."""
    seen: list[Any] = []

    def track(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            seen.append(weakref.ref(value))

    def on_output(module: nn.Module, inputs: Any, output: Any) -> None:
        for t in output if isinstance(output, (tuple, list)) else [output]:
            track(t)

    def pack(t: torch.Tensor) -> torch.Tensor:  # a detached alias: a saved output holding itself would be a cycle
        alias = t.detach()
        track(alias)
        return alias

    hooks = [s.module.register_forward_hook(on_output) for s in pipe.stages]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    for h in hooks:
        h.remove()
    gc.collect()
    owned = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *keep]}
    alive = {t.untyped_storage().data_ptr() for ref in seen if (t := ref()) is not None}
    return len(alive - owned)


@pytest.mark.parametrize("stages,threads", SETTINGS)
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_activations_are_released_after_each_step(stages: int, threads: bool, schedule: str) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(6)])
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    pipe = build(model, x, stages, threads, schedule)
    assert _live_activations(pipe, model, lambda: pipe.train_step(x, y, F.mse_loss), [x, y]) == 0
    assert _live_activations(pipe, model, lambda: F.mse_loss(pipe(x), y).backward(), [x, y]) == 0  # as plain

    calls = [0]

    def fails_on_the_third(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("loss failed")
        return F.mse_loss(out, target)

    def failed_step() -> None:
        try:
            pipe.train_step(x, y, fails_on_the_third)
        except RuntimeError as exc:  # not pytest.raises: its record of the error holds the frames
            assert str(exc) == "loss failed"
        else:
            raise AssertionError("the step did not fail")

    assert _live_activations(pipe, model, failed_step, [x, y]) == 0  # a failed step's too


def test_a_plan_after_a_step_leaves_the_weights_trainable() -> None:
    """plan() propagates shapes on meta, swapping the weights out and back (torch.utils.swap_tensors); a
    step's activations left alive held the weights' AccumulateGrad nodes, which the swap poisons."""
    from partitioner import plan

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8), torch.randn(8, 4)
    for threads in (False, True):
        pipe = build(model, x, 2, threads)
        pipe.train_step(x, y, F.mse_loss)
        F.mse_loss(pipe(x), y).backward()
        plan(model, cluster="1x2xH100", example_inputs=(x,), micro_batches=4)
        again = build(model, x, 2, threads)
        model.zero_grad()
        reference.zero_grad()
        loss = again.train_step(x, y, F.mse_loss)
        ref_loss = F.mse_loss(reference(x), y)
        ref_loss.backward()
        assert rel(loss, ref_loss) < 1e-5
        assert_same_grads(model, reference)
