"""The search space (partitioner.place.search.space): the request's choices decoded once, checked once."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cost_model.precision import MIXED
from partitioner.errors import PartitionError
from partitioner.place.search.space import SearchSpace
from partitioner.request import PlanRequest

ROOT = Path(__file__).resolve().parent.parent
# What reading a request's tensor or sharding choice looks like: comparing it with "auto", asking whether a
# choice is None (every value allowed), or what set of values it holds.
DECODINGS = [
    r"\b(tensor|sharding)\s*(==|!=)\s*[\"']auto[\"']",
    r"\b(tensor|sharding)\s+(not\s+)?in\s+\(\s*[\"']auto[\"']",
    r"\.(tensor|sharding)\s+is\s+(not\s+)?None",
    r"set\([^)]*\.(tensor|sharding)\)\s*(==|!=)",
]
SPACE = "partitioner/place/search/space.py"
CHECKS = "partitioner/request.py"  # checks the values it holds (known, what needs replicas="auto"), means nothing


def test_tensor_and_sharding_are_decoded_in_one_module() -> None:
    found: dict[str, list[str]] = {}
    for path in sorted((ROOT / "partitioner").rglob("*.py")):
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if any(re.search(p, line) for p in DECODINGS):
                found.setdefault(str(path.relative_to(ROOT)), []).append(f"{number}: {line.strip()}")
    elsewhere = {f: lines for f, lines in found.items() if f not in (SPACE, CHECKS)}
    assert not elsewhere, f"tensor/sharding choices read outside {SPACE}: {elsewhere}"
    assert len(found.get(SPACE, [])) >= 4  # the grep finds the decodings where they are


def request(**options: object) -> PlanRequest:
    return PlanRequest.of([torch.device("cpu")] * 8, processes=True, **options)


def test_a_request_decodes_into_one_space() -> None:
    plain = SearchSpace.of(request(micro_batches=8, replicas="auto"), "1f1b")
    assert plain == SearchSpace(micro_batches=8, schedules=("1f1b",))
    assert (plain.tensor, plain.sharding, plain.recompute_modes, plain.cluster_only) == (None, None, ("none",), [])
    assert plain.sharding_modes() == ("none",)  # without a precision, replicas are not sharded
    fixed = SearchSpace.of(request(replicas="auto", tensor=4, sharding="zero2", precision=MIXED, recompute="auto"),
                           "gpipe")
    assert (fixed.tensor, fixed.sharding, fixed.precision, fixed.recompute) == ((4,), ("zero2",), MIXED, "auto")
    assert fixed.recompute_modes == ("none", "full")
    assert fixed.cluster_only == ["tensor degrees [4]", "sharding ['zero2']"]
    assert fixed.optimizer("sgd") == MIXED.optimizer and plain.optimizer("sgd") == "sgd"
    whole = SearchSpace.of(request(tensor=1, sharding="none", recompute="selective"), "gpipe")
    assert whole.unsplit and whole.cluster_only == [] and whole.recompute == "none"  # per stage: planning's


def test_the_space_names_what_it_cannot_plan() -> None:
    with pytest.raises(PartitionError, match="recompute='some'"):
        SearchSpace(recompute="some")  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="micro_batches=0"):
        SearchSpace(micro_batches=0)
    with pytest.raises(PartitionError, match="allow one value at least"):
        SearchSpace(tensor=())
    with pytest.raises(PartitionError, match=r"tensor degrees \[0\]"):
        SearchSpace(tensor=(0,))
    with pytest.raises(PartitionError, match="sharding='zero1' needs the training precision"):
        SearchSpace(sharding=("zero1",))
    with pytest.raises(PartitionError, match=r"tensor degrees \[3\] cannot split this model on 1x8xH100"):
        SearchSpace(tensor=(3,)).tensor_degrees([1, 2, 4, 8], "1x8xH100")
    assert SearchSpace(tensor=[2, 2, 1]).tensor_degrees([1, 2, 4], "here") == [1, 2]  # type: ignore[arg-type]
    assert SearchSpace(precision=MIXED).sharding_modes() == ("none", "zero1", "zero2", "zero3")
