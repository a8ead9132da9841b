"""The split is optimal: its bottleneck equals brute force over every contiguous split."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.chain import SplitProblem, make_problem, plan_pipeline, solve
from partitioner.place.search.boundaries import boundary_bytes
from partitioner.predict.simulator import simulate
from tests import zoo
from tests.values import random_values


def random_problem(rng: np.random.Generator, n: int, stages: int) -> SplitProblem:
    producers, consumers, sizes = random_values(rng, n)
    links = rng.uniform(0, 1e-4, size=(stages, 2)) * np.array([1.0, 1e-7])
    return SplitProblem(
        node_times=rng.uniform(1e-4, 1e-2, size=(stages, n)),
        producers=producers,
        consumers=consumers,
        value_bytes=sizes,
        recv_link=np.vstack([[0.0, 0.0], links[1:]]),
        send_link=np.vstack([links[:-1], [0.0, 0.0]]),
    )


def brute_force(problem: SplitProblem) -> float:
    n, p = problem.n, problem.stages
    best = np.inf
    for inner in itertools.combinations(range(1, n), p - 1):
        bounds = (0, *inner, n)
        best = min(best, max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))))
    return best


@pytest.mark.parametrize("seed", range(12))
def test_boundary_matrices_match_direct_count(seed: int) -> None:
    rng = np.random.default_rng(seed)
    problem = random_problem(rng, int(rng.integers(2, 10)), 2)
    recv, send = boundary_bytes(problem.producers, problem.consumers, problem.value_bytes, problem.n,
                                np.arange(problem.n + 1))
    for a in range(problem.n):
        for b in range(a + 1, problem.n + 1):
            assert (recv[a, b], send[a, b]) == pytest.approx(problem.bytes_in_out(a, b))


@pytest.mark.parametrize("seed", range(40))
def test_split_equals_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    stages = int(rng.integers(1, 5))
    problem = random_problem(rng, int(rng.integers(stages, 12)), stages)
    bounds, bottleneck = solve(problem)
    assert bounds[0] == 0 and bounds[-1] == problem.n and all(a < b for a, b in zip(bounds, bounds[1:]))
    achieved = max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:])))
    assert achieved == pytest.approx(bottleneck, rel=1e-9)
    assert bottleneck == pytest.approx(brute_force(problem), rel=1e-9)


FIXED = DeviceSpec(name="test", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30)


class SlowLinkCost(AnalyticCostModel):
    """Fixed device rates and a slow link between every pair of stages, so transfers matter."""

    def __init__(self) -> None:
        super().__init__(measure=lambda d: FIXED)

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return 0.0 if nbytes <= 0 else 5e-6 + nbytes / 1e8


@pytest.mark.parametrize("name", ["mlp", "inception", "tiny_gpt"])
@pytest.mark.parametrize("stages", [2, 3])
def test_traced_models_split_equals_brute_force(name: str, stages: int) -> None:
    model, args, kwargs = zoo.ZOO[name]()
    traced = trace(model, args, kwargs)
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, kwargs))
    order = [n.name for n in compute_nodes(traced.graph_module)][:14]  # keep brute force small
    problem = make_problem(graph, order, [torch.device("cpu")] * stages, SlowLinkCost())
    assert solve(problem)[1] == pytest.approx(brute_force(problem), rel=1e-9)


def test_heterogeneous_devices_get_uneven_stages() -> None:
    problem = SplitProblem(
        node_times=np.array([[1.0] * 12, [3.0] * 12]),  # stage 1's device is 3x slower
        producers=np.arange(-1, 12),
        consumers=[np.array([i + 1]) for i in range(-1, 12)],
        value_bytes=np.zeros(13),
        recv_link=np.zeros((2, 2)),
        send_link=np.zeros((2, 2)),
    )
    bounds, bottleneck = solve(problem)
    assert bounds == [0, 9, 12] and bottleneck == 9.0


def test_too_many_stages() -> None:
    problem = SplitProblem(np.ones((3, 2)), np.array([-1]), [np.array([0])], np.ones(1), np.zeros((3, 2)),
                           np.zeros((3, 2)))
    with pytest.raises(PartitionError, match="3 stages but the graph has only 2 compute nodes"):
        solve(problem)


def test_plan_covers_every_compute_node_once() -> None:
    model, args, _ = zoo.tiny_gpt()
    traced = trace(model, args, {})
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, {}))
    order = [n.name for n in compute_nodes(traced.graph_module)]
    plan = plan_pipeline(graph, order, [torch.device("cpu")] * 4, SlowLinkCost(), micro_batches=4)
    assert [n for s in plan.stages for n in s.nodes] == order
    assert plan.predicted_step_ms == pytest.approx(simulate(plan).makespan_ms)  # the simulated step (assemble)
    assert plan.predicted_step_ms >= 4 * max(s.compute_ms for s in plan.stages)  # every rank runs 4 micro-batches
    assert all(s.predicted_ms == pytest.approx(s.compute_ms + s.comm_ms) for s in plan.stages)
    assert all(s.reads_from and max(s.reads_from) < s.index for s in plan.stages[1:])
    assert sum(s.param_bytes for s in plan.stages) == sum(p.numel() * 4 for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def test_large_graph_uses_coarse_cuts_and_stays_fast() -> None:
    rng = np.random.default_rng(0)
    n = 6000
    problem = SplitProblem(
        node_times=rng.uniform(0, 1, size=(8, n)),
        producers=np.arange(-1, n),
        consumers=[np.array([i + 1]) for i in range(-1, n)],
        value_bytes=np.zeros(n + 1),
        recv_link=np.zeros((8, 2)),
        send_link=np.zeros((8, 2)),
    )
    start = time.perf_counter()
    bounds, bottleneck = solve(problem)
    assert len(bounds) == 9 and time.perf_counter() - start < 60  # a hang guard, not a speed target
    assert bottleneck <= problem.node_times[0].sum() / 8 * 1.05


def _uniform(n: int, stages: int) -> SplitProblem:
    return SplitProblem(
        node_times=np.ones((stages, n)),
        producers=np.arange(-1, n),
        consumers=[np.array([i + 1]) for i in range(-1, n)],
        value_bytes=np.zeros(n + 1),
        recv_link=np.zeros((stages, 2)),
        send_link=np.zeros((stages, 2)),
    )


@pytest.mark.parametrize(("stages", "forced", "expected"), [
    (2, [2], [0, 2, 12]),  # as many stages as segments: exactly on the marker, however unbalanced
    (3, [2], [0, 2, 7, 12]),  # one stage more: the long segment is split by cost
    (3, [2, 10], [0, 2, 10, 12]),
    (4, [6], [0, 3, 6, 9, 12]),
])
def test_forced_cuts_are_kept_and_segments_split_further_by_cost(stages: int, forced: list[int],
                                                                 expected: list[int]) -> None:
    problem = _uniform(12, stages)
    problem.forced = np.array(forced)
    bounds, _ = solve(problem)
    assert bounds == expected
    # the same split as the brute force over splits that keep every forced cut
    best = min(
        max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(bounds_, bounds_[1:])))
        for inner in itertools.combinations(range(1, 12), stages - 1) if set(forced) <= set(inner)
        for bounds_ in [(0, *inner, 12)]
    )
    assert max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))) == best


def test_more_segments_than_stages_cut_at_the_best_markers() -> None:
    """Fewer stages than marked segments: the cuts are the best p - 1 of the markers (PyTorch's pipelining
    test models mark 4 segments and run them on 2 or 3 devices)."""
    for stages, forced in [(2, [2, 4]), (2, [1, 5, 9]), (3, [1, 2, 6, 10])]:
        problem = _uniform(12, stages)
        problem.node_times[:, :] = np.linspace(1.0, 3.0, 12)  # uneven, so the choice matters
        problem.forced = np.array(forced)
        bounds, got = solve(problem)
        assert set(bounds[1:-1]) <= set(forced) and len(bounds) == stages + 1
        best = min(
            max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(b_, b_[1:])))
            for inner in itertools.combinations(forced, stages - 1) for b_ in [(0, *inner, 12)]
        )
        assert max(problem.stage_time(s, a, b) for s, (a, b) in enumerate(zip(bounds, bounds[1:]))) == best


# ---- schedule="auto": the planner chooses the schedule ----

def _fixed_cost(memory_bytes: int = 1 << 34) -> Any:
    from cost_model.analytic import AnalyticCostModel
    from cost_model.devices import DeviceSpec

    spec = DeviceSpec(name="test", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=memory_bytes)
    return AnalyticCostModel(measure=lambda d: spec)


def _device_need(plan: Any) -> int:
    """Bytes every rank's stages need on the one device "cpu", counted directly from the programs."""
    return sum(plan.stages[s].memory_bytes for prog in plan.programs
               for s in {op.stage for op in prog.ops if op.kind in ("F", "B", "W")})


@pytest.mark.parametrize("processes", [False, True])
def test_auto_schedule_keeps_the_fastest_of_every_schedule_planned_alone(processes: bool) -> None:
    from partitioner import plan

    model, args, _ = zoo.tiny_gpt()
    alone = {s: plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule=s,  # type: ignore[arg-type]
                     cost_model=_fixed_cost(), processes=processes).predicted_step_ms
             for s in ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")}
    auto = plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule="auto",
                cost_model=_fixed_cost(), processes=processes)
    assert auto.alternatives == pytest.approx(alone)
    assert auto.schedule == min(alone, key=lambda s: alone[s])
    assert auto.predicted_step_ms == pytest.approx(min(alone.values()))
    assert auto.virtual_stages == (2 if auto.schedule in ("interleaved", "zbv", "dualpipev") else 1)


def test_auto_schedule_keeps_only_schedules_that_fit_memory() -> None:
    from partitioner import plan

    model, args, _ = zoo.tiny_gpt()
    made = {s: plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule=s,  # type: ignore[arg-type]
                    cost_model=_fixed_cost(), processes=True)
            for s in ("gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev")}
    need = {s: _device_need(p) for s, p in made.items()}
    fastest = min(made, key=lambda s: made[s].predicted_step_ms)
    capacity = min(need.values())  # only the leanest schedules fit
    assert need[fastest] > capacity, "the test needs a fastest schedule that does not fit"
    auto = plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule="auto",
                cost_model=_fixed_cost(capacity), processes=True)
    fitting = [s for s in made if need[s] <= capacity]
    assert auto.schedule == min(fitting, key=lambda s: made[s].predicted_step_ms)
    assert sorted(auto.alternatives) == sorted(s if s in fitting else f"{s} (over memory)" for s in made)


def test_auto_schedule_leaves_out_layouts_the_job_cannot_run() -> None:
    from partitioner.place.planning import schedule_layouts

    assert schedule_layouts([[0], [1]], 4) == {
        "1f1b": [[0], [1]], "gpipe": [[0], [1]], "zb1": [[0], [1]],
        "interleaved": [[0], [1], [0], [1]], "zbv": [[0], [1], [1], [0]], "dualpipev": [[0], [1], [1], [0]],
    }
    # interleaved: rounds of 2 micro-batches; dualpipev: a micro-batch per stage or more
    assert list(schedule_layouts([[0], [1]], 3)) == ["1f1b", "gpipe", "zb1", "zbv"]
    assert list(schedule_layouts([[0, 1], [2]], 4)) == ["1f1b", "gpipe", "zb1"]  # replicas: one stage per rank
    assert list(schedule_layouts([[0]], 4)) == ["1f1b", "gpipe", "zb1"]
    assert list(schedule_layouts([[0], [1]], 4, hybrid=True)) == ["1f1b", "gpipe"]


def test_auto_schedule_trains_like_the_plain_model() -> None:
    import copy

    from partitioner import partition

    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    reference = copy.deepcopy(model)
    y = torch.randn_like(reference(x))
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="auto",
                     cost_model=_fixed_cost())
    assert pipe.plan.schedule in pipe.plan.alternatives
    loss = pipe.train_step(x, y, lambda out, t: ((out - t) ** 2).mean())
    ref = ((reference(x) - y) ** 2).mean()
    ref.backward()
    assert zoo.rel(loss, ref.detach()) < 1e-5
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None and zoo.rel(p.grad, q.grad) < 1e-5, name  # type: ignore[arg-type]


@pytest.mark.timeout(300)
def test_auto_schedule_under_torchrun_trains_like_the_plain_model() -> None:
    from tests.test_distributed import check_equivalence

    check_equivalence(2, ["tiny_gpt:auto:-"])  # rank 0 chooses, every rank runs the chosen plan (NCCL's rules)
