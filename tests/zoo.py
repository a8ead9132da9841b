"""Small models with random weights for equivalence tests; each factory returns (model, args, kwargs)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.pipelining import pipe_split

BATCH = 7  # odd on purpose: 3 and 4 micro-batches are uneven (3,2,2 and 2,2,2,1)

Case = tuple[nn.Module, tuple[Any, ...], dict[str, Any]]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error of `a` against the reference `b`, in float64 (bf16 outputs compare fairly)."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-12))


def assert_same_outputs(out: Any, ref: Any, tol: float = 1e-5) -> None:
    """Same type and structure (a ModelOutput stays one), every tensor of the same shape and dtype within `tol`
    relative, every other leaf equal."""
    assert type(out) is type(ref)
    leaves, spec = pytree.tree_flatten(out)
    ref_leaves, ref_spec = pytree.tree_flatten(ref)
    assert spec == ref_spec
    for a, b in zip(leaves, ref_leaves):
        if isinstance(b, torch.Tensor):
            assert a.shape == b.shape and a.dtype == b.dtype
            assert rel(a, b) < tol, rel(a, b)
        else:
            assert a == b


class MLP(nn.Module):
    def __init__(self, width: int = 32, depth: int = 5) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


class ResBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(h)))


class ResCNN(nn.Module):
    def __init__(self, channels: int = 8, blocks: int = 3) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU())
        self.blocks = nn.Sequential(*[ResBlock(channels) for _ in range(blocks)])
        self.fc = nn.Linear(channels, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.blocks(self.stem(x))
        return self.fc(h.mean(dim=(2, 3)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int, seq: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq, dtype=torch.bool)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q = q.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        k = k.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        v = v.view(b, t, self.heads, c // self.heads).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // self.heads)
        att = att.masked_fill(~self.mask[:t, :t], float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """GPT with the LM head's weight tied to the token embedding."""

    def __init__(self, vocab: int = 50, width: int = 32, heads: int = 4, layers: int = 3, seq: int = 12) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Parameter(torch.randn(1, seq, width) * 0.02)
        self.blocks = nn.Sequential(*[Block(width, heads, seq) for _ in range(layers)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, : idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


class Inception(nn.Module):
    """Four parallel branches joined by concat, twice, then a classifier."""

    def __init__(self, cin: int = 4, c: int = 4) -> None:
        super().__init__()
        self.b1 = nn.Conv2d(cin, c, 1)
        self.b2 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 3, padding=1))
        self.b3 = nn.Sequential(nn.Conv2d(cin, c, 1), nn.ReLU(), nn.Conv2d(c, c, 5, padding=2))
        self.b4 = nn.Sequential(nn.MaxPool2d(3, stride=1, padding=1), nn.Conv2d(cin, c, 1))
        self.mix = nn.Conv2d(4 * c, cin, 1)
        self.fc = nn.Linear(cin, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.b1(x), self.b2(x), self.b3(x), self.b4(x)], dim=1)
        h = F.relu(self.mix(h)) + x
        return self.fc(h.mean(dim=(2, 3)))


class KeywordDict(nn.Module):
    """Keyword-only inputs, an optional argument left at None, and a dict output."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(6, 16)
        self.ctx = nn.Linear(4, 16)
        self.out = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, *, context: torch.Tensor, scale: torch.Tensor | None = None) -> dict[str, Any]:
        h = torch.tanh(self.enc(x) + self.ctx(context))
        if scale is not None:
            h = h * scale
        return {"logits": self.out(h), "features": (h, h.sum(-1))}


class InPlace(nn.Module):
    """`h.mul_(2)` and `h.add_(1)` leave no data edge to the later reader of h (a skip)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        g = torch.tanh(self.layers[1](x))
        h.mul_(2)
        g = torch.tanh(self.layers[2](g))
        g = torch.tanh(self.layers[3](g))
        h.add_(1)
        g = torch.tanh(self.layers[4](g))
        return self.layers[5](g + h)


class ModeDependent(nn.Module):
    """Traced through: `F.dropout(x, p, self.training)` and an `if self.training:` branch are baked in per mode."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.dropout(torch.tanh(self.a(x)), 0.5, self.training)
        if self.training:
            h = h * 3
        h = torch.tanh(self.b(h))
        return self.c(F.dropout(h, 0.3, self.training))


def mode_dependent() -> Case:
    return ModeDependent(), (torch.randn(BATCH, 6),), {}


def in_place() -> Case:
    return InPlace(), (torch.randn(BATCH, 8),), {}


def mlp() -> Case:
    return MLP(), (torch.randn(BATCH, 32),), {}


def rescnn() -> Case:
    return ResCNN(), (torch.randn(BATCH, 3, 8, 8),), {}


def tiny_gpt() -> Case:
    return TinyGPT(), (torch.randint(0, 50, (BATCH, 12)),), {}


def inception() -> Case:
    return Inception(), (torch.randn(BATCH, 4, 6, 6),), {}


def keyword_dict() -> Case:
    return KeywordDict(), (torch.randn(BATCH, 6),), {"context": torch.randn(BATCH, 4)}


def hf_gpt2() -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
        bos_token_id=0, eos_token_id=0,
    )
    return GPT2LMHeadModel(config), (torch.randint(0, 64, (BATCH, 10)),), {}


ZOO: dict[str, Callable[[], Case]] = {
    "mlp": mlp,
    "rescnn": rescnn,
    "tiny_gpt": tiny_gpt,
    "inception": inception,
    "keyword_dict": keyword_dict,
    "hf_gpt2": hf_gpt2,
    "in_place": in_place,
    "mode_dependent": mode_dependent,
}


# --- fidelity cases (tests/test_fidelity.py): what fx and micro-batching could silently change ---

BACKWARD_CALLS: list[int] = []  # CountingFn.backward records here: a side effect the pipeline must run


class StraightThrough(torch.autograd.Function):
    """Round in forward, identity in backward: autograd of round() would give zero gradients."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return torch.round(x * 4) / 4

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class CountingFn(torch.autograd.Function):
    """tanh whose backward also records how many rows it saw (a side effect for later)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        BACKWARD_CALLS.append(int(grad.shape[0]))
        return grad * (1 - y * y)


class ScaleSplit(torch.autograd.Function):
    """Two outputs and non-tensor arguments; its backward is its own (gradient damped by `damp`)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, k: float, damp: bool) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.k, ctx.damp = k, damp
        return x * k, x.sum(-1, keepdim=True)

    @staticmethod
    def backward(ctx: Any, ga: torch.Tensor, gb: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = ga * ctx.k + gb
        return (grad * 0.5 if ctx.damp else grad), None, None


class CustomFunctions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(17, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = StraightThrough.apply(self.a(x))
        h = CountingFn.apply(self.b(h))
        scaled, total = ScaleSplit.apply(h, 0.5, True)
        return self.c(torch.cat([scaled, total], dim=-1))


class MixedIO(nn.Module):
    """An input without the batch dimension (a table as long as the batch, given whole), and
    outputs of mixed kinds: per-sample logits, a fixed-size tensor, a scalar that differs per
    micro-batch (needs a merge rule), a Python value."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Linear(8, 8)
        self.head = nn.Linear(8, 5)
        self.scale = nn.Parameter(torch.tensor([1.5]))

    def forward(self, x: torch.Tensor, table: torch.Tensor) -> dict[str, Any]:
        h = torch.tanh(self.enc(x) + table.mean(0))
        logits = self.head(h)
        return {"logits": logits, "scale": self.scale * 2, "energy": h.pow(2).sum(), "classes": 5}


class TensorDefault(nn.Module):
    """A tensor default in forward's signature: fx bakes it in as a constant of the graph."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 6)

    def forward(self, x: torch.Tensor, gain: torch.Tensor = torch.linspace(0.5, 1.5, 8)) -> torch.Tensor:  # noqa: B008
        return self.b(torch.tanh(self.a(x)) * gain)


class Aliased(nn.Module):
    """A weight tied between two modules, a module registered under two names and called twice,
    and a buffer read at the start and again after any cut."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(8, 12, bias=False)
        self.mid = nn.Linear(12, 12)
        self.again = self.mid  # the same module under a second name
        self.out2 = nn.Linear(8, 7)
        self.register_buffer("shift", torch.linspace(-1, 1, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.emb(x + self.shift))
        h = torch.tanh(self.again(torch.tanh(self.mid(h))))
        h = F.linear(h, self.emb.weight.t())  # the tied use: emb's weight again, transposed
        return self.out2(torch.tanh(h) - self.shift)


class Markers(nn.Module):
    """One pipe_split() between two cheap layers, far from where cost alone would cut."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.rest = nn.Sequential(*[nn.Linear(8, 8) for _ in range(5)])
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        pipe_split()
        return self.head(self.rest(h))


class MarkersExport(Markers):
    """The same, with `*inputs`: torch.fx refuses it, so torch.export traces it."""

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(inputs[0])


def custom_functions() -> Case:
    return CustomFunctions(), (torch.randn(BATCH, 8),), {}


def mixed_io() -> Case:
    return MixedIO(), (torch.randn(BATCH, 8), torch.randn(BATCH, 8)), {}


def tensor_default() -> Case:
    return TensorDefault(), (torch.randn(BATCH, 8),), {}


def aliased() -> Case:
    return Aliased(), (torch.randn(BATCH, 8),), {}


def markers() -> Case:
    return Markers(), (torch.randn(BATCH, 8),), {}


def markers_export() -> Case:
    return MarkersExport(), (torch.randn(BATCH, 8),), {}


ZOO.update({
    "custom_functions": custom_functions,
    "tensor_default": tensor_default,
    "aliased": aliased,
    "markers": markers,
    "markers_export": markers_export,
})


class PlainExperts(nn.Module):
    """A stack of experts of one shape, as Hugging Face writes them: weights (E, ...) and
    experts(hidden (T, W), index (T, k), weights (T, k)) -> (T, W), the sum over each token's k slots."""

    def __init__(self, experts: int = 4, width: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, width, hidden) / math.sqrt(width))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, width) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            h = torch.relu(x[token] @ self.w_in[e]) @ self.w_out[e]
            out = out.index_add(0, token, h * weights[token, slot].unsqueeze(-1))
        return out


class PlainMoE(nn.Module):
    """A plain PyTorch mixture of experts: a router (Linear), its top-k, a stack of experts; no Hugging Face."""

    def __init__(self, width: int = 16, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = PlainExperts(experts, width)
        self.top_k, self.width = top_k, width

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.width)
        weights, index = torch.topk(self.router(flat).softmax(-1), self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return self.experts(flat, index, weights).view_as(x)


class PlainMoEModel(nn.Module):
    """Tokens -> embedding -> blocks of (norm, MoE, residual) -> head: a plain MoE language model (torch.fx path)."""

    def __init__(self, vocab: int = 64, width: int = 16, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.norms = nn.ModuleList(nn.LayerNorm(width) for _ in range(layers))
        self.moes = nn.ModuleList(PlainMoE(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for norm, moe in zip(self.norms, self.moes):
            x = x + moe(norm(x))
        return self.head(x)


# --- Hugging Face families from their default configs, only the sizes shrunk (tests/test_hf_models.py) ---


@dataclass
class HFCase:
    """A Hugging Face model class and its default config with the sizes shrunk; `inputs(batch, seq)` builds
    an example call (`seq`: tokens, or the image side for vision models)."""

    cls: Any
    config: Any
    inputs: Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]

    def build(self) -> nn.Module:
        return self.cls(self.config)


def _tokens(vocab: int, *, decoder: bool = False) -> Callable[[int, int], tuple[tuple[Any, ...], dict[str, Any]]]:
    def inputs(batch: int, seq: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = torch.randint(0, vocab, (batch, seq))
        return (ids,), ({"decoder_input_ids": torch.randint(0, vocab, (batch, seq))} if decoder else {})
    return inputs


def _pixels(batch: int, side: int) -> tuple[tuple[Any, ...], dict[str, Any]]:
    return (torch.randn(batch, 3, side, side),), {"interpolate_pos_encoding": True}


_TEXT = {"vocab_size": 128}
_DECODER = {**_TEXT, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
_ENCODER = {**_TEXT, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4}


def hf_case(name: str) -> HFCase:
    """The family `name` (of HF_FAMILIES) from its default config, sizes shrunk, special tokens in the vocabulary."""
    import transformers as hf

    if name == "gpt2":
        config = hf.GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                               eos_token_id=0)
        return HFCase(hf.GPT2LMHeadModel, config, _tokens(128))
    if name in ("llama", "mistral", "qwen2", "qwen3", "gemma", "phi3"):
        cls_config, cls_model = {
            "llama": (hf.LlamaConfig, hf.LlamaForCausalLM), "mistral": (hf.MistralConfig, hf.MistralForCausalLM),
            "qwen2": (hf.Qwen2Config, hf.Qwen2ForCausalLM), "qwen3": (hf.Qwen3Config, hf.Qwen3ForCausalLM),
            "gemma": (hf.GemmaConfig, hf.GemmaForCausalLM), "phi3": (hf.Phi3Config, hf.Phi3ForCausalLM),
        }[name]
        extra: dict[str, Any] = {"head_dim": 8} if name in ("gemma", "qwen3") else {}
        if name == "phi3":
            extra = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}
        return HFCase(cls_model, cls_config(**_DECODER, **extra), _tokens(128))
    if name in ("bert", "roberta"):
        cls_config, cls_model = {"bert": (hf.BertConfig, hf.BertForMaskedLM),
                                 "roberta": (hf.RobertaConfig, hf.RobertaForMaskedLM)}[name]
        return HFCase(cls_model, cls_config(**_ENCODER), _tokens(128))
    if name == "t5":
        config = hf.T5Config(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4)
        return HFCase(hf.T5ForConditionalGeneration, config, _tokens(128, decoder=True))
    if name == "vit":
        config = hf.ViTConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                              image_size=32, patch_size=8, num_labels=5)
        return HFCase(hf.ViTForImageClassification, config, _pixels)
    if name in _MORE:
        cls_model, config = _MORE[name](hf)
        return HFCase(cls_model, config, _tokens(128))
    raise KeyError(name)


def _more() -> dict[str, Callable[[Any], tuple[Any, Any]]]:
    """Issue 36's families: each name's (model class, default config with the sizes shrunk, special tokens below
    128); experts shrunk to 4 (2 per token) so a block holds several."""
    layers = {"num_hidden_layers": 2}
    moe = {**_DECODER, "num_local_experts": 4, "num_experts_per_tok": 2}
    return {
        "opt": lambda hf: (hf.OPTForCausalLM, hf.OPTConfig(
            vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
            word_embed_proj_dim=32, max_position_embeddings=64)),
        "gpt_neox": lambda hf: (hf.GPTNeoXForCausalLM, hf.GPTNeoXConfig(
            vocab_size=128, hidden_size=32, intermediate_size=64, num_attention_heads=4, max_position_embeddings=64,
            **layers)),
        "falcon": lambda hf: (hf.FalconForCausalLM, hf.FalconConfig(
            vocab_size=128, hidden_size=32, num_attention_heads=4, max_position_embeddings=64, **layers)),
        "gptj": lambda hf: (hf.GPTJForCausalLM, hf.GPTJConfig(
            vocab_size=128, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64, bos_token_id=0,
            eos_token_id=0)),
        "mixtral": lambda hf: (hf.MixtralForCausalLM, hf.MixtralConfig(**moe)),
        "qwen3_moe": lambda hf: (hf.Qwen3MoeForCausalLM, hf.Qwen3MoeConfig(
            **{**moe, "moe_intermediate_size": 16, "head_dim": 8})),
        "gpt_oss": lambda hf: (hf.GptOssForCausalLM, hf.GptOssConfig(
            **{**moe, "head_dim": 8, "sliding_window": 4})),
        "bloom": lambda hf: (hf.BloomForCausalLM, hf.BloomConfig(vocab_size=128, hidden_size=32, n_layer=2, n_head=4)),
    }


_MORE = _more()

HF_FAMILIES = ["gpt2", "llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "bert", "roberta", "t5", "vit"]
HF_MORE_FAMILIES = list(_MORE)  # issue 36: the families below as they come
