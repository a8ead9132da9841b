"""Worker for tests/test_distributed.py: run under torchrun (or with RANK/WORLD_SIZE set).

Modes:
  equivalence CASES  each case 'model:schedule:replicas[:placement[:eval]][:recompute=MODE]' trains steps
                     (the example's shapes, fewer samples, a shorter sequence) and compares this rank's loss
                     and gradients with single-process full-batch training
  checkpoint DIR     train 3, save, train 3, then rebuild with another plan, load, train 3
  fault KILL_RANK    train until KILL_RANK kills itself mid-step; others must fail naming it
  resume DIR OUT     train 6 steps saving every step; on the first attempt rank 1 dies at step 5
  infeasible         plan for devices far too small: every rank must raise, none may wait
  batch JOBS         the jobs of tests/batch.py (equivalence CASE, checkpoint DIR, infeasible, whole_input),
                     in one launch
  devices CASE       bad device lists ('differ': rank 1 passes another list; 'gpu': GPUs this machine
                     lacks): every rank must raise the same PartitionError, none may wait
Prints 'RESULT ...' lines; exits non-zero on any mismatch.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition  # noqa: E402
from runtime.checkpoint import consolidate  # noqa: E402
from tests import zoo  # noqa: E402
from tests.batch import serve  # noqa: E402
from tests.zoo import rel  # noqa: E402


def lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if out.dim() == 3:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())
    return F.cross_entropy(out, y)


def data(name: str, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    torch.manual_seed(seed)
    model, (x,), _ = zoo.ZOO[name]()
    x = torch.cat([x, x[:1]])  # batch 8: even for 2 and 4 replicas, uneven for 3 micro-batches
    with torch.no_grad():
        out = model(x)
    y = torch.randint(0, out.shape[-1], out.shape[:-1])
    return model, x, y



def equivalence(cases: list[str]) -> int:
    world = int(os.environ["WORLD_SIZE"])
    bad = 0
    for case in cases:
        name, schedule, reps, *rest = case.split(":")
        recompute = next((r.split("=", 1)[1] for r in rest if r.startswith("recompute=")), "none")
        rest = [r for r in rest if not r.startswith("recompute=")]
        placement = rest[0] if rest else "pipeline"
        switch_to_eval = rest[1:] == ["eval"]  # partitioned in training, then trained in eval mode
        replicas = "auto" if reps == "auto" else json.loads(reps) if reps != "-" else None
        model, x, y = data(name)
        reference = copy.deepcopy(model)
        m = 4 if schedule != "interleaved" else 2 * world
        pipe = partition(
            model, ["cpu"] * world, example_inputs=(x,), micro_batches=m, schedule=schedule, replicas=replicas,
            placement=placement, recompute=recompute,
        )
        if switch_to_eval:
            model.eval()
            reference.eval()
        worst, loss_err = 0.0, 0.0
        # the example's shapes, then fewer samples, then (token inputs) a shorter sequence: each
        # new input signature sends message headers once more, in the order NCCL needs
        tokens = x.dim() == 2 and not x.is_floating_point()
        variants = [(x, y)] + ([(x[:6], y[:6])] if 6 >= m else []) + ([(x[:, :9], y[:, :9])] if tokens else [])
        held = pipe.held_tensor_ids()
        for vx, vy in variants:
            model.zero_grad()
            reference.zero_grad()
            loss = pipe.train_step(vx, vy, lm_loss)
            ref_loss = lm_loss(reference(vx), vy)
            ref_loss.backward()
            ref_grads = dict(reference.named_parameters())
            for pname, p in model.named_parameters():
                if id(p) in held:
                    worst = max(worst, rel(p.grad, ref_grads[pname].grad))
            loss_err = max(loss_err, rel(loss, ref_loss.detach()) if loss is not None else 0.0)
        local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        full_bytes = sum(p.numel() * p.element_size() for p in reference.parameters())
        stage_bytes = sum(p.numel() * p.element_size() for p in pipe.stage_modules.parameters())
        # the rank holds exactly its stages' weights (all of them, where every stage reads a tied weight)
        ok = worst < 1e-5 and loss_err < 1e-5 and local_bytes == stage_bytes
        if recompute != "auto":  # every stage recomputes as asked
            ok = ok and all(s.recompute == recompute for s in pipe.plan.stages)
        if placement == "branches":  # the branches really sit on both ranks
            ok = ok and {s.ranks[0] for s in pipe.plan.stages} == set(range(world))
        bad += not ok
        print(f"RESULT case={case} rank={dist.get_rank()} stages={[s.index for s in pipe.stages]} "
              f"grad_err={worst:.2e} loss_err={loss_err:.2e} param_bytes={local_bytes}/{full_bytes} ok={ok}",
              flush=True)
    return bad


def train(pipe, model, x, y, steps: int, optimizer) -> list[float]:  # type: ignore[no-untyped-def]
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = pipe.train_step(x, y, lm_loss)
        optimizer.step()
        if loss is not None:
            losses.append(float(loss))
    return losses


def checkpoint(directory: str) -> int:
    world = int(os.environ["WORLD_SIZE"])
    model, x, y = data("tiny_gpt")
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train(pipe, model, x, y, 3, opt)
    pipe.save_checkpoint(directory, opt)
    after = train(pipe, model, x, y, 3, opt)

    fresh, _, _ = data("tiny_gpt", seed=1)  # other weights: everything must come from the checkpoint
    pipe2 = partition(fresh, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="interleaved",
                      virtual_stages=2)
    opt2 = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    pipe2.load_checkpoint(directory, opt2)
    resumed = train(pipe2, fresh, x, y, 3, opt2)
    ok = all(abs(a - b) <= 1e-5 * abs(a) for a, b in zip(after, resumed)) and len(after) == len(resumed)
    if dist.get_rank() == 0:
        plain, _, _ = data("tiny_gpt", seed=2)
        plain.load_state_dict(consolidate(directory), strict=True)
    print(f"RESULT rank={dist.get_rank()} after={after} resumed={resumed} ok={ok}", flush=True)
    return 0 if ok else 1


def fault(kill_rank: int) -> int:
    from cost_model.analytic import AnalyticCostModel
    from cost_model.devices import DeviceSpec

    world = int(os.environ["WORLD_SIZE"])
    model, x, y = data("tiny_gpt")
    # a device of fixed speed: the same cuts on every run (profiled on a loaded machine, a stage could hold no
    # module to die in, and the rank meant to be killed finished its steps)
    fixed = DeviceSpec(name="fixed", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 34)
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b", timeout=30,
                     cost_model=AnalyticCostModel(measure=lambda d: fixed))
    calls = [0]

    def maybe_die(module, args):  # type: ignore[no-untyped-def]
        calls[0] += 1
        if dist.get_rank() == kill_rank and calls[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)

    for stage in pipe.stages:
        for sub in stage.module.modules():
            if sub is not stage.module and not list(sub.children()):
                sub.register_forward_pre_hook(maybe_die)
    for _ in range(5):
        pipe.train_step(x, y, lm_loss)
    return 0


def resume(directory: str, out: str) -> int:
    world = int(os.environ["WORLD_SIZE"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    model, x, y = data("tiny_gpt")
    pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b", timeout=30)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step_file = Path(directory) / "last_step"
    start = 0
    if step_file.exists():
        start = int(step_file.read_text())
        pipe.load_checkpoint(str(Path(directory) / f"step{start}"), opt)
    for step in range(start, 6):
        if attempt == 0 and step == 4 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        loss = pipe.train_step(x, y, lm_loss)
        opt.step()
        if loss is not None:
            with open(out, "a") as f:
                f.write(f"{attempt} {step} {float(loss)!r}\n")
        pipe.save_checkpoint(str(Path(directory) / f"step{step + 1}"), opt)
        dist.barrier()
        if dist.get_rank() == 0:
            step_file.write_text(str(step + 1))
        dist.barrier()
    return 0


def infeasible() -> int:
    from cost_model.analytic import AnalyticCostModel
    from cost_model.devices import DeviceSpec
    from partitioner.place.search.infeasible import InfeasibleError

    tiny = DeviceSpec(name="tiny", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=10_000)
    model, x, _ = data("tiny_gpt")
    try:
        partition(model, ["cpu"] * int(os.environ["WORLD_SIZE"]), example_inputs=(x,), micro_batches=4,
                  replicas="auto", cost_model=AnalyticCostModel(measure=lambda d: tiny), timeout=120)
    except (InfeasibleError, ValueError) as exc:
        first = str(exc).splitlines()[0]
        print(f"RESULT rank={dist.get_rank()} raised {type(exc).__name__}: {first} ok=True", flush=True)
        return 0
    print(f"RESULT rank={dist.get_rank()} planned a model that cannot fit ok=False", flush=True)
    return 1


def bad_devices(case: str) -> int:
    from partitioner.errors import PartitionError

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if case == "differ":
        devices = ["cpu"] * world if rank != 1 else ["cpu:0"] * world
    else:
        devices = ["cuda"] * world
    model, x, _ = data("tiny_gpt")
    try:
        partition(model, devices, example_inputs=(x,), micro_batches=2, timeout=60)
    except PartitionError as exc:
        print(f"RESULT rank={rank} raised {str(exc).splitlines()[0]} ok=True", flush=True)
        return 0
    print(f"RESULT rank={rank} accepted devices={devices} ok=False", flush=True)
    return 1


def whole_input() -> int:
    """An input given whole to every micro-batch (input_split_spec) under 1F1B: gradients equal the plain model's."""
    torch.manual_seed(0)
    model, (x, table), _ = zoo.mixed_io()
    x = torch.cat([x, x[:1]])
    table = torch.cat([table, table[:1]])  # as long as the batch, but one table: must not be split
    y = torch.randint(0, 5, (x.shape[0],))
    reference = copy.deepcopy(model)

    def loss_fn(out: dict[str, torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out["logits"], target)

    pipe = partition(model, ["cpu"] * int(os.environ["WORLD_SIZE"]), example_inputs=(x, table), micro_batches=4,
                     schedule="1f1b", input_split_spec={"table": None})
    pipe.train_step((x, table), y, loss_fn)
    loss_fn(reference(x, table), y).backward()
    held = pipe.held_tensor_ids()
    ref = dict(reference.named_parameters())
    mine = [(p.grad, ref[n].grad) for n, p in model.named_parameters() if id(p) in held]
    same_kind = all((a is None) == (b is None) for a, b in mine)  # a weight the loss does not reach has none
    worst = max((rel(a, b) for a, b in mine if a is not None and b is not None), default=0.0)
    ok = same_kind and worst < 1e-5 and any(a is not None for a, _ in mine) == any(b is not None for _, b in mine)
    print(f"RESULT case=whole_input rank={dist.get_rank()} grad_err={worst:.2e} ok={ok}", flush=True)
    return 0 if ok else 1


def main() -> int:
    mode, *rest = sys.argv[1:]
    if mode == "equivalence":
        code = equivalence(rest)
    elif mode == "whole_input":
        code = whole_input()
    elif mode == "checkpoint":
        code = checkpoint(rest[0])
    elif mode == "infeasible":
        code = infeasible()
    elif mode == "batch":
        code = serve(rest[0], {"equivalence": lambda *cases: equivalence(list(cases)), "checkpoint": checkpoint,
                               "infeasible": infeasible, "whole_input": whole_input}, int(os.environ["RANK"]))
    elif mode == "devices":
        return bad_devices(rest[0])  # no process group was started
    elif mode == "fault":
        code = fault(int(rest[0]))
    else:
        code = resume(rest[0], rest[1])
    dist.destroy_process_group()
    return code


if __name__ == "__main__":
    sys.exit(main())
