"""Plans for torch.distributed.pipelining and torchtitan: actions, split points, torchtitan jobs, CSV import, a run by
torch (the torchtitan jobs beside torchtitan itself: tests/test_torchtitan_export.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
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
from partitioner.export import from_torch_schedule, read_torch_actions, to_torch_schedule
from partitioner.export.pipelines import pipeline_schedule
from partitioner.export.torchtitan import torchtitan_job
from partitioner.export.wire import wire
from partitioner.predict.simulator import simulate
from rules.schedules import schedule_names, unregister
from tests import zoo
from tests.batch import Job, Launch
from tests.test_distributed import launch_jobs

WORKER = str(Path(__file__).resolve().parent / "export_worker.py")
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


def overrides(args: list[str]) -> dict[str, str]:
    """torchtitan's `--section.key=value` arguments as a dict."""
    return dict(a.split("=", 1) for a in args if a.startswith("--") and "=" in a)


def test_torchtitan_job_sets_every_degree_the_batch_and_the_module_lists_with_a_comment_each() -> None:
    plan = make_plan(3, "1f1b", split_spec={"blocks.1": SplitPoint.BEGINNING, "blocks.2": SplitPoint.BEGINNING})
    job = torchtitan_job(plan, "out/schedule.csv", module="llama3", config="llama3_debugmodel")
    args = job.args()
    assert args[:4] == ["--module", "llama3", "--config", "llama3_debugmodel"]
    assert args[-1] == "activation-checkpoint:none"  # a tyro subcommand: nothing after it is read as an option
    assert overrides(args) == {  # 4 micro-batches of 2 samples (12 tokens) on 3 stages, fp32, nothing split
        "--parallelism.pipeline_parallel_degree": "3", "--parallelism.data_parallel_replicate_degree": "1",
        "--parallelism.data_parallel_shard_degree": "1", "--parallelism.tensor_parallel_degree": "1",
        "--parallelism.context_parallel_degree": "1", "--parallelism.expert_parallel_degree": "1",
        "--parallelism.pipeline_parallel_microbatch_size": "2", "--training.local_batch_size": "8",
        "--training.global_batch_size": "8", "--training.seq_len": "12",
        "--parallelism.pipeline_parallel_schedule": "PipelineScheduleSingle",
        "--parallelism.pipeline_parallel_schedule_csv": "out/schedule.csv",
        "--training.dtype": "float32", "--training.mixed_precision_param": "float32",
    }
    parts = args.index("--parallelism.module_fqns_per_model_part")  # the plan's tok, blocks.N, ln, head
    assert args[parts + 1:parts + 4] == ["tok_embeddings,layers.0", "layers.1", "layers.2,norm,lm_head"]
    assert "--training.disable_cuda_graphs" in args  # torchtitan 0.3.0 refuses CUDA graphs with a pipeline
    text = job.script()
    assert all(why and f"  # {why}\n  {' '.join(tokens)}" in text for tokens, why in job.options)
    assert "predicted step" in text and "Predicted memory per GPU" in text and not job.notes
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    cut = torchtitan_job(make_plan(2, "gpipe"))  # cut inside blocks.1: the layer goes whole where most of it runs
    assert cut.parts.parts == [["tok_embeddings", "layers.0"], ["layers.1", "layers.2", "norm", "lm_head"]]
    assert cut.notes[0].startswith("layers.1 (blocks.1): the plan cuts it before blocks_1_ln2")
    assert cut.notes[0].endswith("exported in stage 1") and "stage 0 37%, stage 1 63%" in cut.notes[0]
    with pytest.raises(ValueError, match="--module and --config"):
        cut.args()
    mixed = torchtitan_job(make_plan(2, "gpipe", recompute=["full", "none"]))  # torchtitan: one mode for all
    assert mixed.checkpointing == "activation-checkpoint:full" and "stages [1] recompute more" in mixed.notes[-1]


def test_torchtitan_refuses_what_it_cannot_run_naming_the_stage_and_the_fix() -> None:
    plan = make_plan(4, "1f1b", replicas=[2, 2])
    mixed = partitioner.Plan.from_json(plan.to_json())
    mixed.stages[1].tensor = 2
    with pytest.raises(PartitionError, match=r"stage 1 splits its layers over 2 ranks and stage 0 over 1: .*one "
                                             r"tensor degree for every stage \(tensor=2, CLI --tensor 2\)"):
        torchtitan_job(mixed)
    mixed = partitioner.Plan.from_json(plan.to_json())
    mixed.stages[1].sharding = "zero3"
    with pytest.raises(PartitionError, match=r"stage 1 shards its replicas 'zero3' and stage 0 'none': .*one "
                                             r"sharding mode for every stage"):
        torchtitan_job(mixed)
    with pytest.raises(PartitionError, match=r"stage 1 runs only parts of layers.0 \(placed in stage 0\), "
                                             r"layers.1 \(placed in stage 2\).*Fix: plan with fewer stages \(4 now, "
                                             r"the model has 3 layers\)"):
        torchtitan_job(make_plan(4, "1f1b"))  # 4 stages over 3 blocks, cut inside two of them
    flat = make_plan(2, "gpipe")
    for node in flat.graph["nodes"] if flat.graph else []:
        node["module"] = ""  # a model with no module list: nothing is layers.N
    with pytest.raises(PartitionError, match="no list of repeated layers .* run the plan on torch.distributed"):
        torchtitan_job(flat)


def test_sliced_micro_batches_are_per_replica(fake_world: Any, tmp_path: Path) -> None:
    plan = make_plan(4, "1f1b", replicas=[2, 2])  # 4 micro-batches dealt: 2 per pipeline
    plan.data_split, plan.programs = "slice", []  # every replica runs all 4, each on its slice (sharded replicas)
    sched = pipeline_schedule(plan)
    assert (sched.pipelines, sched.micro_batches, sched.stage_to_rank) == (2, 4, {0: 0, 1: 1})
    assert [sorted(a for a in row if a[1] == "F") for row in sched.actions] == [
        ["0F0", "0F1", "0F2", "0F3"], ["1F0", "1F1", "1F2", "1F3"]]
    fake_world(2)
    runtime = _PipelineScheduleRuntime(torch_stages([0], 2), n_microbatches=4)
    runtime._load_csv(str(sched.write_csv(tmp_path / "slice.csv")))  # torch's loader and validator take it
    got = overrides(torchtitan_job(plan, module="m", config="c").args())
    assert got["--training.local_batch_size"] == str(2 * 4)  # 2 samples a slice x 4 micro-batches per pipeline
    assert got["--training.global_batch_size"] == str(2 * 4 * 2)  # x 2 pipelines
    assert got["--parallelism.pipeline_parallel_microbatch_size"] == "2"


def test_replicated_stages_are_pipelines_side_by_side() -> None:
    plan = make_plan(4, "1f1b", replicas=[2, 2])
    sched = plan.to_torch_schedule()
    assert (sched.pipelines, sched.micro_batches, sched.ranks) == (2, 2, 2)
    assert sched.actions == [["0F0", "0F1", "0B0", "0B1"], ["1F0", "1B0", "1F1", "1B1"]]
    got = overrides(torchtitan_job(plan, module="m", config="c").args())
    assert (got["--parallelism.data_parallel_replicate_degree"], got["--training.local_batch_size"],
            got["--training.global_batch_size"]) == ("2", "4", "8")  # 2 micro-batches of 2 per pipeline
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


def run_script(script: Path, *extra: str, **env: str) -> tuple[list[str], list[str]]:
    """(torchrun's arguments, torchtitan.train's) of a job script, run with a torchrun that prints them."""
    echo = script.parent / "echo_args.py"
    echo.write_text("import json, sys\nprint(json.dumps(sys.argv[1:]))\n")
    run = subprocess.run(["bash", str(script), *extra], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "TORCHRUN": f"{sys.executable} {echo}", **env})
    assert run.returncode == 0, run.stderr
    argv = json.loads(run.stdout)
    at = argv.index("torchtitan.train")
    assert argv[at - 1] == "-m"
    return argv[:at - 1], argv[at + 1:]


def test_cli_export_writes_csv_and_torchtitan_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plan = make_plan(2, "gpipe")
    (tmp_path / "plan.json").write_text(plan.to_json())
    code = main(["export", "--plan", str(tmp_path / "plan.json"), "--csv", str(tmp_path / "s.csv"),
                 "--torchtitan", str(tmp_path / "job.sh"), "--torchtitan-module", "llama3"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "s.csv").read_text() == plan.to_torch_schedule().csv()
    assert "stage -> rank: 0:0, 1:1" in out and "split points: stage 1 at blocks.1.ln2" in out
    assert "pp 2 x dp_replicate 1 x dp_shard 1 x cp 1 x tp 1 x ep 1" in out
    assert "torchtitan stage 1: layers.1-2, norm, lm_head" in out
    assert "note: layers.1 (blocks.1): the plan cuts it" in out
    job = torchtitan_job(plan, str(tmp_path / "s.csv"), module="llama3", config="llama3_debugmodel")
    launch, args = run_script(tmp_path / "job.sh", "--training.steps=3", CONFIG="llama3_debugmodel", NODE_RANK="0")
    assert launch[:3] == ["--nnodes=1", "--nproc-per-node=2", "--node-rank=0"]
    assert args == [*job.args()[:-1], "--training.steps=3", job.args()[-1]]  # overrides go before the subcommand
    blank = subprocess.run(["bash", str(tmp_path / "job.sh")], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "CONFIG"})
    assert blank.returncode != 0 and "set CONFIG to the torchtitan --config" in blank.stderr
    four = make_plan(4, "1f1b")
    (tmp_path / "four.json").write_text(four.to_json())
    assert main(["export", "--plan", str(tmp_path / "four.json"), "--csv", str(tmp_path / "f.csv")]) == 0
    assert "not on a module boundary: the cut before stage 3 falls inside blocks.2" in capsys.readouterr().out
    assert main(["export", "--plan", str(tmp_path / "four.json"), "--csv", str(tmp_path / "f.csv"),
                 "--torchtitan", str(tmp_path / "four.sh")]) == 2
    assert "stage 1 runs only parts of layers.0" in capsys.readouterr().err


# each schedule: our runtime and torch's _PipelineScheduleRuntime (loading the exported CSV) against the plain model
CROSSCHECK = ["gpipe", "1f1b", "interleaved", "zb1", "zbv", "inception:gpipe:branches"]  # tiny_gpt, then branches
LAUNCH_S = 450  # the whole launch; the first test waits for it


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Both torchrun tests' jobs from one 2-rank launch (tests/batch.py); each test checks its own jobs."""
    directory = tmp_path_factory.mktemp("export")
    jobs = [*(Job(f"crosscheck {c}", "crosscheck", [str(directory), c]) for c in CROSSCHECK),
            Job("unsafe", "unsafe", [str(directory)])]  # last: it leaves a failed step behind on both ranks
    return launch_jobs(2, jobs, directory, worker=WORKER, timeout=LAUNCH_S)


@pytest.mark.timeout(LAUNCH_S + 60)
def test_torch_runtime_runs_the_exported_actions_under_nccl_rules(two_ranks: Launch) -> None:
    lines = [line for case in CROSSCHECK for line in two_ranks.lines(f"crosscheck {case}")]
    assert len(lines) == 2 * len(CROSSCHECK), "\n".join(lines)
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    assert all(int(re.search(r"routed=(\d+)", line).group(1)) > 0 for line in lines)  # type: ignore[union-attr]


@pytest.mark.timeout(LAUNCH_S + 60)
def test_nccl_rules_wrapper_fails_an_order_that_only_gloo_runs(two_ranks: Launch) -> None:
    lines = two_ranks.lines("unsafe")
    assert len(lines) == 2, "\n".join(lines)
    assert all("ok=True" in line and "NcclRuleError" in line for line in lines), "\n".join(lines)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
