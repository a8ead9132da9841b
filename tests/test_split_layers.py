"""Plans that split layers (tensor parallelism) and shard weights (FSDP2) run under torchrun, equal to the plain model.

Every run is on gloo under NCCL's rules (tests/test_distributed.torchrun): point-to-point messages through
runtime.nccl_rules, and the tensor, data-parallel and gradient groups checking before every collective that all
their ranks post the same one (runtime.nccl_rules.collective_checks). Workers: tests/split_worker.py.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import torch

from partitioner import PartitionError, partition, plan
from runtime.distributed import NCCL_RULES_ENV
from tests import split_worker
from tests.batch import Job, Launch
from tests.test_distributed import launch_jobs, results, torchrun

WORKER = str(Path(__file__).resolve().parent / "split_worker.py")


def run(ranks: int, *args: str, cases: int, nccl_rules: bool = True) -> list[str]:
    proc = torchrun(ranks, *args, worker=WORKER, timeout=600, nccl_rules=nccl_rules)
    lines = results(proc.stdout)
    assert proc.returncode == 0 and len(lines) == ranks * cases, proc.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    return lines


# The 4-rank cases of every test below, run in one launch (a launch costs each of the 4 ranks an import of torch,
# transformers and partitioner: ~30 s on CI's 2 cores, eleven times before); each test checks its own cases' jobs
TENSOR = ["gpt:1f1b:tp2pp2", "gpt4:interleaved:tp2pp2", "gpt:1f1b:tp2dp2"]
HUGGING_FACE = ["llama:1f1b:tp2pp2", "llama:gpipe:tp2dp2", "gpt2:1f1b:tp2pp2", "gpt2:1f1b:tp2dp2"]
CNN = ["cnn:1f1b:dp2tp2", "cnn:gpipe:tp2dp2"]
FSDP = ["gpt:1f1b:pp2dp2:zero1", "gpt:1f1b:pp2dp2:zero2", "gpt:1f1b:pp2dp2:zero3", "gpt:gpipe:pp2dp2:zero3",
        "gpt:1f1b:pp2dp2:zero1:full", "gpt:1f1b:pp2dp2:zero2:full", "gpt:1f1b:pp2dp2:zero3:full",
        "gpt:1f1b:pp2dp2:zero3:selective", "gpt4:gpipe:pp2dp2:zero2:full/none", "gpt:1f1b:tp2dp2:zero3",
        "gpt:1f1b:tp2dp2:zero1:full"]
MODES = ["modes:1f1b:pp2dp2:zero3", "modes:1f1b:pp2dp2:zero3:none:eval", "modes:gpipe:pp2dp2:zero1:full:eval",
         "gpt2x4:1f1b:pp2dp2:zero3:none:eval", "gpt2x4:1f1b:tp2dp2:zero1:full:eval", "tail:1f1b:pp2dp2:zero3"]
MIXED = ["gpt:1f1b:tp2dp2:zero3:none:mixed", "gpt2x4:1f1b:tp2dp2:zero1:full:mixed"]
FAMILIES = ["hf-persimmon:1f1b:pp2dp2:zero3", "hf-phi:1f1b:tp2dp2:zero1", "hf-starcoder2:1f1b:tp2pp2",
            "hf-qwen2_moe:gpipe:pp2dp2:zero3:none:eval", "hf-gpt_bigcode:gpipe:tp2dp2:zero3"]
MEMORY = ["gpt:1f1b:pp2dp2:zero1", "gpt:1f1b:pp2dp2:zero2", "gpt:1f1b:pp2dp2:zero3", "gpt:1f1b:pp2dp2:zero3:full",
          "gpt:1f1b:pp2dp2:zero2:selective"]
FULL_SHARD = "gpt:1f1b:pp2dp2:zero3+every"
ONEHOT = "llama:1f1b:tp2pp2:none:none:onehot"  # a loss DTensor cannot run on split logits
CHECKPOINT = ["gpt:1f1b:tp2pp2", "gpt2:1f1b:tp2dp2", "gpt:1f1b:pp2dp2:zero3", "gpt:1f1b:tp2dp2:zero3"]
# memory is measured on the production transport: the emulation's threads free message buffers at times of their own
PRODUCTION = {NCCL_RULES_ENV: "0"}


def jobs(checkpoints: Path) -> list[Job]:
    equivalence = [*TENSOR, *HUGGING_FACE, *CNN, *FSDP, *MODES, *MIXED, *FAMILIES, FULL_SHARD, ONEHOT]
    return [*(Job(f"equivalence {c}", "equivalence", [c]) for c in equivalence),
            *(Job(f"memory {c}", "memory", [c], PRODUCTION) for c in [*MEMORY, FULL_SHARD]),
            *(Job(f"checkpoint {c}", "checkpoint", [str(checkpoints), c]) for c in CHECKPOINT)]


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Every 4-rank job of this file from one launch (tests/batch.py)."""
    directory = tmp_path_factory.mktemp("split_layers")
    return launch_jobs(4, jobs(directory), directory, worker=WORKER, timeout=LAUNCH_S)


LAUNCH_S = 1500  # the whole launch (one case took ~10-40 s on CI's 2 cores); the first test waits for it
TEST_S = LAUNCH_S + 100


def check(launch: Launch, mode: str, cases: list[str]) -> list[str]:
    """Each case's lines on every rank, each ok (each case its own job, so a failure names its case)."""
    lines = [line for case in cases for line in launch.lines(f"{mode} {case}")]
    assert len(lines) == 4 * len(cases), "\n".join(lines)
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    return lines


@pytest.mark.timeout(TEST_S)
def test_gpt_tensor_by_pipeline_and_by_data_with_1f1b_and_interleaved(four_ranks: Launch) -> None:
    # tp 2 x pp 2 (4 ranks; interleaved: 4 stages round robin over the two tensor groups) and tp 2 x dp 2: loss and
    # every gradient within 1e-5 of the plain model; every rank holds split weights (DTensors)
    lines = check(four_ranks, "equivalence", TENSOR)
    assert all(int(re.search(r"dtensors=(\d+)", line).group(1)) > 0 for line in lines)  # type: ignore[union-attr]


@pytest.mark.timeout(TEST_S)
def test_hugging_face_llama_gqa_and_gpt2_conv1d(four_ranks: Launch) -> None:
    check(four_ranks, "equivalence", HUGGING_FACE)


def _last_stage(lines: list[str], case: str) -> list[str]:
    """The lines of `case` from the ranks of its last stage (the ones that ran the loss)."""
    return [line for line in lines if f"case={case} " in line and "split_logits=[]" not in line]


@pytest.mark.timeout(TEST_S)
def test_the_loss_reads_logits_split_by_vocabulary(four_ranks: Launch) -> None:
    # an untied LM head split over 2 tensor ranks: its logits stay split into the loss (DTensor's loss_parallel)
    # and the results equal the plain model's, with pipelines, replicas, FSDP2 and recomputation
    lines = check(four_ranks, "equivalence", [*HUGGING_FACE[:2], FAMILIES[-1]])
    for case in [*HUGGING_FACE[:2], FAMILIES[-1]]:
        ran = _last_stage(lines, case)
        assert len(ran) == (2 if "pp2" in case else 4), "\n".join(lines)
        assert all("split_logits=[True] whole_again=0" in line for line in ran), "\n".join(ran)
    # a loss DTensor cannot run on them runs on the whole logits, with a warning, and is still equal
    lines = check(four_ranks, "equivalence", [ONEHOT])
    ran = _last_stage(lines, ONEHOT)
    assert len(ran) == 2 and all("split_logits=[False, True] whole_again=1" in line for line in ran), "\n".join(ran)


@pytest.mark.timeout(TEST_S)
def test_alexnet_style_cnn_one_weird_trick_and_tensor_by_data(four_ranks: Launch) -> None:
    # dp2tp2: convolutions on 2 replicas dealt micro-batches, the fully connected layers split over 2 ranks
    check(four_ranks, "equivalence", CNN)


@pytest.mark.timeout(TEST_S)
def test_fsdp_each_mode_on_two_stages_by_two_replicas_three_adam_steps(four_ranks: Launch) -> None:
    # micro-batches sliced over the replicas (data_split "slice"), weights sharded by FSDP2; the tied embedding is
    # kept whole and all-reduced over both stages' ranks; 3 Adam steps equal the plain model's. Each mode also with
    # recomputation (full, selective; every stage, or one of two): FSDP2's units are the checkpointed segments, and
    # every Linear runs twice per micro-batch where its stage recomputes, once where it does not (the worker counts).
    # tp2dp2: one stage split over 2 tensor ranks and sharded over 2 replicas (FSDP2 over DTensors on one 2-D mesh),
    # its tied embedding and head inside it, with and without recomputation
    lines = check(four_ranks, "equivalence", FSDP)
    recomputed = [line for line in lines if "case=gpt:1f1b:pp2dp2:zero3:full " in line]
    assert len(recomputed) == 4 and all("linear_calls=[12]" in line for line in recomputed)


@pytest.mark.timeout(TEST_S)
def test_fsdp_of_a_model_traced_once_per_mode_runs_either_graph(four_ranks: Launch) -> None:
    # forward reads self.training, so each stage has a graph per mode; both shard as one (runtime.mode_units):
    # "modes" scales activations by 1.5 in training only, so equal in eval means the eval graph ran on the shards.
    # GPT-2 (torch.export: every weight a get_attr) gets one FSDP2 unit per block, not one per stage.
    # "tail": a sharded stage without weights runs unsharded (it has nothing to shard) rather than being refused.
    lines = check(four_ranks, "equivalence", MODES)
    units = [re.search(r"units=\[(\d+)\]", line) for line in lines if "case=tail" not in line]
    assert all(u is not None and int(u.group(1)) >= 2 for u in units), "\n".join(lines)


@pytest.mark.timeout(TEST_S)
def test_fsdp_over_split_fused_layers_in_mixed_precision(four_ranks: Launch) -> None:
    # a fused q/k/v layer split over 2 tensor ranks and sharded over 2 replicas computes in bf16 over fp32 master
    # weights: its bias, which FSDP2 leaves whole (runtime.sharding), is cast as FSDP2 casts the weights
    check(four_ranks, "equivalence", MIXED)


@pytest.mark.timeout(TEST_S)
def test_families_nobody_here_wrote_a_case_for(four_ranks: Launch) -> None:
    # Hugging Face families by model_type, default configs shrunk (split_worker.any_family): tp x pp, tp x dp with
    # zero1, pp x dp with zero3 (in eval: the other mode's graph), an MoE with experts whole; loss, every gradient
    # and 3 Adam steps against the plain model. A sweep of 13 such families x 4 layouts passed the same way.
    check(four_ranks, "equivalence", FAMILIES)


@pytest.mark.timeout(TEST_S)
def test_fsdp_memory_per_rank_against_training_memory(four_ranks: Launch) -> None:
    # every rank within 10%: 1F1B's first stage holds 2 micro-batches, its last 1 (cost_model.training_memory's
    # in_flight). Measured on the production transport: the emulation's threads free message buffers at times of
    # their own
    # recomputed stages too, against cost_model.recompute_cost's kept and peak bytes of the mode
    lines = check(four_ranks, "memory", MEMORY)
    assert len(lines) == 4 * len(MEMORY) and any("in_flight=2 " in line for line in lines)
    assert all(abs(float(re.search(r"err=([-+\d.]+)%", line).group(1))) <= 10 for line in lines)  # type: ignore[union-attr]


@pytest.mark.timeout(TEST_S)
def test_full_shard_reduces_every_micro_batch_equal_to_the_plain_model_and_holds_less(four_ranks: Launch) -> None:
    # the plan's gradient_sync "every" (FULL_SHARD): FSDP2 reduce-scatters after each micro-batch's backward and keeps
    # only the shard; 3 Adam steps equal the plain model's, and every rank's measured peak is below the same plan's
    # accumulating whole gradients ("last"), each within 10% of cost_model.training_memory
    check(four_ranks, "equivalence", [FULL_SHARD])
    lines = check(four_ranks, "memory", [FULL_SHARD, "gpt:1f1b:pp2dp2:zero3"])
    peak = {(m.group(1), m.group(2)): int(m.group(3)) for m in (
        re.search(r"case=\S+:(zero3\S*) rank=(\d+) .*measured=(\d+)", line) for line in lines) if m}
    assert len(peak) == 8 and all(peak["zero3+every", r] < peak["zero3", r] for r in "0123")
    assert all(abs(float(re.search(r"err=([-+\d.]+)%", line).group(1))) <= 10 for line in lines)  # type: ignore[union-attr]


@pytest.mark.timeout(TEST_S)
def test_dcp_checkpoints_of_a_tensor_parallel_and_a_sharded_run_load_into_the_plain_model(four_ranks: Launch) -> None:
    # tp2dp2:zero3: a stage split and sharded, its fused q/k/v weight in nested strided shards of a 2-D mesh
    check(four_ranks, "checkpoint", CHECKPOINT)


def test_a_collective_posted_out_of_order_is_caught_before_it_runs() -> None:
    lines = run(2, "misordered", cases=1)
    assert all("Detected mismatch between collectives" in line for line in lines)


def test_one_process_refuses_a_split_plan_naming_torchrun() -> None:
    torch.manual_seed(0)
    model, x, _ = split_worker.gpt()
    made = plan(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    made.stages[0].tensor, made.stages[0].tensor_groups = 2, [split_worker.found_groups(model, x)(made.stages[0])[0]]
    made.stages[1].ranks, made.programs = [2], []
    with pytest.raises(PartitionError, match="torchrun --nproc_per_node=3"):
        partition(model, ["cpu"] * 3, example_inputs=(x,), plan=made)


def test_one_weird_trick_example_trains_like_the_plain_model() -> None:
    example = str(Path(__file__).resolve().parent.parent / "examples" / "one_weird_trick.py")
    proc = torchrun(4, "--steps", "3", worker=example, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:]
    # the planner's own choice for 4 PCIe GPUs is the trick (convolutions on 2 replicas, the classifier split 2 ways)
    assert "The planner's choice for" in proc.stdout and "The plan that runs" in proc.stdout
    assert "fully connected layers split: yes, the trick" in proc.stdout, proc.stdout[-4000:]
    steps = re.findall(r"step +\d+  loss ([\d.]+)  plain model ([\d.]+)", proc.stdout)
    assert len(steps) == 3 and all(abs(float(a) - float(b)) <= 1e-5 * float(b) for a, b in steps), proc.stdout[-2000:]
