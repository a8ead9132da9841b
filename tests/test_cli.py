"""`python -m partitioner`: the plan table, simulate and profile output, and exit codes with reasons."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from partitioner.capture.graph import compute_nodes
from partitioner.capture.trace import trace
from partitioner.cli.inputs import UsageError, load_example
from partitioner.cli.main import main
from partitioner.meta import empty_weights
from partitioner.predict.assemble import finish
from partitioner.show.visualizer import DrawablePlan
from tests import zoo

ROOT = Path(__file__).resolve().parent.parent


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """main(argv) in this process: exit code, stdout, stderr (argparse errors exit through SystemExit)."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "160")


def test_help_reads_well() -> None:
    result = subprocess.run([sys.executable, "-m", "partitioner", "--help"], capture_output=True, text=True, cwd=ROOT,
                            timeout=120, check=False)
    assert result.returncode == 0
    for words in ("plan", "profile", "simulate", "MODULE:FACTORY", "PYTHONPATH", "one micro-batch",
                  "exit codes: 0 success"):
        assert words in result.stdout
    result = subprocess.run([sys.executable, "-m", "partitioner", "plan", "--help"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0 and "--micro-batches M" in result.stdout and ".html (interactive)" in result.stdout


def test_plan_prints_the_table_and_writes_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    html, saved = tmp_path / "plan.html", tmp_path / "plan.json"
    code, out, err = run(["plan", "tests.zoo:tiny_gpt", "--devices", "cpu,cpu", "--micro-batches", "2",
                          "--out", str(html), "--save", str(saved), "--quiet"], capsys)  # fmt: skip
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].strip() == "tests.zoo:tiny_gpt: 2 stages"
    assert lines[1].split() == ["stage", "device", "nodes", "first", "..", "last", "node", "compute", "ms", "comm",
                                "ms", "total", "ms", "params", "activations", "sends"]  # fmt: skip
    rows = [line.split() for line in lines[3:5]]
    assert [r[:2] for r in rows] == [["0", "cpu"], ["1", "cpu"]]
    model, args, kwargs = zoo.tiny_gpt()
    assert int(rows[0][2]) + int(rows[1][2]) == len(compute_nodes(trace(model, args, kwargs).graph_module))
    assert "batch 7 in 2 micro-batches, schedule gpipe, pipeline; bottleneck" in out and "bubble" in out
    assert f"wrote {html}" in out and 'id="plan-data"' in html.read_text()
    plan = DrawablePlan.from_json(saved.read_text())
    assert plan.graph is not None and [s.device for s in plan.stages] == ["cpu", "cpu"]


def test_simulate_a_saved_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    saved = tmp_path / "plan.json"
    assert run(["plan", "tests.zoo:mlp", "--devices", "cpu,cpu,cpu", "--save", str(saved), "--quiet"], capsys)[0] == 0
    argv = ["simulate", "--plan", str(saved), "--schedule", "1f1b", "--micro-batches", "4", "--width", "40"]
    code, out, err = run(argv, capsys)
    assert code == 0, err
    plan = DrawablePlan.from_json(saved.read_text())
    plan.micro_batches, plan.schedule = 4, "1f1b"
    expected = finish(plan)  # the plan's programs lowered again, priced as saved
    computes = [str(op) for op in plan.programs[0].ops if op.is_compute]
    assert computes[:4] == ["F s0 mb0 t0", "F s0 mb1 t1", "F s0 mb2 t2", "B s0 mb0 t5"]
    assert f"{saved}: 3 stages, 4 micro-batches, schedule 1f1b" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  cpu ")]  # a row per rank: none alike
    assert [r[:3] for r in rows] == [["cpu", str(k), f"{d.busy_ms:.3f}"] for k, d in enumerate(expected.devices)]
    assert f"makespan {expected.makespan_ms:.3f} ms, bubble fraction {expected.bubble_fraction:.1%}" in out


def test_simulate_from_a_factory_writes_the_picture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    svg = tmp_path / "timeline.dot"
    argv = ["simulate", "tests.zoo:inception", "--devices", "cpu,cpu", "--micro-batches", "3", "--out", str(svg),
            "--quiet"]
    code, out, _ = run(argv, capsys)
    assert code == 0 and "bubble fraction" in out and svg.read_text().startswith("digraph plan")


@pytest.mark.parametrize("command", ["plan", "simulate"])
def test_schedule_auto_prints_the_choice_the_planner_makes(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cost_model.analytic import AnalyticCostModel
    from partitioner import plan

    code, out, err = run([command, "tests.zoo:tiny_gpt", "--devices", "cpu,cpu", "--micro-batches", "4",
                          "--schedule", "auto", "--quiet"], capsys)
    assert code == 0, err
    model, args, kwargs = zoo.tiny_gpt()
    expected = plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule="auto",
                    cost_model=AnalyticCostModel())  # what the CLI plans with, without --profile
    assert f"schedule {expected.schedule}" in out
    assert set(expected.alternatives) == {"gpipe", "1f1b", "interleaved", "zb1", "zbv", "dualpipev"}
    compared = ", ".join(f"{name} {ms:.3f} ms" for name, ms in expected.alternatives.items())
    assert f"predicted step of each {'schedule' if command == 'plan' else 'candidate'} compared: {compared}" in out


@pytest.mark.parametrize("schedule", ["interleaved", "zb1", "zbv"])
def test_every_schedule_and_recomputation_from_the_command_line(schedule: str,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    from cost_model.analytic import AnalyticCostModel
    from partitioner import plan

    code, out, err = run(["simulate", "tests.zoo:tiny_gpt", "--devices", "cpu,cpu", "--micro-batches", "4",
                          "--schedule", schedule, "--recompute", "full", "--quiet"], capsys)
    assert code == 0, err
    model, args, _ = zoo.tiny_gpt()
    expected = plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule=schedule,  # type: ignore[arg-type]
                    recompute="full", cost_model=AnalyticCostModel())
    stages = len(expected.stages)
    assert f"{stages} stages, 4 micro-batches, schedule {schedule}, recompute {', '.join(['full'] * stages)}" in out
    assert f"makespan {expected.predicted_step_ms:.3f} ms" in out
    code, out, err = run(["plan", "tests.zoo:tiny_gpt", "--devices", "cpu,cpu", "--micro-batches", "4",
                          "--schedule", schedule, "--recompute", "full", "--quiet"], capsys)
    assert code == 0 and f"schedule {schedule}, recompute {', '.join(['full'] * stages)}, pipeline" in out, err


@pytest.mark.parametrize("update", ["2bw", "stash"])
def test_asynchronous_updates_from_the_command_line(update: str, capsys: pytest.CaptureFixture[str]) -> None:
    from cost_model.analytic import AnalyticCostModel
    from partitioner import plan

    argv = ["plan", "tests.zoo:mlp", "--devices", "cpu,cpu", "--micro-batches", "4", "--quiet"]
    code, out, err = run([*argv, "--schedule", "1f1b", "--update", update], capsys)
    assert code == 0, err
    model, args, _ = zoo.mlp()
    expected = plan(model, ["cpu", "cpu"], example_inputs=args, micro_batches=4, schedule="1f1b",
                    update=update, cost_model=AnalyticCostModel())  # type: ignore[arg-type]
    assert f"update {update}: steady step {expected.predicted_step_ms:.3f} ms (no flush between steps)" in out
    code, _, err = run([*argv, "--schedule", "gpipe", "--update", update], capsys)
    assert code == 2 and "use schedule='1f1b'" in err


def test_profile_shows_every_node(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(["profile", "tests.zoo:mlp", "--analytic", "--top", "0", "--quiet"], capsys)
    assert code == 0, err
    model, args, kwargs = zoo.mlp()
    names = [n.name for n in compute_nodes(trace(model, args, kwargs).graph_module)]
    assert all(f" {name} " in out for name in names) and f"{len(names)} nodes, forward" in out
    assert "Linear" in out and "GELU" in out  # module calls show their class
    code, out, _ = run(["profile", "tests.zoo:mlp", "--analytic", "--sort", "time", "--top", "2", "--quiet"], capsys)
    assert code == 0 and f"({len(names) - 2} more rows: --top 0 shows all)" in out


@pytest.mark.parametrize(
    "argv, reason",
    [
        ([], "the following arguments are required: COMMAND"),
        (["plan"], "the following arguments are required: MODULE:FACTORY"),
        (["plan", "tests.zoo:mlp", "--schedule", "zigzag"], "invalid choice: 'zigzag'"),
        (["plan", "nocolon"], "'nocolon' is not MODULE:FACTORY; write e.g. mymodels:make_model"),
        (["plan", "no_such_module_xyz:make"], "cannot import 'no_such_module_xyz'"),
        (["plan", "tests.zoo:nope"], "tests.zoo has no 'nope'; callables there:"),
        (["plan", "tests.zoo:BATCH"], "BATCH is a int, not a function"),
        (["plan", "tests.zoo:MLP"], "tests.zoo:MLP returned MLP; it must return (model, example_inputs)"),
        (["plan", "tests.zoo:Block"], "calling tests.zoo:Block failed: TypeError"),  # needs arguments
        (["plan", "missing.py:make"], "no file missing.py"),
        (["plan", "tests.zoo:mlp", "--devices", "cpu,,cpu"], "--devices 'cpu,,cpu' has an empty entry"),
        (["plan", "tests.zoo:mlp", "--devices", "cuda:99"], "--devices:"),
        (["plan", "tests.zoo:mlp", "--batch", "5"], "batch 7, but --batch 5 needs 5;"),
        (["plan", "tests.zoo:mlp", "--micro-batches", "0"], "--micro-batches 0: use 1 or more"),
        (["plan", "tests.zoo:mlp", "--micro-batches", "9"], "--micro-batches 9 is more than the batch of 7"),
        (["plan", "tests.zoo:mlp", "--out", "plan.txt"], "--out plan.txt: the suffix picks the picture"),
        (["simulate"], "simulate needs either MODULE:FACTORY or --plan PLAN.json"),
        (["simulate", "--plan", "missing.json"], "--plan missing.json: cannot read a saved plan"),
        (["plan", "tests.zoo:mlp", "--recompute", "most"], "invalid choice: 'most'"),
        (["simulate", "--plan", "p.json", "--recompute", "full"], "--recompute full with --plan: a saved plan carries"),
        (["simulate", "--plan", "p.json", "--schedule", "auto"], "--schedule auto with --plan: choosing a schedule"),
    ],
)
def test_bad_arguments_exit_2_with_the_reason(argv: list[str], reason: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(argv, capsys)
    assert code == 2
    assert reason in " ".join(err.split()), err


def test_exit_code_of_the_real_command() -> None:
    result = subprocess.run([sys.executable, "-m", "partitioner", "plan", "nocolon"], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 2 and "error: 'nocolon' is not MODULE:FACTORY" in result.stderr


def test_factory_forms(tmp_path: Path) -> None:
    (tmp_path / "models.py").write_text(
        "import torch\nfrom torch import nn\n"
        "def sized(batch=4):\n    return nn.Linear(3, 2), torch.randn(batch, 3)\n"
        "def micro():\n    return nn.Linear(3, 2), (torch.randn(2, 3),)\n"
        "def wrong():\n    return 3\n"
        "class Branchy(nn.Module):\n    def forward(self, x):\n        return x if x.sum().item() > 0 else -x\n"
        "def untraceable():\n    return Branchy(), torch.randn(4, 3)\n"
    )
    path = str(tmp_path / "models.py")
    assert load_example(path + ":sized", None, 1).batch == 4
    example = load_example(path + ":sized", 12, 3)  # called with batch=12
    assert example.batch == 12 and example.args[0].shape == (12, 3)
    example = load_example(path + ":micro", 8, 4)  # one micro-batch of 2, repeated to the full batch
    assert example.args[0].shape == (8, 3) and torch.equal(example.args[0][:2], example.args[0][6:])
    with pytest.raises(UsageError, match=r"needs 6 \(a full batch\) or 1.5 \(one micro-batch\)"):
        load_example(path + ":micro", 6, 4)
    with pytest.raises(UsageError, match=r"batch 2, but --batch 6 needs 6; change --batch"):  # one size only
        load_example(path + ":micro", 6, 1)
    with pytest.raises(UsageError, match=r"returned int; it must return \(model, example_inputs\)"):
        load_example(path + ":wrong", None, 1)
    # the work failed, not the arguments
    assert main(["plan", path + ":untraceable", "--devices", "cpu", "--quiet"]) == 1


GPT = f"{ROOT / 'examples' / 'models.py'}:make_gpt"
CLUSTER = ["--cluster", "2x8xH100", "--dtype", "bf16", "--quiet"]


def _make_gpt(batch: int) -> tuple[torch.nn.Module, torch.Tensor]:
    """examples/models.py's make_gpt, imported here on its own (not through the command line's loader)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("examples_models_for_test", ROOT / "examples" / "models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    model, (x,) = module.make_gpt(batch=batch)
    return model, x


def test_plan_for_a_cluster_that_is_not_here(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import re

    from torch.utils.flop_counter import FlopCounterMode

    import partitioner
    from cost_model.gpu_table import GpuTable

    html, saved = tmp_path / "plan.html", tmp_path / "plan.json"
    code, out, err = run(["plan", GPT, *CLUSTER, "--global-batch", "32", "--micro-batches", "16", "--replicas", "auto",
                          "--schedule", "auto", "--out", str(html), "--save", str(saved)], capsys)  # fmt: skip
    assert code == 0, err
    for words in ("on 2x8xH100-SXM", "16 GPUs on 2 hosts", "replicas", "hosts", "memory per GPU", "capacity"):
        assert words in out, out
    found = re.search(r"predicted step ([\d.]+) ms, samples/s ([\d.]+), tokens/s ([\d.]+), MFU ([\d.]+)%", out)
    assert found, out
    step_ms, samples, tokens, mfu = (float(v) for v in found.groups())

    model, x = _make_gpt(32)  # the same model and batch through the API, in bf16 as --dtype bf16 casts it
    model = model.to(torch.bfloat16)
    ref = partitioner.plan(model, cluster="2x8xH100", example_inputs=(x,), micro_batches=16, replicas="auto",
                           schedule="auto", precision="mixed")  # fmt: skip  (--cluster's default precision)
    assert step_ms == pytest.approx(ref.predicted_step_ms, abs=1e-4)
    step_s = ref.predicted_step_ms / 1e3
    assert samples == pytest.approx(32 / step_s, abs=0.1)
    assert tokens == pytest.approx(32 * x.shape[1] / step_s, abs=0.1)  # token ids: batch x sequence
    with FlopCounterMode(display=False) as counter:  # model FLOPs counted on the plain model
        model(x)
    peak = GpuTable.load().get("H100").bf16_flops
    expected = 3 * counter.get_total_flops() / (step_s * 16 * peak)
    assert mfu / 100 == pytest.approx(expected, rel=1e-3, abs=5e-7)  # printed to 4 decimals of a percent
    rows = [line.split() for line in out.splitlines()]
    for s in ref.stages:  # each stage's row: its ranks (tensor ranks too), replicas, tensor degree, sharding, hosts
        hosts = sorted({r // 8 for r in s.all_ranks})
        assert s.all_ranks == list(range(s.all_ranks[0], s.all_ranks[-1] + 1))  # the planner gives runs of ranks
        span = [f"{v[0]}-{v[-1]}" if len(v) > 1 else str(v[0]) for v in (s.all_ranks, hosts)]
        assert [str(s.index), span[0], str(len(s.ranks)), str(s.tensor), s.sharding, span[1]] in [r[:6] for r in rows]
    words = " ".join(out.split())  # rich wraps long lines at the console's width
    assert "memory per GPU by kind" in words and "precision mixed: bf16 compute, fp32 master weights" in words

    loaded = DrawablePlan.from_json(saved.read_text())
    assert loaded.gpus_per_host == 8 and [s.ranks for s in loaded.stages] == [s.ranks for s in ref.stages]
    assert [s.nodes for s in loaded.stages] == [s.nodes for s in ref.stages]
    assert loaded.predicted_step_ms == pytest.approx(ref.predicted_step_ms)
    assert html.stat().st_size > 0


def test_cluster_plan_chooses_the_micro_batches(capsys: pytest.CaptureFixture[str]) -> None:
    import re

    code, out, err = run(["plan", GPT, *CLUSTER, "--global-batch", "32", "--replicas", "auto"], capsys)
    assert code == 0, err
    tried = dict(re.findall(r"(\d+) ([\d.]+) ms", out.split("micro-batch count tried:")[1].splitlines()[0]))
    assert set(tried) == {"16", "32"}  # the largest divisors of 32 up to 1, 2 and 4 per GPU
    chosen = re.search(r"global batch 32 in (\d+) micro-batches", out)
    assert chosen and float(tried[chosen.group(1)]) == min(float(v) for v in tried.values())


def meta_gpt(batch: int = 32) -> tuple[torch.nn.Module, tuple[torch.Tensor]]:
    """examples/models.py's GPT built on meta: a MODULE:FACTORY planned from shapes alone."""
    with empty_weights():
        model, x = _make_gpt(batch)
    return model, (x,)


def test_cluster_plan_traces_once_for_every_micro_batch_count(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 36 item 7: the counts the command tries share one trace, and each count's plan is plan()'s for it."""
    import re

    import partitioner
    from partitioner.capture import example

    traces: list[str] = []
    real = example.trace

    def counted(model: torch.nn.Module, *args: object, **kwargs: object) -> object:
        traces.append(type(model).__name__)
        return real(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(example, "trace", counted)
    code, out, err = run(["plan", "tests.test_cli:meta_gpt", *CLUSTER, "--global-batch", "32"], capsys)
    assert code == 0, err
    tried = dict(re.findall(r"(\d+) ([\d.]+) ms", out.split("micro-batch count tried:")[1].splitlines()[0]))
    assert set(tried) == {"16", "32"} and traces == ["GPT"]
    model, x = meta_gpt()
    model.to(torch.bfloat16)  # as --dtype bf16 casts it
    for m, ms in tried.items():  # what the one trace planned is what planning the count on its own makes
        alone = partitioner.plan(model, cluster=CLUSTER[1], example_inputs=x, micro_batches=int(m), replicas="auto",
                                 schedule="auto", precision="mixed")
        assert f"{alone.predicted_step_ms:.3f}" == ms


def test_cluster_plan_told_not_to_shard_or_split(capsys: pytest.CaptureFixture[str]) -> None:
    """--sharding none and --tensor 1 reach the search: left free, this batch of 2 on 8 H100 splits and shards."""
    argv = ["plan", GPT, "--cluster", "1x8xH100", "--quiet", "--global-batch", "2", "--micro-batches", "2",
            "--schedule", "1f1b"]

    def stage_rows(out: str) -> list[list[str]]:
        lines = out.splitlines()
        at = next(i for i, line in enumerate(lines) if line.split()[:5] == ["stage", "ranks", "replicas", "tensor",
                                                                            "sharding"])
        return [line.split() for line in lines[at + 2:] if line.split() and line.split()[0].isdigit()][:8]

    code, out, err = run(argv, capsys)
    assert code == 0, err
    free = stage_rows(out.split("memory per GPU by kind")[0])
    assert any(r[3] != "1" for r in free) and any(r[4] != "none" for r in free), out
    code, out, err = run([*argv, "--sharding", "none", "--tensor", "1"], capsys)
    assert code == 0, err
    told = stage_rows(out.split("memory per GPU by kind")[0])
    assert told and all(r[3:5] == ["1", "none"] for r in told), out
    code, _, err = run([*argv, "--tensor", "two"], capsys)
    assert code == 2 and "--tensor 'two': write auto, or a tensor degree" in err, err
    code, _, err = run([*argv, "--sharding", "zero1", "--precision", "none"], capsys)
    assert code == 2 and "sharding='zero1' needs the training precision" in err, err


HUGE = ("import torch\nfrom torch import nn\n"
        "def make(batch=16):\n    with torch.device('meta'):\n"
        "        model = nn.Sequential(*[nn.Linear(32768, 32768) for _ in range(160)])\n"
        "    return model, (torch.randn(batch, 32768),)\n")  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--global-batch", "32", "--micro-batches", "16", "--replicas", "8,8,8"], "too few GPUs for the stages"),
        (["--global-batch", "30", "--micro-batches", "16"], "--global-batch 30 does not divide into 16 micro-batches"),
        (["--global-batch", "12", "--micro-batches", "6", "--replicas", "2,2,2,2,2,2,4"],
         "--micro-batches 6 do not divide over the 4 replicas of stage 6"),
        (["--cluster", "0x8xH100"], "hosts must be >= 1"),  # any size above 0 plans (tests/test_cluster_search.py)
        (["--devices", "cpu,cpu"], "--devices with --cluster"),
        (["--cluster", "2x8xH1000"], "unknown GPU type 'H1000'"),
        (["--replicas", "2,x"], "--replicas '2,x': write auto"),
        (["HUGE", "--global-batch", "16", "--micro-batches", "16", "--replicas", ",".join(["1"] * 16),
          "--schedule", "gpipe"], "stage 0 does not fit in memory per GPU"),
        (["HUGE", "--global-batch", "16", "--micro-batches", "16"], "the model does not fit in memory per GPU"),
        (["HUGE", "--global-batch", "16", "--micro-batches", "16", "--replicas", "auto"],
         "the model does not fit in memory per GPU"),
    ],
)
def test_cluster_errors_name_what_does_not_fit(argv: list[str], reason: str, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    target = GPT
    if argv[0] == "HUGE":  # 160 layers of 32768 x 32768 on meta: 320 GiB of bf16 weights over 16 GPUs
        (tmp_path / "huge.py").write_text(HUGE)
        target, argv = f"{tmp_path / 'huge.py'}:make", argv[1:]
    code, _, err = run(["plan", target, *CLUSTER, *argv], capsys)
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1 and reason in err, err
    if reason == "the model does not fit in memory per GPU":  # and why: the fullest GPU's states and activations
        assert "Its fullest GPU (stage " in err and " of activations: " in err, err


def test_mfu_divides_by_the_peak_of_the_precision_products_run_in(capsys: pytest.CaptureFixture[str]) -> None:
    # an fp32 model under --cluster's default precision ("mixed") runs its products in bf16: its MFU is over the
    # bf16 peak, as the same plan's model cast to bf16 (--dtype bf16) reports it, not over the fp32 one (15x lower)
    import re

    lines = {}
    for dtype in ([], ["--dtype", "bf16"]):
        code, out, err = run(["plan", GPT, "--cluster", "1x8xH100", *dtype, "--global-batch", "16",
                              "--micro-batches", "4", "--quiet"], capsys)  # fmt: skip
        assert code == 0, err
        found = re.search(r"MFU ([\d.]+)%, ([\d.]+) TFLOP/s per GPU.*over 8 GPUs x ([\d.]+) TFLOP/s \(\S+ dense (\w+) "
                          r"peak\)", out, re.S)
        assert found, out
        lines[bool(dtype)] = found.groups()
    assert lines[False][2:] == lines[True][2:] == ("989.4", "bf16")
    assert 0 < float(lines[False][0]) <= 100
