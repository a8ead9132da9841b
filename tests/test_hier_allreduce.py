"""The hierarchical all-reduce: which groups take it, that it is priced as it runs, and (torchrun) its sums."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cost_model.cluster_shape import Cluster
from cost_model.comm import ring_allreduce_time
from runtime.hier_allreduce import algorithm, hosts_of
from tests.batch import Job, Launch
from tests.test_distributed import launch_jobs

WORKER = str(Path(__file__).resolve().parent / "hier_worker.py")
ROUND = {"intra": {"kind": "nvswitch", "gb_per_s": 100, "latency_us": 10},
         "inter": {"kind": "infiniband", "gbit_per_s": 80, "latency_us": 20}}  # fmt: skip


def test_which_groups_are_hierarchical() -> None:
    assert hosts_of([5, 0, 4, 1], gpus_per_host=4) == [[0, 1], [4, 5]]
    assert hosts_of([3, 1], gpus_per_host=0) == [[1, 3]]
    assert algorithm(range(16), gpus_per_host=8) == "hierarchical"  # 2 hosts x 8
    assert algorithm([0, 1, 8, 9, 16, 17], gpus_per_host=8) == "hierarchical"  # 3 hosts x 2
    assert algorithm(range(8), gpus_per_host=8) == "flat"  # one host
    assert algorithm([0, 8, 16], gpus_per_host=8) == "flat"  # one rank per host
    assert algorithm([0, 1, 2, 8], gpus_per_host=8) == "flat"  # uneven: 3 + 1
    assert algorithm(range(16), gpus_per_host=0) == "flat"  # layout unknown
    with pytest.raises(ValueError, match="names a rank twice"):
        algorithm([0, 0, 8], gpus_per_host=8)


def test_the_price_follows_the_algorithm_the_runtime_picks() -> None:
    # over random groups of a 4x4 cluster: hierarchical groups cost the three phases, flat ones one ring
    cluster = Cluster.from_dict({"hosts": 4, "gpus_per_host": 4, "gpu": "H100", "fabric": ROUND})
    intra, inter = cluster.fabric.intra, cluster.fabric.inter
    rng, b = random.Random(0), 1e9
    seen = set()
    for _ in range(300):
        ranks = rng.sample(range(16), rng.randint(2, 16))
        kind = algorithm(ranks, gpus_per_host=4)
        hosts = hosts_of(ranks, gpus_per_host=4)
        if kind == "hierarchical":
            g, h = len(hosts[0]), len(hosts)
            expected = ring_allreduce_time(b, g, intra) + ring_allreduce_time(b / g, h, inter)
        elif len(hosts) == 1:
            expected = ring_allreduce_time(b, len(ranks), intra)
        else:
            expected = ring_allreduce_time(b, len(ranks), inter)
        seen.add((kind, len(hosts) == 1))
        assert cluster.allreduce_time(b, ranks) == pytest.approx(expected), ranks
    assert seen == {("hierarchical", False), ("flat", False), ("flat", True)}


LAUNCH_S = 400  # both jobs; the first test waits for them


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory: pytest.TempPathFactory) -> Launch:
    """Both modes from one 4-rank launch (tests/batch.py): a launch costs each rank an import of torch and partitioner,
    slow with 4 ranks on CI's 2 cores; each test checks its own job."""
    jobs = [Job("collective", "collective"), Job("train", "train")]
    return launch_jobs(4, jobs, tmp_path_factory.mktemp("hier"), worker=WORKER, timeout=LAUNCH_S)


def _run(launch: Launch, mode: str) -> list[str]:
    lines = launch.lines(mode)
    assert lines, launch.output[-4000:]
    assert all("ok=True" in line for line in lines), "\n".join(line for line in lines if "ok=False" in line)
    return lines


@pytest.mark.timeout(LAUNCH_S + 60)
def test_sums_equal_the_flat_all_reduce_on_four_ranks(four_ranks: Launch) -> None:
    # 6 groups x 4 sizes (odd sizes pad the shards), each checked against the sum computed from the seeds
    lines = _run(four_ranks, "collective")
    assert len(lines) == 4 * (4 + 4 + 4 + 2 + 2 + 4)
    assert sum("algorithm=hierarchical" in line for line in lines) == 4 * 4


@pytest.mark.timeout(LAUNCH_S + 60)
def test_replicas_over_two_hosts_train_like_the_plain_model(four_ranks: Launch) -> None:
    # one stage, 4 replicas, '2 hosts x 2 GPUs': the runtime reduces hierarchically (under NCCL's rules)
    lines = _run(four_ranks, "train")
    assert len(lines) == 4 * 3 and sum("algorithms=['hierarchical']" in line for line in lines) == 4 * 2
    assert sum("case=stale" in line for line in lines) == 4  # staleness 1: waited a step later, same sums
