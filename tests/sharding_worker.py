"""Worker for tests/test_sharding.py, under torchrun on gloo: one GPT stage sharded by FSDP2 against the plain model.

    python -m torch.distributed.run --nproc_per_node=2 tests/sharding_worker.py equivalence CASE [CASE ...]
    python -m torch.distributed.run --nproc_per_node=2 tests/sharding_worker.py memory CASE [CASE ...]
    python -m torch.distributed.run --nproc_per_node=2 tests/sharding_worker.py checkpoint DIR
    python -m torch.distributed.run --nproc_per_node=2 tests/sharding_worker.py batch JOBS   (tests/batch.py)

A CASE is MODE[:SYNC[:FLAG]]: zero1, zero2 or zero3; gradient sync "last" (default) or "every"; FLAG "hsdp" (a
2-D mesh: replicate 2, shard 1), "mixed" (bf16 compute, fp32 master weights, reduction and Adam moments), "fthenb"
(every micro-batch's forward, then every backward: several in flight) or "tied" (the tied embedding left to
FSDP2's ignored_params, its gradient all-reduced here as the runtime all-reduces a weight two stages share).
Each rank takes its half of every batch and cuts it into MICRO_BATCHES. Prints one 'RESULT ... ok=...' line per case
and rank; exits non-zero on any mismatch.
"""

from __future__ import annotations

import copy
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.memory import stage_memory  # noqa: E402
from cost_model.precision import FP32, MIXED  # noqa: E402
from cost_model.recompute_cost import graph_nodes, recompute_costs  # noqa: E402
from cost_model.training_memory import TrainingMemory, training_memory  # noqa: E402
from examples.models import GPT, GPTConfig  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from runtime.plan import Plan, StagePlan  # noqa: E402
from runtime.sharding import ShardedStage, ShardingConfig, data_mesh, shard_stage  # noqa: E402
from runtime.sharding_memory import RankMemory  # noqa: E402
from runtime.stage import build_stages  # noqa: E402
from tests.batch import serve  # noqa: E402
from tests.zoo import rel  # noqa: E402

CONFIG = GPTConfig(vocab=128, width=64, heads=2, layers=3, seq=16)
BATCH, MICRO_BATCHES, STEPS = 8, 2, 3


@dataclass(frozen=True)
class Case:
    mode: str
    sync: str
    flag: str

    @classmethod
    def parse(cls, text: str) -> Case:
        mode, sync, flag = [*text.split(":"), "", ""][:3]
        return cls(mode, sync or "last", flag)

    @property
    def config(self) -> ShardingConfig:
        mixed = self.flag == "mixed"
        return ShardingConfig(self.mode, torch.bfloat16 if mixed else None,  # type: ignore[arg-type]
                              torch.float32 if mixed else None, self.sync)  # type: ignore[arg-type]


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def adam(params: Any) -> torch.optim.Adam:
    """Adam with eps=1e-6: the attention key's bias has no true gradient (softmax ignores a shift), only rounding
    noise of about 1e-9, which eps=1e-8 would turn into updates of up to lr/10 that differ run to run."""
    return torch.optim.Adam(params, lr=1e-3, eps=1e-6, foreach=False)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.seq), generator=g),
             torch.randint(0, CONFIG.vocab, (BATCH, CONFIG.seq), generator=g)) for _ in range(STEPS)]


def micro_batch() -> torch.Tensor:
    return torch.zeros(BATCH // dist.get_world_size() // MICRO_BATCHES, CONFIG.seq, dtype=torch.long)


def sharded_gpt(case: Case) -> tuple[GPT, GPT, ShardedStage]:
    """The model, a plain copy made before sharding, and one stage holding all of the model, sharded by `case`."""
    torch.manual_seed(0)
    model = GPT(CONFIG)
    reference = copy.deepcopy(model)
    gm = trace(model, (micro_batch(),)).graph_module
    ranks = list(range(dist.get_world_size()))
    stage = build_stages(gm, Plan([StagePlan(0, "cpu", [n.name for n in compute_nodes(gm)], ranks=ranks)]))[0][0]
    mesh = data_mesh(ranks, replicate=len(ranks) if case.flag == "hsdp" else 1)
    assert mesh is not None
    tied = [model.tok.weight] if case.flag == "tied" else []
    return model, reference, shard_stage(stage.module, mesh, case.config, model=model, unsharded=tied)


def local(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[0] // dist.get_world_size()
    return x[dist.get_rank() * n:(dist.get_rank() + 1) * n]


def sharded_step(stage: ShardedStage, x: torch.Tensor, y: torch.Tensor, keep: bool = False,
                 in_flight: bool = False) -> torch.Tensor | None:
    """Forward and backward of this rank's half of the batch in MICRO_BATCHES, each backward after its forward
    (or, `in_flight`, every forward first); its outputs if `keep`."""
    xs, ys = local(x).chunk(MICRO_BATCHES), local(y).chunk(MICRO_BATCHES)
    outs, losses = [], []

    def backward(i: int) -> None:
        stage.before_backward(last=i == len(xs) - 1)
        losses[i].backward()

    for i, (xm, ym) in enumerate(zip(xs, ys)):
        (out,) = stage(xm)
        losses.append(lm_loss(out, ym) * (xm.shape[0] / local(x).shape[0]))
        if not in_flight:
            backward(i)
        if keep:
            outs.append(out.detach())
    for i in range(len(xs) if in_flight else 0):
        backward(i)
    return torch.cat(outs) if keep else None


class Collectives:
    """Counts FSDP2's all-gathers and reduce-scatters (torch.distributed's *_single calls, which it makes)."""

    def __init__(self) -> None:
        self.counts = {"all_gather_single": 0, "reduce_scatter_single": 0, "all_reduce": 0}
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Collectives:
        for name in self.counts:
            self._saved[name] = original = getattr(dist, name)
            setattr(dist, name, self._counting(name, original))
        return self

    def _counting(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            self.counts[name] += 1
            return original(*args, **kwargs)
        return call

    def __exit__(self, *exc: object) -> None:
        for name, original in self._saved.items():
            setattr(dist, name, original)


def expected_collectives(case: Case, groups: int) -> dict[str, int]:
    """What [Note: sharding modes] says one step does: all-gathers per FSDP group and reduce-scatters."""
    gathers = {"zero1": 1, "zero2": MICRO_BATCHES, "zero3": 2 * MICRO_BATCHES}[case.mode]
    reduces = MICRO_BATCHES if case.sync == "every" else 1
    if case.flag == "hsdp":  # shard groups of one rank: nothing to gather or scatter, an all-reduce across replicas
        return {"all_gather_single": 0, "reduce_scatter_single": 0, "all_reduce": reduces * groups}
    return {"all_gather_single": gathers * groups, "reduce_scatter_single": reduces * groups, "all_reduce": 0}


def equivalence(text: str) -> bool:
    case = Case.parse(text)
    _, reference, stage = sharded_gpt(case)
    params = {k: t for k, t in stage.model_state_dict().items() if isinstance(t, torch.nn.Parameter)}
    ref = dict(reference.named_parameters(remove_duplicate=False))
    opt, ref_opt = adam(stage.parameters()), adam(reference.parameters())
    worst = {"out": 0.0, "grad": 0.0, "weight": 0.0}
    for x, y in batches():
        with Collectives() as seen:
            out = sharded_step(stage, x, y, keep=True, in_flight=case.flag == "fthenb")
        for p in stage.parameters():
            if not isinstance(p, DTensor) and p.grad is not None:  # left to the runtime: all-reduce (mean)
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
        ref_out = reference(x)
        lm_loss(ref_out, y).backward()
        assert out is not None
        worst["out"] = max(worst["out"], rel(out, local(ref_out)))
        for k, p in params.items():
            worst["grad"] = max(worst["grad"], rel(full(p.grad), ref[k].grad))  # type: ignore[arg-type]
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    for k, p in params.items():
        worst["weight"] = max(worst["weight"], rel(full(p.detach()), ref[k].detach()))
    groups = len(stage.units) + (case.flag != "tied")  # the root's group holds the tied embedding
    counts_ok = seen.counts == expected_collectives(case, groups)
    ok = all(v < 1e-5 for v in worst.values()) and params.keys() == ref.keys() and counts_ok
    errs = " ".join(f"{k}={v:.1e}" for k, v in worst.items())
    print(f"RESULT equivalence case={text} rank={dist.get_rank()} units={len(stage.units)} {errs} "
          f"collectives={seen.counts} ok={ok}", flush=True)
    return ok


def predicted(case: Case, stage: ShardedStage) -> TrainingMemory:
    """cost_model's prediction for one rank: training_memory with the activations the planner prices
    (recompute_cost's peak of one micro-batch in flight, its input, its logits and their loss)."""
    torch.manual_seed(0)
    model = GPT(CONFIG).to(torch.bfloat16 if case.flag == "mixed" else torch.float32)  # activations in compute dtype
    gm = trace(model, (micro_batch(),)).graph_module
    graph = build_graph(gm, [micro_batch()])
    names = [n.name for n in compute_nodes(gm)]
    cost = recompute_costs(graph_nodes(graph, names))["none"]
    logits = sum(int(graph.nodes[u]["out_bytes"]) for n, a in graph.nodes(data=True) if a["op"] == "output"
                 for u in graph.predecessors(n))
    held = stage_memory(0, cost.kept_bytes, stage=0, stages=1, micro_batches=MICRO_BATCHES, flight=1,
                        recv_bytes=micro_batch().nbytes, send_bytes=logits, peak_bytes=cost.peak_bytes, last=True)
    params = sum(p.numel() for p in stage.parameters())
    units = [sum(p.numel() for p in u.parameters()) for u in stage.units]
    return training_memory(params, MIXED if case.flag == "mixed" else FP32, mode=case.mode,
                           degree=dist.get_world_size(), micro_batches=MICRO_BATCHES, gradient_sync=case.sync,
                           activation_bytes=held.activations + held.buffers,
                           buffer_bytes=sum(b.nbytes for b in stage.buffers()), units=units)


def state_tensors(opt: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in opt.state.values():
        yield from (t for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def memory(text: str) -> bool:
    """Measured peak bytes of this rank over 3 training steps (runtime.sharding_memory) against cost_model's
    prediction; the optimizer state is 1/d of the plain model's, exactly."""
    case = Case.parse(text)
    _, _, stage = sharded_gpt(case)
    data = batches()
    opt = adam(stage.parameters())
    with RankMemory([*stage.parameters(), *stage.buffers()]) as meter:
        for x, y in data:
            sharded_step(stage, x, y)
            opt.step()
            opt.zero_grad()
    state = sum(t.to_local().untyped_storage().nbytes() for t in state_tensors(opt))  # type: ignore[attr-defined]
    want = predicted(case, stage)
    params = sum(p.numel() for p in stage.parameters())
    err = meter.peak / want.total - 1
    ok = abs(err) <= 0.10 and state == want.optimizer == 2 * params * 4 // dist.get_world_size()
    kinds = " ".join(f"{k}={v}" for k, v in want.to_dict().items())
    print(f"RESULT memory case={text} rank={dist.get_rank()} measured={meter.peak} predicted={want.total} "
          f"err={err:+.1%} optimizer_state={state} of_plain={2 * params * 4} ({kinds}) ok={ok}", flush=True)
    return ok


def checkpoint(directory: str) -> bool:
    """A DCP checkpoint of a sharded run (zero3, after 3 steps) loads into a plain model, and a plain model's
    checkpoint loads into the sharded stage: every weight equal."""
    model, _, stage = sharded_gpt(Case.parse("zero3"))
    opt = adam(stage.parameters())
    for x, y in batches():
        sharded_step(stage, x, y)
        opt.step()
        opt.zero_grad()
    sharded = stage.model_state_dict()
    dcp.save(sharded, checkpoint_id=f"{directory}/sharded")
    torch.manual_seed(5)
    plain = GPT(CONFIG)
    dcp.load(plain.state_dict(), checkpoint_id=f"{directory}/sharded")
    into_plain = max(rel(v, full(sharded[k]).detach()) for k, v in plain.state_dict().items() if k in sharded)
    same_keys = sharded.keys() == plain.state_dict().keys()
    torch.manual_seed(6)
    other = GPT(CONFIG)
    dcp.save(other.state_dict(), checkpoint_id=f"{directory}/plain")
    dcp.load(sharded, checkpoint_id=f"{directory}/plain")
    expected = other.state_dict()
    into_sharded = max(rel(full(v).detach(), expected[k]) for k, v in sharded.items())
    via_model = max(rel(full(v).detach(), expected[k]) for k, v in model.state_dict().items())  # the model's keys
    ok = max(into_plain, into_sharded, via_model) == 0.0 and same_keys
    print(f"RESULT checkpoint rank={dist.get_rank()} keys={len(sharded)} into_plain={into_plain:.1e} "
          f"into_sharded={into_sharded:.1e} via_model={via_model:.1e} ok={ok}", flush=True)
    return ok


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    try:
        what, *args = argv
        runs: dict[str, Callable[[str], bool]] = {"equivalence": equivalence, "memory": memory,
                                                   "checkpoint": checkpoint}
        if what == "batch":  # every mode's cases in one launch, one job each
            return serve(args[0], runs, dist.get_rank())
        results = [runs[what](a) for a in args]
        return 0 if all(results) else 1
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
