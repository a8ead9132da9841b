"""Memory-bound operator classes priced by the bytes their eager CUDA kernels move, counted by hand
(cost_model/ops.py, [Note: eager kernel bytes]), on an H100 SXM described from the GPU table."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cost_model.analytic import AnalyticCostModel
from cost_model.cluster import DeviceSet
from cost_model.devices import DeviceSpec
from cost_model.ops import classify

GPU = torch.device("cuda", 0) if not torch.cuda.is_available() else torch.device("cuda", 99)
CPU = torch.device("cpu")
LAUNCH = 5e-6  # analytic._GPU_OP_OVERHEAD_S: one eager kernel launch
HBM = 0.9 * 3350e9  # gpus.json: the H100 SXM's 3350 GB/s x FlashMLA's measured 0.9
B, S, H = 8, 1024, 4096
ACT = B * S * H * 2  # one bf16 activation of the shape: 64 MiB


def never(device: torch.device) -> DeviceSpec:
    raise AssertionError(f"the model measured {device} although it was described")


def h100() -> AnalyticCostModel:
    return AnalyticCostModel(DeviceSet.from_dict({"devices": {str(GPU): {"gpu_type": "H100-SXM"}}}), measure=never)


def node(target: str, *, out: float = ACT, ratio: float | None = 1.0, dtype: str = "bfloat16",
         shape: tuple[int, ...] = (B, S, H)) -> dict[str, Any]:
    attrs: dict[str, Any] = {"name": target, "op": "call_function", "target": target, "shapes": [shape],
                             "dtypes": [dtype], "out_bytes": out, "flops": 0}
    if ratio is not None:
        attrs["input_ratio"] = ratio
    return attrs


@pytest.mark.parametrize("target, ratio, launches, forward, backward", [
    # layer norm: read x, write y | dx kernel reads dy, x and writes dx; dgamma/dbeta kernel reads dy, x
    ("layer_norm", 1.0, (3, 4), 2.0, 5.0),
    ("rms_norm", 1.0, (3, 4), 2.0, 5.0),
    # softmax over rows on chip: read x, write y | read dy, y, write dx
    ("softmax", 1.0, (2, 3), 2.0, 3.0),
    # gelu, silu: read x, write y | read dy, x, write dx
    ("gelu", 1.0, (2, 3), 2.0, 3.0),
    ("silu", 1.0, (2, 3), 2.0, 3.0),
    # dropout, bf16: read x, write y and a 1-byte mask (half of y) | read dy and the mask, write dx
    ("dropout", 1.0, (2, 3), 2.5, 2.5),
    # residual add: read a, b, write y | the fork's two gradients summed: read 2, write 1
    ("add", 2.0, (2, 1), 3.0, 3.0),
    # same-shaped product: read a, b, write y | da = dy * b, db = dy * a: 2 x (read 2, write 1)
    ("mul", 2.0, (2, 3), 3.0, 6.0),
    # a cast up to fp32 (the output, ACT, is fp32; the input half of it): read x, write y | read dy, write dx
    ("float", 0.5, (2, 3), 1.5, 1.5),
])
def test_memory_bound_classes_move_the_hand_counted_bytes(target: str, ratio: float, launches: tuple[int, int],
                                                          forward: float, backward: float) -> None:
    cost, attrs = h100(), node(target, ratio=ratio)
    assert cost.forward_time(attrs, GPU) == pytest.approx(launches[0] * LAUNCH + forward * ACT / HBM)
    assert cost.backward_time(attrs, GPU) == pytest.approx(launches[1] * LAUNCH + backward * ACT / HBM)


def test_layer_norm_forward_is_two_passes_not_three() -> None:
    # 64 MiB in bf16 on an H100: 3 launches + 2 x 64 MiB at 3015 GB/s = 15 us + 44.5 us
    assert h100().forward_time(node("layer_norm"), GPU) == pytest.approx(15e-6 + 44.51e-6, rel=1e-3)


def test_a_reduction_is_priced_by_the_input_it_reads() -> None:
    # sum over the hidden dim: reads 64 MiB, writes 16 KiB
    out = B * S * 2
    summed = node("sum", out=out, ratio=ACT / out, shape=(B, S))
    cost = h100()
    assert cost.forward_time(summed, GPU) == pytest.approx(3 * LAUNCH + (out + ACT) / HBM)
    assert cost.backward_time(summed, GPU) == pytest.approx(3 * LAUNCH + (out + ACT) / HBM)  # dx written once
    unrecorded = node("sum", out=out, ratio=None, shape=(B, S))  # no input recorded: its output alone
    assert cost.forward_time(unrecorded, GPU) == pytest.approx(3 * LAUNCH + 2 * out / HBM)
    assert cost.forward_time(summed, GPU) > 50 * (cost.forward_time(unrecorded, GPU) - 3 * LAUNCH)


class Loss(nn.Module):
    """A vocabulary head with its loss inside forward, as a model that returns the loss does."""

    def __init__(self, width: int = 64, vocab: int = 1000) -> None:
        super().__init__()
        self.head = nn.Linear(width, vocab)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(x)
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def test_cross_entropy_inside_forward_reaches_the_cost_model_priced_over_the_logits() -> None:
    from partitioner.capture.graph import build_graph
    from partitioner.capture.trace import trace

    x, targets = torch.randn(4, 32, 64), torch.randint(0, 1000, (4, 32))
    gm = trace(Loss(), (x, targets)).graph_module
    graph = build_graph(gm, [x, targets])
    (name,) = [n for n, a in graph.nodes(data=True) if a["op"] == "call_function" and classify(a) == "loss"]
    attrs = graph.nodes[name]
    logits, labels = 4 * 32 * 1000 * 4, 4 * 32 * 8
    assert attrs["out_bytes"] == 4  # the mean: a scalar
    assert attrs["input_ratio"] * 4 == logits + labels
    cost, inputs = h100(), logits + labels
    # log_softmax reads the logits and writes log-probabilities, nll_loss reads a row's entry | nll_loss_backward
    # writes a zero-filled gradient of the logits, log_softmax_backward reads it and the log-probabilities and
    # writes the logits' gradient
    assert cost.forward_time(attrs, GPU) == pytest.approx(2 * LAUNCH + (4 + 2 * inputs) / HBM)
    assert cost.backward_time(attrs, GPU) == pytest.approx(3 * LAUNCH + (4 + 4 * inputs) / HBM)


def test_cpu_prices_keep_the_fitted_elementwise_class() -> None:
    # The CPU table was fitted with one elementwise class (3.3 / 4.0 output bytes, 5 / 6 overheads): the new
    # accelerator classes (add, mul, the losses) and recorded input ratios leave CPU prices as they were.
    spec = DeviceSpec("cpu", flops_per_s=1e11, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30, kind="cpu")
    cost = AnalyticCostModel({CPU: spec}, measure=never)
    for target, ratio in (("add", 2.0), ("mul", 2.0), ("cross_entropy", 1e4), ("nll_loss", 1e4), ("where", 3.0)):
        attrs = node(target, out=4e6, ratio=ratio, dtype="float32")
        assert cost.forward_time(attrs, CPU) == pytest.approx(5e-6 + 3.3 * 4e6 / 1e10)
        assert cost.backward_time(attrs, CPU) == pytest.approx(6e-6 + 4.0 * 4e6 / 1e10)
    assert cost.forward_time(node("sum", out=4e6, ratio=1e3, dtype="float32"), CPU) == pytest.approx(
        6e-6 + 2.0 * 4e6 / 1e10)  # reductions: still by their output on CPU
