"""Analytic per-GPU training throughput on published GPUs, beside the published figures.

Three model families, each on two GPU types (at least), at the precision the published run used:

    ResNet-50 v1.5   images/s   A100-SXM4-80GB, V100-SXM2-16GB    NVIDIA DeepLearningExamples (PyTorch)
    BERT-large       seq/s      A100-SXM4-80GB, V100-SXM2-32GB    NVIDIA DeepLearningExamples (PyTorch)
    MPT-1B (GPT)     tokens/s   A100-SXM4-80GB, H100-SXM          MosaicML llm-foundry benchmarks

How a prediction is made: the model is built from torch.nn with random weights on the meta
device (no download, no memory), at the published per-GPU batch and dtype; torch.fx traces it,
`partitioner.capture.graph.build_graph` records shapes, bytes and FLOPs per node (FlopCounterMode), and
`AnalyticCostModel` prices every node's forward + backward on a one-GPU `Cluster`
(cost_model/cluster_shape.py). Throughput = batch / the sum. Ignored: the optimizer step
(amortized over gradient accumulation in the BERT runs, < 1% elsewhere), data loading, and the
data-parallel all-reduce (the published multi-GPU rows overlap it; they are divided by the GPUs).

Efficiency: one number per GPU type, never per model. It is the fraction of the type's dense peak
that the analytic model's reference product (a 4096 cube) reaches: EFFICIENCY_SCALE x the type's
measured Maximum Achievable Matmul FLOPS fraction (best-shape bf16 matmul over peak: A100 SXM 85.9%,
H100 SXM 80.1%; https://github.com/stas00/ml-engineering/blob/master/compute/accelerator/README.md,
"Maximum Achievable Matmul FLOPS comparison table"). EFFICIENCY_SCALE = 0.7 / 0.859 makes the A100
the analytic model's stated default (DEFAULT_GPU_EFFICIENCY = 0.7); a type without a measurement
(V100) takes that default.

Last line: `analytic vs published: worst N%`, N = the largest |predicted - published| / published.

Run: python benchmarks/gpu_table.py
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cost_model.analytic import DEFAULT_GPU_EFFICIENCY, AnalyticCostModel  # noqa: E402
from cost_model.cluster_shape import Cluster  # noqa: E402
from partitioner.capture.graph import build_graph  # noqa: E402

MAMF = {"A100-SXM4-80GB": 0.859, "H100-SXM": 0.801}  # measured best-shape bf16 matmul / peak (ml-engineering)
EFFICIENCY_SCALE = DEFAULT_GPU_EFFICIENCY / MAMF["A100-SXM4-80GB"]

DLE = "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch"
RESNET_SRC = f"{DLE}/Classification/ConvNets/resnet50v1.5/README.md (Training performance, 1 GPU, pytorch-21.03)"
BERT_SRC = f"{DLE}/LanguageModeling/BERT/README.md (Pre-training phase 1, seq 128, 1 GPU, pytorch:21.11)"
MPT_SRC = ("https://github.com/mosaicml/llm-foundry/blob/main/scripts/train/benchmarking/README.md "
           "(MPT 1b, seq 2048, 8 GPUs, no activation checkpointing, Throughput (T/s/GPU))")  # fmt: skip


# --- models (torch.nn, random weights, built on meta) ---------------------------------------------------
class Bottleneck(nn.Module):
    """ResNet v1.5 bottleneck: the stride sits on the 3x3 convolution."""

    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        cout = width * 4
        self.conv1, self.bn1 = nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width)
        self.conv2, self.bn2 = nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width)
        self.conv3, self.bn3 = nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        return self.relu(self.bn3(self.conv3(y)) + self.down(x))


class ResNet50(nn.Module):
    """torchvision's resnet50 (v1.5), layer for layer; torchvision is not a dependency here."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))  # fmt: skip
        blocks: list[nn.Module] = []
        cin = 64
        for width, count, stride in [(64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)]:
            for i in range(count):
                blocks.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
        self.layers = nn.Sequential(*blocks)
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class EncoderLayer(nn.Module):
    """A BERT layer (post-norm, biases, GELU, dropout 0.1), as transformers' BertLayer computes it."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.proj, self.ln1 = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.LayerNorm(d)
        self.fc1, self.fc2, self.ln2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.LayerNorm(d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        scores = self.drop(torch.softmax(torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(d // self.heads), -1))
        x = self.ln1(x + self.drop(self.proj(torch.matmul(scores, v).transpose(1, 2).reshape(b, t, d))))
        return self.ln2(x + self.drop(self.fc2(F.gelu(self.fc1(x)))))


class BertLarge(nn.Module):
    """BERT-large pre-training (24 x 1024, 16 heads, vocab 30522): MLM head on the 20 masked positions
    per sequence (DeepLearningExamples' max_predictions_per_seq=20, dense_seq_output) and NSP."""

    def __init__(self, d: int = 1024, layers: int = 24, heads: int = 16, vocab: int = 30522, masked: int = 20) -> None:
        super().__init__()
        self.masked = masked
        self.tok, self.pos, self.typ = nn.Embedding(vocab, d), nn.Embedding(512, d), nn.Embedding(2, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.Sequential(*[EncoderLayer(d, heads) for _ in range(layers)])
        self.head, self.head_ln, self.decoder = nn.Linear(d, d), nn.LayerNorm(d), nn.Linear(d, vocab)
        self.nsp = nn.Linear(d, 2)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, types: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = self.layers(self.ln(self.tok(ids) + self.pos(positions) + self.typ(types)))
        masked = x[:, : self.masked]  # stands for the gathered masked positions: same shapes, same work
        return self.decoder(self.head_ln(F.gelu(self.head(masked)))), self.nsp(x[:, 0])


class DecoderBlock(nn.Module):
    """An MPT/GPT-2 style block: pre-norm, no biases, fused attention (flash: no T x T tensor), GELU MLP."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d, bias=False), nn.Linear(d, 3 * d, bias=False), nn.Linear(
            d, d, bias=False)  # fmt: skip
        self.ln2, self.up, self.down = nn.LayerNorm(d, bias=False), nn.Linear(d, 4 * d, bias=False), nn.Linear(
            4 * d, d, bias=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4).unbind(0)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class MPT1B(nn.Module):
    """MPT-1b as llm-foundry's yamls/pretrain/mpt-1b.yaml: d_model 2048, 24 layers, 16 heads, vocab 50368, tied head."""

    def __init__(self, d: int = 2048, layers: int = 24, heads: int = 16, vocab: int = 50368) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.Sequential(*[DecoderBlock(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.linear(self.ln(self.blocks(self.emb(ids))), self.emb.weight)


# --- the comparison ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One published figure: a model at a batch and dtype on a GPU type, and what was measured."""

    family: str
    gpu: str
    precision: str  # as published
    dtype: torch.dtype  # what the products run in (mixed precision: fp16/bf16; tf32: fp32 with TF32)
    batch: int
    items_per_sample: int  # tokens per sequence for tokens/s, else 1
    unit: str
    published: float
    source: str


def resnet_inputs(batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.empty(batch, 3, 224, 224, device="meta", dtype=dtype)]


def bert_inputs(batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    ids = torch.zeros(batch, 128, dtype=torch.long, device="meta")
    return [ids, ids, ids]


def mpt_inputs(batch: int, dtype: torch.dtype) -> list[torch.Tensor]:
    return [torch.zeros(batch, 2048, dtype=torch.long, device="meta")]


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int, torch.dtype], list[torch.Tensor]]]] = {
    "ResNet-50": (ResNet50, resnet_inputs),
    "BERT-large": (BertLarge, bert_inputs),
    "MPT-1B": (MPT1B, mpt_inputs),
}

CASES = [
    Case("ResNet-50", "A100-SXM4-80GB", "amp fp16", torch.float16, 256, 1, "img/s", 2470, RESNET_SRC),
    Case("ResNet-50", "A100-SXM4-80GB", "tf32", torch.float32, 256, 1, "img/s", 938, RESNET_SRC),
    Case("ResNet-50", "V100-SXM2-16GB", "amp fp16", torch.float16, 256, 1, "img/s", 1200, RESNET_SRC),
    Case("BERT-large", "A100-SXM4-80GB", "amp fp16", torch.float16, 256, 1, "seq/s", 580, BERT_SRC),
    Case("BERT-large", "A100-SXM4-80GB", "tf32", torch.float32, 128, 1, "seq/s", 317, BERT_SRC),
    Case("BERT-large", "V100-SXM2-32GB", "amp fp16", torch.float16, 64, 1, "seq/s", 224, BERT_SRC),
    Case("MPT-1B", "A100-SXM4-80GB", "amp bf16", torch.bfloat16, 14, 2048, "tok/s", 20513, MPT_SRC),
    Case("MPT-1B", "H100-SXM", "amp bf16", torch.bfloat16, 14, 2048, "tok/s", 45455, MPT_SRC),
]


def efficiency(gpu: str) -> float:
    """The stated efficiency of a GPU type (module docstring): scaled MAMF where measured, else the default."""
    return EFFICIENCY_SCALE * MAMF[gpu] if gpu in MAMF else DEFAULT_GPU_EFFICIENCY


def step_seconds(case: Case) -> float:
    """Analytic forward + backward seconds of one step of `case` on one GPU of its type."""
    build, inputs = MODELS[case.family]
    model = build().to(device="meta", dtype=case.dtype)
    graph_module = torch.fx.symbolic_trace(model)
    graph = build_graph(graph_module, inputs(case.batch, case.dtype))
    cluster = Cluster.from_dict({"hosts": 1, "gpus_per_host": 1, "gpu": case.gpu, "efficiency": efficiency(case.gpu)})
    cost = AnalyticCostModel(cluster.device_set(), tf32=True)  # fp32 products on TF32, as the published runs
    cost.prepare(graph_module)
    device = torch.device("cuda:0")
    return sum(cost.node_time(attrs, device) for _, attrs in graph.nodes(data=True))


def main() -> None:
    print(f"efficiency: {EFFICIENCY_SCALE:.3f} x MAMF fraction where measured "
          f"({', '.join(f'{g} {efficiency(g):.3f}' for g in MAMF)}), else {DEFAULT_GPU_EFFICIENCY}")  # fmt: skip
    header = (f"{'model':<11} {'GPU':<15} {'precision':<9} {'batch':>5}  {'analytic':>9}  {'published':>9}  "
              "unit    error")  # fmt: skip
    print(header)
    print("-" * len(header))
    worst = 0.0
    for case in CASES:
        predicted = case.batch * case.items_per_sample / step_seconds(case)
        error = (predicted - case.published) / case.published
        worst = max(worst, abs(error))
        print(f"{case.family:<11} {case.gpu:<15} {case.precision:<9} {case.batch:>5}  {predicted:>9.0f}  "
              f"{case.published:>9.0f}  {case.unit:<6} {error:+6.1%}")  # fmt: skip
    print("\nsources:")
    for source in dict.fromkeys(c.source for c in CASES):
        print(f"  {source}")
    print(f"\nanalytic vs published: worst {round(worst * 100)}%")


if __name__ == "__main__":
    main()
