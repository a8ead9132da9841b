"""Collectives of a group on a cluster, against hand-computed literals: rings, halves, what overlap hides."""

from __future__ import annotations

import numpy as np
import pytest

from cost_model.cluster_shape import Cluster
from cost_model.collectives import DDP_BUCKET_BYTES, all_gather, all_reduce, exposed, reduce_scatter, ring_of

FABRIC = {"intra": {"kind": "nvswitch", "gb_per_s": 100, "latency_us": 10},
          "inter": {"kind": "infiniband", "gb_per_s": 10, "latency_us": 20}}


def cluster(hosts: int) -> Cluster:
    return Cluster.from_dict({"hosts": hosts, "gpus_per_host": 8, "gpu": "H100", "fabric": FABRIC})


def test_a_ring_inside_a_host_and_one_across() -> None:
    # 8 GPUs of one host: 2 (n - 1) l + 2 (n - 1) / n b / B = 14 x 10 us + 1.75 b / 100 GB/s
    latency, slope = ring_of(cluster(1), range(8))
    assert latency == pytest.approx(140e-6) and slope == pytest.approx(1.75 / 100e9)
    # one GPU on each of 2 hosts: the inter-host ring alone, 2 x 20 us + b / 10 GB/s
    latency, slope = ring_of(cluster(2), [0, 8])
    assert latency == pytest.approx(40e-6) and slope == pytest.approx(1 / 10e9)
    assert ring_of(cluster(1), [3]) == (0.0, 0.0)


def test_all_gather_and_reduce_scatter_are_half_an_all_reduce() -> None:
    ring = (140e-6, 1.75e-11)
    assert all_reduce(ring, 1e9) == pytest.approx(0.01764)
    assert all_gather(ring, 1e9) == pytest.approx(0.00882) and reduce_scatter(ring, 1e9) == pytest.approx(0.00882)
    assert all_reduce(ring, 0) == 0.0  # nothing to reduce costs nothing, latency included
    got = all_reduce(ring, np.array([0.0, 1e9]))
    assert isinstance(got, np.ndarray) and got.tolist() == pytest.approx([0.0, 0.01764])


def test_exposed_is_what_compute_does_not_hide_and_at_least_the_last_piece() -> None:
    assert exposed(10.0, 4.0, 1.0) == 6.0
    assert exposed(10.0, 9.5, 1.0) == 1.0  # the last piece starts when the compute that makes it ends
    assert exposed(0.5, 0.0, 1.0) == 0.5  # a piece is never more than the whole
    assert exposed(np.array([10.0, 2.0]), 4.0, 1.0).tolist() == [6.0, 1.0]
    assert DDP_BUCKET_BYTES == 25 * 2**20  # torch DDP's bucket_cap_mb=25
