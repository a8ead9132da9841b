"""Calibration factors from measured runs, against hand-computed least-squares ratios."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Mapping

import pytest
import torch

from cost_model.calibration import CalibratedCostModel, Calibration, fit_calibration, stage_records

CPU = torch.device("cpu")


class Fixed:
    """A base model: every node 1 ms on any device, transfers 2 ms."""

    def node_time(self, node: Mapping[str, Any], device: torch.device) -> float:
        return 1e-3

    def transfer_time(self, nbytes: float, src: torch.device, dst: torch.device) -> float:
        return 2e-3


def test_factor_is_least_squares_ratio() -> None:
    cal = Calibration()
    cal.update([
        {"device": "cpu", "predicted_ms": 10.0, "measured_ms": 12.0},
        {"device": "cpu", "predicted_ms": 20.0, "measured_ms": 22.0},
        {"device": "cuda:1", "predicted_ms": 4.0, "measured_ms": 2.0},
    ])
    # (10*12 + 20*22) / (10^2 + 20^2) = 560 / 500
    assert cal.factor("cpu") == pytest.approx(1.12)
    assert cal.factor(torch.device("cuda", 1)) == pytest.approx(0.5)
    assert cal.factor("cuda:0") == 1.0  # never seen


def test_runs_accumulate_and_decay() -> None:
    cal = Calibration(decay=0.5)
    cal.update([{"device": "cpu", "predicted_ms": 10.0, "measured_ms": 20.0}])  # sums (200, 100) in ms^2
    cal.update([{"device": "cpu", "predicted_ms": 10.0, "measured_ms": 10.0}])  # (100 + 100, 50 + 100)
    assert cal.factor("cpu") == pytest.approx(200 / 150)


def test_stage_records_from_a_plan() -> None:
    stages = [SimpleNamespace(device="cpu", compute_ms=5.0), SimpleNamespace(device="cpu", compute_ms=15.0)]
    records = stage_records(stages, [6.0, 18.0])
    assert records[1] == {"device": "cpu", "predicted_ms": 15.0, "measured_ms": 18.0}
    with pytest.raises(ValueError, match="one time per stage"):
        stage_records(stages, [1.0])


def test_calibrated_model_predicts_what_was_measured() -> None:
    model = CalibratedCostModel(Fixed())
    node = {"name": "fc", "op": "call_module"}
    assert model.node_time(node, CPU) == pytest.approx(1e-3)
    # A measured run: a 10-node stage predicted 10 ms ran 13 ms; a transfer ran 3 ms, not 2.
    model.calibration.update([
        {"device": "cpu", "predicted_ms": 10.0, "measured_ms": 13.0},
        {"src": "cpu", "dst": "cuda:0", "predicted_ms": 2.0, "measured_ms": 3.0},
    ])
    assert model.node_time(node, CPU) == pytest.approx(1.3e-3)
    assert model.forward_time(node, CPU) == pytest.approx(1.3e-3 / 3)
    assert model.transfer_time(1, CPU, torch.device("cuda", 0)) == pytest.approx(3e-3)
    assert model.transfer_time(1, torch.device("cuda", 0), CPU) == pytest.approx(2e-3)  # other direction unseen


def test_json_round_trip(tmp_path: Any) -> None:
    cal = Calibration(decay=0.9)
    cal.update([{"device": "cpu", "predicted_ms": 3.0, "measured_ms": 4.0}])
    path = tmp_path / "calibration.json"
    cal.save(path)
    again = Calibration.load(path)
    assert again == cal and again.factor("cpu") == pytest.approx(4 / 3)


def test_bad_records() -> None:
    cal = Calibration()
    with pytest.raises(ValueError, match="measured_ms"):
        cal.update([{"device": "cpu", "predicted_ms": 1.0}])
    with pytest.raises(ValueError, match=">= 0"):
        cal.observe("cpu", -1.0, 1.0)


def test_measured_stage_times_from_a_runtime_trace_feed_calibration() -> None:
    from cost_model.calibration import measured_stage_ms

    trace = {"devices": [
        {"device": "cpu (rank 0)", "events": [
            {"kind": "forward", "stage": 0, "microbatch": 0, "start": 0.0, "end": 1.0},
            {"kind": "forward", "stage": 0, "microbatch": 1, "start": 1.0, "end": 2.0},
            {"kind": "send", "stage": 0, "microbatch": 0, "start": 1.0, "end": 1.5},
            {"kind": "backward", "stage": 0, "microbatch": 1, "start": 5.0, "end": 7.0},
            {"kind": "backward", "stage": 0, "microbatch": 0, "start": 7.0, "end": 9.0}]},
        {"device": "cpu (rank 1)", "events": [
            {"kind": "forward", "stage": 1, "microbatch": 0, "start": 2.0, "end": 4.0},
            {"kind": "backward", "stage": 1, "microbatch": 0, "start": 4.0, "end": 8.0}]},
    ]}
    measured = measured_stage_ms(trace)
    assert measured == {0: 3.0, 1: 6.0}  # forward + backward per micro-batch; sends left out
    calibration = Calibration()
    calibration.update(stage_records([{"device": "cpu", "compute_ms": 1.5}, {"device": "cpu", "compute_ms": 3.0}],
                                     [measured[0], measured[1]]))
    assert calibration.factor("cpu") == pytest.approx(2.0)


def test_fit_recovers_a_known_wake_up_and_receive_cost_from_a_synthetic_trace() -> None:
    # Rank 0 computes stage 0 and posts each message in 0.2 ms; the link: 0.5 ms + 1000 bytes at 1000
    # bytes/ms, so a message lands at sender's compute end + 0.2 + 1.5. Rank 1 posts a receive (0.3 ms,
    # then 0.1 ms), blocks on micro-batch 0 (lands at 2 + 1.7 = 3.7) and resumes at 4.4: woken 0.7 ms late;
    # micro-batch 1 landed at 5.9, before its take at 6.5, which costs 0.1 ms.
    # Per RECV op: posting (0.3 + 0.1) / 2 receives + 0.1 per take of a landed message = 0.3 ms.
    from cost_model.calibration import fit_calibration

    plan = {"stages": [{"index": 0, "device": "cpu", "forward_ms": 2.0, "backward_ms": 0.0, "reads_from": [],
                        "recv_bytes": 0, "ranks": [0]},
                       {"index": 1, "device": "cpu", "forward_ms": 2.0, "backward_ms": 0.0, "reads_from": [0],
                        "recv_bytes": 1000, "ranks": [1]}],
            "programs": [{"rank": 0, "device": "cpu", "ops": ["F s0 mb0 t0", "SEND s0->s1 mb0 r1 t0", "F s0 mb1 t1",
                                                               "SEND s0->s1 mb1 r1 t1", "STEP"]},
                         {"rank": 1, "device": "cpu", "ops": ["RECV s0->s1 mb0 r0 t0", "F s1 mb0 t1",
                                                               "RECV s0->s1 mb1 r0 t1", "F s1 mb1 t2", "STEP"]}]}

    def ev(kind: str, stage: int, mb: int, start: float, end: float, peer: int = -1) -> dict[str, Any]:
        return {"kind": kind, "stage": stage, "microbatch": mb, "start": start, "end": end, "peer": peer}

    rank0 = [ev("forward", 0, 0, 0.0, 2.0), ev("send", 0, 0, 2.0, 2.2, 1), ev("forward", 0, 1, 2.2, 4.2),
             ev("send", 0, 1, 4.2, 4.4, 1)]
    rank1 = [ev("recv", 0, 0, 0.0, 0.3, 0), ev("recv", 1, 0, 0.3, 4.4, 0), ev("forward", 1, 0, 4.4, 6.4),
             ev("recv", 0, 1, 6.4, 6.5, 0), ev("recv", 1, 1, 6.5, 6.6, 0), ev("forward", 1, 1, 6.6, 8.6)]
    trace = {"devices": [{"device": "cpu (rank 0)", "events": rank0}, {"device": "cpu (rank 1)", "events": rank1}]}
    fitted = fit_calibration(plan, trace, step_ms=9.0, cores=2.0, previous=Calibration(links={"gloo": [0.5, 1000.0]}))
    assert fitted.task_ms["SEND"] == pytest.approx(0.2)
    assert fitted.task_ms["WAKE"] == pytest.approx(0.7)
    assert fitted.task_ms["RECV"] == pytest.approx(0.3)
    assert fitted.links["gloo"] == pytest.approx([0.5, 1000.0])


TRUE_F = {"gemm": 1.5, "conv": 0.8, "memory": 2.0}  # measured / base of each group's share of a forward, alone
TRUE_B = {"gemm": 1.2, "conv": 1.0, "memory": 1.5}
BESIDE = {"gemm": 0.5, "conv": 0.1, "memory": 0.3}  # added per other rank computing beside the op


def _group_run(shares: list[dict[str, float]], scale: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """Two cpu stages on ranks 0 and 1 (forward `scale` x (2, 3) ms, backward twice that), 4 micro-batches:
    the first two forwards of each stage side by side with the other rank's, the rest alone; each op lasts
    what the true group factors say of its shares."""
    stages = [{"index": s, "device": "cpu", "forward_ms": scale * (2 + s), "backward_ms": 2 * scale * (2 + s),
               "reads_from": [s - 1] if s else [], "ranks": [s]} for s in range(2)]

    def ms(s: int, kind: str, beside: float) -> float:
        base = stages[s]["forward_ms" if kind == "forward" else "backward_ms"]
        factors = TRUE_F if kind == "forward" else TRUE_B
        beside_f = BESIDE if kind == "forward" else dict.fromkeys(BESIDE, 0.0)
        return base * sum(v * (factors[g] + beside_f[g] * beside) for g, v in shares[s].items())

    def longer(s: int, short: float) -> float:
        """The length of the longer of two ops side by side: beside the other for short / its own length."""
        alone, slope = ms(s, "forward", 0.0), ms(s, "forward", 1.0) - ms(s, "forward", 0.0)
        return (alone + (alone * alone + 4 * slope * short) ** 0.5) / 2

    rows: list[list[dict[str, Any]]] = [[], []]
    clock = 0.0
    for mb in range(2):  # both ranks' forwards start together (the shorter has the other beside it throughout)
        lengths = [ms(s, "forward", 1.0) for s in range(2)]
        short = min(range(2), key=lambda s: lengths[s])
        lengths[1 - short] = longer(1 - short, lengths[short])
        for s in range(2):
            rows[s].append({"kind": "forward", "stage": s, "microbatch": mb, "start": clock, "end": clock + lengths[s]})
        clock += max(lengths) + 100.0  # apart from what follows
    for s in range(2):  # then every other op alone
        for kind, mbs in (("forward", range(2, 4)), ("backward", range(4))):
            for mb in mbs:
                rows[s].append({"kind": kind, "stage": s, "microbatch": mb, "start": clock,
                                "end": clock + ms(s, kind, 0.0)})
                clock += ms(s, kind, 0.0) + 1.0
    trace = {"devices": [{"device": f"cpu (rank {s})", "events": rows[s]} for s in range(2)]}
    return {"stages": stages, "programs": []}, trace


def test_group_factors_fitted_on_two_models_price_a_third_with_another_mix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("cost_model.group_fit.RIDGE", 1e-9)  # the data alone (the prior: next test)
    gemm_model = [{"gemm": 0.8, "memory": 0.2}, {"gemm": 0.5, "memory": 0.5}]
    conv_model = [{"conv": 0.9, "memory": 0.1}, {"conv": 0.6, "memory": 0.4}]
    made = None
    for shares, scale in ((gemm_model, 1.0), (conv_model, 1.0), (gemm_model, 3.0)):
        plan, trace = _group_run(shares, scale)
        made = fit_calibration(plan, trace, step_ms=1000.0, cores=2.0, previous=made, shares=shares)
    assert made is not None
    fit = made.group_factors("cpu", "F")
    assert fit is not None
    assert {g: fit.factors[g] for g in TRUE_F} == pytest.approx(TRUE_F, rel=1e-3)
    assert {g: fit.contention[g] for g in BESIDE} == pytest.approx(BESIDE, rel=1e-3)  # 1 rank beside: + h
    mixed = {"gemm": 0.3, "conv": 0.3, "memory": 0.4}  # a model neither run had
    assert made.stage_ms("cpu", "F", 10.0, mixed) == pytest.approx(10 * (0.45 + 0.24 + 0.8), rel=1e-4)
    assert made.stage_ms("cpu", "F", 10.0, mixed, others=1.0) == pytest.approx(
        10 * (0.45 + 0.24 + 0.8 + 0.15 + 0.03 + 0.12), rel=1e-3)
    assert made.stage_ms("cpu", "B", 10.0, mixed) == pytest.approx(10 * (0.36 + 0.3 + 0.6), rel=1e-4)
    # the pooled factor alone would price that model as the average of the runs it saw: off by far more
    assert abs(10 * made.compute_factor("cpu", "F") - 14.9) > 1.0
    again = Calibration.from_dict(made.to_dict())  # the normal equations travel in the JSON
    assert again.stage_ms("cpu", "F", 10.0, mixed) == pytest.approx(made.stage_ms("cpu", "F", 10.0, mixed))


def test_a_group_never_seen_takes_the_pooled_factor_and_a_rarely_seen_one_stays_near_it() -> None:
    shares = [{"gemm": 0.8, "memory": 0.2}, {"gemm": 0.5, "memory": 0.5}]
    plan, trace = _group_run(shares, 1.0)
    made = fit_calibration(plan, trace, step_ms=1000.0, cores=2.0, shares=shares)
    fit = made.group_factors("cpu", "F")
    assert fit is not None
    assert fit.factors["conv"] == pytest.approx(fit.factors["*"]) == fit.factors["attention"]  # unseen: pooled
    assert fit.contention["conv"] == pytest.approx(fit.contention["*"])
    assert made.group_factors("cuda:0", "F") is None and made.stage_ms("cuda:0", "F", 1.0, {"gemm": 1.0}) is None
    plain = fit_calibration(plan, trace, step_ms=1000.0, cores=2.0)  # no shares: the pooled factors only
    assert plain.groups == {} and "groups" not in plain.to_dict()
