"""The Plan is plain data: JSON round trip and a readable table."""

from __future__ import annotations

from runtime.plan import Plan, StagePlan


def make() -> Plan:
    return Plan(
        stages=[
            StagePlan(0, "cuda:0", ["a", "b"], predicted_ms=2.0, param_bytes=3 << 20),
            StagePlan(1, "cuda:1", ["c"], predicted_ms=3.0, activation_bytes=1500),
        ],
        micro_batches=4,
        predicted_step_ms=15.0,
    )


def test_json_round_trip() -> None:
    plan = make()
    assert Plan.from_json(plan.to_json()) == plan
    assert plan.stage_of() == {"a": 0, "b": 0, "c": 1}
    assert plan.devices == ["cuda:0", "cuda:1"] and plan.bottleneck_ms == 3.0


def test_summary_table() -> None:
    lines = make().summary().splitlines()
    assert lines[0].split()[:3] == ["stage", "device", "nodes"]
    assert lines[2].split()[:3] == ["0", "cuda:0", "2"] and "3.0 MiB" in lines[2]
    assert "1.5 KiB" in lines[3]
    assert "2 stages, 4 micro-batches" in lines[-1] and "bottleneck 3.000 ms" in lines[-1]
