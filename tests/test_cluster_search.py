"""The cluster-scale search: exact where the device-list search runs, rank placement, any cluster size."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import networkx as nx
import numpy as np
import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster_shape import Cluster
from examples.models import GPT, GPTConfig
from partitioner.api import plan as make_plan
from partitioner.arguments import cluster_devices
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.place.cluster.candidate import windows
from partitioner.place.cluster.look import replica_step
from partitioner.place.cluster.plan import plan_on_cluster
from partitioner.place.cluster.prepare import cluster_problem
from partitioner.place.cluster.search import search_cluster
from partitioner.place.cluster.space import layout
from partitioner.place.devices.problem import device_problem
from partitioner.place.devices.search import evaluate, solve_devices
from partitioner.place.replicated import plan_hybrid
from partitioner.place.search.blocks import block_cuts
from partitioner.place.search.graph_costs import affine
from partitioner.place.search.infeasible import InfeasibleError
from partitioner.place.search.space import SearchSpace
from partitioner.predict.simulator import simulate
from runtime.plan import Plan, StagePlan
from runtime.program import plan_programs

ROUND = {"intra": {"kind": "nvswitch", "gb_per_s": 100, "latency_us": 10},
         "inter": {"kind": "infiniband", "gb_per_s": 10, "latency_us": 20}}


def round_cluster(hosts: int, per_host: int) -> Cluster:
    return Cluster.from_dict({"hosts": hosts, "gpus_per_host": per_host, "gpu": "H100", "fabric": ROUND})


def chain(nodes: int, seed: int) -> tuple[nx.DiGraph, list[str]]:
    """A chain with skips and uneven nodes, annotated for a batch of 64 (shapes give the batch)."""
    rng = np.random.default_rng(seed)
    g = nx.DiGraph()
    g.add_node("x", name="x", op="placeholder", out_bytes=1 << 20, shapes=[(64, 1024)], dtypes=["float32"])
    order = [f"n{i}" for i in range(nodes)]
    for i, name in enumerate(order):
        out = int(rng.integers(1 << 18, 1 << 24))
        g.add_node(name, name=name, op="call_function", flops=int(rng.integers(1e9, 1e12)), out_bytes=out,
                   param_bytes=int(rng.integers(0, 1 << 28)), shapes=[(64, out // 256)], dtypes=["float32"])
        g.add_edge(order[i - 1] if i else "x", name)
        if i >= 3 and i % 3 == 0:
            g.add_edge(order[i - 3], name)
    g.add_node("output", name="output", op="output", out_bytes=0)
    g.add_edge(order[-1], "output")
    return g, order


def uniform_optimum(problem: object, gpus: int, ms: list[int], schedule: str) -> float:
    """A reference: every p x d = gpus with d | m, every placement of the cuts, max W from hybrid.evaluate."""
    n, best = problem.n, np.inf  # type: ignore[attr-defined]
    for p in (p for p in range(1, min(gpus, n) + 1) if gpus % p == 0):
        d = gpus // p
        for m in (m for m in ms if m % d == 0):
            for inner in itertools.combinations(range(1, n), p - 1):
                bounds = [0, *inner, n]
                step, _, memory = evaluate(problem, bounds, [d] * p, m, schedule)  # type: ignore[arg-type]
                if all(x <= problem.capacity[0] for x in memory):  # type: ignore[attr-defined]
                    # the same max W; d pipelines of m / d micro-batches each fill in p - 1 of them
                    best = min(best, step / ((m + p - 1) / m) * ((m // d + p - 1) / (m // d)))
    return float(best)


@pytest.mark.parametrize("seed,headroom", [(0, 0.9), (1, 0.9), (2, 0.02)])
def test_count_search_is_the_exact_optimum_of_the_device_list_objective_on_one_host(seed: int,
                                                                                    headroom: float) -> None:
    # one host: every link is NVSwitch and an all-reduce depends only on its size, so both searches price a
    # layout alike (the same max W; the count search's fill counts d pipelines); the count search must find
    # exactly the best equal-replica layout (a direct enumeration),
    # never beat the exhaustive search over uneven replicas, and equal it where it keeps one replica per stage
    graph, order = chain(10, seed)
    cluster = round_cluster(1, 8)
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    devices = [torch.device(f"cuda:{r}") for r in range(8)]
    ms = [8, 16]
    old = device_problem(graph, order, devices, cost, headroom=headroom, micro_batches=ms)
    new = cluster_problem(graph, order, devices[0], cost, ms, headroom=headroom)
    found = search_cluster(new, cluster, micro_batches=ms, schedules=("1f1b",))
    assert found.step_s == pytest.approx(uniform_optimum(old, 8, ms, "1f1b"), rel=1e-9)
    assert solve_devices(old, ms, ("1f1b",)).step_s <= found.step_s * (1 + 1e-9)
    pipeline = search_cluster(new, cluster, micro_batches=ms, schedules=("1f1b",), replicate=False)
    exhaustive = solve_devices(old, ms, ("1f1b",), stages=8, replicate=False)
    assert pipeline.step_s == pytest.approx(exhaustive.step_s, rel=1e-9)
    assert pipeline.bounds == exhaustive.bounds or evaluate(old, pipeline.bounds, [1] * 8, pipeline.micro_batches,
                                                            "1f1b")[0] == pytest.approx(exhaustive.step_s, rel=1e-9)


def test_layouts_and_their_prices_by_where_ranks_sit() -> None:
    assert layout(2, 4, "replicas-together") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout(2, 4, "pipelines-together") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    cluster = round_cluster(2, 4)
    together = windows(cluster, layout(2, 4, "replicas-together"), 1e9)
    spread = windows(cluster, layout(2, 4, "pipelines-together"), 1e9)
    # replicas together: stage 1 receives across hosts (20 us, 10 GB/s); its all-reduce is one host's ring of 4:
    # 2 * 3 * 10 us + 2 * 3 / 4 * b / 100 GB/s
    assert together[1][2] == pytest.approx((20e-6, 1 / 10e9))
    assert together[0][4] == pytest.approx((60e-6, 1.5 / 100e9))
    # pipelines together: neighbours share a host (10 us, 100 GB/s); each stage's 4 replicas sit 2 per host:
    # in-host 2 * (10 us + 1 / 2 * b / 100 GB/s), across 2 * 20 us + 2 * 1 / 2 * (b / 2) / 10 GB/s
    assert spread[1][2] == pytest.approx((10e-6, 1 / 100e9))
    assert spread[0][4] == pytest.approx(affine(cluster.allreduce_time, [0, 2, 4, 6]))
    assert spread[0][4] == pytest.approx((20e-6 + 40e-6, 1 / 100e9 + 0.5 / 10e9))


def test_block_cuts_are_block_starts_and_every_position_outside_blocks() -> None:
    modules = ["tok", "", "blocks.0", "blocks.0.ln", "blocks.1.qkv", "blocks.1", "blocks.2", "blocks.3.mlp.0",
               "blocks.3", "ln", "head"]
    assert block_cuts(modules).tolist() == [0, 1, 2, 4, 6, 7, 9, 10, 11]
    assert block_cuts(["a", "b", "c"]) is None


def small_gpt(batch: int, layers: int = 4) -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=64, width=32, heads=2, layers=layers, seq=8)), torch.randint(0, 64, (batch, 8))


def test_plan_on_16384_gpus_places_every_rank_once_with_local_device_names() -> None:
    model, x = small_gpt(4096, layers=8)
    gm = trace(model, (x,), {}).graph_module
    graph, order = build_graph(gm, [x]), [n.name for n in compute_nodes(gm)]
    cluster = Cluster.parse("2048x8xH100")
    plan, found = plan_on_cluster(graph, order, cluster, AnalyticCostModel(cluster_devices(cluster)[2]))
    ranks = sorted(r for s in plan.stages for r in s.ranks)
    assert ranks == list(range(16384))
    assert found.stages * found.replicas == 16384 and plan.micro_batches % found.replicas == 0
    assert {s.device for s in plan.stages} <= {f"cuda:{g}" for g in range(8)}
    assert all(s.device == f"cuda:{s.ranks[0] % 8}" for s in plan.stages)
    assert plan.gpus_per_host == 8 and plan.host_of(16383) == 2047
    assert plan.programs == [] and plan.predicted_step_ms > 0  # lowered where it runs (cluster_plan docstring)
    back = Plan.from_json(plan.to_json())
    assert [s.ranks for s in back.stages] == [s.ranks for s in plan.stages] and back.gpus_per_host == 8
    assert len(plan.to_json()) < 4_000_000


def test_plan_front_door_beyond_128_gpus() -> None:
    model, x = small_gpt(512)
    made = make_plan(model, cluster="32x8xH100", example_inputs=(x,), micro_batches=256, replicas="auto",
                     schedule="1f1b")
    assert sorted(r for s in made.stages for r in s.ranks) == list(range(256))
    assert made.gpus_per_host == 8 and all(s.device.startswith("cuda:") and int(s.device[5:]) < 8
                                           for s in made.stages)
    assert len(made.programs) == 256 and made.predicted_step_ms > 0


def test_rank_map_survives_json_and_is_what_each_rank_runs() -> None:
    model, x = small_gpt(16)
    made = make_plan(model, cluster=round_cluster(2, 2), example_inputs=(x,), micro_batches=8, replicas="auto",
                     schedule="1f1b")
    back = Plan.from_json(made.to_json())
    assert [s.ranks for s in back.stages] == [s.ranks for s in made.stages]
    groups = [(s.ranks, [s.index]) for s in back.stages if len(s.ranks) > 1]
    for program in plan_programs(back, groups):  # what runtime/distributed.py lowers for a plan without programs
        runs = {op.stage for op in program.ops if op.is_compute}
        assert runs == {s.index for s in back.stages if program.rank in s.ranks}
    assert json.loads(made.to_json())["gpus_per_host"] == 2


def test_too_little_memory_names_the_memory_per_gpu() -> None:
    model, x = small_gpt(64)
    gm = trace(model, (x,), {}).graph_module
    graph, order = build_graph(gm, [x]), [n.name for n in compute_nodes(gm)]
    cluster = Cluster.parse("1x8xH100")
    with pytest.raises(InfeasibleError, match="per GPU is needed") as err:
        plan_on_cluster(graph, order, cluster, AnalyticCostModel(cluster_devices(cluster)[2]), headroom=1e-9)
    assert err.value.needed_bytes and len(err.value.needed_bytes) == 8


def test_too_little_memory_says_what_the_fullest_gpu_holds() -> None:
    # the error splits the memory it names into states and activations, per stage of the split it names: the
    # states are at least Adam's four copies of the weights each stage holds (weights, gradients, two moments, fp32),
    # summed over the stages the model's own parameters; 1F1B's stage s of p holds p - s micro-batches in flight
    model, x = small_gpt(64)
    gm = trace(model, (x,), {}).graph_module
    graph, order = build_graph(gm, [x]), [n.name for n in compute_nodes(gm)]
    cluster = Cluster.parse("1x8xH100")
    with pytest.raises(InfeasibleError) as err:
        plan_on_cluster(graph, order, cluster, AnalyticCostModel(cluster_devices(cluster)[2]), headroom=1e-9,
                        space=SearchSpace(schedules=("1f1b",)))
    held, needed = err.value.held, err.value.needed_bytes
    assert held and max(h.total for h in held) == pytest.approx(max(needed), rel=1e-6, abs=1.0)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(h.states for h in held) >= 4 * weights * (1 - 1e-9)
    assert all(h.activations > 0 and h.chunks == 1 for h in held)
    p = len(held)
    micro_batches = int(next(t for t in str(err.value).split(", ") if t.endswith("micro-batches")).split()[0])
    assert [h.in_flight for h in held] == [min(p - s, micro_batches // (8 // p)) for s in range(p)]
    fullest = max(held, key=lambda h: h.total)
    assert f"Its fullest GPU (stage {fullest.stage})" in str(err.value) and "of activations" in str(err.value)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("p,d,m", [(2, 1, 2), (2, 2, 4), (4, 2, 8), (4, 4, 12), (3, 2, 6), (8, 8, 64)])
def test_replica_chain_is_the_simulators_step_in_the_runtimes_order(schedule: str, p: int, d: int, m: int) -> None:
    # the estimate for plans over EAGER_RANKS against the reference: rank_schedule's lists for every rank,
    # lowered into programs and simulated by partitioner.predict.simulator
    ranks = layout(p, d, "replicas-together")
    forward, backward = [1.0 + 0.25 * s for s in range(p)], [2.0 + 0.5 * (s % 2) for s in range(p)]
    stages = [StagePlan(index=s, device=f"cuda:{s}", nodes=[f"n{s}"], ranks=ranks[s], reads_from=[s - 1] if s else [],
                        forward_ms=forward[s], backward_ms=backward[s], compute_ms=forward[s] + backward[s],
                        recv_bytes=1, allreduce_ms=0.5 if d > 1 else 0.0) for s in range(p)]
    plan = Plan(stages=stages, micro_batches=m, schedule=schedule)  # type: ignore[arg-type]
    reference = simulate(plan, transfer_ms=lambda src, dst, nbytes: 0.0,
                         group_ms=lambda group: 0.5 if len(group) > 1 else 0.0).makespan_ms
    assert replica_step(schedule, m, d, forward, backward, [0.0] * p,
                        [0.5 if d > 1 else 0.0] * p) == pytest.approx(reference)


def test_torchrun_runs_a_cluster_plans_rank_map(tmp_path: Path) -> None:
    # a 2 x 2 cluster plan of tests.zoo's tiny_gpt with replica j of stage s on rank 2j + s (pipelines together:
    # neither stage on consecutive ranks), saved, then run by 4 CPU gloo processes from the file
    from tests.dist_worker import data
    from tests.test_distributed import results, torchrun

    model, x, _ = data("tiny_gpt")
    gm = trace(model, (x,), {}).graph_module
    cluster = round_cluster(2, 2)
    made, _ = plan_on_cluster(build_graph(gm, [x]), [n.name for n in compute_nodes(gm)], cluster,
                              AnalyticCostModel(cluster_devices(cluster)[2]), space=SearchSpace(micro_batches=4),
                              stages=2)
    assert [len(s.ranks) for s in made.stages] == [2, 2]
    for stage, ranks in zip(made.stages, layout(2, 2, "pipelines-together")):
        stage.ranks = ranks
    made.programs = []  # lowered where it runs, as for a plan of more than EAGER_RANKS ranks
    path = tmp_path / "plan.json"
    path.write_text(made.to_json())
    run = torchrun(4, str(path), worker=str(Path(__file__).resolve().parent / "cluster_worker.py"), timeout=240)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 4, run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)


def test_recompute_auto_searches_both_ways_and_recomputes_where_nothing_fits_without() -> None:
    model, x = small_gpt(2048)  # activations dominate the weights
    gm = trace(model, (x,), {}).graph_module
    graph, order = build_graph(gm, [x]), [n.name for n in compute_nodes(gm)]
    cluster = round_cluster(1, 2)
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    gpu = float(cost.spec(torch.device("cuda:0")).memory_bytes)
    four, full_, auto_ = (SearchSpace(micro_batches=4, recompute=r) for r in ("none", "full", "auto"))
    none, _ = plan_on_cluster(graph, order, cluster, cost, space=four, stages=2)
    full, _ = plan_on_cluster(graph, order, cluster, cost, space=full_, stages=2)
    assert all(s.recompute == "none" for s in none.stages) and all(s.recompute == "full" for s in full.stages)
    held = [max(s.memory_bytes for s in p.stages) for p in (none, full)]
    assert held[1] < 0.5 * held[0]  # only the stage inputs kept
    assert full.predicted_step_ms > none.predicted_step_ms  # the forward runs twice
    headroom = 1.05 * held[1] / gpu  # room for the recomputing plan only
    with pytest.raises(InfeasibleError):
        plan_on_cluster(graph, order, cluster, cost, headroom=headroom, space=four, stages=2)
    auto, _ = plan_on_cluster(graph, order, cluster, cost, headroom=headroom, space=auto_, stages=2)
    assert all(s.recompute == "full" for s in auto.stages)
    assert max(s.memory_bytes for s in auto.stages) <= headroom * gpu
    roomy, _ = plan_on_cluster(graph, order, cluster, cost, space=auto_, stages=2)
    assert all(s.recompute == "none" for s in roomy.stages)  # fits without: not recomputed
    # plan(recompute="auto") reaches the search through plan_hybrid (the device-list search finds nothing)
    devices = ["cuda:0", "cuda:1"]
    with pytest.raises(InfeasibleError):
        plan_hybrid(graph, order, devices, cost, headroom=headroom, space=four, stages=2)
    front = plan_hybrid(graph, order, devices, cost, headroom=headroom, space=auto_, stages=2)
    assert all(s.recompute == "full" for s in front.stages)


def test_a_cluster_is_planned_from_shapes_and_equals_the_plan_from_values(monkeypatch: pytest.MonkeyPatch) -> None:
    import partitioner.make.plan as make_plan_module
    from partitioner.errors import PartitionError

    model, x = small_gpt(256)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    args = {"example_inputs": (x,), "micro_batches": 16, "replicas": "auto", "schedule": "1f1b"}
    shapes = make_plan(model, cluster="2x4xH100", **args)  # type: ignore[arg-type]

    def needs_values(value: object) -> object:  # as shapes_only reports a forward that reads values
        raise PartitionError("planning a model on meta ... failed") from RuntimeError("needs values")

    monkeypatch.setattr(make_plan_module, "on_meta", needs_values)
    values = make_plan(model, cluster="2x4xH100", **args)  # type: ignore[arg-type]
    assert [(s.nodes, s.ranks, s.memory_bytes) for s in shapes.stages] == [
        (s.nodes, s.ranks, s.memory_bytes) for s in values.stages]
    assert shapes.predicted_step_ms == pytest.approx(values.predicted_step_ms, rel=1e-9)
    assert all(torch.equal(before[k], v) and not v.is_meta for k, v in model.state_dict().items())


@pytest.mark.parametrize("stages", [1, 2])
def test_the_search_holds_what_a_recomputing_plan_holds(stages: int) -> None:
    # Full recomputation keeps each checkpoint's input (a layer's input, read by the next layer's segment) and,
    # during one micro-batch's backward, its segment's recomputed activations (cost_model.recompute_cost): the
    # search counts both, within 30% of the plan's walk either way (it kept only the stage inputs: 4.1 MB for a
    # plan's 13.3, 31% of it)
    model, x = small_gpt(2048)
    gm = trace(model, (x,), {}).graph_module
    graph, order = build_graph(gm, [x]), [n.name for n in compute_nodes(gm)]
    cluster = round_cluster(1, 2)
    made, found = plan_on_cluster(graph, order, cluster, AnalyticCostModel(cluster_devices(cluster)[2]),
                                  stages=stages, space=SearchSpace(micro_batches=8, recompute="full"))
    for held, stage in zip(found.memory, made.stages):
        assert 0.7 * stage.memory_bytes <= held <= 1.3 * stage.memory_bytes


def test_a_runs_own_stage_boundaries_are_kept_not_refined() -> None:
    # 10 uneven nodes on 4 GPUs as 2 stages: given the one cut {3} and refine_cuts=False the stages are [0, 3, 10]
    # (searched or refined, the cut moves to 4, which prices lower)
    graph, order = chain(10, 0)
    cluster = round_cluster(1, 4)
    cost = AnalyticCostModel(cluster_devices(cluster)[2])
    devices = [torch.device(f"cuda:{r}") for r in range(4)]
    problem = cluster_problem(graph, order, devices[0], cost, [8])
    kept = search_cluster(problem, cluster, micro_batches=[8], schedules=("1f1b",), stages=2,
                          cuts=np.array([0, 3, 10]), refine_cuts=False)
    assert kept.bounds == [0, 3, 10]
    free = search_cluster(problem, cluster, micro_batches=[8], schedules=("1f1b",), stages=2)
    assert free.bounds == [0, 4, 10] and free.step_s < kept.step_s
    refined = search_cluster(problem, cluster, micro_batches=[8], schedules=("1f1b",), stages=2,
                             cuts=np.array([0, 3, 10]))  # refined around the given cut, it moves to the better one
    assert refined.bounds == [0, 4, 10]
