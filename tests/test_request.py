"""PlanRequest: each option checked once with an error naming the fix; sharding= and tensor= reach the search."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from cost_model.analytic import AnalyticCostModel
from cost_model.precision import MIXED
from examples.models import make_gpt
from partitioner.api import plan as make_plan
from partitioner.errors import PartitionError
from partitioner.place.search.space import SearchSpace
from partitioner.request import PlanRequest

DEVICES = tuple(torch.device("cuda", i) for i in range(8))


def request(**options: Any) -> PlanRequest:
    return PlanRequest(devices=DEVICES, processes=True, cluster=True, **options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"sharding": "zero4"}, r"sharding='zero4'; use one of 'auto', 'none', 'zero1', 'zero2', 'zero3'"),
        ({"tensor": 0}, r"tensor=0; use 'auto' \(the search chooses\) or a degree such as 8"),
        ({"tensor": "8"}, r"tensor='8'; use 'auto'"),
        ({"tensor": True}, r"tensor=True; use 'auto'"),
        ({"sharding": "zero3", "precision": MIXED}, r"sharding='zero3' shards stage replicas .* use replicas='auto'"),
        ({"sharding": "zero1", "replicas": "auto"}, r"needs the training precision .* give precision="),
        ({"tensor": 2, "replicas": (4, 4)}, r"tensor=2 splits layers .* use replicas='auto' \(or tensor=1\)"),
        ({"tensor": 3, "replicas": "auto"}, r"tensor=3 does not divide the 8 devices"),
    ],
)
def test_bad_sharding_or_tensor_names_the_fix(options: dict[str, Any], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        request(**options)


def test_sharding_and_tensor_become_the_search_space() -> None:
    def space(made: PlanRequest) -> tuple[object, object]:
        decoded = SearchSpace.of(made, "1f1b")
        return decoded.tensor, decoded.sharding

    assert space(request()) == (None, None)  # "auto": the search chooses, as before the options existed
    assert space(request(sharding="none", tensor=1)) == ((1,), ("none",))
    assert space(request(sharding="zero2", tensor=4, replicas="auto", precision=MIXED)) == ((4,), ("zero2",))
    assert request(sharding="none", tensor=1, replicas=(4, 4)).sharding == "none"  # never splits: always honoured


def test_a_cluster_plan_never_shards_or_splits_where_told_not_to() -> None:
    """A batch of 2 on 8 H100: left free the search splits layers over 2 ranks and shards replicas (zero1)."""
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=2)

    def planned(**options: Any) -> Any:
        return make_plan(model, cluster="1x8xH100", example_inputs=(x,), micro_batches=2, replicas="auto",
                         schedule="1f1b", precision="mixed", **options)

    free = planned()
    assert any(s.tensor > 1 for s in free.stages) and any(s.sharding != "none" for s in free.stages)
    unsharded = planned(sharding="none")
    assert all(s.sharding == "none" for s in unsharded.stages) and unsharded.data_split == "deal"
    whole = planned(tensor=1)
    assert all(s.tensor == 1 and not s.tensor_groups for s in whole.stages)
    split = planned(tensor=2, sharding="zero2")
    assert all(s.tensor == 2 for s in split.stages)
    assert all(s.sharding == "zero2" for s in split.stages if s.replicas > 1)
    for made in (unsharded, whole, split):
        made.check()


def test_a_device_list_cannot_fix_a_degree_the_cluster_search_alone_plans() -> None:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=4)
    with pytest.raises(PartitionError, match=r"tensor degrees \[2\] are planned by the search over a cluster's GPUs"):
        make_plan(model, ["cpu"] * 4, example_inputs=(x,), micro_batches=4, replicas="auto", processes=True,
                  schedule="1f1b", tensor=2, cost_model=AnalyticCostModel())
