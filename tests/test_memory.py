"""Stage memory under GPipe and 1F1B against hand-computed byte counts."""

from __future__ import annotations

import pytest

from cost_model.memory import (
    ALLOCATOR_HEADROOM,
    CUDA_CONTEXT_BYTES,
    device_overhead_bytes,
    in_flight,
    saved_activation_bytes,
    stage_memory,
    usable_bytes,
)
from cost_model.recompute_cost import recompute_costs, saved_bytes_per_node


def test_micro_batches_in_flight() -> None:
    assert [in_flight("gpipe", s, 4, 8) for s in range(4)] == [8, 8, 8, 8]
    assert [in_flight("1f1b", s, 4, 8) for s in range(4)] == [4, 3, 2, 1]
    assert [in_flight("1F1B", s, 4, 2) for s in range(4)] == [2, 2, 2, 1]  # never more than m
    with pytest.raises(ValueError, match="gpipe"):
        in_flight("zigzag", 0, 2, 2)
    with pytest.raises(ValueError, match="0 <= stage < stages"):
        in_flight("gpipe", 4, 4, 8)


def test_stage_memory_adam_1f1b_hand_computed() -> None:
    mem = stage_memory(100, 10, stage=1, stages=4, micro_batches=8, schedule="1f1b", optimizer="adam",
                       recv_bytes=5, send_bytes=7)
    # params 100, grads 100, Adam 2 x 100, activations (4 - 1) x (10 + 5), buffers 2 x (5 + 7)
    assert (mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers) == (100, 100, 200, 45, 24)
    assert mem.total == 469
    assert mem.to_dict()["total"] == 469


def test_stage_memory_gpipe_and_optimizers() -> None:
    sgd = stage_memory(1000, 50, stage=0, stages=2, micro_batches=4, optimizer="sgd")
    assert (sgd.optimizer, sgd.activations, sgd.buffers) == (0, 200, 0)
    momentum = stage_memory(1000, 50, stage=0, stages=2, micro_batches=4, optimizer="sgd_momentum")
    assert momentum.optimizer == 1000
    with pytest.raises(ValueError, match="adam"):
        stage_memory(1, 1, stage=0, stages=1, micro_batches=1, optimizer="lion")
    with pytest.raises(ValueError, match=">= 0"):
        stage_memory(-1, 1, stage=0, stages=1, micro_batches=1)


def test_fits_with_headroom() -> None:
    mem = stage_memory(100, 0, stage=0, stages=1, micro_batches=1, optimizer="sgd")  # 200 bytes
    assert mem.fits(1000)
    assert not mem.fits(210)  # 90% of 210 is 189
    assert mem.fits(210, headroom=1.0)


def test_saved_activations_count_what_autograd_saves_once() -> None:
    # x -> fc -> view -> relu -> fc2 -> gelu; fc saves x (the stage's input: not counted), relu its output,
    # which fc2 saves too (once), gelu its input (fc2's output); views and sizes save nothing. The old upper
    # bound counted every output: fc, relu, fc2 and gelu, 128 bytes.
    def node(name: str, op: str, target: str, inputs: list[str], **more: object) -> dict[str, object]:
        return {"name": name, "op": op, "target": target, "shapes": [(2, 4)], "out_bytes": 32,
                "inputs": [(u, 32) for u in inputs], **more}

    nodes = [
        node("fc", "call_module", "fc", ["x"], kind="Linear", flops=64),
        node("v", "call_method", "view", ["fc"]),
        node("r", "call_function", "relu", ["v"]),
        node("fc2", "call_module", "fc2", ["r"], kind="Linear", flops=64),
        node("gelu", "call_function", "gelu", ["fc2"]),
        {**node("n", "call_function", "floordiv", ["gelu"]), "shapes": [], "out_bytes": 0},
    ]
    assert saved_bytes_per_node(nodes) == {"fc": 0, "v": 0, "r": 32, "fc2": 32, "gelu": 0, "n": 0}
    assert saved_activation_bytes(nodes) == 64 == recompute_costs(nodes)["none"].kept_bytes


def test_cuda_loses_its_context_and_allocator_headroom() -> None:
    import torch

    gib = 1 << 30
    assert CUDA_CONTEXT_BYTES == 512 << 20 and ALLOCATOR_HEADROOM == 0.10
    assert device_overhead_bytes("cuda") == device_overhead_bytes("cuda:3") == CUDA_CONTEXT_BYTES
    assert device_overhead_bytes(torch.device("cuda", 1)) == CUDA_CONTEXT_BYTES
    assert device_overhead_bytes("cpu") == device_overhead_bytes(torch.device("cpu")) == 0
    # an 80 GiB H100: (80 GiB - 0.5 GiB) x 0.9 = 71.55 GiB for tensors
    assert usable_bytes(80 * gib, "cuda:0") == int(79.5 * gib * 0.9)
    assert usable_bytes(80 * gib, "cpu") == 80 * gib  # host memory: no context, no headroom
    assert usable_bytes(100 << 20, "cuda") == 0  # smaller than the context: nothing, never negative
    mem = stage_memory(30 * gib, 5 * gib, stage=0, stages=2, micro_batches=4, optimizer="sgd")  # 80 GiB
    assert mem.total <= 80 * gib and mem.total > usable_bytes(80 * gib, "cuda")
    with pytest.raises(ValueError, match="negative"):
        usable_bytes(-1, "cuda")


def test_backward_peak_walks_the_nodes_in_reverse() -> None:
    # Two blocks (segments 'blocks.0' and 'blocks.1') of fc (Linear) -> act (GELU); the stage's input
    # 'x' is received. Each value 400 bytes; see cost_model/recompute_cost.py
    from cost_model.recompute_cost import recompute_costs, segment_key

    def node(name: str, kind: str, module: str, inputs: list[str]) -> dict[str, object]:
        return {"name": name, "op": "call_module", "kind": kind, "target": module, "module": module,
                "out_bytes": 400, "shapes": [[4, 25]], "dtypes": ["float32"], "flops": 10 if kind == "Linear" else 0,
                "inputs": [(u, 400) for u in inputs], "forward_s": 0.0}

    stage = [node("fc0", "Linear", "blocks.0.fc", ["x"]), node("act0", "GELU", "blocks.0.act", ["fc0"]),
             node("fc1", "Linear", "blocks.1.fc", ["act0"]), node("act1", "GELU", "blocks.1.act", ["fc1"])]
    assert [segment_key(n["module"]) for n in stage] == ["blocks.0"] * 2 + ["blocks.1"] * 2  # type: ignore[arg-type]
    costs = recompute_costs(stage)
    # none keeps fc0 (GELU's input), act0 (fc1's input), fc1: 1200; act1's backward adds the gradients of act1
    # and of fc1 (800) while all three are alive
    assert (costs["none"].kept_bytes, costs["none"].peak_bytes) == (1200, 2000)
    # full keeps act0 (read by the next segment); in blocks.1's backward: act0, fc1 recomputed, 2 gradients
    assert (costs["full"].kept_bytes, costs["full"].peak_bytes) == (400, 1600)
    assert costs["full"].rerun_bytes == 1200
    # selective keeps the products fc0, fc1 and the crossing act0: its peak is none's
    assert (costs["selective"].kept_bytes, costs["selective"].peak_bytes) == (1200, 2000)
    # a stage of one segment: full keeps nothing of its own and recomputes all "none" keeps: no saving at the peak
    whole = recompute_costs([{**n, "module": "head"} for n in stage])
    assert (whole["full"].kept_bytes, whole["full"].peak_bytes) == (0, 2000)


def test_stage_memory_with_the_backward_peak_hand_computed() -> None:
    # stage 1 of 4, 1F1B, 8 micro-batches: 3 in flight; A 10 kept, 30 at the backward's worst, R 5, S 7
    mem = stage_memory(100, 10, stage=1, stages=4, micro_batches=8, schedule="1f1b", recv_bytes=5, send_bytes=7,
                       peak_bytes=30)
    # activations 2 x 10 + 30 + 3 x 5; buffers: 3 outputs held + their gradient, (3 + 1) x 7
    assert (mem.params, mem.grads, mem.optimizer, mem.activations, mem.buffers) == (100, 100, 200, 65, 28)
    last = stage_memory(100, 10, stage=3, stages=4, micro_batches=8, schedule="1f1b", recv_bytes=5, send_bytes=7,
                        peak_bytes=30, last=True)
    # one in flight; the loss holds 3 x 7 beside the 10 kept (31 > 30); the output itself once
    assert (last.activations, last.buffers) == (31 + 5, 7)
    assert stage_memory(1, 10, stage=0, stages=1, micro_batches=4, peak_bytes=12, flight=2).activations == 22


@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_predicted_peak_matches_the_measured_one_of_a_gpt(mode: str) -> None:
    # A real 1F1B step with Adam, measured by runtime.memory_meter: the plan's memory_bytes per stage
    import torch
    import torch.nn.functional as F

    from cost_model.analytic import AnalyticCostModel
    from examples.models import GPT, GPTConfig
    from partitioner import partition
    from runtime.memory_meter import MemoryMeter

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=64, width=32, heads=4, layers=4, seq=64, tied=False)
    model = GPT(cfg)
    x, y = torch.randint(0, 64, (16, 64)), torch.randint(0, 64, (16, 64))
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4, schedule="1f1b", threads=False,
                     cost_model=AnalyticCostModel(), recompute=mode)  # type: ignore[arg-type]
    optimizer = torch.optim.Adam(model.parameters())
    with MemoryMeter([s.module for s in pipe.stages], optimizer=optimizer) as meter:
        for _ in range(2):  # the second step has Adam's state from the start
            meter.reset_peaks()
            optimizer.zero_grad()
            pipe.train_step(x, y, lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
            optimizer.step()
    for predicted, measured in zip([s.memory_bytes for s in pipe.plan.stages], meter.peaks):
        assert abs(predicted - measured) <= 0.05 * measured, (mode, predicted, measured)
