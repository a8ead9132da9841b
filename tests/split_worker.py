"""Worker for tests/test_split_layers.py: plans that split layers and shard weights, run under torchrun on gloo.

    python -m torch.distributed.run --nproc_per_node=4 tests/split_worker.py equivalence CASE [CASE ...]
    ... split_worker.py checkpoint DIR CASE        a DCP checkpoint of the run loads into the plain model
    ... split_worker.py memory CASE [CASE ...]     measured peak bytes per rank against the prediction
    ... split_worker.py misordered                 (2 ranks) a collective posted out of order is caught
    ... split_worker.py batch JOBS                  the jobs (any of the modes above, one case each) of
                                                   tests/batch.py, in one launch

A CASE is MODEL:SCHEDULE:LAYOUT[:SHARDING[:RECOMPUTE]]: MODEL of MODELS, or "hf-" and any Hugging Face model_type
(`any_family`); LAYOUT "tp2pp2" (2 stages, each split over
2 tensor ranks), "tp2dp2" (one stage split over 2 ranks, 2 replicas dealt micro-batches, or sliced where SHARDING is
given), "pp2dp2" (2 stages x 2 replicas, micro-batches sliced over the replicas) or "dp2tp2" (Krizhevsky's "one
weird trick": stage 0 on 2 replicas dealt micro-batches, stage 1 split over 2). SHARDING zero1, zero2 or zero3
shards the replicas' weights with FSDP2 ("zero3+every": the plan's gradient_sync "every", FULL_SHARD:
gradients reduce-scattered after each micro-batch, only the shard kept); RECOMPUTE "full" or "selective"
recomputes every stage as well ("a/b": one mode per stage; "none": not); MODE "eval" runs the partitioned and
the plain model in eval mode (a model traced in training whose forward reads self.training runs its other graph:
"modes" scales by 1.5 in training only); "onehot" trains on a loss DTensor cannot run on logits split by
vocabulary (they are gathered for it, with a warning); "mixed" trains in mixed precision (FSDP2 computes in bf16
over fp32 master weights): one step, the loss and every gradient (against the largest) within 3e-2 of the fp32 plain
model's. Rank 0
plans the stages with partitioner.plan (then every rank reads its plan), the split fields are set by hand (the
groups partitioner.capture.shardable finds within each stage). `equivalence` compares the loss, every gradient
this rank holds and (sharded cases) the weights after 3 Adam steps with the plain model; `memory` (sharded cases)
the rank's peak bytes with cost_model.training_memory. Prints 'RESULT ... ok=...' per case and rank.
"""

from __future__ import annotations

import copy
import os
import sys
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from cost_model.memory import stage_memory  # noqa: E402
from cost_model.precision import FP32  # noqa: E402
from cost_model.recompute_cost import graph_nodes, recompute_costs  # noqa: E402
from cost_model.training_memory import training_memory  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner import partition, plan  # noqa: E402
from partitioner.capture.graph import build_graph  # noqa: E402
from partitioner.capture.shardable import find_shardable  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from rules.actions import peak_in_flight  # noqa: E402
from runtime.layer_split import ShardedRun  # noqa: E402
from runtime.mode_units import ModeSwitch  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from runtime.recompute import RecomputedStage  # noqa: E402
from runtime.sharding_memory import RankMemory  # noqa: E402
from runtime.stage import stage_io  # noqa: E402
from tests import zoo  # noqa: E402
from tests.batch import serve  # noqa: E402
from tests.tp_worker import AlexNetStyle  # noqa: E402
from tests.zoo import rel  # noqa: E402

Case = tuple[nn.Module, torch.Tensor, torch.Tensor]
BATCH = 8
# a device of fixed speed: the same cuts on every run (a profiled one may cut elsewhere when the machine is busy)
COST = AnalyticCostModel(measure=lambda device: DeviceSpec("cpu", flops_per_s=1e10, bytes_per_s=1e10,
                                                           op_overhead_s=1e-6, memory_bytes=1 << 34))


def gpt(layers: int = 2) -> Case:
    model = GPT(GPTConfig(vocab=64, width=32, heads=4, layers=layers, seq=8))
    return model, torch.randint(0, 64, (BATCH, 8)), torch.randint(0, 64, (BATCH, 8))


def hugging_face(name: str, layers: int | None = None) -> Callable[[], Case]:
    def make() -> Case:
        case = zoo.hf_case(name)
        for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout"):  # dropout off: exact compare
            if hasattr(case.config, key):
                setattr(case.config, key, 0.0)
        for key in ("n_layer", "num_hidden_layers"):
            if layers is not None and hasattr(case.config, key):
                setattr(case.config, key, layers)
        case.config.use_cache = False
        return case.build(), torch.randint(0, 128, (BATCH, 8)), torch.randint(0, 128, (BATCH, 8))
    return make


class ModeScaled(nn.Module):
    """Blocks whose forward reads `self.training` (traced once per mode): in training each block's output is
    scaled by 1.5, in eval it is not, so a run equal to the plain model in eval mode ran the eval graph."""

    def __init__(self, layers: int = 4, width: int = 16) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers))
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
            if self.training:
                x = x * 1.5
        return self.head(x)


class WeightlessTail(nn.Module):
    """Layers, then a tail of operations without weights (the split worker cuts stage 1 there: "tail")."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.layers(x)
        return torch.tanh(h) * 2 + torch.sigmoid(h)


def mode_scaled() -> Case:
    return ModeScaled(), torch.randn(BATCH, 16), torch.randint(0, 10, (BATCH,))


def cnn() -> Case:
    return AlexNetStyle().eval(), torch.randn(BATCH, 3, 8, 8), torch.randint(0, 10, (BATCH,))


MODELS: dict[str, Callable[[], Case]] = {"gpt": gpt, "gpt4": lambda: gpt(4), "llama": hugging_face("llama"),
                                         "gpt2": hugging_face("gpt2"), "gpt2x4": hugging_face("gpt2", layers=4),
                                         "cnn": cnn, "modes": mode_scaled,
                                         "tail": lambda: (WeightlessTail(), torch.randn(BATCH, 16),
                                                          torch.randint(0, 10, (BATCH,)))}


EXPORTED = {"llama", "gpt2", "gpt2x4"}  # traced by torch.export (Hugging Face models)


SPLIT_LOGITS: list[bool] = []  # per call of loss_fn: were the logits it read split by vocabulary (a DTensor)?


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    out = getattr(out, "logits", out)
    SPLIT_LOGITS.append(isinstance(out, DTensor))
    return F.cross_entropy(out.flatten(0, -2), y.flatten())


def onehot_loss(out: Any, y: torch.Tensor) -> torch.Tensor:
    """A loss DTensor cannot run on split logits (a plain one-hot tensor of their shape beside them)."""
    out = getattr(out, "logits", out)
    SPLIT_LOGITS.append(isinstance(out, DTensor))
    return (out.float() - F.one_hot(y, out.shape[-1]).float()).pow(2).mean()


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor, by torch's own DTensor.full_tensor() (a fused q/k/v weight split over tensor
    ranks and sharded by FSDP2 too is sharded along another dim, so this is the model's weight: runtime.sharding's
    [Note: fused weights under FSDP2])."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def fresh_weights(model: nn.Module, reference: nn.Module, params: dict[str, nn.Parameter]) -> float:
    """Right after partition, before a step: how far torch's full-weight tools are from the plain model's weights:
    `full_tensor()` of every weight this rank holds, and where it holds every weight (one stage),
    `get_model_state_dict(..., full_state_dict=True)` (every rank calls it: a collective over their meshes)."""
    expected = reference.state_dict()
    worst = max((rel(full(q.detach()), expected[n]) for n, q in params.items()), default=0.0)
    if len(params) == len(list(model.parameters())):
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        worst = max(worst, *(rel(v, expected[k]) for k, v in state.items() if v.is_floating_point()))
    return worst


def found_groups(model: nn.Module, x: torch.Tensor) -> Callable[[Any], list[Any]]:
    """The groups partitioner.capture.shardable finds that split 2 ways, by stage (`x`: a micro-batch); one trace
    for every stage (a Hugging Face model's torch.export trace costs a rank seconds on CI's 2 cores)."""
    traced = trace(copy.deepcopy(model), (x,))
    found = find_shardable(traced.graph_module, build_graph(traced.graph_module, traced.flatten_inputs((x,), {})))
    return lambda stage: [g.spec() for g in found.within(stage.nodes) if 2 in g.degrees]


def on_rank0(make: Callable[[], Plan]) -> Plan:
    """The plan rank 0 makes (its split fields set, checked), sent to every rank as JSON, as partitioner's own
    plan_on_rank0 does: the other ranks trace nothing for it. An error on rank 0 is raised on every rank."""
    made: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            made[0] = ("plan", make().to_json())
        except Exception as exc:  # noqa: BLE001 - raised on every rank below, not waited for
            made[0] = ("error", f"rank 0 could not plan: {type(exc).__name__}: {exc}")
    dist.broadcast_object_list(made, src=0)
    kind, text = made[0]
    if kind == "error":
        raise RuntimeError(text)
    return Plan.from_json(text)


def split_plan(model: nn.Module, x: torch.Tensor, schedule: str, layout: str, sharding: str = "none",
               recompute: str = "none") -> Plan:
    """Rank 0 plans the stages (partitioner.plan, one process) and sets the split fields; every rank gets that plan."""
    return on_rank0(lambda: _split_plan(model, x, schedule, layout, sharding, recompute))


def _split_plan(model: nn.Module, x: torch.Tensor, schedule: str, layout: str, sharding: str,
                recompute: str) -> Plan:
    pipeline = layout in ("tp2pp2", "pp2dp2", "dp2tp2")  # else one stage
    sharding, _, sync = sharding.partition("+")  # "zero3+every": gradients reduce-scattered per micro-batch
    micro_batches = 4
    p = plan(copy.deepcopy(model), ["cpu"] * (2 if pipeline else 1), example_inputs=(x,),
             micro_batches=micro_batches, schedule=schedule, processes=False, cost_model=COST)
    p.programs, p.graph = [], None
    groups = found_groups(model, x[: BATCH // micro_batches]) if "tp2" in layout else None
    for stage in p.stages:
        if layout == "tp2pp2":
            stage.ranks = [2 * r for r in stage.ranks]
        elif layout == "tp2dp2":
            stage.ranks = [0, 2]
            stage.sharding = sharding  # type: ignore[assignment]
            stage.recompute = recompute  # type: ignore[assignment]
        elif layout == "tp2":
            stage.ranks = [0]
        elif layout == "dp2tp2":  # "one weird trick": the first stage data-parallel, the second split
            stage.ranks = [0, 1] if stage.index == 0 else [2]
            stage.tensor = 2 if stage.index == 1 else 1
        else:
            stage.ranks = [2 * stage.index, 2 * stage.index + 1]
            stage.sharding = sharding  # type: ignore[assignment]
            stage.gradient_sync = sync or "last"  # type: ignore[assignment]
            modes = recompute.split("/")  # one mode for every stage, or one per stage
            stage.recompute = modes[stage.index % len(modes)]  # type: ignore[assignment]
        if groups is not None and (layout.startswith("tp2") or (layout == "dp2tp2" and stage.index == 1)):
            stage.tensor = 2
            stage.tensor_groups = groups(stage)
    if isinstance(model, WeightlessTail):  # stage 1: the operations after the last layer, no weights
        order = [n for st in p.stages for n in st.nodes]
        cut = order.index("layers_2") + 1
        p.stages[0].nodes, p.stages[1].nodes = order[:cut], order[cut:]
    if layout == "pp2dp2" or sharding != "none":
        p.data_split, p.micro_batches = "slice", micro_batches // 2
    p.check()
    return p


SMALL = {"vocab_size": 128, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64, "head_dim": 8,
         "use_cache": False}


def any_family(model_type: str) -> Case:
    """A causal LM of any Hugging Face family by its model_type ("hf-olmo"), built as transformers builds it from
    its default config with the common sizes shrunk (transformers maps them to the family's own names), dropout
    off and special tokens inside the vocabulary: families nobody here wrote a case for."""
    import transformers as hf

    config = hf.AutoConfig.for_model(model_type, **SMALL)
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= SMALL["vocab_size"]:
            setattr(config, key, 0)
    model = hf.AutoModelForCausalLM.from_config(config)
    return model, torch.randint(0, 128, (BATCH, 8)), torch.randint(0, 128, (BATCH, 8))


def build(case: str, seed: int = 0) -> tuple[nn.Module, nn.Module, Any, torch.Tensor, torch.Tensor]:
    """The case's model (partitioned), a plain copy made before, the pipeline and a batch."""
    name, schedule, layout, *rest = case.split(":")
    torch.manual_seed(seed)
    model, x, y = any_family(name.removeprefix("hf-")) if name.startswith("hf-") else MODELS[name]()
    reference = copy.deepcopy(model)
    p = split_plan(model, x, schedule, layout, *rest[:2])
    if rest[2:] == ["mixed"]:
        p.precision = {"compute": "bfloat16", "param": "float32", "grad": "float32", "state": "float32"}
    pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), plan=p)
    if rest[2:] == ["eval"]:
        model.eval()
        reference.eval()
    return model, reference, pipe, x, y


def held(pipe: Any, model: nn.Module) -> dict[str, nn.Parameter]:
    ids = pipe.held_tensor_ids()
    return {n: q for n, q in model.named_parameters() if id(q) in ids}


def adam(params: Any) -> torch.optim.Adam:
    """eps=1e-6: a gradient that is only rounding noise (an attention key's bias) is not blown up to lr / 10."""
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6, foreach=False)


def sgd(params: Any) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def count_calls(model: nn.Module) -> dict[str, int]:
    """Calls of each of the model's Linear layers from now on (a recomputed forward calls them again in backward)."""
    calls: dict[str, int] = {}

    def hook(name: str) -> Callable[..., None]:
        def count(*_: Any) -> None:
            calls[name] = calls.get(name, 0) + 1
        return count

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            module.register_forward_pre_hook(hook(name))
    return calls


def equivalence(case: str) -> bool:
    _, _, layout, sharding = [*case.split(":"), "none"][:4]
    model, reference, pipe, x, y = build(case)
    params = held(pipe, model)
    any_name = case.startswith("hf-")
    mixed = case.endswith(":mixed")  # bf16 compute: one step, gradients against the largest (Adam would amplify
    steps = 3 if sharding != "none" and not mixed else 1  # the bf16 noise of gradients that are only noise)
    calls = count_calls(model)
    loss_of = onehot_loss if case.endswith(":onehot") else loss_fn
    worst_fresh = fresh_weights(model, reference, params)
    opt, ref_opt = adam(params.values() or [torch.zeros(1, requires_grad=True)]), adam(reference.parameters())
    ref_params = dict(reference.named_parameters())
    worst = {"fresh": worst_fresh, "loss": 0.0, "grad": 0.0, "weight": 0.0}
    for _ in range(steps):
        opt.zero_grad()
        ref_opt.zero_grad()
        SPLIT_LOGITS.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = pipe.train_step(x, y, loss_of)
        split_logits = sorted(set(SPLIT_LOGITS))  # what the last stage's loss read (nothing: not this rank's)
        whole_again = sum("runs on the whole logits instead" in str(w.message) for w in caught)
        ref_loss = loss_of(reference(x), y)
        ref_loss.backward()
        if loss is not None:
            worst["loss"] = max(worst["loss"], rel(loss, ref_loss.detach()))
        scale = max(float(ref_params[n].grad.abs().max()) for n in params) if mixed and params else 0.0
        for n, q in sorted(params.items()):
            if mixed:
                worst["grad"] = max(worst["grad"], float((full(q.grad) - ref_params[n].grad).abs().max()) / scale)
            elif q.grad is not None or ref_params[n].grad is not None:
                worst["grad"] = max(worst["grad"], rel(full(q.grad), ref_params[n].grad))
        opt.step()
        ref_opt.step()
    if steps > 1:  # families of any name: against the largest weight (Adam blows up the rounding noise that is the
        # whole gradient of a key's norm bias, a weight that starts at 0)
        scale = max(float(ref_params[n].abs().max()) for n in params) if any_name and params else 0.0
        for n, q in sorted(params.items()):
            error = float((full(q.detach()) - ref_params[n].detach()).abs().max()) / scale if any_name else \
                rel(full(q.detach()), ref_params[n].detach())
            worst["weight"] = max(worst["weight"], error)
    split = sum(isinstance(q, DTensor) for q in params.values())  # split (TP) or sharded (FSDP2) weights
    plan_ = pipe.plan
    splits = any(plan_.stages[s.index].tensor > 1 or plan_.stages[s.index].sharding != "none" for s in pipe.stages
                 if any(True for _ in s.module.parameters()))
    tolerance = 3e-2 if mixed else 1e-5
    weightless = not any(True for s in pipe.stages for _ in s.module.parameters())  # "tail": stage 1
    ok = all(v < tolerance for v in worst.values()) and (bool(params) or weightless) and (split > 0) == splits
    units = [[u.traced if isinstance(u, ModeSwitch) else u for u in s.module.stage.units]  # one per graph pair
             for s in pipe.stages if isinstance(s.module, ShardedRun)]
    if plan_.data_split == "slice":  # every micro-batch on every replica: each Linear runs once a micro-batch, twice
        # where its stage recomputes (counted by module hooks: torch.fx graphs call the modules, torch.export's the
        # aten ops inside them)
        mode = plan_.stages[pipe.stages[0].index].recompute
        runs = steps * plan_.micro_batches * (1 if mode == "none" else 2)
        if case.split(":")[0] not in EXPORTED and not any_name and not weightless:
            ok = ok and bool(calls) and set(calls.values()) == {runs}
        # FSDP2's units are the checkpointed segments (a stage checkpointed whole: its root, the one unit)
        ok = ok and all(isinstance(u, RecomputedStage) == (mode != "none") for u in (units or [[]])[0])
        ok = ok and (weightless or bool(units))  # a stage with weights is sharded; one without is not
    errs = " ".join(f"{k}={v:.1e}" for k, v in worst.items())
    print(f"RESULT case={case} rank={dist.get_rank()} stages={[s.index for s in pipe.stages]} "
          f"tensor={[s.tensor for s in plan_.stages]} params={len(params)} dtensors={split} "
          f"units={[len(u) for u in units]} linear_calls={sorted(set(calls.values()))} "
          f"split_logits={split_logits} whole_again={whole_again} {errs} ok={ok}",
          flush=True)
    return ok


def checkpoint(directory: str, case: str) -> bool:
    """One SGD step with momentum, a DCP checkpoint (weights and optimizer state); the plain model loads it with its
    own keys (consolidated), and a fresh pipeline of another model loads it back and takes the next step as the plain
    one does."""
    from runtime.checkpoint import consolidate

    path = os.path.join(directory, case.replace(":", "_"))
    model, reference, pipe, x, y = build(case)
    opt, ref_opt = sgd(held(pipe, model).values()), sgd(reference.parameters())
    pipe.train_step(x, y, loss_fn)
    loss_fn(reference(x), y).backward()
    opt.step()
    ref_opt.step()
    pipe.save_checkpoint(path, opt)
    into_plain = 0.0
    if dist.get_rank() == 0:
        plain, _, _ = MODELS[case.split(":")[0]]()
        plain.load_state_dict(consolidate(path), strict=True)
        expected = reference.state_dict()
        into_plain = max(rel(v, expected[k]) for k, v in plain.state_dict().items() if v.is_floating_point())
    fresh, _, again, _, _ = build(case, seed=1)
    opt2 = sgd(held(again, fresh).values())
    again.load_checkpoint(path, opt2)
    for o in (opt2, ref_opt):
        o.zero_grad()
    again.train_step(x, y, loss_fn)
    loss_fn(reference(x), y).backward()
    opt2.step()
    ref_opt.step()
    ref_params = dict(reference.named_parameters())
    resumed = max(rel(full(q.detach()), ref_params[n].detach()) for n, q in sorted(held(again, fresh).items()))
    ok = into_plain < 1e-5 and resumed < 1e-5
    print(f"RESULT checkpoint case={case} rank={dist.get_rank()} into_plain={into_plain:.1e} "
          f"resumed={resumed:.1e} ok={ok}", flush=True)
    return ok


def predicted(pipe: Any, case: str, x: torch.Tensor) -> tuple[int, int]:
    """cost_model's bytes for this rank's sharded stage (one stage per rank): training_memory of its sharded
    weights (FSDP2 units as built) and of a tied weight it keeps whole, with the activations cost_model.memory
    prices for one slice of a micro-batch, as many in flight as its program holds; and that many."""
    plan_, stage = pipe.plan, pipe.stages[0]
    s, pieces = stage.index, pipe.plan.micro_batches * pipe.plan.stages[0].replicas
    traced = trace(MODELS[case.split(":")[0]]()[0], (x[: BATCH // pieces],))
    gm = traced.graph_module
    graph = build_graph(gm, traced.flatten_inputs((x[: BATCH // pieces],), {}))
    cost = recompute_costs(graph_nodes(graph, plan_.stages[s].nodes))[plan_.stages[s].recompute]
    ins, outs = stage_io(gm, plan_)[s]
    out_bytes = {n: int(graph.nodes[n].get("out_bytes", 0)) for n in graph.nodes}
    recv = sum(out_bytes.get(n, 0) for n in ins)
    last = s == len(plan_.stages) - 1
    send = sum(out_bytes.get(u, 0) for n, a in graph.nodes(data=True) if a["op"] == "output"
               for u in graph.predecessors(n)) if last else sum(out_bytes.get(n, 0) for n in outs)
    program = plan_.programs[dist.get_rank()].ops
    flight = peak_in_flight([[(op.stage, op.kind, op.split) for op in program if op.is_compute]], len(plan_.stages))
    held_ = stage_memory(0, cost.kept_bytes, stage=s, stages=len(plan_.stages), micro_batches=pieces // 2,
                         flight=flight[s], recv_bytes=recv, send_bytes=send, peak_bytes=cost.peak_bytes, last=last)
    weights = list(stage.module.parameters())
    sharded = sum(q.numel() for q in weights if isinstance(q, DTensor))
    # the units' sharded weights (a tied weight a unit reads stays whole: FSDP2 ignores it)
    units = [sum(q.numel() for q in u.parameters() if isinstance(q, DTensor)) for u in stage.module.stage.units]
    mode = plan_.stages[s].sharding
    want = training_memory(sharded, FP32, mode=mode, degree=2, micro_batches=pieces // 2,
                           gradient_sync=plan_.stages[s].gradient_sync,
                           activation_bytes=held_.activations + held_.buffers, units=units, in_flight=flight[s],
                           buffer_bytes=sum(b.nbytes for b in stage.module.buffers()))
    whole = training_memory(sum(q.numel() for q in weights if not isinstance(q, DTensor)), FP32)
    return want.total + whole.total, flight[s]


def memory(case: str) -> bool:
    """Measured peak bytes of this rank over 3 Adam steps (runtime.sharding_memory) against `predicted`."""
    model, _, pipe, x, y = build(case)
    params = held(pipe, model)
    opt = adam(params.values())
    with RankMemory([*params.values(), *pipe.stages[0].module.buffers()]) as meter:
        for _ in range(3):
            opt.zero_grad()
            pipe.train_step(x, y, loss_fn)
            opt.step()
    want, flight = predicted(pipe, case, x)
    err = meter.peak / want - 1
    ok = abs(err) <= 0.10
    print(f"RESULT memory case={case} rank={dist.get_rank()} stage={pipe.stages[0].index} in_flight={flight} "
          f"measured={meter.peak} predicted={want} err={err:+.1%} ok={ok}", flush=True)
    return ok


def misordered() -> bool:
    """Tensor rank 1 posts an extra collective on its group before the stage's own: under the NCCL rules
    (runtime.nccl_rules.collective_checks) both ranks stop with an error naming both collectives, before it runs."""
    model, _, pipe, x, y = build("gpt:1f1b:tp2")
    mesh = next(q for q in model.parameters() if isinstance(q, DTensor)).device_mesh
    if dist.get_rank() == 1:
        pipe.stages[0].module.register_forward_pre_hook(
            lambda *_: dist.all_reduce(torch.zeros(3), group=mesh.get_group()))
    try:
        pipe.train_step(x, y, loss_fn)
        caught = "nothing"
    except Exception as exc:  # noqa: BLE001 - what the rules report
        caught = str(exc)
    ok = "Detected mismatch between collectives" in caught
    print(f"RESULT misordered rank={dist.get_rank()} caught={caught[:240]!r} ok={ok}", flush=True)
    return ok


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    try:
        what, *args = argv
        if what == "equivalence":
            return 0 if all([equivalence(c) for c in args]) else 1  # noqa: C419 - every case runs
        if what == "checkpoint":
            return 0 if all([checkpoint(args[0], c) for c in args[1:]]) else 1  # noqa: C419
        if what == "memory":
            return 0 if all([memory(c) for c in args]) else 1  # noqa: C419
        if what == "misordered":
            return 0 if misordered() else 1
        if what == "batch":
            return serve(args[0], {"equivalence": equivalence, "checkpoint": checkpoint, "memory": memory,
                                   "misordered": misordered}, dist.get_rank())
        raise SystemExit(f"unknown mode {what!r}")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
