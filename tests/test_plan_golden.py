"""Plans byte-identical to those the code made before partitioner/ was split into layers (tests/data/plans).

The files were written by plan(...).to_json() with the calls below, at commit d0ce5ec (before the
restructuring). Described clusters price analytically from the GPU table, so the JSON does not depend
on this machine. A change that moves a plan on purpose rewrites the file and says why in its commit.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from examples.models import InceptionNet, make_gpt
from partitioner import Plan, plan

DATA = Path(__file__).resolve().parent / "data" / "plans"


def _gpt() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model, (x,) = make_gpt(batch=16)
    return model, x


def _inception() -> tuple[torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return InceptionNet(), torch.randn(8, 3, 32, 32)


CASES: dict[str, tuple[Callable[[], tuple[torch.nn.Module, torch.Tensor]], dict[str, Any]]] = {
    "gpt_1f1b_4xa100": (_gpt, {"cluster": "1x4xA100-SXM4-80GB", "micro_batches": 8, "schedule": "1f1b"}),
    "gpt_auto_2x8xh100": (_gpt, {"cluster": "2x8xH100", "micro_batches": 16, "schedule": "auto",
                                 "replicas": "auto"}),
    "gpt_interleaved_4xh100": (_gpt, {"cluster": "1x4xH100", "micro_batches": 8, "schedule": "interleaved",
                                      "recompute": "auto"}),
    "inception_auto_2xa100": (_inception, {"cluster": "1x2xA100-SXM4-80GB", "micro_batches": 4,
                                           "placement": "auto"}),
    "gpt_schedule_auto_4xh100": (_gpt, {"cluster": "1x4xH100", "micro_batches": 8, "schedule": "auto"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_plan_json_is_byte_identical(name: str) -> None:
    make, options = CASES[name]
    model, x = make()
    made = plan(model, example_inputs=(x,), **options)
    expected = gzip.decompress((DATA / f"{name}.json.gz").read_bytes()).decode("utf-8")
    got = made.to_json()
    if got != expected:  # name the first difference, not 100 kB of JSON
        at = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b) if got[:len(expected)] != expected \
            else len(expected)
        pytest.fail(f"{name}: the plan differs from the saved one at character {at}: "
                    f"got ...{got[max(0, at - 80):at + 80]!r}... expected ...{expected[max(0, at - 80):at + 80]!r}...")


@pytest.mark.parametrize("name", list(CASES))
def test_saved_plans_of_before_load_check_and_round_trip(name: str) -> None:
    text = gzip.decompress((DATA / f"{name}.json.gz").read_bytes()).decode("utf-8")
    loaded = Plan.from_json(text)
    loaded.check()
    assert loaded.to_json() == text
