"""The hybrid planner equals exhaustive search over stages, replicas, micro-batches and schedules."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.memory import in_flight, stage_memory
from cost_model.processes import BetweenProcesses
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.shardable import find_shardable
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.place.devices.problem import device_problem
from partitioner.place.devices.search import evaluate, solve_devices
from partitioner.place.devices.split import tensor_space
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.counts import micro_batch_counts
from partitioner.place.search.degrees import Degrees, TensorDegree
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.problem import SearchProblem
from partitioner.predict.simulator import simulate
from runtime.microbatch import split_sizes
from runtime.plan import Plan
from tests import zoo
from tests.hybrid_worker import SmallCnn, cost as fixed_speed
from tests.values import random_values


def random_problem(rng: np.random.Generator, n: int, devices: int, kinds: int = 2, tight: bool = True) -> SearchProblem:
    producers, consumers, sizes = random_values(rng, n)
    params = rng.uniform(0, 1e6, n) * (rng.random(n) < 0.7)
    saved = rng.uniform(0, 2e5, n)
    capacity = np.full(devices, np.inf)
    if tight:
        capacity = rng.uniform(0.6, 1.6, devices) * (4 * params.sum() / devices + saved.sum() / 2)
    return SearchProblem(
        fixed_times=rng.uniform(0, 1e-3, (kinds, n)),
        batch_times=rng.uniform(1e-3, 1e-2, (kinds, n)),
        device_kind=rng.integers(0, kinds, devices),
        producers=producers,
        consumers=consumers,
        value_bytes=sizes,
        param_bytes=params,
        saved_bytes=saved,
        link=np.stack([rng.uniform(0, 1e-4, (devices, devices)), rng.uniform(0, 3e-8, (devices, devices))], axis=-1),
        allreduce=np.stack([rng.uniform(0, 1e-4, (devices, devices + 1)), rng.uniform(0, 3e-9, (devices, devices + 1))],
                           axis=-1),
        capacity=capacity,
        optimizer_states=int(rng.integers(0, 3)),
    )


def moved(pr: SearchProblem, a: int, b: int) -> tuple[float, float]:
    """Whole-batch bytes a stage [a, b) receives (made before a, read inside) and sends (made inside, read at b+)."""
    recv = send = 0.0
    for p, cons, nbytes in zip(pr.producers, pr.consumers, pr.value_bytes):
        if p < a and any(a <= c < b for c in cons):
            recv += nbytes
        if a <= p < b and b < pr.n and any(c >= b for c in cons):
            send += nbytes
    return recv, send


def stage_numbers(
    pr: SearchProblem, a: int, b: int, w: int, r: int, m: int, before: int = 1
) -> tuple[float, float, float, float, float]:
    """Direct (slow) W, static bytes, bytes per micro-batch in flight, capacity, and recv+send of one stage
    after a stage of `before` replicas (devices w - before .. w-1): its receive is priced on the slowest of
    every sender-receiver pair."""
    D = pr.devices
    recv, send = (x / m for x in moved(pr, a, b))
    devs = range(w, w + r)
    per_mb = pr.fixed_times + pr.batch_times / m
    if pr.size_times and pr.batch and m <= pr.batch:  # priced at shapes: the mean over tensor_split's sizes
        per_mb = sum(pr.size_times[x] for x in split_sizes(pr.batch, m)) / m
    compute = max(per_mb[pr.device_kind[d], a:b].sum() for d in devs)
    t = compute
    if w > 0 and recv > 0:
        pairs = [(x, d) for x in range(w - before, w) for d in devs]
        t += 2 * (max(pr.link[x, d, 0] for x, d in pairs) + max(pr.link[x, d, 1] for x, d in pairs) * recv)
    if w + r < D and send > 0:
        t += 2 * (max(pr.link[d, w + r, 0] for d in devs) + max(pr.link[d, w + r, 1] for d in devs) * send)
    params = pr.param_bytes[a:b].sum()
    work = math.ceil(m / r) * t
    if r > 1 and params > 0:
        work += pr.allreduce[w, r, 0] + pr.allreduce[w, r, 1] * params
    static = (2 + pr.optimizer_states) * params + 2 * (recv + send)
    if pr.out_bytes is not None:  # one backward's working set: 3 x the stage's largest output
        static += 3 * pr.out_bytes[a:b].max() / m
    flight = pr.saved_bytes[a:b].sum() / m + recv + send
    return work, static, flight, min(pr.capacity[d] for d in devs), recv + send


def compositions(total: int, parts: int):
    for inner in itertools.combinations(range(1, total), parts - 1):
        edges = (0, *inner, total)
        yield [y - x for x, y in zip(edges, edges[1:])]


def configs(pr: SearchProblem, ms, schedules, stages=None, replicate=True):
    """Every (step, max memory ratio, bounds, replicas, m, schedule), feasible or not."""
    n, D = pr.n, pr.devices
    for m in ms:
        for p in range(1, min(D, n) + 1):
            if stages is not None and p != stages:
                continue
            for inner in itertools.combinations(range(1, n), p - 1):
                bounds = (0, *inner, n)
                for reps in compositions(D, p):
                    if max(reps) > m or (not replicate and max(reps) > 1):
                        continue
                    starts = np.cumsum([0, *reps])
                    nums = [stage_numbers(pr, a, b, w, r, m, before)
                            for a, b, w, r, before in zip(bounds, bounds[1:], starts, reps, [0, *reps])]
                    step = (m + p - 1) / m * max(x[0] for x in nums)
                    for schedule in schedules:
                        ratio = 0.0
                        for s, ((_, static, flight, cap, _), r) in enumerate(zip(nums, reps)):
                            # a replica's own 1F1B (runtime/schedule.py): min(p - s, ceil(m / r)) in flight
                            f = min(in_flight(schedule, s, p, m), math.ceil(m / r))
                            ratio = max(ratio, (static + f * flight) / cap)
                        yield step, ratio, bounds, reps, m, schedule


def exhaustive(pr: SearchProblem, ms, schedules=("gpipe", "1f1b"), stages=None, replicate=True) -> float:
    return min((c[0] for c in configs(pr, ms, schedules, stages, replicate) if c[1] <= 1.0), default=math.inf)


def check_solution(pr: SearchProblem, sol, ms) -> None:
    """Valid structure, the step it claims, and every replica within its device's memory."""
    b, reps, m = sol.bounds, sol.replicas, sol.micro_batches
    assert b[0] == 0 and b[-1] == pr.n and all(x < y for x, y in zip(b, b[1:]))
    assert sum(reps) == pr.devices and len(reps) == len(b) - 1 and max(reps) <= m and m in ms
    starts = np.cumsum([0, *reps])
    nums = [stage_numbers(pr, x, y, w, r, m, before) for x, y, w, r, before in zip(b, b[1:], starts, reps, [0, *reps])]
    assert sol.step_s == pytest.approx((m + len(reps) - 1) / m * max(x[0] for x in nums), rel=1e-9)
    for s, ((_, static, flight, cap, _), r) in enumerate(zip(nums, reps)):
        used = static + min(in_flight(sol.schedule, s, len(reps), m), math.ceil(m / r)) * flight
        assert used <= cap * (1 + 1e-12)
        assert sol.memory[s] == pytest.approx(used, rel=1e-9)


@pytest.mark.parametrize("seed", range(150))
def test_equals_exhaustive_search(seed: int) -> None:
    rng = np.random.default_rng(seed)
    D = int(rng.integers(1, 5))
    pr = random_problem(rng, int(rng.integers(2, 13)), D, kinds=int(rng.integers(1, 3)), tight=seed % 4 != 0)
    ms = sorted({int(x) for x in rng.choice([1, 2, 3, 4, 6, 8], size=int(rng.integers(1, 4)), replace=False)})
    schedules = [("gpipe", "1f1b"), ("gpipe",), ("1f1b",)][seed % 3]
    expected = exhaustive(pr, ms, schedules)
    if not np.isfinite(expected):
        with pytest.raises(InfeasibleError):
            solve_devices(pr, ms, schedules)
        return
    sol = solve_devices(pr, ms, schedules)
    assert sol.step_s == pytest.approx(expected, rel=1e-9)
    assert sol.schedule in schedules
    check_solution(pr, sol, ms)


@pytest.mark.parametrize("seed", range(30))
def test_fixed_stage_count_and_no_replication_equal_exhaustive(seed: int) -> None:
    rng = np.random.default_rng(100 + seed)
    D = int(rng.integers(2, 5))
    pr = random_problem(rng, int(rng.integers(D, 13)), D)
    ms = [1, 2, 4]
    stages = int(rng.integers(1, D + 1))
    for kwargs in ({"stages": stages}, {"replicate": False}):
        expected = exhaustive(pr, ms, **kwargs)
        if not np.isfinite(expected):
            with pytest.raises(InfeasibleError):
                solve_devices(pr, ms, **kwargs)
            continue
        sol = solve_devices(pr, ms, **kwargs)
        assert sol.step_s == pytest.approx(expected, rel=1e-9)
        assert len(sol.replicas) == kwargs.get("stages", D)
        check_solution(pr, sol, ms)


def test_slow_stage_gets_more_replicas() -> None:
    """Node 0 takes 2 s, node 1 takes 1 s, 3 devices, m = 4: [2 replicas, 1 replica], step 1.25 s."""
    zero2, zero3 = np.zeros((3, 3, 2)), np.zeros((3, 4, 2))
    pr = SearchProblem(
        np.zeros((1, 2)), np.array([[2.0, 1.0]]), np.zeros(3, dtype=int), np.array([-1, 0, 1]),
        [np.array([0]), np.array([1]), np.array([2])], np.zeros(3), np.zeros(2), np.zeros(2), zero2, zero3,
        np.full(3, np.inf),
    )
    sol = solve_devices(pr, 4)
    assert (sol.bounds, sol.replicas, sol.step_s) == ([0, 1, 2], [2, 1], pytest.approx(1.25))


def test_memory_bounds_the_cost_model_formula() -> None:
    """One replica per stage: the planner's bytes are cost_model.memory.stage_memory's coarse count plus the
    sent outputs held in flight; with node outputs known, they bound its fine count (what assemble predicts)
    for any backward working set up to 3 x the stage's largest output, so a plan that fits here fits there."""
    rng = np.random.default_rng(7)
    pr = random_problem(rng, 6, 3, tight=False)
    optimizer = ["sgd", "momentum", "adam"][pr.optimizer_states]
    bounds, reps, m = [0, 2, 4, 6], [1, 1, 1], 4
    for schedule in ("gpipe", "1f1b"):
        for out in (None, rng.uniform(1e2, 1e4, pr.n)):
            pr.out_bytes = out
            memory = evaluate(pr, bounds, reps, m, schedule)[2]
            for s, (a, b) in enumerate(zip(bounds, bounds[1:])):
                recv, send = (x / m for x in moved(pr, a, b))
                args = (int(pr.param_bytes[a:b].sum()), int(pr.saved_bytes[a:b].sum() / m))
                kw = {"stage": s, "stages": 3, "micro_batches": m, "schedule": schedule, "optimizer": optimizer,
                          "recv_bytes": int(recv), "send_bytes": int(send)}
                f = in_flight(schedule, s, 3, m)
                if out is None:
                    assert memory[s] == pytest.approx(stage_memory(*args, **kw).total + f * send, abs=32)
                    continue
                largest = out[a:b].max() / m
                fine = stage_memory(*args, **kw, peak_bytes=args[1] + int(3 * largest), last=s == 2).total
                assert fine <= memory[s] + 32


def test_infeasible_error_names_the_memory_each_device_needs() -> None:
    rng = np.random.default_rng(3)
    pr = random_problem(rng, 6, 3, tight=False)
    pr.capacity = np.array([1e3, 9e2, 1e3])
    with pytest.raises(InfeasibleError) as info:
        solve_devices(pr, [1, 2, 4])
    text, needed = str(info.value), info.value.needed_bytes
    assert "fits on no split" in text and "Fix:" in text
    for d in range(3):
        assert f"device {d}: needs " in text and f"(has {pr.capacity[d]:.0f} B)" in text
    best_ratio = min(c[1] for c in configs(pr, [1, 2, 4], ("1f1b",)))
    assert max(x / c for x, c in zip(needed, pr.capacity)) == pytest.approx(best_ratio, rel=1e-6)
    # why: each stage's states and in-flight activations add up to what its devices need, and 1F1B's stage s of
    # p holds min(p - s, m / replicas) micro-batches (the message names the fullest device)
    held = info.value.held
    assert held and all(math.ceil(h.total) in needed for h in held)
    assert max(h.total for h in held) == pytest.approx(max(needed), abs=1.0)
    assert all(h.states >= 0 and h.activations >= 0 and h.in_flight >= 1 for h in held)
    assert held[-1].in_flight == 1 and [h.in_flight for h in held] == sorted((h.in_flight for h in held), reverse=True)
    fullest = max(held, key=lambda h: h.total)
    assert f"Its fullest device (stage {fullest.stage})" in text
    pr.capacity = np.array(needed, dtype=float)  # exactly that much memory: now it plans
    check_solution(pr, solve_devices(pr, [1, 2, 4]), [1, 2, 4])


def test_memory_never_exceeded_on_larger_problems() -> None:
    rng = np.random.default_rng(11)
    pr = random_problem(rng, 400, 6)
    pr.capacity = pr.capacity * 0.5
    try:
        sol = solve_devices(pr, [2, 4, 8], budget=2e6)
    except InfeasibleError as exc:
        pr.capacity = np.array(exc.needed_bytes, dtype=float)
        sol = solve_devices(pr, [2, 4, 8], budget=2e6)
    check_solution(pr, sol, [2, 4, 8])


def test_bad_arguments_raise_partition_error() -> None:
    pr = random_problem(np.random.default_rng(0), 4, 3, tight=False)
    for kwargs in ({"schedules": ("zb",)}, {"stages": 5}, {"micro_batches": 0}, {"replicate": False, "stages": 2}):
        with pytest.raises(PartitionError):
            solve_devices(pr, **kwargs)


CLUSTER = DeviceSet.from_dict({
    "devices": {
        "cuda:0": {"flops_per_s": 4e9, "bytes_per_s": 2e10, "memory_bytes": "120KiB"},
        "cuda:1": {"flops_per_s": 2e9, "bytes_per_s": 1e10, "memory_bytes": "48KiB"},
        "cuda:2": {"flops_per_s": 4e9, "bytes_per_s": 2e10, "memory_bytes": "120KiB"},
        "cuda:3": {"flops_per_s": 1e9, "bytes_per_s": 1e10, "memory_bytes": "64KiB"},
    },
    "links": [{"between": ["cuda:0", "cuda:1"], "kind": "nvlink"}],
    "default_link": {"kind": "slow", "latency_s": 1e-5, "bandwidth": 1e8},
})


@pytest.mark.parametrize("name", ["mlp", "inception"])
@pytest.mark.parametrize("devices", [2, 3, 4])
def test_traced_models_equal_exhaustive_search(name: str, devices: int) -> None:
    model, args, kwargs = zoo.ZOO[name]()
    traced = trace(model, args, kwargs)
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, kwargs))
    order = [n.name for n in compute_nodes(traced.graph_module)]
    assert len(order) <= 16
    names = [f"cuda:{i}" for i in range(devices)]
    cost = AnalyticCostModel(CLUSTER)
    pr = device_problem(graph, order, names, cost)
    assert pr.batch == zoo.BATCH and pr.devices == devices
    sol = solve_devices(pr)
    assert sol.step_s == pytest.approx(exhaustive(pr, micro_batch_counts(devices, zoo.BATCH)), rel=1e-9)
    plan = plan_hybrid(graph, order, names, cost)
    # The plan is the solver's placement; its numbers are assemble's, typed (no notes).
    assert [len(s.nodes) for s in plan.stages] == [b - a for a, b in zip(sol.bounds, sol.bounds[1:])]
    assert [len(s.ranks) for s in plan.stages] == sol.replicas and plan.micro_batches == sol.micro_batches
    assert plan.schedule == sol.schedule and plan.placement == "hybrid"
    assert [x for s in plan.stages for x in s.nodes] == order
    assert [r for s in plan.stages for r in s.ranks] == list(range(devices)) == [p.rank for p in plan.programs]
    assert all(s.device == names[s.ranks[0]] for s in plan.stages)
    assert [p.device for p in plan.programs] == names  # each replica's own device
    for s in plan.stages:
        assert s.capacity_bytes == min(int(pr.capacity[r]) for r in s.ranks)
        assert 0 < s.memory_bytes <= s.capacity_bytes
        assert (s.allreduce_ms > 0) == (len(s.ranks) > 1 and s.param_bytes > 0)
    assert plan.predicted_step_ms == pytest.approx(simulate(plan).makespan_ms)
    assert Plan.from_json(json.dumps(json.loads(plan.to_json()))) == plan


def test_traced_model_too_big_names_each_device() -> None:
    model, args, kwargs = zoo.mlp()
    traced = trace(model, args, kwargs)
    graph = build_graph(traced.graph_module, traced.flatten_inputs(args, kwargs))
    order = [n.name for n in compute_nodes(traced.graph_module)]
    names = ["cuda:0", "cuda:1", "cuda:2"]
    with pytest.raises(InfeasibleError) as info:
        plan_hybrid(graph, order, names, AnalyticCostModel(CLUSTER), memory_bytes=[8e3, 4e3, 8e3])
    text = str(info.value)
    assert all(f"{name}: needs " in text for name in names) and "(has 7.81 KiB)" in text
    plan = plan_hybrid(graph, order, names, AnalyticCostModel(CLUSTER), memory_bytes=info.value.needed_bytes)
    assert all(s.capacity_bytes == info.value.needed_bytes[s.ranks[0]] for s in plan.stages)
    assert all(s.memory_bytes <= s.capacity_bytes for s in plan.stages if s.capacity_bytes is not None)


def two_host_problem(hosts: list[int]) -> SearchProblem:
    """Node 0 (1 s of whole-batch compute) sends 1 MB to node 1 (2 s); a device per entry of `hosts`, links
    1 ns per byte inside a host and 100 ns per byte between hosts, no latency, no weights."""
    D = len(hosts)
    link = np.zeros((D, D, 2))
    for i, j in itertools.product(range(D), range(D)):
        link[i, j, 1] = 0.0 if i == j else 1e-9 if hosts[i] == hosts[j] else 1e-7
    return SearchProblem(
        np.zeros((1, 2)), np.array([[1.0, 2.0]]), np.zeros(D, dtype=int), np.array([0]), [np.array([1])],
        np.array([1e6]), np.zeros(2), np.zeros(2), link, np.zeros((D, D + 1, 2)), np.full(D, np.inf),
    )


def test_a_stage_pays_for_senders_on_another_host() -> None:
    # Stage 0 on devices 0 (host 0) and 1 (host 1), stage 1 on device 2 (host 1), m = 2: micro-batch 0
    # comes from device 0, across the hosts. Per micro-batch 0.5 MB, both ways: 2 x 0.05 s.
    pr = two_host_problem([0, 1, 1])
    step, work, _ = evaluate(pr, [0, 1, 2], [2, 1], 2, "gpipe")
    assert work == pytest.approx([1.0 / 2 + 2 * 0.05, 2 * (2.0 / 2 + 2 * 0.05)])  # not 2 x (1 + 2 x 0.0005)
    assert step == pytest.approx(3 / 2 * 2.2)
    # A stage replicated over both hosts, receiving from a stage on one host: the pair across hosts is priced.
    pr = two_host_problem([0, 0, 1])
    work = evaluate(pr, [0, 1, 2], [1, 2], 2, "gpipe")[1]
    assert work[1] == pytest.approx(1 * (2.0 / 2 + 2 * 0.05))
    # Same devices, one host: the fast link.
    pr = two_host_problem([0, 0, 0])
    assert evaluate(pr, [0, 1, 2], [2, 1], 2, "gpipe")[1][1] == pytest.approx(2 * (2.0 / 2 + 2 * 0.0005))


def test_the_solver_prices_senders_as_exhaustive_search_does() -> None:
    # 5 devices over two hosts: the best layout and its step equal those of every layout priced pair by pair.
    pr = two_host_problem([0, 0, 0, 1, 1])
    pr.batch_times = np.array([[3.0, 2.0]])
    ms = [1, 2, 4]
    sol = solve_devices(pr, ms)
    assert sol.step_s == pytest.approx(exhaustive(pr, ms), rel=1e-9)
    check_solution(pr, sol, ms)


# Tensor degrees (search/degrees.py, devices/tensor.py, devices/dp.py): a stage of r replicas may split its layers
# over t ranks each.


def split_case(memory_bytes: int, hidden: int = 256, devices: int = 4) -> tuple[SearchProblem, Degrees]:
    """tests/hybrid_worker.SmallCnn on `devices` processes of fixed speed holding `memory_bytes`, with the tensor
    degrees its fully connected layers take (devices.split.tensor_space)."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 8, 8)
    traced = trace(SmallCnn(hidden), (x,), {})
    gm = traced.graph_module
    graph = build_graph(gm, traced.flatten_inputs((x,), {}))
    order = [n.name for n in compute_nodes(gm)]
    cost, names = BetweenProcesses(fixed_speed(memory_bytes)), ["cpu"] * devices
    problem = device_problem(graph, order, names, cost)
    space, _, _ = tensor_space(graph, order, names, cost, problem, find_shardable(gm, graph))
    assert space is not None and space.tensors == (1, 2, 4)
    return problem, space


def split_configs(pr: SearchProblem, space: Degrees, ms: list[int]):
    """Every (step, bounds, replicas, tensors, m) that fits, 1F1B: each stage r replicas of t devices, r <= m."""
    n, D = pr.n, pr.devices
    for m in ms:
        for p in range(1, D + 1):
            for inner in itertools.combinations(range(1, n), p - 1):
                bounds = (0, *inner, n)
                for sizes in compositions(D, p):
                    ways = [[(s // t, t) for t in space.tensors if s % t == 0 and s // t <= m] for s in sizes]
                    for choice in itertools.product(*ways):
                        reps, tensors = [r for r, _ in choice], [t for _, t in choice]
                        step, _, memory = evaluate(pr, bounds, reps, m, "1f1b", tensors, space)
                        if math.isfinite(step) and max(memory) <= pr.capacity.min():
                            yield step, list(bounds), reps, tensors, m


@pytest.mark.parametrize("memory_bytes, ms", [(10**9, [2, 4]), (1_300_000, [4]), (700_000, [2, 4])])
def test_tensor_degrees_equal_exhaustive_search(memory_bytes: int, ms: list[int]) -> None:
    pr, space = split_case(memory_bytes)
    sol = solve_devices(pr, ms, ("1f1b",), tensor=space)
    best = min(split_configs(pr, space, ms), key=lambda c: c[0])
    assert sol.step_s == pytest.approx(best[0], rel=1e-9)
    assert (sol.bounds, sol.replicas, sol.tensors, sol.micro_batches) == tuple(best[1:])
    assert sum(r * t for r, t in zip(sol.replicas, sol.tensors)) == pr.devices


def test_a_stage_splits_its_layers_only_where_time_or_memory_demands_it() -> None:
    # Small fully connected layers: every stage whole, the solution the search without tensor degrees finds.
    pr, space = split_case(10**9, hidden=64)
    whole, split = solve_devices(pr, [4], ("1f1b",)), solve_devices(pr, [4], ("1f1b",), tensor=space)
    assert split.tensors == [1] and split.tensor == []
    assert (split.bounds, split.replicas, split.step_s) == (whole.bounds, whole.replicas, whole.step_s)
    # Large ones (2.1 M weights): 4 replicas all-reduce them over processes; 2 replicas of 2 ranks are faster.
    pr, space = split_case(10**9, hidden=1024)
    whole, split = solve_devices(pr, [4], ("1f1b",)), solve_devices(pr, [4], ("1f1b",), tensor=space)
    assert whole.replicas == [4] and (split.replicas, split.tensors) == ([2], [2]) and split.step_s < whole.step_s
    # Memory: 630 kB per device holds the classifier's weights, gradients and Adam moments only split 4 ways.
    pr, space = split_case(700_000)
    with pytest.raises(InfeasibleError):
        solve_devices(pr, [4], ("1f1b",))
    split = solve_devices(pr, [4], ("1f1b",), tensor=space)
    assert split.tensors == [4] and max(split.memory) <= pr.capacity.min()


def test_nothing_fits_names_the_tensor_degrees_that_came_closest() -> None:
    pr, space = split_case(400_000)
    with pytest.raises(InfeasibleError, match=r"replicas \[1\], tensor \[4\]") as caught:
        solve_devices(pr, [4], ("1f1b",), tensor=space)
    assert len(caught.value.needed_bytes) == 4 and min(caught.value.needed_bytes) > 0.9 * 400_000


def test_a_stage_may_split_only_where_it_holds_whole_groups() -> None:
    # One group at positions 2..4 (a cut at 3 or 4 would fall inside it), cut candidates 0, 1, 2, 3, 5, 6:
    # a stage [a, b) may split where a <= 2, b >= 5 and neither a nor b is 3 or 4.
    degree = TensorDegree(2, (), forbidden=np.array([3, 4]), spans=np.array([[2, 4]]))
    cuts = np.array([0, 1, 2, 3, 5, 6])
    valid = degree.valid(cuts)
    expected = {(a, b) for a in (0, 1, 2) for b in (5, 6)}
    assert {(int(cuts[i]), int(cuts[j])) for i, j in zip(*np.nonzero(valid))} == expected
