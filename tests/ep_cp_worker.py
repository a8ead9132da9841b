"""Worker for tests/test_ep_cp.py: experts and sequences split over ranks, run under torchrun on gloo.

    python -m torch.distributed.run --nproc_per_node=4 tests/ep_cp_worker.py equivalence CASE [CASE ...]
    ... ep_cp_worker.py misordered      (2 ranks) two MoE layers' all-to-alls posted in another order are caught

A CASE is MODEL:SCHEDULE:LAYOUT[:SHARDING[:RECOMPUTE]]. MODEL: "mixtral", "qwen3_moe", "gpt_oss" (Hugging Face,
torch.export), "moe" (tests.zoo.PlainMoEModel, torch.fx), "llama256" (Hugging Face Llama at 256 tokens). LAYOUT:
"pp2ep2" (2 stages x 2 sliced replicas, each stage's experts split over its 2), "dp4ep2" (one stage, 4 sliced
replicas, experts split over pairs: each expert on 2 replicas), "pp2cp2" (2 stages, each one replica whose sequence
is split over 2 ranks), "dp2cp2" (one stage, 2 sliced replicas x 2 context ranks), "tp2cp2" (one stage, one replica:
layers split over 2 tensor ranks and the sequence over 2 context ranks). SHARDING zero1/2/3 shards the
replicas (and context ranks) with FSDP2; RECOMPUTE "full" or "selective" recomputes every stage; a last field
"whole" trains without `loss_per_token` (the loss on the outputs gathered whole; else on each rank's tokens).
Rank 0 plans the stages with partitioner.plan (the planner does not choose experts or sequences yet); the expert
and context fields are set by hand from what partitioner.capture.experts and partitioner.capture.sequence find.
Compares the loss, every gradient this rank holds and the weights after one Adam step with the plain model
(relative 1e-4); prints 'RESULT ... ok=...' per case and rank.
"""

from __future__ import annotations

import copy
import operator
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition, plan  # noqa: E402
from partitioner.capture.experts import find_experts  # noqa: E402
from partitioner.capture.sequence import find_sequence_split  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from runtime.context_parallel import ContextAttention, ContextGather, ContextSlice  # noqa: E402
from runtime.expert_parallel import ExpertDispatch  # noqa: E402
from runtime.layer_split import ShardedRun  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.recompute import RecomputedStage  # noqa: E402
from tests import zoo  # noqa: E402
from tests.split_worker import COST, adam, found_groups, full, held, loss_fn, on_rank0  # noqa: E402
from tests.zoo import rel  # noqa: E402

Case = tuple[nn.Module, torch.Tensor, torch.Tensor]
TOLERANCE = 1e-4


def hugging_face(name: str, batch: int = 8, seq: int = 8, **config: Any) -> Callable[[], Case]:
    def make() -> Case:
        case = zoo.hf_case(name)
        for key, value in {"use_cache": False, "attention_dropout": 0.0, **config}.items():
            setattr(case.config, key, value)
        return case.build(), torch.randint(0, 128, (batch, seq)), torch.randint(0, 128, (batch, seq))
    return make


def plain_moe() -> Case:
    return zoo.PlainMoEModel(), torch.randint(0, 64, (8, 8)), torch.randint(0, 64, (8, 8))


MODELS: dict[str, Callable[[], Case]] = {
    "mixtral": hugging_face("mixtral"), "qwen3_moe": hugging_face("qwen3_moe"), "gpt_oss": hugging_face("gpt_oss"),
    "moe": plain_moe, "llama256": hugging_face("llama", batch=4, seq=256, max_position_embeddings=256),
    "mixtral64": hugging_face("mixtral", batch=4, seq=64, max_position_embeddings=64),
}


def axes_plan(model: nn.Module, x: torch.Tensor, schedule: str, layout: str, sharding: str = "none",
              recompute: str = "none") -> Plan:
    """Rank 0 plans the stages and sets the expert and context fields; every rank gets that plan."""
    return on_rank0(lambda: _axes_plan(model, x, schedule, layout, sharding, recompute))


def _axes_plan(model: nn.Module, x: torch.Tensor, schedule: str, layout: str, sharding: str, recompute: str) -> Plan:
    stages = 2 if layout.startswith("pp2") else 1
    p = plan(copy.deepcopy(model), ["cpu"] * stages, example_inputs=(x,), micro_batches=4, schedule=schedule,
             processes=False, cost_model=COST)
    p.programs, p.graph = [], None
    traced = trace(copy.deepcopy(model), (x[:2],))
    experts = find_experts(traced.graph_module, model)
    if layout == "pp2ep2":  # one MoE layer a stage: cut after the first one's call (and the pieces of its output)
        order, nodes = [n for s in p.stages for n in s.nodes], {n.name: n for n in traced.graph_module.graph.nodes}
        cut = order.index(experts.layers[0].node) + 1
        while cut < len(order) and nodes[order[cut]].target is operator.getitem:
            cut += 1
        p.stages[0].nodes, p.stages[1].nodes = order[:cut], order[cut:]
    sequence = find_sequence_split(traced.graph_module) if "cp" in layout else None
    groups = found_groups(model, x[:2]) if "tp2" in layout else None
    for stage in p.stages:
        stage.sharding = sharding  # type: ignore[assignment]
        stage.recompute = recompute  # type: ignore[assignment]
        if layout == "pp2ep2":
            stage.ranks = [2 * stage.index, 2 * stage.index + 1]
        elif layout == "dp4ep2":
            stage.ranks = [0, 1, 2, 3]
        elif layout == "dp2ep2":
            stage.ranks = [0, 1]
        elif layout == "pp2cp2":
            stage.ranks = [2 * stage.index]
        elif layout in ("dp2cp2", "dp2cp2ep2"):
            stage.ranks = [0, 2]
        elif layout in ("tp2cp2", "pp2tp2cp2"):  # one replica a stage: layers split over 2 tensor ranks, the
            assert groups is not None  # sequence over 2 context ranks (pp2tp2cp2: 2 stages, 8 ranks)
            stage.ranks = [4 * stage.index]
            stage.tensor, stage.tensor_groups = 2, groups(stage)
        if "ep2" in layout:
            stage.expert, stage.expert_layers = 2, [e.path for e in experts.within(stage.nodes)]
        if sequence is not None:
            stage.context, stage.context_attention = 2, sequence.attentions_within(stage.nodes)
    p.data_split, p.micro_batches = "slice", max(1, p.micro_batches // p.stages[0].replicas)
    p.check()
    return p


def build(case: str) -> tuple[nn.Module, nn.Module, Any, torch.Tensor, torch.Tensor]:
    name, schedule, layout, *rest = case.split(":")
    torch.manual_seed(0)
    model, x, y = MODELS[name]()
    reference = copy.deepcopy(model)
    p = axes_plan(model, x, schedule, layout, *rest[:2])
    pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), plan=p)
    return model, reference, pipe, x, y


def equivalence(case: str) -> bool:
    model, reference, pipe, x, y = build(case)
    params = held(pipe, model)
    opt, ref_opt = adam(params.values()), adam(reference.parameters())
    ref_params = dict(reference.named_parameters())
    tokens: list[int] = []  # the sequence length of the logits each micro-batch's loss read on this rank

    split_vocab: list[bool] = []  # and whether they were split by vocabulary (a DTensor: tensor ranks)

    def counted(out: Any, y: torch.Tensor) -> torch.Tensor:
        logits = getattr(out, "logits", out)
        tokens.append(int(logits.shape[-2]))
        split_vocab.append(isinstance(logits, DTensor))
        return loss_fn(out, y)

    per_token = ":whole" not in case  # "whole": the loss's default, outputs gathered whole for it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = pipe.train_step(x, y, counted, loss_per_token=per_token)
    gathered = sum("gathered over the context ranks" in str(w.message) for w in caught)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    worst = {"loss": rel(loss, ref_loss.detach()) if loss is not None else 0.0, "grad": 0.0, "weight": 0.0}
    for n, q in sorted(params.items()):
        worst["grad"] = max(worst["grad"], rel(full(q.grad), ref_params[n].grad))
    opt.step()
    ref_opt.step()
    for n, q in sorted(params.items()):
        worst["weight"] = max(worst["weight"], rel(full(q.detach()), ref_params[n].detach()))
    modules = [m for s in pipe.stages for m in s.module.modules()]
    dispatches = sum(isinstance(m, ExpertDispatch) for m in modules)
    split = pipe.plan.stages[pipe.stages[0].index]
    attention = sum(isinstance(m, ContextAttention) for m in modules)
    gathers, slices = (sum(isinstance(m, kind) for m in modules) for kind in (ContextGather, ContextSlice))
    ok = all(v < TOLERANCE for v in worst.values()) and bool(params)
    ok = ok and (dispatches > 0) == (split.expert > 1) and (attention > 0) == (split.context > 1 and bool(
        split.context_attention))  # split as planned, sharded by FSDP2 and recomputed where planned
    ok = ok and any(isinstance(m, ShardedRun) for m in modules) == (split.sharding != "none")
    ok = ok and any(isinstance(m, RecomputedStage) for m in modules) == (split.recompute != "none")
    experts = sum(isinstance(q, DTensor) for q in params.values())
    errs = " ".join(f"{k}={v:.1e}" for k, v in worst.items())
    print(f"RESULT case={case} rank={dist.get_rank()} stages={[s.index for s in pipe.stages]} "
          f"dispatches={dispatches} attention={attention} gathers={gathers} slices={slices} dtensors={experts} "
          f"params={len(params)} loss_tokens={sorted(set(tokens))} split_vocab={sorted(set(split_vocab))} "
          f"gathered={gathered} {errs} ok={ok}",
          flush=True)
    return ok


def misordered() -> bool:
    """Rank 1 runs its two MoE layers' exchanges in the other order (its stage graph calls layer 1's dispatch
    first): under NCCL the rows would pair up with the wrong layer's; under the NCCL rules both ranks stop at the
    first all-to-all, naming the two layers, before it runs."""
    model, _, pipe, x, y = build("moe:gpipe:dp2ep2")
    if dist.get_rank() == 1:
        graph = next(m for s in pipe.stages for m in s.module.modules() if hasattr(m, "ep0") and hasattr(m, "ep1"))
        first, second = graph.ep0, graph.ep1
        graph.ep0, graph.ep1 = second, first
    try:
        pipe.train_step(x, y, loss_fn)
        caught = "nothing"
    except Exception as exc:  # noqa: BLE001 - what the rules report
        caught = str(exc)
    ok = "all-to-alls that do not pair up" in caught and "moes.0.experts" in caught and "moes.1.experts" in caught
    print(f"RESULT misordered rank={dist.get_rank()} caught={caught[:300]!r} ok={ok}", flush=True)
    return ok


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    try:
        what, *args = argv
        if what == "equivalence":
            return 0 if all([equivalence(c) for c in args]) else 1  # noqa: C419 - every case runs
        if what == "misordered":
            return 0 if misordered() else 1
        raise SystemExit(f"unknown mode {what!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
