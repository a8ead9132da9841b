"""Branch placement measured: an Inception-style net on 2 gloo ranks vs one process, beside the simulator.

Each rank runs one thread. (a) rank 0 trains the model alone; (b) partition(...,
placement="branches") puts each block's parallel branches on both ranks. Prints the
measured step time of each next to the simulator's prediction for that plan, then the
measured and predicted speedups.
Usage: torchrun --standalone --nproc_per_node=2 benchmarks/branches.py [--steps 5]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
from models import InceptionNet  # noqa: E402
from rank_timing import timed  # noqa: E402

from cost_model import default_cost_model  # noqa: E402
from partitioner import partition  # noqa: E402
from partitioner.capture.graph import build_graph, compute_nodes  # noqa: E402
from partitioner.capture.trace import trace  # noqa: E402
from partitioner.place.chain import plan_pipeline  # noqa: E402
from runtime.plan import Plan  # noqa: E402


def predicted_ms(model: nn.Module, x: torch.Tensor, plan: Plan | None = None) -> float:
    """The predicted step of `plan` (its simulated programs), or of the whole model on one device when plan is None."""
    if plan is not None:
        return plan.predicted_step_ms
    traced = trace(model, (x,))
    flat = traced.flatten_inputs((x,), {})
    cost = default_cost_model()
    cost.prepare(traced.graph_module, flat)  # type: ignore[attr-defined]
    order = [n.name for n in compute_nodes(traced.graph_module)]
    plan = plan_pipeline(build_graph(traced.graph_module, flat), order, [torch.device("cpu")], cost, 1)
    return plan.predicted_step_ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--micro-batches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = InceptionNet()
    x = torch.randn(args.batch, 3, 32, 32)
    y = torch.randint(0, 10, (args.batch,))

    single = copy.deepcopy(base)

    def single_step() -> None:
        if rank == 0:
            F.cross_entropy(single(x), y).backward()

    t_single = timed(single_step, args.steps, warmup=1)

    model = copy.deepcopy(base)
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=args.micro_batches, placement="branches")

    def branch_step() -> None:
        pipe.train_step(x, y, F.cross_entropy)

    t_branch = timed(branch_step, args.steps, warmup=1)
    if rank == 0:
        p_single = predicted_ms(base, x)
        p_branch = predicted_ms(base, x, pipe.plan)
        used = sorted({s.ranks[0] for s in pipe.plan.stages})
        print(f"Inception-style net, 3 blocks x 4 branches, batch {args.batch}, 1 thread per process; "
              f"branch plan: {len(pipe.plan.stages)} stages on ranks {used}, {args.micro_batches} micro-batches")
        print(f"{'run':<32} {'measured ms/step':>16} {'predicted ms/step':>18}")
        print(f"{'one process':<32} {t_single * 1e3:>16.1f} {p_single:>18.1f}")
        print(f"{'branches on 2 ranks':<32} {t_branch * 1e3:>16.1f} {p_branch:>18.1f}")
        print(f"branch speedup: measured {t_single / t_branch:.2f}, predicted {p_single / p_branch:.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
