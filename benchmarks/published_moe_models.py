"""Mixture-of-experts models of published training runs, from their published shapes, for benchmarks/published_moe.py
(meta only: priced, never run).

A decoder of `layers` blocks (RMSNorm, attention through F.scaled_dot_product_attention, RMSNorm, a feed-forward)
whose first `dense_layers` feed-forwards are SwiGLU MLPs and the rest a mixture of experts: a router (Linear) and
its top-k, a stack of `experts` SwiGLU experts called as `experts(hidden, index, weights)` with `num_experts`
(what partitioner/capture/experts.py finds), and `shared` always-on experts beside it. The experts' forward
gathers each token-slot's expert weights and multiplies them: the FLOPs of a dropless grouped GEMM, on meta
without storage. Attention: grouped-query (Qwen3, GPT-OSS), or DeepSeek's multi-head latent attention by its
shapes (q through a rank-`q_rank` bottleneck, k and v through a rank-`kv_rank` one, q/k head dim
`head_dim` + `rope_dim`, v head dim `head_dim`); GPT-OSS's sliding-window layers and attention sinks are
written as full causal attention (the same FLOPs at 4k tokens within a factor its 128-token window saves).

Shapes: DeepSeek-V3 (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json: 61 layers, 3 dense,
width 7168, 128 heads, 256 routed experts of 2048 and 1 shared, top-8, q/kv ranks 1536/512, vocab 129280);
Qwen3-235B-A22B (https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json: 94 layers, width 4096,
64 heads, 4 KV heads of 128, 128 experts of 1536, top-8, vocab 151936); GPT-OSS-120B
(https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json: 36 layers, width 2880, 64 heads, 8 KV heads
of 64, 128 experts of 2880, top-4, vocab 201088).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["DEEPSEEK_V3", "GPT_OSS_120B", "QWEN3_235B", "MoEShape", "MoETransformer"]


@dataclass(frozen=True)
class MoEShape:
    """A published MoE decoder's shape (module docstring)."""

    layers: int
    width: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_ffn: int
    vocab: int
    seq: int = 4096
    shared: int = 0  # always-on experts of expert_ffn each
    dense_layers: int = 0
    dense_ffn: int = 0
    q_rank: int = 0  # > 0: multi-head latent attention
    kv_rank: int = 0
    rope_dim: int = 0


DEEPSEEK_V3 = MoEShape(61, 7168, 128, 128, 128, 256, 8, 2048, 129280, shared=1, dense_layers=3, dense_ffn=18432,
                       q_rank=1536, kv_rank=512, rope_dim=64)
QWEN3_235B = MoEShape(94, 4096, 64, 4, 128, 128, 8, 1536, 151936)
GPT_OSS_120B = MoEShape(36, 2880, 64, 8, 64, 128, 4, 2880, 201088)


class Experts(nn.Module):
    """A stack of SwiGLU experts: experts(hidden (T, H), index (T, k), weights (T, k)) -> (T, H)."""

    def __init__(self, experts: int, width: int, ffn: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.gate_up = nn.Parameter(torch.empty(experts, width, 2 * ffn))
        self.down = nn.Parameter(torch.empty(experts, ffn, width))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        gate, up = torch.einsum("th,tkhf->tkf", x, self.gate_up[index]).chunk(2, dim=-1)
        out = torch.einsum("tkf,tkfh->tkh", F.silu(gate) * up, self.down[index])
        return (out * weights.unsqueeze(-1)).sum(1)


class MoE(nn.Module):
    """Router, top-k, the stack of experts and the shared experts."""

    def __init__(self, s: MoEShape) -> None:
        super().__init__()
        self.top_k, self.width = s.top_k, s.width
        self.router = nn.Linear(s.width, s.experts, bias=False)
        self.experts = Experts(s.experts, s.width, s.expert_ffn)
        self.shared = SwiGLU(s.width, s.shared * s.expert_ffn) if s.shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.width)
        weights, index = torch.topk(self.router(flat).softmax(-1), self.top_k, dim=-1)
        out = self.experts(flat, index, weights / weights.sum(-1, keepdim=True)).view_as(x)
        return out + self.shared(x) if self.shared is not None else out


class SwiGLU(nn.Module):
    def __init__(self, width: int, ffn: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(width, ffn, bias=False), nn.Linear(width, ffn, bias=False)
        self.down = nn.Linear(ffn, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """Grouped-query attention, or multi-head latent attention where the shape has a q rank (module docstring)."""

    def __init__(self, s: MoEShape) -> None:
        super().__init__()
        self.s = s
        qk = s.head_dim + s.rope_dim
        if s.q_rank:
            self.q = nn.Sequential(nn.Linear(s.width, s.q_rank, bias=False), nn.RMSNorm(s.q_rank),
                                   nn.Linear(s.q_rank, s.heads * qk, bias=False))
            self.kv = nn.Sequential(nn.Linear(s.width, s.kv_rank, bias=False), nn.RMSNorm(s.kv_rank),
                                    nn.Linear(s.kv_rank, s.heads * (qk + s.head_dim), bias=False))
        else:
            self.q = nn.Linear(s.width, s.heads * qk, bias=False)
            self.kv = nn.Linear(s.width, 2 * s.kv_heads * s.head_dim, bias=False)
        self.o = nn.Linear(s.heads * s.head_dim, s.width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, (b, t, _) = self.s, x.shape
        qk = s.head_dim + s.rope_dim
        q = self.q(x).view(b, t, s.heads, qk).transpose(1, 2)
        if s.q_rank:
            k, v = self.kv(x).view(b, t, s.heads, qk + s.head_dim).transpose(1, 2).split([qk, s.head_dim], dim=-1)
        else:
            k, v = self.kv(x).view(b, t, s.kv_heads, 2 * s.head_dim).transpose(1, 2).chunk(2, dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=not s.q_rank)
        return self.o(y.transpose(1, 2).reshape(b, t, s.heads * s.head_dim))


class Block(nn.Module):
    def __init__(self, s: MoEShape, dense: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(s.width), nn.RMSNorm(s.width)
        self.attention = Attention(s)
        self.mlp: nn.Module = SwiGLU(s.width, s.dense_ffn) if dense else MoE(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class MoETransformer(nn.Module):
    """Token embedding, the blocks, a final RMSNorm and an untied head."""

    def __init__(self, s: MoEShape) -> None:
        super().__init__()
        self.embed = nn.Embedding(s.vocab, s.width)
        self.layers = nn.ModuleList(Block(s, k < s.dense_layers) for k in range(s.layers))
        self.norm = nn.RMSNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
