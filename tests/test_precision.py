"""Training precision and memory by kind against literal numbers: bytes per parameter, the issue's 7B, ZeRO 1/2/3."""

from __future__ import annotations

import pytest
import torch

from cost_model.precision import FP32, MIXED, PURE_BF16, Precision, optimizer_name, optimizer_state_elements
from cost_model.training_memory import fits_under, training_memory
from rules.sharding import accumulates_unsharded, mode_rule, reduces
from runtime.plan import Plan, StagePlan

LLAMA_7B = 6_738_415_616  # Llama-2-7B's parameters
GIB = 1 << 30


def test_mixed_precision_adam_keeps_16_bytes_per_parameter() -> None:
    per = MIXED.bytes_per_param()  # torch.amp: fp32 weights (the master), bf16 compute, fp32 grads and moments
    assert (per.weights, per.master, per.gradients, per.optimizer) == (2, 4, 4, 8)
    assert per.kept == 16 and per.peak == 18  # the bf16 copy lives from forward to backward only
    assert LLAMA_7B * per.kept == 107_814_649_856
    assert Precision(grad="bf16").bytes_per_param().kept == 14  # bf16 gradients: 4 + 2 + 8
    assert per.master + per.optimizer == 12  # fp32 master and moments: ZeRO's K = 12
    assert Precision(grad="bf16").bytes_per_param().peak == 16  # bf16 weights and grads, fp32 master and moments


def test_pure_bf16_is_what_the_planner_priced_before() -> None:
    per = PURE_BF16.bytes_per_param()
    assert (per.weights, per.master, per.gradients, per.optimizer, per.kept) == (2, 0, 2, 4, 8)
    m = training_memory(LLAMA_7B, PURE_BF16, activation_bytes=14_800_000_000)
    # the plan: 13.5 GB parameters + 13.5 gradients + 27 Adam + 14.8 activations = 64.1 GiB (of rounded terms)
    assert (round(m.weights / 1e9, 1), round(m.gradients / 1e9, 1), round(m.optimizer / 1e9, 1)) == (13.5, 13.5, 27.0)
    assert round(m.total / GIB, 1) == 64.0
    assert FP32.bytes_per_param().kept == 16 and not FP32.mixed


def test_a_plan_that_fits_under_one_precision_and_not_another_says_so() -> None:
    fit = fits_under(LLAMA_7B, 72 * GIB, [PURE_BF16, MIXED], activation_bytes=14_800_000_000)
    assert fit.fitting == ["pure bf16"]
    assert fit.message == "fits in 72.0 GiB under pure bf16 (64.0 GiB) but not under mixed (126.7 GiB)"
    # the whole model on each of 128 GPUs, sharded ZeRO-3 by 32 blocks of 202M: mixed precision fits
    sharded = fits_under(LLAMA_7B, 72 * GIB, {"mixed": MIXED}, mode="zero3", degree=128,
                         units=[202_383_360] * 32, activation_bytes=14_800_000_000)
    assert sharded.fitting == ["mixed"] and round(sharded.memory["mixed"].total / GIB, 1) == 17.5


def test_optimizers_by_name_and_from_the_object() -> None:
    w = [torch.nn.Parameter(torch.zeros(2, 2))]
    assert optimizer_name(torch.optim.Adam(w)) == "adam"
    assert optimizer_name(torch.optim.AdamW(w)) == "adamw"
    assert optimizer_name(torch.optim.Adam(w, amsgrad=True)) == "amsgrad"
    assert optimizer_name(torch.optim.SGD(w, lr=0.1)) == "sgd"
    assert optimizer_name(torch.optim.SGD(w, lr=0.1, momentum=0.9)) == "sgd_momentum"
    assert optimizer_name(torch.optim.Adafactor(w)) == "adafactor"
    optimizers = {"adam": 8, "sgd_momentum": 4, "sgd": 0, "amsgrad": 12}
    assert {n: MIXED.with_optimizer(n).bytes_per_param().optimizer for n in optimizers} == optimizers
    assert MIXED.with_optimizer(torch.optim.SGD(w, lr=0.1)).bytes_per_param().kept == 8
    # Adafactor: a row and a column per matrix, a vector whole; its step counters aside
    shapes = [(4096, 11008), (4096,), (8, 32, 64)]
    assert optimizer_state_elements("adafactor", shapes) == 4096 + 11008 + 4096 + 256 + 512
    with pytest.raises(ValueError, match="name the closest one"):
        Precision(optimizer="lion")


def test_adafactor_state_matches_torch() -> None:
    w = [torch.nn.Parameter(torch.randn(6, 10)), torch.nn.Parameter(torch.randn(10))]
    opt = torch.optim.Adafactor(w)
    sum(p.sum() for p in w).backward()
    opt.step()
    held = sum(t.numel() for s in opt.state.values() for t in s.values() if t.dim() > 0)
    assert held == optimizer_state_elements(optimizer_name(opt), [p.shape for p in w]) == 6 + 10 + 10


def test_precision_is_data() -> None:
    p = Precision(torch.bfloat16, "fp32", "bf16", torch.float32, "adamw")
    assert (p.compute, p.param, p.grad, p.state, p.optimizer) == ("bfloat16", "float32", "bfloat16", "float32", "adamw")
    assert Precision.from_dict(p.to_dict()) == p
    assert Precision.parse("mixed") == MIXED and Precision.parse("bf16") == PURE_BF16
    assert Precision.parse("bf16/fp32/bf16/fp32:adamw") == Precision("bf16", "fp32", "bf16", "fp32", "adamw")
    with pytest.raises(ValueError, match="COMPUTE/PARAM/GRAD/STATE"):
        Precision.parse("fp33")
    with pytest.raises(ValueError, match="is not one of"):
        Precision(compute="int3")


def test_fp8_products_keep_the_weights_fp8_copy_and_its_transpose() -> None:
    fp8 = Precision(matmul="fp8")
    assert fp8.matmul == "float8_e4m3fn" and fp8.matmul_copy_bytes == 2 and MIXED.matmul_copy_bytes == 0
    per = fp8.bytes_per_param()
    assert (per.weights, per.master, per.gradients, per.optimizer) == (4, 4, 4, 8)  # bf16 + 2 x fp8 copies
    assert Precision.from_dict(fp8.to_dict()) == fp8
    P, d = 1_000_000, 8
    assert training_memory(P, fp8).weights == training_memory(P, MIXED).weights + 2 * P
    units = [100_000] * 9
    z3, z3_fp8 = (training_memory(P, p, mode="zero3", degree=d, micro_batches=1, units=units) for p in (MIXED, fp8))
    assert z3_fp8.weights == 2 * z3.weights  # the gathered units' copies: 2 + 2 bytes where 2 were
    with pytest.raises(ValueError, match="is not one of"):
        Precision(matmul="fp7")


def test_a_plan_holds_every_precision_field() -> None:
    fp8 = Precision(matmul="fp8")
    plan = Plan(stages=[StagePlan(0, "cuda:0", ["a"])], micro_batches=1, precision=fp8.to_dict())
    plan.check()  # runtime/plan.py's own list of the keys holds 'matmul': every plan failed its check without it
    assert Precision.from_dict(Plan.from_json(plan.to_json()).precision or {}) == fp8


def test_memory_by_kind_divided_by_the_sharding_degree() -> None:
    P, d = 1_000_000, 8
    none = training_memory(P, MIXED)
    assert none.to_dict() == {"weights": 2 * P, "master": 4 * P, "gradients": 4 * P, "optimizer": 8 * P,
                              "activations": 0, "total": 18 * P}
    units = [100_000] * 9  # root: 100_000
    z1 = training_memory(P, MIXED, mode="zero1", degree=d, micro_batches=4, units=units)
    assert (z1.weights, z1.master, z1.optimizer) == (2 * P, 4 * P // d, 8 * P // d)  # optimizer (+ master) / d
    assert z1.gradients == 4 * P + 4 * 100_000  # accumulated unsharded, plus the largest reduce-scatter input
    z2 = training_memory(P, MIXED, mode="zero2", degree=d, micro_batches=4, gradient_sync="every", units=units)
    # shards (fp32) + the root's gradients (held to the backward's end) + one unit's (until its reduce-scatter)
    assert z2.gradients == 4 * P // d + 4 * 100_000 + 4 * 100_000 and z2.weights == 2 * P
    z3 = training_memory(P, MIXED, mode="zero3", degree=d, micro_batches=4, gradient_sync="every", units=units)
    assert z3.weights == 2 * (100_000 + 2 * 100_000)  # + parameters / d: the root and two blocks gathered
    z3_last = training_memory(P, MIXED, mode="zero3", degree=d, micro_batches=4, units=units)
    assert z3_last.gradients == z1.gradients  # sync "last": full gradients between micro-batches
    assert z3.total < z3_last.total < z1.total  # FULL_SHARD holds the least; accumulating whole, zero1's gradients
    assert training_memory(P, MIXED, mode="zero3", degree=d, micro_batches=1, units=units).gradients == z3.gradients
    with pytest.raises(ValueError, match="more than the stage's"):
        training_memory(10, MIXED, mode="zero3", units=[11])


def test_sharding_rules() -> None:
    assert [mode_rule(m).reshard_after_forward for m in ("zero1", "zero2", "zero3")] == [False, False, True]
    assert [mode_rule(m).keep_gathered for m in ("zero1", "zero2", "zero3")] == [True, False, False]
    assert not mode_rule("none").sharded
    assert reduces("zero3", "last", last=False) is False and reduces("zero3", "every", last=False)
    assert accumulates_unsharded("zero3", "last", 2) and not accumulates_unsharded("zero3", "last", 1)
    assert not accumulates_unsharded("none", "last", 8)
    with pytest.raises(ValueError, match="use 'zero2'"):
        mode_rule("zero1", "every")
    with pytest.raises(ValueError, match="is not one of"):
        mode_rule("zero4")
