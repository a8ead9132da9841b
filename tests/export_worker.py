"""Worker for tests/test_export.py under torchrun: a plan's exported actions run by torch's own pipelining runtime.

Modes:
  crosscheck DIR CASE...      per case ('schedule' for tiny_gpt, or 'model:schedule[:placement]'): train one step
                              with our runtime (partition) and with
                              torch's _PipelineScheduleRuntime loading the plan's exported CSV (DIR/...csv) over
                              PipelineStages built from our stage modules; losses and gradients against the
                              plain model. With PARTITIONER_NCCL_RULES=1 every point-to-point call torch makes
                              on the default group goes through runtime.nccl_rules.NcclRulesComm (`RulesP2P`).
  unsafe DIR                  the same 1F1B pipeline with rank 0 posting a gradient receive before its activation
                              send: it runs on plain gloo and must fail under RulesP2P (the wrapper is active).
  batch JOBS                  both, in one launch: the jobs of tests/batch.py (crosscheck DIR CASE, unsafe DIR)
Prints 'RESULT ... ok=True|False' lines; exits non-zero on a mismatch.
"""

from __future__ import annotations

import copy
import os
import sys
from contextlib import nullcontext
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cost_model.analytic import AnalyticCostModel  # noqa: E402
from cost_model.devices import DeviceSpec  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.export import pipeline_stages, schedule_runtime  # noqa: E402
from runtime.comm import P2P  # noqa: E402
from runtime.distributed import NCCL_RULES_ENV  # noqa: E402
from runtime.nccl_rules import NcclRulesComm  # noqa: E402
from tests.batch import serve  # noqa: E402
from tests.dist_worker import data, lm_loss  # noqa: E402
from tests.zoo import rel  # noqa: E402

# A described CPU: the same cuts on every machine and run (the cuts of tests/test_export.py's plans).
CPU = DeviceSpec(name="cpu", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 34, kind="cpu")


def described() -> AnalyticCostModel:
    return AnalyticCostModel(measure=lambda d: CPU)


class RulesP2P:
    """Within `with`, torch.distributed's point-to-point calls on the default group go through `comm` (NCCL's rules).

    torch's pipelining runtime calls `dist.isend`/`irecv` (a batch of one kind), `dist.batch_isend_irecv`
    (mixed batches) and `dist.send`/`recv` (its warm-up); each becomes one `comm.batch`, posted in the
    order torch posts it, as ProcessGroupNCCL would run it. Calls on other groups (NcclRulesComm's own)
    pass through. Both `torch.distributed` and `distributed_c10d` are patched, so `P2POp` accepts the
    wrapped functions. `routed` counts the calls that went through `comm`.
    """

    NAMES = ("isend", "irecv", "send", "recv", "batch_isend_irecv")

    def __init__(self, comm: NcclRulesComm) -> None:
        self.comm, self.routed = comm, 0
        self.original = {name: getattr(c10d, name) for name in self.NAMES}

    def _default(self, group: Any) -> bool:
        return group is None or group is dist.group.WORLD or group is c10d._get_default_group()

    def _post(self, kind: str, tensor: torch.Tensor, peer: int | None, group_peer: int | None) -> Any:
        self.routed += 1
        return self.comm.batch([P2P(kind, tensor, peer if peer is not None else int(group_peer or 0))])  # type: ignore[arg-type]

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        original = self.original

        def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                  group_dst: int | None = None) -> Any:
            if not self._default(group):
                return original["isend"](tensor, dst, group, tag, group_dst)
            return self._post("send", tensor, dst, group_dst)

        def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                  group_src: int | None = None) -> Any:
            if not self._default(group):
                return original["irecv"](tensor, src, group, tag, group_src)
            return self._post("recv", tensor, src, group_src)

        def send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
                 group_dst: int | None = None) -> None:
            if not self._default(group):
                return original["send"](tensor, dst, group, tag, group_dst)
            self._post("send", tensor, dst, group_dst).wait()

        def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
                 group_src: int | None = None) -> int:
            if not self._default(group):
                return original["recv"](tensor, src, group, tag, group_src)
            self._post("recv", tensor, src, group_src).wait()
            return int(src if src is not None else group_src or 0)

        def batch_isend_irecv(ops: list[Any]) -> list[Any]:
            if not ops or not self._default(ops[0].group):
                return original["batch_isend_irecv"](ops)
            self.routed += 1
            return [self.comm.batch([P2P("send" if op.op in (isend, original["isend"]) else "recv", op.tensor,
                                         op.peer) for op in ops])]

        return {"isend": isend, "irecv": irecv, "send": send, "recv": recv, "batch_isend_irecv": batch_isend_irecv}

    def __enter__(self) -> RulesP2P:
        for name, fn in self._wrappers().items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name, fn in self.original.items():
            setattr(c10d, name, fn)
            setattr(dist, name, fn)


def _torch_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter's gradient summed over the ranks holding a copy (torch's stages do not reduce tied weights)."""
    mine = {n: p.grad for n, p in model.named_parameters() if p.grad is not None and p.numel()}
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    total: dict[str, torch.Tensor] = {}
    for grads in gathered:
        for n, g in grads.items():
            total[n] = total[n] + g if n in total else g.clone()
    return total


def crosscheck(directory: str, cases: list[str]) -> int:
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    rules = os.environ.get(NCCL_RULES_ENV) == "1"
    bad = 0
    for case in cases:
        name, schedule, placement = (case.split(":") + ["pipeline"])[:3] if ":" in case else ("tiny_gpt", case,
                                                                                               "pipeline")
        model, x, y = data(name)
        reference, theirs = copy.deepcopy(model), copy.deepcopy(model)
        m = 4
        pipe = partition(model, ["cpu"] * world, example_inputs=(x,), micro_batches=m, schedule=schedule,
                         placement=placement, cost_model=described())
        ours = pipe.train_step(x, y, lm_loss)
        ref_loss = lm_loss(reference(x), y)
        ref_loss.backward()
        ref = dict(reference.named_parameters())
        held = pipe.held_tensor_ids()
        our_err = max(rel(p.grad, ref[n].grad) for n, p in model.named_parameters() if id(p) in held)

        stages = pipeline_stages(theirs, pipe.plan, (x,))
        csv = stages.schedule.write_csv(Path(directory) / f"{case.replace(':', '-')}.rank{rank}.csv")
        runtime = schedule_runtime(stages, lm_loss, csv=csv)
        losses: list[torch.Tensor] = []
        comm = NcclRulesComm(timeout_s=30.0) if rules else None
        wrapper = RulesP2P(comm) if comm is not None else None
        with wrapper if wrapper is not None else nullcontext():
            runtime.step(x, target=y, losses=losses)
        if comm is not None:
            comm.close()
        grads = _torch_grads(theirs)
        torch_err = max(rel(grads[n], p.grad) for n, p in ref.items())
        missing = [n for n in ref if n not in grads]
        loss_err = 0.0
        if losses:
            torch_loss = torch.stack([loss.detach() for loss in losses]).sum()
            loss_err = max(rel(torch_loss, ref_loss), rel(ours, ref_loss) if ours is not None else 0.0)
        routed = wrapper.routed if wrapper is not None else -1
        ok = our_err < 1e-5 and torch_err < 1e-5 and loss_err < 1e-5 and not missing and (not rules or routed > 0)
        bad += not ok
        print(f"RESULT case={case} rank={rank} actions={','.join(stages.schedule.actions[rank])} "
              f"our_grad_err={our_err:.2e} torch_grad_err={torch_err:.2e} loss_err={loss_err:.2e} "
              f"routed={routed} ok={ok}", flush=True)
    return bad


def unsafe(directory: str) -> int:
    """Rank 0 posts its receive of stage 1's gradient (mb 0) before sending mb 0's activations."""
    world, rank = int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"])
    model, x, y = data("tiny_gpt")
    pipe = partition(copy.deepcopy(model), ["cpu"] * world, example_inputs=(x,), micro_batches=4, schedule="1f1b",
                     cost_model=described())
    results = {}
    for rules in (False, True):
        stages = pipeline_stages(copy.deepcopy(model), pipe.plan, (x,))
        csv = stages.schedule.write_csv(Path(directory) / f"unsafe.rank{rank}.csv")
        runtime = schedule_runtime(stages, lm_loss, csv=csv)
        order = runtime.pipeline_order_with_comms[0]
        names = [str(a) for a in order]
        moved = order.pop(names.index("0RECV_B0"))
        order.insert(names.index("0SEND_F0"), moved)
        comm = NcclRulesComm(timeout_s=5.0) if rules else None
        try:
            with RulesP2P(comm) if comm is not None else nullcontext():
                runtime.step(x, target=y, losses=[])
            results[rules] = "ran"
        except Exception as exc:  # noqa: BLE001 - the expected failure is reported, not raised
            results[rules] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
        if comm is not None:
            comm.close()
    ok = results[False] == "ran" and results[True].startswith("NcclRuleError")
    print(f"RESULT mode=unsafe rank={rank} gloo={results[False]!r} rules={results[True]!r} ok={ok}", flush=True)
    return 0 if ok else 1


def main() -> int:
    mode, *args = sys.argv[1:]
    torch.set_num_threads(1)
    try:
        if mode == "crosscheck":
            return 1 if crosscheck(args[0], args[1:]) else 0
        if mode == "unsafe":
            return unsafe(args[0])
        if mode == "batch":
            return serve(args[0], {"crosscheck": lambda d, *cases: crosscheck(d, list(cases)), "unsafe": unsafe},
                         int(os.environ["RANK"]))
        raise SystemExit(f"unknown mode {mode!r}")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
