"""Joining a torchrun job: each rank's GPU, one backend spec, ranks that disagree stop with one error."""

from __future__ import annotations

import time

import pytest
import torch

from runtime.errors import PartitionError
from runtime.launch import backend_for, check_ranks, job_devices, own_device, rank_device, wire_device
from tests.test_distributed import results, torchrun


def test_index_less_cuda_takes_the_local_rank() -> None:
    assert rank_device("cuda", local_rank=3, cuda_count=8, rank=11) == torch.device("cuda", 3)
    assert rank_device("cuda:5", local_rank=3, cuda_count=8) == torch.device("cuda", 5)
    assert rank_device(torch.device("cpu"), local_rank=3, cuda_count=0) == torch.device("cpu")


def test_a_gpu_the_node_lacks_is_named_with_the_fix() -> None:
    with pytest.raises(PartitionError, match=r"rank 2 LOCAL_RANK=2 takes cuda:2 but only 2 CUDA devices.*"
                                             r"--nproc_per_node=2"):
        rank_device("cuda", local_rank=2, cuda_count=2, rank=2)
    with pytest.raises(PartitionError, match="asks for cuda:4 but only 4 CUDA"):
        rank_device("cuda:4", local_rank=0, cuda_count=4)
    with pytest.raises(PartitionError, match="'cpu' or 'cuda"):
        rank_device("mps", local_rank=0, cuda_count=0)
    with pytest.raises(PartitionError, match="not a device name"):
        rank_device("gpu:0", local_rank=0, cuda_count=0)


def test_own_device_reads_local_rank_and_checks_the_list_length(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert own_device(["cpu", "cpu"], rank=1, world=2) == torch.device("cpu")
    with pytest.raises(PartitionError, match="lists 3 devices but the job has 2 ranks"):
        own_device(["cpu"] * 3, rank=0, world=2)
    with pytest.raises(PartitionError, match="single value"):
        job_devices("cuda")  # type: ignore[arg-type]


def test_one_backend_spec_for_mixed_jobs() -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda", 0)
    assert backend_for([cpu, cpu]) == "gloo"
    assert backend_for([gpu, cpu]) == "cpu:gloo,cuda:nccl"  # the same string on every rank, GPU or not
    assert backend_for([gpu, torch.device("cuda", 1)]) == "cpu:gloo,cuda:nccl"
    assert wire_device(gpu, [torch.device("cuda", 1)]) == gpu  # NCCL between two GPUs
    assert wire_device(gpu, [cpu]) == cpu  # gloo where one end has no GPU
    assert wire_device(cpu, [gpu]) == cpu
    assert wire_device(gpu, [torch.device("cuda", 1), cpu]) == cpu  # an all-reduce group with a CPU rank


def _rec(given: list[str], device: str | None, gpu: str | None = None, error: str | None = None,
         host: str = "node0") -> dict[str, object]:
    return {"given": given, "device": device, "gpu": gpu, "host": host, "error": error}


def test_ranks_agreeing_give_every_ranks_device() -> None:
    given = ["cuda", "cuda", "cpu"]
    records = [_rec(given, "cuda:0", "GPU-a"), _rec(given, "cuda:1", "GPU-b"), _rec(given, "cpu")]
    assert check_ranks(records) == [torch.device("cuda", 0), torch.device("cuda", 1), torch.device("cpu")]
    # two nodes: the same index on two hosts is two GPUs
    two_nodes = [_rec(given, "cuda:0", "GPU-a"), _rec(given, "cuda:0", "GPU-c", host="node1"), _rec(given, "cpu")]
    assert check_ranks(two_nodes)[1] == torch.device("cuda", 0)


def test_two_ranks_on_one_gpu_is_an_error_naming_both() -> None:
    given = ["cuda:0", "cuda:0"]
    with pytest.raises(PartitionError, match=r"ranks 0 and 1 would both run on cuda:0 of host node0.*one GPU per rank"):
        check_ranks([_rec(given, "cuda:0", "GPU-a"), _rec(given, "cuda:0", "GPU-a")])


def test_ranks_with_different_lists_or_a_failed_rank_stop() -> None:
    with pytest.raises(PartitionError, match=r"rank 1 passed devices=\['cpu'\] but rank 0 passed"):
        check_ranks([_rec(["cpu", "cpu"], "cpu"), _rec(["cpu"], "cpu")])
    with pytest.raises(PartitionError, match="rank 1: only 0 CUDA"):
        check_ranks([_rec(["cpu", "cuda"], "cpu"), _rec(["cpu", "cuda"], None, error="only 0 CUDA devices")])


@pytest.mark.parametrize("case, expected",
                         [("differ", "rank 1 passed devices="), ("gpu", "rank 0: rank 0 LOCAL_RANK=0")])
def test_torchrun_ranks_stop_together_on_bad_devices(case: str, expected: str) -> None:
    start = time.monotonic()
    run = torchrun(2, "devices", case, timeout=100)
    lines = results(run.stdout)
    assert run.returncode == 0 and len(lines) == 2 and all("ok=True" in line for line in lines), run.stdout[-3000:]
    assert all(expected in line for line in lines), lines
    assert time.monotonic() - start < 60  # nobody waited for a rank that had already failed
