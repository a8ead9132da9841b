"""benchmarks/published_runs.py: what it compares is the source's figure, the fit sees only fit rows, and a row's
unstated choices are tried from the fastest to the one using least memory."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.measured_plan import plan_arguments
from benchmarks.measured_runs import RUNS
from benchmarks.published_runs import Priced, _axes, _priced_on, fitted, measured_tps, price_row, variants
from partitioner.place.cluster.fixed import Fixed
from partitioner.place.search import kernels as kernels_search

BY_KEY = {r.key: r for r in RUNS}


def test_measured_throughput_is_the_printed_figure() -> None:
    titan = BY_KEY["titan-8B-8-fsdp"]  # prints tokens/s per GPU: 5,762
    assert measured_tps(titan) == pytest.approx(5762, abs=0.5)
    sc21 = BY_KEY["sc21-1.7B"]  # 137 TFLOP/s per GPU under eq. 3's count of a step
    m = sc21.model
    h, layers, s = m.width, m.layers, sc21.seq
    eq3_per_token = 96 * layers * h * h * (1 + s / (6 * h) + m.vocab / (16 * layers * h))  # eq. 3 over B s
    assert measured_tps(sc21) == pytest.approx(137e12 / eq3_per_token, rel=0.01)


def _row(split: str, family: str, measured: float, forced: float, gemm: float, attention: float = 0.0) -> Priced:
    return Priced("k", "s", split, family, "3d", measured, forced=forced, gemm_share=gemm, attention_share=attention)


def test_the_fit_reads_fit_rows_only_and_scales_each_kind_of_compute() -> None:
    # predicted 1 s a token: 0.5 GEMMs, 0.5 the rest; measured 1.5 s: GEMMs must take 1 s, factor 0.5
    rows = [_row("fit", "A100", 1 / 1.5, 1.0, 0.5), _row("fit", "A100", 1 / 1.5, 1.0, 0.5),
            _row("held-out", "A100", 1 / 9.0, 1.0, 0.5)]
    gemm, attention = fitted(rows)["A100"]
    assert gemm == pytest.approx(0.5) and attention == pytest.approx(0.5)  # no row decides attention: one factor
    # rows at short sequences (attention 10% of a step) cannot tell slow attention from slow GEMMs: still one
    short = [_row("fit", "H100", 1 / 1.5, 1.0, 0.8, 0.1), _row("fit", "H100", 1 / 1.2, 1.0, 0.85, 0.05)]
    gemm, attention = fitted(short)["H100"]
    assert gemm == attention and 0.5 < gemm < 1.0
    # a second row with attention alone slower by 2x: attention's factor 0.5, GEMMs' stays exact
    rows.append(_row("fit", "A100", 1 / 1.8, 1.0, 0.0, 0.8))  # 0.8 / f_a + 0.2 = 1.8 -> f_a = 0.5
    assert fitted(rows)["A100"] == (pytest.approx(0.5), pytest.approx(0.5))
    assert fitted([_row("held-out", "H100", 1.0, 2.0, 1.0)]) == {}


def test_a_factor_scales_the_gpu_types_product_rates() -> None:
    args = plan_arguments(BY_KEY["sc21-1.7B"])
    base, _ = _priced_on(args, (1.0, 1.0))
    scaled, table = _priced_on(args, (0.9, 0.6))
    assert scaled.gpu.name != base.gpu.name and table.get(scaled.gpu.name) == scaled.gpu
    for (k, v), (k2, v2) in zip(base.gpu.gemm, scaled.gpu.gemm):
        assert k == k2 and v2 == pytest.approx(v * 0.9)
    assert scaled.gpu.attention == pytest.approx(tuple(a * 0.6 for a in base.gpu.attention or ()))
    assert scaled.gpu.memory_bytes == base.gpu.memory_bytes
    assert scaled.fabric == base.fabric  # the links stay the measured GPU's (their defaults go by the type's name)


def test_unstated_choices_go_from_fastest_to_least_memory() -> None:
    run = BY_KEY["megascale-175B-256"]  # states t, p and v; not SP, sharding or recomputation
    tried = variants(run, Fixed(**plan_arguments(run).fixed))
    assert [(f.sequence_parallel, f.sharding, f.recompute) for f in tried] == [
        (True, "none", "none"), (True, "zero1", "none"), (True, "zero1", "attention"), (True, "zero1", "full")]
    titan = BY_KEY["titan-8B-64-2d-bf16-2025"]  # torchtitan's selective op policy, as run: priced as such
    assert [f.recompute for f in variants(titan, Fixed(**plan_arguments(titan).fixed))] == ["selective-op"]
    stated = BY_KEY["sc21-1.7B"]  # everything stated: only its own configuration
    assert variants(stated, Fixed(**plan_arguments(stated).fixed)) == [Fixed(**plan_arguments(stated).fixed)]


def test_a_faster_free_plan_names_the_axes_it_changed() -> None:
    run = BY_KEY["sc21-1.7B"]
    fixed = plan_arguments(run).fixed
    same = _axes(run, fixed, fixed["tensor"], fixed["stages"], fixed["virtual_stages"], fixed["sharding"],
                 fixed["recompute"], fixed["micro_batch_size"])
    assert same == ()
    other = _axes(run, fixed, 2, 1, 1, "zero1", "none", 4)
    assert set(other) == {"tensor", "sharding", "recomputation", "micro-batch size"}


@pytest.mark.timeout(300)
def test_a_row_is_priced_forced_and_free() -> None:
    row = price_row(BY_KEY["sc21-1.7B"])
    assert row.forced is not None and not row.over and row.memory is not None and row.memory < row.capacity
    assert 0.5 < row.forced / row.measured < 2.0  # the analytic model, not a hard-coded figure
    assert row.free is not None and row.free >= row.forced * (1 - 1e-9)  # its space holds the forced configuration
    assert 0.0 < row.gemm_share <= 1.0 and 0.0 < row.attention_share < row.gemm_share
    assert dataclasses.asdict(row)["key"] == "sc21-1.7B"


@pytest.mark.timeout(300)
def test_mpt_1b_fits_where_it_trained_with_its_fused_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    """llm-foundry trained MPT-1B at 10 sequences of 2,048 per A100-40GB with flash-attn's fused cross-entropy: the
    loss keeps the logits and writes their gradient (2 outputs), not torch's log-probabilities beside them (3)."""
    run = BY_KEY["foundry-a100-40gb-1b-2048-32"]
    assert run.kernels.kernels == "fused" and run.parallel.micro_batch_size == 10
    row = price_row(run, free=False)
    assert not row.over and row.memory is not None and row.memory < row.capacity
    monkeypatch.setitem(kernels_search.WORKING_OUTPUTS, "fused", 3)  # the loss as torch's eager one holds it
    eager_loss = price_row(run, free=False)
    assert eager_loss.over and eager_loss.memory is not None
    logits = 10 * 2048 * 50368 * 2  # one micro-batch's bf16 logits, counted by hand
    assert (eager_loss.memory - row.memory) * 2**30 == pytest.approx(logits, rel=1e-3)
