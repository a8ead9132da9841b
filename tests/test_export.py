"""Plans for torch.distributed.pipelining and torchtitan: actions, split points, TOML, CSV import, a run by torch."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint
from torch.distributed.pipelining.schedules import ScheduleZBVZeroBubble, _PipelineScheduleRuntime
from torch.testing._internal.distributed.fake_pg import FakeStore

import partitioner
from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from partitioner.cli.main import main
from partitioner.errors import PartitionError
from partitioner.export import from_torch_schedule, read_torch_actions, to_torch_schedule, to_torchtitan
from partitioner.export.wire import wire
from partitioner.predict.simulator import simulate
from rules.schedules import schedule_names, unregister
from tests import zoo
from tests.test_distributed import results, torchrun

WORKER = str(Path(__file__).resolve().parent / "export_worker.py")
# torchtitan's JobConfig fields these keys must be (torchtitan/config/job_config.py: Parallelism, Training)
TORCHTITAN_PARALLELISM = {
    "data_parallel_replicate_degree", "data_parallel_shard_degree", "tensor_parallel_degree",
    "pipeline_parallel_degree", "pipeline_parallel_split_points", "pipeline_parallel_schedule",
    "pipeline_parallel_schedule_csv", "pipeline_parallel_microbatch_size",
}
PLANS: dict[tuple[Any, ...], partitioner.Plan] = {}
# A described CPU: plans (cuts included) are the same on every machine and every run.
CPU = DeviceSpec(name="cpu", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 34, kind="cpu")


def make_plan(ranks: int, schedule: str, name: str = "tiny_gpt", **kw: Any) -> partitioner.Plan:
    """A zoo model (batch 8, 4 micro-batches) planned for `ranks` described CPU processes (cached: plans are data)."""
    key = (ranks, schedule, name, repr(sorted(kw.items())))
    if key not in PLANS:
        torch.manual_seed(0)
        model, (x,), _ = zoo.ZOO[name]()
        x = torch.cat([x, x[:1]])
        PLANS[key] = partitioner.plan(model, ["cpu"] * ranks, example_inputs=(x,), micro_batches=4,
                                      schedule=schedule, processes=True,
                                      cost_model=AnalyticCostModel(measure=lambda d: CPU), **kw)
    return partitioner.Plan.from_json(PLANS[key].to_json())


def read_toml(text: str) -> dict[str, Any]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+ (on 3.10 the checks that read TOML skip)
    return dict(tomllib.loads(text))


@pytest.fixture
def fake_world() -> Iterator[Any]:
    """A fake process group of any size in this process: torch's schedule classes need one to exist."""

    def start(world: int) -> None:
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def torch_stages(indices: list[int], total: int) -> list[PipelineStage]:
    return [PipelineStage(nn.Linear(2, 2), s, total, torch.device("cpu"), input_args=(torch.empty(1, 2),),
                          output_args=(torch.empty(1, 2),)) for s in indices]


def test_four_stage_1f1b_actions_are_the_plans_programs() -> None:
    sched = make_plan(4, "1f1b").to_torch_schedule()
    assert sched.actions == [
        "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3".split(),
        "1F0 1F1 1F2 1B0 1F3 1B1 1B2 1B3".split(),
        "2F0 2F1 2B0 2F2 2B1 2F3 2B2 2B3".split(),
        "3F0 3B0 3F1 3B1 3F2 3B2 3F3 3B3".split(),
    ]
    assert sched.stage_to_rank == {0: 0, 1: 1, 2: 2, 3: 3} and sched.layout == "chain"
    assert (sched.micro_batches, sched.pipelines, sched.torch_class) == (4, 1, "PipelineScheduleSingle")
    assert sched.csv().splitlines()[3] == "3F0,3B0,3F1,3B1,3F2,3B2,3F3,3B3"


def test_split_backward_v_and_loop_layouts() -> None:
    zbv = make_plan(2, "zbv", virtual_stages=2).to_torch_schedule()
    assert zbv.stage_to_rank == {0: 0, 1: 1, 2: 1, 3: 0} and zbv.torch_class == "ZBVZeroBubble"
    assert "3I0" in zbv.actions[0] and "3W0" in zbv.actions[0] and "3B0" not in zbv.actions[0]
    loop = make_plan(2, "interleaved").to_torch_schedule()
    assert loop.stage_to_rank == {0: 0, 1: 1, 2: 0, 3: 1} and loop.torch_class == "PipelineScheduleMulti"
    zb1 = make_plan(2, "zb1").to_torch_schedule()
    assert zb1.actions[1][:5] == ["1F0", "1I0", "1F1", "1I1", "1W0"]
    branches = make_plan(2, "gpipe", "inception", placement="branches")  # two branches on rank 0, the rest on 1
    sched = branches.to_torch_schedule()
    assert sched.layout == "custom" and sched.stage_to_rank == {0: 1, 1: 0, 2: 0}
    with pytest.raises(PartitionError, match="torchtitan lays stages out"):
        branches.to_torchtitan()


@pytest.mark.parametrize("ranks,schedule", [(4, "1f1b"), (2, "zbv")])
def test_exported_csv_loads_in_torch_unchanged(tmp_path: Path, fake_world: Any, ranks: int, schedule: str) -> None:
    sched = make_plan(ranks, schedule).to_torch_schedule()
    path = sched.write_csv(tmp_path / "schedule.csv")
    fake_world(ranks)
    mine = [s for s, r in sched.stage_to_rank.items() if r == 0]
    runtime = _PipelineScheduleRuntime(torch_stages(mine, sched.stages), n_microbatches=sched.micro_batches)
    runtime._load_csv(str(path))
    assert {r: [str(a) for a in row] for r, row in runtime.pipeline_order.items()} == dict(enumerate(sched.actions))
    assert runtime.stage_index_to_group_rank == sched.stage_to_rank
    assert any("SEND_F" in str(a) for a in runtime.pipeline_order_with_comms[0])  # torch lowered it with messages


def test_split_points_name_module_boundaries_and_the_cuts_that_are_not() -> None:
    two = make_plan(2, "gpipe").to_torch_schedule().split_points
    assert two.begins == ["blocks.1.ln2"] and two.on_boundaries
    four = make_plan(4, "1f1b").to_torch_schedule().split_points
    assert four.begins == ["blocks.0.mlp.2", None, None] and not four.on_boundaries
    assert four.off_boundary == [
        "the cut before stage 2 falls inside blocks.1: blocks_1_proj runs in stage 1 and add_3 in stage 2",
        "the cut before stage 3 falls inside blocks.2: transpose_13 runs in stage 2 and matmul_4 in stage 3",
    ]
    with pytest.raises(ValueError, match="not all on module boundaries"):
        four.names()
    marked = make_plan(3, "1f1b", split_spec={"blocks.1": SplitPoint.BEGINNING, "blocks.2": SplitPoint.BEGINNING})
    split = marked.to_torch_schedule().split_points
    assert split.names() == ["blocks.1", "blocks.2"]
    assert split.modules[1] == ["blocks.1"] and split.modules[0][:2] == ["tok", "blocks.0"]


def test_torchtitan_toml_uses_its_keys_with_a_comment_each() -> None:
    plan = make_plan(3, "1f1b", split_spec={"blocks.1": SplitPoint.BEGINNING, "blocks.2": SplitPoint.BEGINNING})
    text = plan.to_torchtitan("out/schedule.csv")
    config = read_toml(text)
    assert set(config["parallelism"]) <= TORCHTITAN_PARALLELISM and set(config) == {"parallelism", "training"}
    par = config["parallelism"]
    assert par["pipeline_parallel_degree"] == 3 and par["pipeline_parallel_schedule"] == "PipelineScheduleSingle"
    assert par["pipeline_parallel_schedule_csv"] == "out/schedule.csv"
    assert par["pipeline_parallel_split_points"] == ["blocks.1", "blocks.2"]
    assert par["pipeline_parallel_microbatch_size"] == 2 and config["training"] == {"local_batch_size": 8}
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"], par["tensor_parallel_degree"]) \
        == (1, 1, 1)
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            assert "  # " in line, line  # every value says where it came from
    assert "predicted step" in text and "Predicted memory per GPU" in text
    cut_inside = to_torchtitan(make_plan(4, "1f1b"))
    assert "pipeline_parallel_split_points" not in read_toml(cut_inside)["parallelism"]
    assert "# pipeline_parallel_split_points: not written" in cut_inside and "falls inside blocks.2" in cut_inside


def test_replicated_stages_are_pipelines_side_by_side() -> None:
    plan = make_plan(4, "1f1b", replicas=[2, 2])
    sched = plan.to_torch_schedule()
    assert (sched.pipelines, sched.micro_batches, sched.ranks) == (2, 2, 2)
    assert sched.actions == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    assert read_toml(plan.to_torchtitan())["parallelism"]["data_parallel_replicate_degree"] == 2
    plan.stages[0].ranks = [0]
    with pytest.raises(PartitionError, match="same replica count"):
        to_torch_schedule(plan)


def test_import_round_trip_checks_lowers_and_simulates(tmp_path: Path) -> None:
    plan = make_plan(4, "1f1b")
    path = plan.to_torch_schedule().write_csv(tmp_path / "s.csv")
    imported = partitioner.Plan.from_torch_schedule(path, plan)
    try:
        assert isinstance(imported, partitioner.Plan) and imported.schedule.startswith("torch-csv-")
        imported.check()
        assert [p.compute() for p in imported.programs] == [p.compute() for p in plan.programs]
        assert [[str(op) for op in p.ops] for p in imported.programs] == [[str(op) for op in p.ops]
                                                                         for p in plan.programs]
        assert imported.predicted_step_ms == pytest.approx(simulate(imported).makespan_ms)
        assert imported.predicted_step_ms == pytest.approx(plan.predicted_step_ms, rel=1e-6)
        again = partitioner.Plan.from_json(imported.to_json())  # registered: a saved copy loads and checks
        assert again.schedule == imported.schedule
    finally:
        unregister(imported.schedule)


def test_import_torchs_own_zbv_schedule(tmp_path: Path, fake_world: Any) -> None:
    fake_world(2)
    theirs = ScheduleZBVZeroBubble(torch_stages([0, 3], 4), n_microbatches=4)
    theirs._dump_csv(str(tmp_path / "zbv.csv"), format="compute_only")
    plan = make_plan(2, "zbv", virtual_stages=2)
    imported = from_torch_schedule(tmp_path / "zbv.csv", plan, name="torch-zbv-test")
    try:
        assert [s.ranks for s in imported.stages] == [[0], [1], [1], [0]] and imported.virtual_stages == 2
        assert imported.predicted_step_ms > 0 and len(imported.programs) == 2
        mine = [a for a in imported.programs[0].compute() if a.stage == 3]
        assert [str(a) for a in mine[:3]] == ["3F0", "3B0", "3W0"]  # torch's I is our split B
        assert all(op.split for op in imported.programs[0].ops if op.kind == "B" and op.stage == 3)
    finally:
        unregister("torch-zbv-test")


def test_import_refuses_incomplete_deadlocking_or_misplaced_schedules() -> None:
    plan = make_plan(2, "1f1b")
    with pytest.raises(PartitionError, match="incomplete"):
        from_torch_schedule([["0F0", "0F1", "0B0"], ["1F0", "1B0", "1F1", "1B1"]], plan)
    with pytest.raises(PartitionError, match="deadlock"):
        from_torch_schedule([["0F0", "0B0", "0F1", "0B1"], ["1F1", "1B1", "1F0", "1B0"]], plan)
    with pytest.raises(PartitionError, match="stage 0 runs on ranks 0 and 1"):
        from_torch_schedule([["0F0", "0B0"], ["0F1", "1F0"]], plan)
    with pytest.raises(PartitionError, match="taken"):
        from_torch_schedule([["0F0", "0B0"], ["1F0", "1B0"]], plan, name="1f1b")
    assert read_torch_actions([["0F0", "0RECV_B0", "(0F1;1B0)OVERLAP_F_B", "", "1I0"]])[0] == \
        read_torch_actions([["0F0", "0F1", "1B0", "1B0"]])[0]
    assert not any(n.startswith("torch-csv-") for n in schedule_names())  # refused imports register nothing


def test_values_cross_cuts_as_tensors_and_come_back_as_they_were() -> None:
    value = (torch.randn(2, 3).t(), 4, 0.5, True, torch.Size([2, 3]), {"k": torch.ones(1)})
    w = wire("v", value)
    sent = w.encode(value)
    assert w.width == len(sent) == 6 and all(isinstance(t, torch.Tensor) and t.is_contiguous() for t in sent)
    back = w.decode(sent)
    assert back[1:5] == (4, 0.5, True, torch.Size([2, 3])) and type(back[1]) is int and type(back[4]) is torch.Size
    assert torch.equal(back[0], value[0]) and torch.equal(back[5]["k"], value[5]["k"])
    x = torch.randn(3, 2, requires_grad=True)
    out = w.encode((x.t(), 1, 1.0, False, torch.Size([1]), {"k": x.sum(0, keepdim=True)}))[0]
    out.sum().backward()  # a tensor crosses as a new tensor whose gradient reaches the value it was
    assert x.grad is not None and torch.equal(x.grad, torch.ones(3, 2))
    with pytest.raises(PartitionError, match="crosses a cut"):
        wire("obj", ("text",))


def test_cli_export_writes_csv_and_toml(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(2, "gpipe")
    (tmp_path / "plan.json").write_text(plan.to_json())
    code = main(["export", "--plan", str(tmp_path / "plan.json"), "--csv", str(tmp_path / "s.csv"),
                 "--torchtitan", str(tmp_path / "t.toml")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "s.csv").read_text() == plan.to_torch_schedule().csv()
    config = read_toml((tmp_path / "t.toml").read_text())
    assert config["parallelism"]["pipeline_parallel_schedule_csv"] == str(tmp_path / "s.csv")
    assert "stage -> rank: 0:0, 1:1" in out and "split points: stage 1 at blocks.1.ln2" in out
    four = make_plan(4, "1f1b")
    (tmp_path / "four.json").write_text(four.to_json())
    assert main(["export", "--plan", str(tmp_path / "four.json"), "--csv", str(tmp_path / "f.csv")]) == 0
    assert "not on a module boundary: the cut before stage 3 falls inside blocks.2" in capsys.readouterr().out


def test_torch_runtime_runs_the_exported_actions_under_nccl_rules(tmp_path: Path) -> None:
    # each schedule: our runtime and torch's _PipelineScheduleRuntime (loading the exported CSV) against the plain model
    cases = ["gpipe", "1f1b", "interleaved", "zb1", "zbv", "inception:gpipe:branches"]  # tiny_gpt, then branches
    run = torchrun(2, "crosscheck", str(tmp_path), *cases, worker=WORKER, timeout=300)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 * len(cases), run.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    assert all(int(re.search(r"routed=(\d+)", line).group(1)) > 0 for line in lines)  # type: ignore[union-attr]


def test_nccl_rules_wrapper_fails_an_order_that_only_gloo_runs(tmp_path: Path) -> None:
    run = torchrun(2, "unsafe", str(tmp_path), worker=WORKER, timeout=180)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2, run.stdout[-4000:]
    assert all("ok=True" in line and "NcclRuleError" in line for line in lines), "\n".join(lines)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
