"""partitioner.show.split and the page data: a plan's context and expert degrees are shown where a stage has them."""

from __future__ import annotations

from partitioner.show.split import split_summary
from partitioner.show.visualizer import page_data
from runtime.plan import Plan, StagePlan


def test_context_and_expert_degrees_are_shown_where_used() -> None:
    plan = Plan([StagePlan(0, "cuda:0", ["a"], ranks=[0, 2], expert=2, expert_layers=["e"], context=2),
                 StagePlan(1, "cuda:0", ["b"], ranks=[4, 6], expert=2, expert_layers=["f"], context=2,
                           reads_from=[0])], data_split="slice", gpus_per_host=8)
    lines = split_summary(plan).splitlines()
    assert lines[0].split()[:7] == ["stage", "ranks", "replicas", "tensor", "context", "expert", "sharding"]
    assert lines[2].split()[:7] == ["0", "0-3", "2", "1", "2", "2", "none"]  # each replica on 2 ranks: 0-1, 2-3
    data = page_data(plan)
    assert data["title"].endswith("sequence split over 2 ranks, experts split over 2 replicas")
    assert (data["stages"][1]["context"], data["stages"][1]["expert"]) == (2, 2)
    plan.stages[0].expert = plan.stages[1].expert = 1
    plan.stages[0].expert_layers = plan.stages[1].expert_layers = []
    assert "expert" not in split_summary(plan).splitlines()[0]  # a column only where a stage splits its experts
    assert "context" not in split_summary(Plan([StagePlan(0, "cpu", ["a"], ranks=[0, 1])])).splitlines()[0]
