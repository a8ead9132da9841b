"""The kernel set as a plan input (rules/kernels.py, cost_model/fused_kernels.py, search/kernels.py): what the fused
set keeps, counted by hand on published layer shapes; the plan that names it; the torchtitan export that runs it."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from typing import Any

import numpy as np
import pytest
import torch

import partitioner
from benchmarks.published_models import Llama, LlamaShape, MegatronGPT, MegatronShape
from cost_model.fused_kernels import attention_core, fused_away, fused_saved
from cost_model.recompute_cost import graph_nodes, saved_bytes_per_node
from partitioner.capture.graph import build_graph, compute_nodes
from partitioner.capture.trace import trace
from partitioner.errors import PartitionError
from partitioner.export.torchtitan import torchtitan_job
from partitioner.place.search.kernels import FusedFacts, fused_plan
from partitioner.place.search.space import SearchSpace
from rules.kernels import WORKING_OUTPUTS
from runtime.plan import Plan, StagePlan

B, S = 2, 64  # samples, tokens


def _nodes(model: torch.nn.Module) -> tuple[list[dict[str, Any]], list[str]]:
    with torch.device("meta"):
        model = model.to(torch.bfloat16)
    x = torch.zeros(B, S, dtype=torch.long, device="meta")
    gm = trace(model, (x,), {}).graph_module
    graph = build_graph(gm, [x])
    order = [n.name for n in compute_nodes(gm)]
    return graph_nodes(graph, order), order


def _layer(order: list[str], nodes: list[dict[str, Any]], k: int) -> list[str]:
    return [n for n, node in zip(order, nodes) if str(node.get("module", "")).startswith(f"layers.{k}")
            or n.startswith(f"layers_{k}_")]


def test_fused_llama_layer_drops_the_silu_output_and_the_attention_copy() -> None:
    h, ffn = 256, 832
    with torch.device("meta"):
        model = Llama(LlamaShape(layers=2, width=h, ffn=ffn, heads=4, kv_heads=1, vocab=100, seq=S))
    nodes, order = _nodes(model)
    eager, fused = saved_bytes_per_node(nodes, "cuda"), fused_saved(nodes, "cuda")
    dropped = {n: eager[n] - fused[n] for n in order if eager[n] != fused[n]}
    # SwiGLU's silu(gate) (b s ffn bf16: recomputed from the kept gate) and the attention output made contiguous
    # for o (b s h bf16: flash writes the layout o reads), in each layer; nothing else
    assert sorted(dropped.values()) == sorted([2 * B * S * h] * 2 + [2 * B * S * ffn] * 2)
    assert all(("silu" in n) or ("reshape" in n) for n in dropped)
    assert {n for n in fused_away(nodes) if "silu" in n} == {n for n in dropped if "silu" in n}


def test_fused_gpt_layer_keeps_a_log_sum_exp_instead_of_the_scores() -> None:
    h, a = 256, 4
    with torch.device("meta"):
        model = MegatronGPT(MegatronShape(layers=2, width=h, heads=a, vocab=100, seq=S, dropout=0.1))
    nodes, order = _nodes(model)
    eager, fused = saved_bytes_per_node(nodes, "cuda"), fused_saved(nodes, "cuda")
    softmax = [n for n in order if n.startswith("softmax")]
    dropout = [n for n in order if "attention_dropout" in n]
    assert len(softmax) == len(dropout) == 2
    assert [eager[n] for n in softmax] == [2 * B * a * S * S] * 2  # the probabilities, bf16
    assert [fused[n] for n in softmax] == [4 * B * a * S] * 2  # one fp32 statistic per row
    # eager: its byte mask and its bf16 output (what probs @ v keeps); flash draws the mask again from the seed
    assert [eager[n] for n in dropout] == [3 * B * a * S * S] * 2 and [fused[n] for n in dropout] == [0, 0]
    layer = _layer(order, nodes, 1)
    # Korthikanti et al.'s 34 bytes per s b h element (flash attention: no 5 a s / h term), plus the statistics
    assert sum(fused[n] for n in layer) == 34 * B * S * h + 4 * B * a * S


def test_the_attention_core_is_the_scores_and_their_product_or_the_fused_call() -> None:
    with torch.device("meta"):
        gpt = MegatronGPT(MegatronShape(layers=2, width=512, heads=4, vocab=100, seq=S, dropout=0.1))  # head 128
    nodes, _ = _nodes(gpt)
    scores, core = attention_core(nodes)
    # per layer: q k^T, softmax and dropout (s x s), and probabilities @ v
    assert sorted(n.split("_")[0] for n in scores) == ["layers"] * 2 + ["matmul"] * 2 + ["softmax"] * 2
    assert len(core - scores) == 2
    assert all(any(u in scores for u, _ in n["inputs"]) for n in nodes if n["name"] in core - scores)
    llama = Llama(LlamaShape(layers=2, width=256, ffn=832, heads=4, kv_heads=1, vocab=100, seq=S))
    x = torch.zeros(B, S, dtype=torch.long)  # traced on CPU, not priced: the SDPA call counts no FLOPs
    gm = trace(llama, (x,), {}).graph_module
    nodes = graph_nodes(build_graph(gm, [x]), [n.name for n in compute_nodes(gm)])
    scores, core = attention_core(nodes)
    assert scores == set() and core == {n["name"] for n in nodes if "scaled_dot_product" in str(n.get("target"))}
    assert len(core) == 2


def test_the_kernel_set_is_checked_where_it_is_asked_for() -> None:
    with pytest.raises(PartitionError, match="kernels='compiled'"):
        SearchSpace(kernels="compiled")
    with pytest.raises(ValueError, match="kernels='compiled'"):
        Plan(stages=[], kernels="compiled").check()  # type: ignore[arg-type]


def _both_kernel_sets(vocab: int, **options: Any) -> dict[str, Plan]:
    """A small Llama planned on 1x4xH100 under each kernel set, everything else as `options` say."""
    with torch.device("meta"):
        model = Llama(LlamaShape(layers=4, width=256, ffn=832, heads=4, kv_heads=1, vocab=vocab, seq=256))
    tokens = torch.zeros(16, 256, dtype=torch.long, device="meta")
    out = {}
    for kernels in ("eager", "fused"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out[kernels] = partitioner.plan(model, cluster="1x4xH100", example_inputs=(tokens,), micro_batches=8,
                                            precision="mixed", tensor=1, kernels=kernels, **options)
    return out


@pytest.fixture(scope="module")
def plans() -> dict[str, Plan]:
    return _both_kernel_sets(100, replicas="auto", sharding="zero3")


def test_a_fused_plan_names_its_kernels_and_keeps_fewer_activations(plans: dict[str, Plan]) -> None:
    eager, fused = plans["eager"], plans["fused"]
    assert (eager.kernels, fused.kernels) == ("eager", "fused")
    assert sum(s.activation_bytes for s in fused.stages) < sum(s.activation_bytes for s in eager.stages)
    assert fused.predicted_step_ms <= eager.predicted_step_ms
    assert "kernels fused;" in fused.summary() and "kernels" not in eager.summary().splitlines()[-1]
    assert json.loads(fused.to_json())["kernels"] == "fused" and "kernels" not in json.loads(eager.to_json())
    assert Plan.from_json(fused.to_json()).kernels == "fused"


def test_the_torchtitan_export_compiles_a_fused_plan(plans: dict[str, Plan]) -> None:
    fused = torchtitan_job(plans["fused"], module="llama3", config="llama3_debugmodel")
    eager = torchtitan_job(plans["eager"], module="llama3", config="llama3_debugmodel")
    assert "--compile.enable" in fused.args() and "--compile.enable" not in eager.args()
    assert "kernels fused" in fused.script()


def test_torchtitans_norm_and_rotation_written_op_by_op_compute_what_they_stand_for() -> None:
    """benchmarks' torchtitan-written Llama (issue 37 item 1: eager norms priced per kernel) is the same arithmetic:
    its norm equals torch's nn.RMSNorm, its complex product turns each (even, odd) pair by its angle."""
    from benchmarks.published_models import OpsRMSNorm, complex_rotation

    torch.manual_seed(0)
    x = torch.randn(2, 5, 64)
    ops, ref = OpsRMSNorm(64, eps=1e-6), torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ops.weight.uniform_()
        ref.weight.copy_(ops.weight)
    torch.testing.assert_close(ops(x), ref(x))
    angle = torch.rand(5, 16) * 6.28
    q = torch.randn(2, 5, 3, 32)
    even, odd = q.view(2, 5, 3, 16, 2).unbind(-1)
    cos, sin = angle.cos()[None, :, None], angle.sin()[None, :, None]
    expected = torch.stack((even * cos - odd * sin, even * sin + odd * cos), -1).view(2, 5, 3, 32)
    torch.testing.assert_close(complex_rotation(q, torch.polar(torch.ones_like(angle), angle)), expected)


_LOSS_PEAK = """
import sys, torch, torch.nn.functional as F
N, V = 2048, 32768  # one output of 256 MiB (fp32): the allocator maps it alone, so the process's resident set shows it
def resident(field):  # bytes, from /proc/self/status: VmRSS now, VmHWM the peak since the last reset
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(field + ":"))
loss_fn = lambda o, y: F.cross_entropy(o, y)
if sys.argv[1] == "fused":
    loss_fn = torch.compile(loss_fn)
    for n, v in ((N // 8, V // 8), (N // 4, V // 4)):  # compiled for any size before the measured step
        a = torch.randn(n, v, requires_grad=True)
        loss_fn(a * 1.0, torch.randint(0, v, (n,))).backward()
        del a
w, y = torch.randn(N, V, requires_grad=True), torch.randint(0, V, (N,))
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")  # the peak resident set reset to the current one: what came before is not counted
before = resident("VmRSS")
loss_fn(w * 1.0, y).backward()  # w * 1.0: the model's output, made in the step and held by the loss alone
print((resident("VmHWM") - before) / (N * V * 4))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kernels", ["eager", "fused"])
def test_the_loss_holds_as_many_outputs_as_its_kernel_set_says(kernels: str) -> None:
    """rules.kernels.WORKING_OUTPUTS against torch itself: the peak a step's loss and its backward add, in outputs,
    under torch's cross-entropy (eager) and torch.compile's (fused), each in a fresh process."""
    out = subprocess.run([sys.executable, "-c", _LOSS_PEAK, kernels], capture_output=True, text=True, timeout=280)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout.strip().splitlines()[-1]) == pytest.approx(WORKING_OUTPUTS[kernels], abs=0.25)


def test_a_fused_plans_last_stage_holds_one_model_output_fewer_for_its_loss() -> None:
    """search/kernels.fused_plan on numbers set by hand: nothing else fused (eager and fused saved bytes equal), so
    the only change is the loss's: the last stage holds 2 outputs at its backward, not 3 (one micro-batch's: the
    facts hold the whole batch's 14 bytes, the plan runs 2 micro-batches); other stages keep theirs."""
    facts = FusedFacts(["a", "b"], np.array([100.0, 100.0]), np.array([100.0, 100.0]), np.array([1.0, 1.0]),
                       np.array([False, False]), np.array([10.0, 10.0]), np.array([10.0, 10.0]), output=14.0)
    stages = [StagePlan(index=i, device="cuda:0", nodes=[n], forward_ms=1.0, backward_ms=2.0, compute_ms=3.0,
                        activation_bytes=50, memory_bytes=80) for i, n in enumerate(("a", "b"))]
    plan = Plan(stages=stages, micro_batches=2)
    fused_plan(plan, facts)
    assert [(s.activation_bytes, s.memory_bytes) for s in plan.stages] == [(50, 80), (43, 73)]
    assert plan.kernels == "fused"


def test_a_split_given_by_hand_is_priced_for_the_kernel_set_asked_for() -> None:
    """replicas=[2, 2] skips the searches that price the kernel set; the plan is still the fused set's, not an eager
    plan named by nothing (the same stages, fewer activations kept on each)."""
    made = _both_kernel_sets(2048, replicas=[2, 2], sharding="none")
    eager, fused = made["eager"], made["fused"]
    assert (eager.kernels, fused.kernels) == ("eager", "fused")
    assert [s.nodes for s in fused.stages] == [s.nodes for s in eager.stages]
    for e, f in zip(eager.stages, fused.stages):
        assert 0 < f.activation_bytes < e.activation_bytes and f.memory_bytes < e.memory_bytes
