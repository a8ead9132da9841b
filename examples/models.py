"""Models bundled with the examples and benchmarks: a small GPT and an Inception-style net, random weights."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "GPTConfig", "InceptionBlock", "InceptionNet", "make_gpt"]


@dataclass
class GPTConfig:
    vocab: int = 512
    width: int = 128
    heads: int = 4
    layers: int = 4
    seq: int = 64
    tied: bool = True  # LM head shares the token embedding's weight


class Block(nn.Module):
    """Pre-norm transformer block with causal self-attention."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))
        self.register_buffer("mask", torch.tril(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool)), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, blocks, and an LM head (tied to the token embedding by default)."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.seq, cfg.width)
        self.blocks = nn.Sequential(*[Block(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        if cfg.tied:
            self.head.weight = self.tok.weight
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        return self.head(self.ln(self.blocks(self.tok(idx) + self.pos(positions))))


class InceptionBlock(nn.Module):
    """Four branches (1x1; 1x1-3x3; 1x1-3x3-3x3; pool-1x1) joined by concat, plus a residual."""

    def __init__(self, c: int) -> None:
        super().__init__()
        q = c // 4
        self.b1 = nn.Conv2d(c, q, 1)
        self.b2 = nn.Sequential(nn.Conv2d(c, q, 1), nn.ReLU(), nn.Conv2d(q, q, 3, padding=1))
        self.b3 = nn.Sequential(
            nn.Conv2d(c, q, 1), nn.ReLU(), nn.Conv2d(q, q, 3, padding=1), nn.ReLU(), nn.Conv2d(q, q, 3, padding=1)
        )
        self.b4 = nn.Sequential(
            nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(c, q, 1), nn.ReLU(), nn.Conv2d(q, q, 3, padding=1)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x + torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1))


class InceptionNet(nn.Module):
    """A stem, Inception blocks of four parallel branches, global pooling and a classifier."""

    def __init__(self, c: int = 64, blocks: int = 3, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.Sequential(*[InceptionBlock(c) for _ in range(blocks)])
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.blocks(F.relu(self.stem(x))).mean(dim=(2, 3)))


def make_gpt(batch: int = 8) -> tuple[GPT, tuple[torch.Tensor]]:
    """A small GPT and a batch of token ids: a MODULE:FACTORY for `python -m partitioner`."""
    cfg = GPTConfig()
    return GPT(cfg), (torch.randint(0, cfg.vocab, (batch, cfg.seq)),)
