"""Experts split over replicas (all-to-all dispatch, dropless) and sequences split over ranks (all-gathered keys and
values, load-balanced causal chunks) run under torchrun on 4 gloo ranks, equal to the plain model.

Every run is under NCCL's rules (tests/test_distributed.torchrun): point-to-point messages through runtime.nccl_rules,
every collective of the expert, context, data and gradient groups checked across its ranks first, and every
all-to-all's exchange and counts checked (runtime.nccl_rules.check_all_to_all). Worker: tests/ep_cp_worker.py, which
compares the loss, every gradient and the weights after one Adam step with the plain model (relative 1e-4).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_distributed import results, torchrun

WORKER = str(Path(__file__).resolve().parent / "ep_cp_worker.py")


def run(ranks: int, *args: str, cases: int) -> list[str]:
    proc = torchrun(ranks, *args, worker=WORKER, timeout=900)
    lines = results(proc.stdout)
    assert proc.returncode == 0 and len(lines) == ranks * cases, proc.stdout[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    return lines


# The cases of the three equivalence tests below, run in one launch (4 ranks importing torch and transformers cost
# ~15 s a launch on CI's 2 cores); each test checks its own cases' lines
EXPERTS = ["mixtral:1f1b:pp2ep2", "qwen3_moe:gpipe:dp4ep2", "gpt_oss:1f1b:pp2ep2", "moe:1f1b:pp2ep2"]
EXPERTS_SHARDED = ["mixtral:1f1b:pp2ep2:zero3:full", "qwen3_moe:gpipe:dp4ep2:zero1", "moe:1f1b:pp2ep2:none:full",
                   "qwen3_moe:1f1b:pp2ep2:zero2:selective"]
SEQUENCES = ["llama256:1f1b:pp2cp2", "llama256:gpipe:dp2cp2:none:none:whole", "llama256:1f1b:pp2cp2:zero3:full",
             "llama256:gpipe:dp2cp2:zero2:selective", "mixtral64:1f1b:dp2cp2ep2", "llama256:1f1b:tp2cp2"]


@pytest.fixture(scope="module")
def equivalence() -> dict[str, list[str]]:
    """Each case's RESULT lines (one per rank) from one 4-rank launch of every equivalence case."""
    proc = torchrun(4, "equivalence", *EXPERTS, *EXPERTS_SHARDED, *SEQUENCES, worker=WORKER, timeout=1200)
    by_case: dict[str, list[str]] = {}
    for line in results(proc.stdout):
        found = re.search(r"case=(\S+)", line)
        by_case.setdefault(found.group(1) if found else "?", []).append(line)
    by_case["?returncode"] = [str(proc.returncode), proc.stdout[-4000:]]
    return by_case


def check(equivalence: dict[str, list[str]], cases: list[str]) -> list[str]:
    code, tail = equivalence["?returncode"]
    lines = [line for case in cases for line in equivalence.get(case, [])]
    assert code == "0" and len(lines) == 4 * len(cases), tail
    assert all("ok=True" in line for line in lines), "\n".join(lines)
    return lines


@pytest.mark.timeout(1300)
def test_experts_split_two_ways_with_a_pipeline_and_with_data_parallel_replicas(
        equivalence: dict[str, list[str]]) -> None:
    # pp2ep2: 2 stages (one MoE layer each) x 2 replicas, each stage's experts split over its 2 replicas (each
    # expert on one rank); dp4ep2: one stage on 4 replicas, experts split over pairs (each expert on 2 replicas,
    # their gradients summed over those). Mixtral and Qwen3-MoE (torch.export: a stack of experts is one node),
    # GPT-OSS (biases, its own gate), a plain PyTorch MoE (torch.fx: the stack is a leaf module)
    lines = check(equivalence, EXPERTS)
    assert all(int(re.search(r"dispatches=(\d+)", line).group(1)) > 0 for line in lines)  # type: ignore[union-attr]


@pytest.mark.timeout(1300)
def test_experts_split_with_sharding_and_recomputation(equivalence: dict[str, list[str]]) -> None:
    # FSDP2 shards the rest of each stage over its replicas (the experts are left to the dispatch); full and
    # selective recomputation run the all-to-alls again inside backward, on every rank of the group alike
    check(equivalence, EXPERTS_SHARDED)


@pytest.mark.timeout(1300)
def test_a_long_sequence_split_two_ways_with_a_pipeline_and_with_data_parallel_replicas(
        equivalence: dict[str, list[str]]) -> None:
    # Hugging Face Llama at 256 tokens: pp2cp2 (2 stages, each one replica whose sequence is split over 2 ranks;
    # positions, RoPE tables and the causal mask cross the stage boundary), dp2cp2 (2 replicas x 2 context ranks),
    # tp2cp2 (one replica, its layers split over 2 tensor ranks and its sequence over 2: attention by heads and
    # chunks at once);
    # each with FSDP2 over the replicas and context ranks and recomputation; and Mixtral with both axes at once
    lines = check(equivalence, SEQUENCES)
    assert all(int(re.search(r"attention=(\d+)", line).group(1)) > 0 for line in lines)  # type: ignore[union-attr]
    # between the two stages the sequence stays split (rank k sends its own tokens to rank k, as priced): stage 0
    # gathers nothing (its one slice is the caller's token ids), stage 1 slices nothing (its gather: the logits)
    piped = [line for line in lines if ":pp2cp2" in line]
    assert piped and all(("stages=[0]" in line and "gathers=0 slices=1" in line) or
                         ("stages=[1]" in line and "gathers=1 slices=0" in line) for line in piped), piped
    # with train_step(..., loss_per_token=True) the last stage's ranks run the loss on their own tokens (half the
    # sequence), the logits never gathered; without it ("whole") on the whole gathered logits, with a warning
    for line in lines:
        if "loss_tokens=[]" in line:
            continue  # not the last stage
        whole = ":whole" in line
        seq = 64 if "mixtral64" in line else 256
        vocab = "[True]" if ":tp2" in line and not whole else "[False]"  # tp2cp2: split by vocabulary too
        assert f"loss_tokens=[{seq if whole else seq // 2}] split_vocab={vocab} gathered={int(whole)}" in line, line
    assert sum(":whole" in line for line in lines) == 4 and sum(":tp2cp2" in line for line in lines) == 4


def test_a_misordered_all_to_all_is_caught_before_it_runs() -> None:
    # rank 1 posts layer 1's dispatch where rank 0 posts layer 0's: torch's collective checker compares an
    # all-to-all's op only (its splits may differ), so this is runtime.nccl_rules.check_all_to_all's to catch
    lines = run(2, "misordered", cases=1)
    assert all("moes.0.experts" in line and "moes.1.experts" in line for line in lines)


@pytest.mark.timeout(1000)
def test_a_pipeline_of_stages_split_by_tensor_and_context_ranks_at_once() -> None:
    # 8 ranks: 2 stages, each one replica of 2 tensor x 2 context ranks (Llama at 256 tokens). Between the stages the
    # sequence stays split (the tensor split's output names the value it makes whole); the loss reads each rank's
    # tokens split by vocabulary; loss, every gradient and one Adam step equal the plain model
    lines = run(8, "equivalence", "llama256:1f1b:pp2tp2cp2", cases=1)
    assert all(("stages=[0]" in line and "gathers=0 slices=1" in line and "loss_tokens=[]" in line) or
               ("stages=[1]" in line and "slices=0" in line and "loss_tokens=[128] split_vocab=[True] gathered=0"
                in line) for line in lines), lines
