"""partitioner.capture.sequence and runtime.context_graph: whether a graph's sequence splits, its causal attentions
and positions, and what needs the whole sequence (with the reason)."""

from __future__ import annotations

import pytest
import torch

from partitioner.capture.sequence import find_sequence_split
from partitioner.capture.trace import trace
from runtime.context_parallel import ContextGroup, positions
from tests import zoo

pytest.importorskip("transformers")


def _traced(family: str, seq: int = 16, **config: object) -> torch.fx.GraphModule:
    case = zoo.hf_case(family)
    for key, value in {"use_cache": False, **config}.items():
        setattr(case.config, key, value)
    return trace(case.build(), (torch.randint(0, 128, (2, seq)),)).graph_module


@pytest.mark.parametrize("family", ["llama", "mixtral", "gpt2"])
def test_causal_decoders_split_their_sequence(family: str) -> None:
    found = find_sequence_split(_traced(family))
    assert found.splits and found.length == 16 and found.inputs == {"input_ids": 1}
    assert [a.mask for a in found.attention] == ["causal mask (checked at 16 tokens)"] * 2  # the model's own mask
    assert found.positions == ["arange"] and found.degrees() == (1, 2, 4, 8)  # 2 x degree chunks of 16
    layer = "transformer.h.{}.attn" if family == "gpt2" else "model.layers.{}.self_attn"
    assert found.attentions_within([a.node for a in found.attention]) == [layer.format(0), layer.format(1)]


def test_a_sliding_window_a_padding_mask_and_eager_attention_stay_whole() -> None:
    window = find_sequence_split(_traced("mistral", sliding_window=4))
    assert not window.splits and all("not the causal one at 16 tokens" in w.reason for w in window.whole)
    case = zoo.hf_case("llama")
    case.config.use_cache = False
    ids = torch.randint(0, 128, (2, 16))
    padded = trace(case.build(), (ids,), {"attention_mask": torch.ones(2, 16, dtype=torch.long)}).graph_module
    found = find_sequence_split(padded)
    assert not found.splits and any("reads the values of input attention_mask" in w.reason for w in found.whole)
    eager = find_sequence_split(_traced("gpt_oss"))  # attention with sinks, written out: no SDPA to gather for
    assert not eager.splits and eager.why_not == "the graph has no scaled_dot_product_attention"


def test_each_rank_holds_two_chunks_head_and_tail() -> None:
    # 8 tokens over 2 ranks in 4 chunks of 2: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    group = ContextGroup(None, 0, 2)
    assert positions(4, group).tolist() == [0, 1, 6, 7] and positions(4, group, rank=1).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="multiple of 4"):
        positions(3, group)


def test_a_sequence_stays_split_only_between_stages_of_one_context_and_tensor_degree() -> None:
    from types import SimpleNamespace

    from runtime.context_parallel import split_boundaries

    class Chain(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            a = x + 1
            b = a * 2
            c = b - 3
            return c, a  # `a` is also the model's output: whole

    gm = torch.fx.symbolic_trace(Chain())

    def stage(nodes: list[str], context: int, tensor: int = 1) -> SimpleNamespace:
        return SimpleNamespace(nodes=nodes, context=context, tensor=tensor)

    same = [stage(["add"], 2), stage(["mul"], 2), stage(["sub"], 2)]
    assert split_boundaries(gm, same) == {"mul"}  # `add` feeds the model output, `sub` is it
    assert split_boundaries(gm, [stage(["add"], 2), stage(["mul"], 2), stage(["sub"], 2, tensor=2)]) == set()
    assert split_boundaries(gm, [stage(["add"], 2), stage(["mul"], 4), stage(["sub"], 4)]) == {"mul"}
    assert split_boundaries(gm, [stage(["add", "mul"], 1), stage(["sub"], 2)]) == set()  # the writer splits nothing


@pytest.mark.parametrize("degree", [1, 2, 4])
def test_each_rank_attends_over_the_prefix_its_chunks_reach_as_whole_causal_attention_does(degree: int) -> None:
    # rank r's queries (chunks r and 2c - 1 - r) over every rank's keys and values, gathered in group order (what
    # ContextAttention hands causal_chunks): its rows and, summed over the ranks, every gradient equal causal
    # attention over the whole sequence (grouped-query heads: 4 query heads over 2 key/value heads)
    import torch.nn.functional as F

    from runtime.context_parallel import causal_chunks

    torch.manual_seed(0)
    seq = 8 * degree
    q, k, v = (torch.randn(2, h, seq, 8, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    weight = torch.randn(2, 4, seq, 8, dtype=torch.float64)
    whole = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    expected = torch.autograd.grad((whole * weight).sum(), (q, k, v))
    every = torch.cat([positions(seq // degree, ContextGroup(None, r, degree)) for r in range(degree)])
    total = torch.zeros((), dtype=torch.float64)
    for r in range(degree):
        cg = ContextGroup(None, r, degree)
        mine = positions(seq // degree, cg)
        out = causal_chunks(q[..., mine, :], k[..., every, :], v[..., every, :], cg, scale=0.3, enable_gqa=True)
        assert torch.allclose(out, whole[..., mine, :], atol=1e-12)
        total = total + (out * weight[..., mine, :]).sum()
    for got, want in zip(torch.autograd.grad(total, (q, k, v)), expected):
        assert torch.allclose(got, want, atol=1e-12)
