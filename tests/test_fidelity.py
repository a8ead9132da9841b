"""Never silently wrong: every model here equals the plain model (outputs and gradients) or raises a named error."""

from __future__ import annotations

import copy
import inspect
import logging
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import SplitPoint

from cost_model.analytic import AnalyticCostModel
from partitioner import partition
from partitioner.api import plan as make_plan
from partitioner.capture.graph import owning_module
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError, TraceError
from tests import zoo
from tests.batch import Job, Launch
from tests.test_distributed import WORKER as DIST_WORKER, launch_jobs
from tests.zoo import rel

TOL = 1e-5



def weighted_sum(out: Any) -> torch.Tensor:
    """A loss that reaches every floating tensor output with its own fixed weights."""
    total = torch.zeros(())
    g = torch.Generator().manual_seed(0)
    for leaf in pytree.tree_leaves(out):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point():
            total = total + (leaf * torch.randn(leaf.shape, generator=g)).sum()
    return total


def assert_equal_to_plain(name: str, stages: int, micro_batches: int = 3, **options: Any) -> Any:
    """Partition zoo case `name` and compare outputs and gradients with an untouched copy."""
    torch.manual_seed(0)
    model, args, kwargs = getattr(zoo, name)()
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * stages, example_inputs=args, example_kwargs=kwargs,
                     micro_batches=micro_batches, **options)
    out = pipe(*args, **kwargs)
    ref = reference(*args, **kwargs)
    for got, want in zip(pytree.tree_leaves(out), pytree.tree_leaves(ref)):
        if isinstance(want, torch.Tensor):
            assert got.shape == want.shape and rel(got, want) < TOL, (got, want)
        else:
            assert got == want
    weighted_sum(out).backward()
    weighted_sum(ref).backward()
    refs = dict(reference.named_parameters())
    for pname, p in model.named_parameters():
        assert p.grad is not None and rel(p.grad, refs[pname].grad) < TOL, pname
    return pipe


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("name", ["custom_functions", "tensor_default", "aliased", "markers", "markers_export"])
def test_equal_to_plain_model(name: str, stages: int) -> None:
    assert_equal_to_plain(name, stages)


def test_custom_functions_are_leaves_running_their_own_forward_and_backward() -> None:
    model, (x,), _ = zoo.custom_functions()
    gm = trace(model, (x,)).graph_module
    targets = [getattr(n.target, "__name__", "") for n in gm.graph.nodes if n.op == "call_function"]
    assert {"StraightThrough_apply", "CountingFn_apply", "ScaleSplit_apply"} <= set(targets)
    assert "round" not in targets  # not traced through: round()'s autograd would give zero gradients
    zoo.BACKWARD_CALLS.clear()
    # analytic prices: profiling (a cold cost cache, as a test run alone or first in its worker has) would run
    # the function's backward while timing it and count here
    assert_equal_to_plain("custom_functions", 2, cost_model=AnalyticCostModel())
    # its backward ran, as the plain model's: once per micro-batch (3, 2, 2 rows) and once for the plain model (7)
    assert sorted(zoo.BACKWARD_CALLS) == [2, 2, 3, 7]


def test_outputs_and_inputs_without_batch_dimension() -> None:
    with pytest.raises(PartitionError, match=r"output \['energy'\].*output_merge_spec=\{\"\['energy'\]\": 'sum'\}"):
        assert_equal_to_plain("mixed_io", 2, input_split_spec={"table": None})
    pipe = assert_equal_to_plain("mixed_io", 3, input_split_spec={"table": None},
                                 output_merge_spec={"['energy']": "sum"})
    model, args, _ = zoo.mixed_io()
    assert pipe(*args)["scale"].shape == (1,)  # returned once, not concatenated across micro-batches


def test_bad_fidelity_arguments_name_the_choices() -> None:
    model, args, _ = zoo.mixed_io()
    with pytest.raises(PartitionError, match="output_merge_spec rule 'max'"):
        partition(model, ["cpu"] * 2, example_inputs=args, output_merge_spec="max")  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="input_split_spec names 'mask'.*'x', 'table'"):
        partition(model, ["cpu"] * 2, example_inputs=args, input_split_spec={"mask": None})
    with pytest.raises(PartitionError, match="split_points='auto'; use one of 'markers', 'cost'"):
        partition(model, ["cpu"] * 2, example_inputs=args, split_points="auto")  # type: ignore[arg-type]


def test_tensor_default_is_a_graph_constant_and_passing_it_is_refused() -> None:
    model, (x,), _ = zoo.tensor_default()
    traced = trace(model, (x,))
    assert traced.method == "fx"
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2)
    with pytest.raises(PartitionError, match="argument 'gain' is passed"):
        pipe(x, torch.ones(8))
    default = inspect.signature(type(model).forward).parameters["gain"].default
    assert torch.equal(default, torch.linspace(0.5, 1.5, 8))  # the graph holds a copy; the signature's is as it was


@pytest.mark.parametrize("name", ["markers", "markers_export"])
def test_markers_are_cuts_in_both_tracing_paths(name: str, caplog: pytest.LogCaptureFixture) -> None:
    model, (x,), _ = getattr(zoo, name)()
    traced = trace(model, (x,))
    assert traced.method == ("fx" if name == "markers" else "export")
    two = make_plan(model, ["cpu"] * 2, example_inputs=(x,))
    assert two.stages[1].cut_from_marker and "marker" in two.summary()
    # the cut is right after `first` (a Linear) and its tanh: stage 0 is those, stage 1 starts in `rest`
    module = {n.name: owning_module(n) for n in traced.graph_module.graph.nodes}
    assert {module[n] for n in two.stages[0].nodes} <= {"first", ""} and "first" in module.values()
    assert len(two.stages[0].nodes) == 2 and module[two.stages[1].nodes[0]].startswith("rest")
    three = make_plan(model, ["cpu"] * 3, example_inputs=(x,))
    assert three.stages[0].nodes == two.stages[0].nodes and three.stages[1].cut_from_marker
    assert not three.stages[2].cut_from_marker  # a further cut by cost
    with caplog.at_level(logging.INFO, logger="partitioner.capture.fidelity"):
        cost = make_plan(model, ["cpu"] * 2, example_inputs=(x,), split_points="cost")
    assert not any(s.cut_from_marker for s in cost.stages) and "ignoring 1 pipe_split() markers" in caplog.text


def test_split_spec_and_too_few_stages() -> None:
    mlp, (h,), _ = zoo.mlp()
    made = make_plan(mlp, ["cpu"] * 2, example_inputs=(h,), split_spec={"head": SplitPoint.BEGINNING})
    assert made.stages[1].nodes == ["head"] and made.stages[1].cut_from_marker
    made = make_plan(mlp, ["cpu"] * 2, example_inputs=(h,), split_spec={"body.0": SplitPoint.END})
    assert made.stages[0].nodes == ["body_0"] and made.stages[1].cut_from_marker
    model, (x,), _ = zoo.markers()
    three = make_plan(model, ["cpu"] * 3, example_inputs=(x,), split_spec={"head": SplitPoint.BEGINNING})
    marked = {s.nodes[0] for s in three.stages[1:]}
    two = make_plan(model, ["cpu"] * 2, example_inputs=(x,), split_spec={"head": SplitPoint.BEGINNING})
    assert two.stages[1].cut_from_marker and two.stages[1].nodes[0] in marked  # one of the marked cuts
    with pytest.raises(PartitionError, match="split_spec names module 'nope'"):
        make_plan(model, ["cpu"] * 2, example_inputs=(x,), split_spec={"nope": SplitPoint.END})


class _BatchBaked(nn.Module):
    """fx cannot trace `*xs`, and torch.export bakes `x.shape[0] == 7` into the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        x = xs[0]
        return self.lin(x) * (2.0 if x.shape[0] == zoo.BATCH else 1.0)


def test_export_errors_are_trace_errors_and_the_model_is_untouched() -> None:
    model = _BatchBaked()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(TraceError, match="torch.export specialized it.*Fix"):
        partition(model, ["cpu"] * 2, example_inputs=(torch.randn(zoo.BATCH, 4),), micro_batches=2)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


class _FunctionUnderExport(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, *xs: torch.Tensor) -> torch.Tensor:
        return zoo.StraightThrough.apply(self.lin(xs[0]))


def test_custom_function_where_only_export_traces_runs_its_own_backward() -> None:
    # was refused (export inlined the forward and dropped the backward); kept whole now (capture/export_functions):
    # round() has zero gradients almost everywhere, so gradients equal to the plain model's come from its backward
    torch.manual_seed(0)
    model = _FunctionUnderExport()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4)
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2)
    pipe(x).square().sum().backward()
    reference(x).square().sum().backward()
    assert model.lin.weight.grad is not None and float(model.lin.weight.grad.abs().sum()) > 0
    assert zoo.rel(model.lin.weight.grad, reference.lin.weight.grad) < 1e-5


ONE_F_ONE_B = [f"{name}:1f1b:-" for name in
               ("custom_functions", "tensor_default", "aliased", "markers", "markers_export")]
LAUNCH_S = 540  # the whole launch; the first test waits for it


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Both torchrun tests' jobs from one 2-rank launch of tests/dist_worker.py (tests/batch.py)."""
    jobs = [*(Job(c, "equivalence", [c]) for c in ONE_F_ONE_B), Job("whole_input", "whole_input")]
    return launch_jobs(2, jobs, tmp_path_factory.mktemp("fidelity"), worker=DIST_WORKER, timeout=LAUNCH_S)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_two_torchrun_ranks_1f1b(two_ranks: Launch) -> None:
    lines = [line for case in ONE_F_ONE_B for line in two_ranks.lines(case)]
    assert len(lines) == 2 * len(ONE_F_ONE_B), "\n".join(lines)
    assert all("ok=True" in line for line in lines), "\n".join(lines)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_an_input_given_whole_on_two_torchrun_ranks(two_ranks: Launch) -> None:
    lines = two_ranks.lines("whole_input")
    assert len(lines) == 2 and all("ok=True" in line for line in lines), "\n".join(lines)


def test_fewer_devices_than_marked_segments_runs_the_best_marked_cut(caplog: pytest.LogCaptureFixture) -> None:
    """A marker and a split_spec point make 3 segments; on 2 devices one of the two marked cuts is taken,
    said in the log, and the pipeline equals the plain model."""
    model, (x,), _ = zoo.markers()
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="partitioner.place.chain"):
        pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2,
                         split_spec={"head": SplitPoint.BEGINNING})
    assert "make 3 segments for 2 stages" in caplog.text and pipe.plan.stages[1].cut_from_marker
    out = pipe(x)
    out.sum().backward()
    ref = reference(x)
    ref.sum().backward()
    assert rel(out, ref) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < 1e-5, name


class _BatchDefault(nn.Module):
    """A default tensor argument with the batch's size (an earlier revision of PyTorch's pipelining test model)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.ones(16, 8)) -> torch.Tensor:  # noqa: B008
        return self.b(torch.relu(self.a(x)) + y)


def test_a_default_with_the_batch_size_is_split_with_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    torch.manual_seed(0)
    model, x = _BatchDefault(), torch.randn(16, 8)
    reference = copy.deepcopy(model)
    with caplog.at_level(logging.INFO, logger="partitioner.capture.trace"):
        pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=4)
    assert "default y=(16, 8) has the batch's size" in caplog.text
    assert rel(pipe(x), reference(x)) < 1e-5
    y = torch.randn(16, 8)  # passed: an input like any other
    assert rel(pipe(x, y), reference(x, y)) < 1e-5
    loss = pipe.train_step(x, torch.zeros(16, 4), torch.nn.functional.mse_loss)
    ref_loss = torch.nn.functional.mse_loss(reference(x), torch.zeros(16, 4))
    ref_loss.backward()
    assert rel(loss, ref_loss) < 1e-5
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.grad is not None and rel(p.grad, q.grad) < 1e-5
