"""One number, one meaning, in every view (issue 36): the CLI's tables, `Plan.summary()`, the saved JSON, the
pictures and `simulate` say the same memory per GPU and the same micro-batches of one plan.

The plans are Llama-shaped models built on meta and planned for H100 clusters that are not here, as a 7B Llama on
16x8xH100 is; every expected number is worked out here from the arguments and the precision's bytes per state.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest

from partitioner.cli.main import main
from partitioner.predict.simulator import simulate
from partitioner.show.visualizer import DrawablePlan, page_data
from runtime.plan import human_bytes

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

FACTORY = f'''
import sys
sys.path.insert(0, {str(ROOT / "benchmarks")!r})
import torch
from published_models import Llama, LlamaShape

SMALL = LlamaShape(layers=4, width=256, ffn=512, heads=8, kv_heads=8, vocab=1000, seq=128)
WIDE = LlamaShape(layers=2, width=1024, ffn=4096, heads=8, kv_heads=8, vocab=32000, seq=4096)


def _make(shape, batch):
    with torch.device("meta"):
        model = Llama(shape)
    return model, (torch.zeros(batch, shape.seq, dtype=torch.long, device="meta"),)


def small(batch=8):
    return _make(SMALL, batch)


def wide(batch=8):
    return _make(WIDE, batch)
'''


def cli(argv: list[str]) -> tuple[int, str]:
    """`python -m partitioner ARGV` in this process: exit code and stdout (one line per line: 300 columns)."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        mp.setenv("COLUMNS", "300")
        code = main(argv)
    return code, out.getvalue()


def svg_text(path: Path) -> list[str]:
    """The strings a matplotlib SVG draws (text kept as text)."""
    return [re.sub(r"\s+", " ", t).strip() for t in re.findall(r"<text[^>]*>([^<]*)</text>", path.read_text())]


@pytest.fixture(scope="module")
def factory(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("models") / "llamas.py"
    path.write_text(FACTORY)
    return path


@pytest.fixture(scope="module")
def sliced(factory: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A small Llama on 2x8xH100, replicas sharded zero1 (each micro-batch sliced over them): the 7B case in small."""
    where = tmp_path_factory.mktemp("sliced")
    saved, svg = where / "plan.json", where / "plan.svg"
    code, out = cli(["plan", f"{factory}:small", "--cluster", "2x8xH100", "--dtype", "bf16", "--global-batch", "64",
                     "--micro-batches", "32", "--sharding", "zero1", "--tensor", "1", "--save", str(saved),
                     "--out", str(svg), "--quiet"])  # fmt: skip
    assert code == 0, out
    return {"out": out, "saved": saved, "svg": svg, "plan": DrawablePlan.from_json(saved.read_text())}


def test_every_view_says_the_same_micro_batches(sliced: dict[str, Any]) -> None:
    plan = sliced["plan"]
    d = len(plan.stages[0].ranks)  # the replicas the search chose
    assert plan.data_split == "slice" and all(len(s.ranks) == d for s in plan.stages) and 32 % d == 0
    # by hand: 64 samples in the 32 micro-batches asked for, each of 64 / 32 samples, 32 / d on each replica
    words = f"32 micro-batches ({32 // d} per replica x {d} replicas) of 2 samples"
    assert f"global batch 64 in {words}, schedule" in sliced["out"]  # the CLI
    assert json.loads(sliced["saved"].read_text())["micro_batches"] == 32 // d  # the JSON: each replica's count
    assert plan.pieces == 32
    graph_input = next(n for n in plan.graph["nodes"] if n["op"] == "placeholder")
    assert graph_input["shapes"][0][0] == 2  # the micro-batch one replica's GPU runs
    assert f"1 stages (hybrid), {words}, schedule" in plan.summary()  # Plan.summary()
    assert page_data(plan)["plan"]["micro_batch_words"] == words  # the HTML page's data
    assert any(t.startswith(words) for t in svg_text(sliced["svg"]))  # the picture
    code, out = cli(["simulate", "--plan", str(sliced["saved"]), "--quiet"])
    assert code == 0 and f"{sliced['saved']}: 1 stages, {words}, schedule" in out  # simulate
    (timeline,) = page_data(plan)["timelines"]  # each replica draws its own micro-batches 0 .. 32 / d - 1
    assert {e["mb"] for row in timeline["rows"] for e in row["events"] if e["kind"] == "F"} == set(range(32 // d))


def test_time_per_micro_batch_is_what_the_timeline_draws(sliced: dict[str, Any]) -> None:
    plan = sliced["plan"]
    (stage,) = plan.stages
    row = simulate(plan).devices[0]
    one = sum(e.duration for e in row.events if e.microbatch == 0 and e.kind.startswith("compute"))  # F0 + B0
    label = f"{one:.2f} ms per micro-batch on each of {stage.replicas} replicas"  # by hand: 1 ms <= one < 100 ms
    assert 1 <= one < 100 and stage.predicted_ms < one / 2  # the old label (divided by the replicas) differs
    assert any(label in t for t in svg_text(sliced["svg"]))  # the stage's band over the graph


def test_picture_memory_is_the_plans_memory_per_gpu(sliced: dict[str, Any]) -> None:
    plan = sliced["plan"]
    (stage,) = plan.stages
    total, cap = human_bytes(stage.memory_bytes), human_bytes(stage.capacity_bytes)
    rows = [line.split() for line in sliced["out"].splitlines() if line.split()[:2] == ["0", "0-15"]]
    assert rows and " ".join(rows[0][-4:]) == f"{total} {cap}"  # memory per GPU, capacity
    texts = svg_text(sliced["svg"])
    assert any(t.startswith(f"{total} of {cap}") for t in texts), texts  # the picture: the same total
    assert any("master weights" in t and "optimizer states" in t for t in texts)
    device = page_data(plan)["devices"][0]
    assert sum(device["kinds"].values()) == stage.memory_bytes == device["memory_bytes"]  # the HTML page's bars


@pytest.fixture(scope="module")
def wide(factory: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A Llama 4096 tokens wide on 1x8xH100, nothing sharded or split: 8 replicas, each on its own GPU."""
    where = tmp_path_factory.mktemp("wide")
    saved, svg = where / "plan.json", where / "plan.svg"
    code, out = cli(["plan", f"{factory}:wide", "--cluster", "1x8xH100", "--dtype", "bf16", "--global-batch", "64",
                     "--micro-batches", "8", "--sharding", "none", "--tensor", "1", "--save", str(saved), "--out",
                     str(svg), "--quiet"])  # fmt: skip
    assert code == 0, out
    return {"out": out, "saved": saved, "svg": svg, "plan": DrawablePlan.from_json(saved.read_text())}


def test_picture_memory_counts_master_weights_and_optimizer_states(wide: dict[str, Any]) -> None:
    """16 bytes per parameter before activations (bf16 weights, fp32 master weights, fp32 gradients, 2 fp32 Adam
    moments): the picture's total is the plan's memory per GPU, which holds them all."""
    plan = wide["plan"]
    (stage,) = plan.stages
    assert stage.replicas == 8 and stage.sharding == "none" and plan.precision["name"] == "mixed"
    states = 8 * stage.param_bytes  # param_bytes counts 2 bytes a parameter
    assert stage.memory_bytes >= states + stage.activation_bytes
    total = human_bytes(stage.memory_bytes)
    old = human_bytes(2 * stage.param_bytes + stage.activation_bytes)  # what the picture showed: no master, no Adam
    texts = svg_text(wide["svg"])
    assert any(t.startswith(f"{total} of ") for t in texts) and not any(t.startswith(f"{old} of ") for t in texts)
    rows = [line.split() for line in wide["out"].splitlines() if line.split()[:2] == ["0", "0-7"]]
    assert rows and " ".join(rows[0][-4:-2]) == total  # the CLI table's memory per GPU


def test_fitting_candidates_are_not_over_memory(wide: dict[str, Any]) -> None:
    """Each of the 8 replicas fits its own GPU (8 of them would not fit one): no candidate is "(over memory)"."""
    plan = wide["plan"]
    (stage,) = plan.stages
    assert stage.memory_bytes < stage.capacity_bytes < 8 * stage.memory_bytes
    compared = wide["out"].split("predicted step of each candidate compared:")[1].splitlines()[0]
    assert len(plan.alternatives) >= 2 and "over memory" not in compared, compared
    assert not any("over memory" in name for name in plan.alternatives)
    assert [p.device for p in plan.programs] == [f"cuda:{r}" for r in range(8)]  # each replica on its own GPU


def test_simulate_a_saved_plan_reproduces_its_predicted_step_and_folds_ranks(sliced: dict[str, Any]) -> None:
    plan = sliced["plan"]
    (stage,) = plan.stages
    assert stage.sharding == "zero1" and stage.allreduce_ms > 0 and not plan.programs  # lowered where it runs
    code, out = cli(["simulate", "--plan", str(sliced["saved"]), "--quiet"])
    assert code == 0, out
    found = re.search(r"makespan ([\d.]+) ms", out)
    assert found and float(found.group(1)) == pytest.approx(plan.predicted_step_ms, abs=5e-4), out
    assert f"the plan's predicted step {plan.predicted_step_ms:.3f} ms" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("  ")]
    assert [r[:4] for r in rows] == [["ranks", "0-15", "(x16)", "0"]]  # 16 identical ranks: one row
    assert "16 ranks simulated as 1 row (identical ranks folded" in out
    code, again = cli(["simulate", "--plan", str(sliced["saved"]), "--micro-batches", "64", "--quiet"])  # in the step
    assert code == 0 and f"64 micro-batches ({64 // stage.replicas} per replica x {stage.replicas} replicas)" in again
    code, _ = cli(["simulate", "--plan", str(sliced["saved"]), "--micro-batches", "33", "--quiet"])
    assert code == 2  # 33 micro-batches cannot be sliced over the replicas


def test_plan_log_and_summary_count_the_same_micro_batches(caplog: pytest.LogCaptureFixture) -> None:
    """plan(micro_batches=4) of a zero3 plan over 4 replicas: the log's 4 micro-batches are the summary's 4 (1 on
    each replica), not the 1 the plan stores per replica."""
    import partitioner
    from tests import zoo

    model, args, _ = zoo.tiny_gpt()
    batch = args[0].shape[0]
    with caplog.at_level(logging.INFO):
        plan = partitioner.plan(model, cluster="1x4xH100", example_inputs=args, micro_batches=4, replicas="auto",
                                sharding="zero3", precision="mixed")
    assert plan.micro_batches == 1 and plan.data_split == "slice" and [s.replicas for s in plan.stages] == [4]
    assert any("4 micro-batches" in r.getMessage() for r in caplog.records)
    samples = f" of {batch // 4} samples" if batch % 4 == 0 else ""
    assert f"4 micro-batches (1 per replica x 4 replicas){samples}" in plan.summary()


def test_micro_batch_words_literal() -> None:
    from runtime.plan import Plan, StagePlan, micro_batch_words

    def plan(replicas: list[int], split: str = "deal", graph: Any = None) -> Plan:
        stages = [StagePlan(k, "cpu", [f"n{k}"], ranks=list(range(10 * k, 10 * k + r))) for k, r in enumerate(replicas)]
        return Plan(stages, micro_batches=8, data_split=split, graph=graph)  # type: ignore[arg-type]

    assert micro_batch_words(plan([1, 1]), 32) == "8 micro-batches of 4 samples"
    assert micro_batch_words(plan([1, 1]), 30) == "8 micro-batches"  # 30 samples do not cut evenly into 8
    assert micro_batch_words(plan([2, 2]), 32) == "8 micro-batches (4 per replica x 2 replicas) of 4 samples"
    assert micro_batch_words(plan([2, 2], "slice"), 32) == "16 micro-batches (8 per replica x 2 replicas) of 2 samples"
    assert micro_batch_words(plan([2, 1])) == "8 micro-batches (dealt over 2/1 replicas)"
    graph = {"nodes": [{"name": "x", "op": "placeholder", "position": 0, "shapes": [[3, 7]]}], "edges": []}
    assert micro_batch_words(plan([4], "slice", graph)) == "32 micro-batches (8 per replica x 4 replicas) of 3 samples"
    one = plan([1])
    one.micro_batches = 1
    assert micro_batch_words(one, 1) == "1 micro-batch of 1 sample"
    assert [plan([2, 2]).pieces, plan([2, 2], "slice").pieces, plan([2, 1]).pieces] == [8, 16, 8]
