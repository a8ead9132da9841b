"""All-to-all over one group of ranks, at the bus bandwidth NCCL reaches inside and across hosts (expert dispatch).

    all_to_all_time(b, ranks) = latency + max((g - 1) / n * b / B_intra, (n - g) / n * b / B_inter)

n ranks, at most g of them on one host; b the bytes each rank sends in all (b / n to each rank of the
group, itself included: what runtime/expert_parallel.py's dispatch or combine moves per rank). The
part for the rank's own host crosses NVSwitch at the intra link's bandwidth, the part for other hosts
crosses the rank's own NIC at the inter link's, both at once. The inter link is one NIC per GPU (the
fabrics of cost_model/gpus.json): NCCL's all-to-all does not aggregate the NICs of other GPUs ("Alltoall
cannot aggregate the bandwidth of multiple NICs, so the performance you should see is the performance of
a single NIC", and "CX-7 NICs at NDR rate (400Gbps) should achieve up to 48-49GB/s per NIC": NCCL
maintainers, https://github.com/NVIDIA/nccl-tests/issues/267), so the fabric's per-GPU inter bandwidth
(400 Gb/s x 0.9 = 45 GB/s on DGX H100) is the figure. This is nccl-tests' busbw for all-to-all:
algbw x (n - 1) / n, each rank's bytes bound for the others over its slowest path. Latency: one step
of the slowest link crossed (NCCL posts every peer's send and receive at once).

Expert load: with uniform routing each rank of the group receives b on average; a `skew` >= 1 (the most
loaded rank's share over the mean, as measured routers give it) scales what the busiest rank receives
and computes (search/experts_context.py applies it).
"""

from __future__ import annotations

import collections
from typing import Iterable

from cost_model.cluster_shape import Cluster, Rank

__all__ = ["all_to_all_time", "all_to_all_affine"]


def all_to_all_time(cluster: Cluster, nbytes: float, ranks: Iterable[Rank]) -> float:
    """Seconds for every rank of `ranks` to send `nbytes` in all, evenly to each rank of the group (module
    docstring); 0 for one rank or nothing to send."""
    group = [cluster.rank(r) for r in ranks]
    n = len(group)
    if n <= 1 or nbytes <= 0:
        return 0.0
    per_host = collections.Counter(r // cluster.gpus_per_host for r in group)
    g = max(per_host.values())
    intra, inter = cluster.fabric.intra, cluster.fabric.inter
    inside = (g - 1) / n * nbytes / intra.bandwidth
    if len(per_host) == 1:
        return intra.latency_s + inside
    across = (n - g) / n * nbytes / inter.bandwidth
    return inter.latency_s + max(inside, across)


def all_to_all_affine(cluster: Cluster, ranks: Iterable[Rank]) -> tuple[float, float]:
    """(latency s, seconds per byte) of `all_to_all_time` over `ranks`: (0, 0) for one rank."""
    group = list(ranks)
    if len(group) <= 1:
        return 0.0, 0.0
    one, big = all_to_all_time(cluster, 1.0, group), all_to_all_time(cluster, 1.0 + 2.0**20, group)
    slope = (big - one) / 2.0**20
    return max(0.0, one - slope), max(0.0, slope)
