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

Node-limited routing (`NodeLimited`; DeepSeek-V3, https://arxiv.org/abs/2412.19437, section 3.2.2: "each
token will be sent to at most 4 nodes", its dispatch sending a token once to each of those nodes over
InfiniBand and forwarding it over NVLink to the GPUs of its experts there; IB 50 GB/s, NVLink 160 GB/s per
GPU on H800): a token crosses the NIC once per other host its experts sit on, not once per expert. With k
experts a token spread uniformly over the group's h hosts, it reaches D = h (1 - (1 - 1/h)^k) hosts on
average, at most M with the limit; (h - 1) / h of them are not its own, so the bytes leaving a rank's NIC
are min(M, D) / k of the unlimited (n - g) / n x b; NVLink carries every slot bound for the rank's own host
and the forwarded ones, (n - 1) / n x b. DeepSeek-V3, 8 experts of 256 on 64 ranks of 8 hosts, M = 4: half
of the NIC's bytes (D = 5.25 > 4).

Expert load: with uniform routing each rank of the group receives b on average; a `skew` >= 1 (the most
loaded rank's share over the mean, as measured routers give it) scales what the busiest rank receives
and computes (search/experts_context.py applies it).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Iterable

from cost_model.cluster_shape import Cluster, Rank

__all__ = ["NodeLimited", "all_to_all_time", "all_to_all_affine"]


@dataclass(frozen=True)
class NodeLimited:
    """Each token's `top_k` experts on at most `max_nodes` hosts, sent once a host (module docstring)."""

    max_nodes: int
    top_k: int

    def __post_init__(self) -> None:
        if self.max_nodes < 1 or self.top_k < 1:
            raise ValueError(f"NodeLimited(max_nodes={self.max_nodes}, top_k={self.top_k}): both are counts of 1 or "
                             "more (DeepSeek-V3: max_nodes=4, top_k=8)")

    def across(self, hosts: int) -> float:
        """The share of the unlimited cross-host bytes a rank sends when the group spans `hosts` hosts."""
        reached = hosts * (1.0 - (1.0 - 1.0 / hosts) ** self.top_k)
        return min(1.0, min(float(self.max_nodes), reached) / self.top_k)


def all_to_all_time(cluster: Cluster, nbytes: float, ranks: Iterable[Rank],
                    routing: NodeLimited | None = None) -> float:
    """Seconds for every rank of `ranks` to send `nbytes` in all, evenly to each rank of the group (module
    docstring), a token once a host where `routing` limits its hosts; 0 for one rank or nothing to send."""
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
    if routing is not None:  # once a host over the NIC, forwarded over NVLink
        across *= routing.across(len(per_host))
        inside = (n - 1) / n * nbytes / intra.bandwidth
    return inter.latency_s + max(inside, across)


def all_to_all_affine(cluster: Cluster, ranks: Iterable[Rank], routing: NodeLimited | None = None
                      ) -> tuple[float, float]:
    """(latency s, seconds per byte) of `all_to_all_time` over `ranks`: (0, 0) for one rank."""
    group = list(ranks)
    if len(group) <= 1:
        return 0.0, 0.0
    one = all_to_all_time(cluster, 1.0, group, routing)
    big = all_to_all_time(cluster, 1.0 + 2.0**20, group, routing)
    slope = (big - one) / 2.0**20
    return max(0.0, one - slope), max(0.0, slope)
