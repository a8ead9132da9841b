"""The models of two published training runs, written as their kernels run, for benchmarks/published.py (meta only).

Megatron-LM's GPT (Narayanan et al., SC'21: https://arxiv.org/abs/2104.04473, section 5) as its code of then
ran it: learned positions, pre-norm layers with biases, a fused q/k/v projection, attention scores written
out (a batched product, one fused scale-mask-softmax kernel, dropout, a batched product), a GELU MLP of 4h,
hidden dropout after each residual branch, and a head tied to the word embedding. The causal mask and the
1/sqrt(d) scale live inside Megatron's fused softmax kernel (one pass over the scores), so they are not
written here as passes of their own: these models are priced and never run.

Llama 3 405B (Llama Team, "The Llama 3 Herd of Models", 2024: https://arxiv.org/abs/2407.21783, Table 3):
126 layers, width 16384, 128 heads with 8 key/value heads, a SwiGLU MLP of 53248, RMSNorm, rotary
positions (one fused pass over q and k, as Transformer Engine's fused RoPE kernel makes it), vocabulary 128256,
an untied head; attention through F.scaled_dot_product_attention (a flash
kernel: no score matrix), grouped keys and values read by the kernel as they are.

The same Llama as torchtitan's code at 9dec370 wrote it (`LlamaShape.written = "torchtitan-2412"`, the code its
end-of-2024 H100 tables ran eagerly, torchtitan/models/norms.py and llama/model.py): RMSNorm as PyTorch ops in fp32
(cast up, square, mean, rsqrt, scale, cast back, times the weight: eight kernels where a fused norm runs one),
rotary positions as a complex64 product (q and k cast up, multiplied, cast back), and keys and values repeated to
every query head before SDPA (repeat_kv: a copy each). Views are written as views: where torchtitan reshapes a
contiguous tensor (no kernel), this code says `view`, so each kernel counted here is one eager PyTorch launched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaShape", "MegatronGPT", "MegatronShape", "Llama", "LLAMA3_405B", "OpsRMSNorm", "complex_rotation"]


@dataclass(frozen=True)
class MegatronShape:
    """One GPT of SC'21's Table 1 (vocabulary 51,200 and sequence 2,048 for every row). `flash`: attention by
    F.scaled_dot_product_attention(is_causal=True), a flash kernel that never writes the scores (MPT as llm-foundry
    ran it, attn_impl triton/flash), instead of Megatron-LM's products and softmax over written scores."""

    layers: int
    width: int
    heads: int
    vocab: int = 51200
    seq: int = 2048
    dropout: float = 0.1
    flash: bool = False


class MegatronLayer(nn.Module):
    """A pre-norm transformer layer as Megatron-LM's ParallelTransformerLayer (2021) computes it."""

    def __init__(self, s: MegatronShape) -> None:
        super().__init__()
        self.heads, self.flash = s.heads, s.flash
        self.ln1, self.qkv, self.dense = nn.LayerNorm(s.width), nn.Linear(s.width, 3 * s.width), nn.Linear(
            s.width, s.width)  # fmt: skip
        self.ln2, self.fc1, self.fc2 = nn.LayerNorm(s.width), nn.Linear(s.width, 4 * s.width), nn.Linear(
            4 * s.width, s.width)  # fmt: skip
        self.attention_dropout, self.hidden_dropout = nn.Dropout(s.dropout), nn.Dropout(s.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attention_dropout.p, is_causal=True)
        else:
            probs = self.attention_dropout(torch.softmax(q @ k.transpose(-2, -1), dim=-1))  # fused scale-mask-softmax
            y = probs @ v
        x = x + self.hidden_dropout(self.dense(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.hidden_dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))))


class MegatronGPT(nn.Module):
    """Word and position embeddings, `layers` MegatronLayers, a final norm and the head (logits).

    `tied`: the head reads the word embedding's weight, as Megatron-LM runs one pipeline stage. With several
    stages it keeps a copy of that weight on the last stage, each vocabulary-parallel on its stage's tensor
    ranks, their gradients summed once a step (section 2.2 of the paper): `tied=False` holds what it holds.
    """

    def __init__(self, s: MegatronShape, tied: bool = True) -> None:
        super().__init__()
        self.word, self.position = nn.Embedding(s.vocab, s.width), nn.Embedding(s.seq, s.width)
        self.embedding_dropout = nn.Dropout(s.dropout)
        self.layers = nn.Sequential(*[MegatronLayer(s) for _ in range(s.layers)])
        self.ln = nn.LayerNorm(s.width)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        if tied:
            self.head.weight = self.word.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embedding_dropout(self.word(tokens) + self.position(positions))
        return self.head(self.ln(self.layers(x)))


@dataclass(frozen=True)
class LlamaShape:
    """A Llama 3 model's shape (the paper's Table 3)."""

    layers: int
    width: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int = 128256
    seq: int = 8192
    written: Literal["kernels", "torchtitan-2412"] = "kernels"  # norm and rotary as one kernel each, or eager ops


LLAMA3_405B = LlamaShape(layers=126, width=16384, ffn=53248, heads=128, kv_heads=8)


class OpsRMSNorm(nn.Module):
    """RMSNorm as torchtitan's `RMSNorm` at 9dec370 computes it: in fp32, one eager kernel per operation."""

    def __init__(self, width: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        up = x.float()
        return (up * torch.rsqrt(up.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _norm(s: LlamaShape) -> nn.Module:
    return OpsRMSNorm(s.width) if s.written == "torchtitan-2412" else nn.RMSNorm(s.width)


def complex_rotation(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """x (b, t, heads, d) turned by `rotation` (t, d/2 complex64) as torchtitan's apply_rotary_emb: cast up, a
    complex product, cast back."""
    b, t, heads, d = x.shape
    turned = torch.view_as_complex(x.float().view(b, t, heads, d // 2, 2)) * rotation.view(1, t, 1, d // 2)
    return torch.view_as_real(turned).view(b, t, heads, d).type_as(x)


class LlamaLayer(nn.Module):
    """RMSNorm, grouped-query attention with rotary positions through SDPA, RMSNorm, SwiGLU MLP; no biases."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.dim = s.heads, s.kv_heads, s.width // s.heads
        self.ops = s.written == "torchtitan-2412"
        self.norm1, self.norm2 = _norm(s), _norm(s)
        self.q = nn.Linear(s.width, s.width, bias=False)
        self.k = nn.Linear(s.width, s.kv_heads * self.dim, bias=False)
        self.v = nn.Linear(s.width, s.kv_heads * self.dim, bias=False)
        self.o = nn.Linear(s.width, s.width, bias=False)
        self.gate, self.up = nn.Linear(s.width, s.ffn, bias=False), nn.Linear(s.width, s.ffn, bias=False)
        self.down = nn.Linear(s.ffn, s.width, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        if self.ops:
            return self._forward_ops(x, rope)
        b, t, c = x.shape
        h = self.norm1(x)
        q = self.q(h).view(b, t, self.heads, self.dim).transpose(1, 2)
        k = self.k(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        v = self.v(h).view(b, t, self.kv_heads, self.dim).transpose(1, 2)
        q, k = q * rope, k * rope  # a fused rotary kernel: one read and one write of q and of k
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(y.transpose(1, 2).reshape(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))

    def _forward_ops(self, x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
        """torchtitan's block at 9dec370: rotary in complex64, K and V repeated to every head (copies), then SDPA."""
        b, t, c = x.shape
        h = self.norm1(x)
        q = complex_rotation(self.q(h).view(b, t, self.heads, self.dim), rotation)
        k = complex_rotation(self.k(h).view(b, t, self.kv_heads, self.dim), rotation)
        v = self.v(h).view(b, t, self.kv_heads, self.dim)
        groups = self.heads // self.kv_heads
        if groups > 1:  # repeat_kv: an expanded view made contiguous, one copy of each
            k = k.unsqueeze(3).expand(b, t, self.kv_heads, groups, self.dim).reshape(b, t, self.heads, self.dim)
            v = v.unsqueeze(3).expand(b, t, self.kv_heads, groups, self.dim).reshape(b, t, self.heads, self.dim)
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o(y.transpose(1, 2).contiguous().view(b, t, c))
        h = self.norm2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """Token embedding, `layers` LlamaLayers, a final RMSNorm and an untied head."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.dim = s.width // s.heads
        self.embed = nn.Embedding(s.vocab, s.width)
        self.layers = nn.ModuleList([LlamaLayer(s) for _ in range(s.layers)])
        self.norm = _norm(s)
        self.head = nn.Linear(s.width, s.vocab, bias=False)
        self.ops = s.written == "torchtitan-2412"
        # the rotation the kernel reads; torchtitan's freqs_cis (complex64) kept as fp32 pairs, which .to(bf16)
        # would cast, so forward casts them back up (t x d numbers: nothing beside a layer's b x t x h)
        self.register_buffer("rope", torch.ones(s.seq, self.dim // 2, 2) if self.ops else torch.ones(s.seq, self.dim),
                             persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        t = tokens.shape[1]
        rope = torch.view_as_complex(self.rope[:t].float()) if self.ops else self.rope[:t].to(x.dtype)
        for layer in self.layers:
            x = layer(x, rope)
        return self.head(self.norm(x))
