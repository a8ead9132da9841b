"""One torchrun job of benchmarks/fidelity.py: plan a config, trace some steps, time others, write JSON.

Rank 0 writes {"plan": Plan.to_json(), "traced": [one gathered trace per traced step],
"traced_ms": [wall ms of each traced step], "measured_ms": [wall ms of each untraced step]}.
Each step is bracketed by barriers, so its wall time covers every rank (optimizer step included);
traced and untraced steps alternate (one traced, three untraced, thirty rounds).
Usage (by fidelity.py): torchrun --standalone --nproc_per_node=N benchmarks/fidelity_worker.py CONFIG OUT.json [ROUNDS]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from examples.models import GPT, GPTConfig, InceptionNet  # noqa: E402
from partitioner import partition  # noqa: E402
from runtime.distributed import DistributedPipeline  # noqa: E402

# name -> (model, schedule, placement, replicas, ranks)
CONFIGS: dict[str, tuple[str, str, str, list[int] | None, int]] = {
    "gpt gpipe": ("gpt", "gpipe", "pipeline", None, 2),
    "gpt 1f1b": ("gpt", "1f1b", "pipeline", None, 2),
    "gpt interleaved": ("gpt", "interleaved", "pipeline", None, 2),
    "gpt replicas [2,1]": ("gpt", "1f1b", "pipeline", [2, 1], 3),
    "inception gpipe": ("inception", "gpipe", "pipeline", None, 2),
    "inception 1f1b": ("inception", "1f1b", "pipeline", None, 2),
    "inception branches": ("inception", "gpipe", "branches", None, 2),
    "inception replicas [2,1]": ("inception", "gpipe", "pipeline", [2, 1], 3),
}
MICRO_BATCHES = 4
WARMUP, ROUNDS, MEASURED_PER_ROUND = 3, 30, 3  # 30 traced steps, 90 untraced: single steps vary by +-25% here


def _data(kind: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor, Any]:
    torch.manual_seed(0)
    if kind == "gpt":
        cfg = GPTConfig(vocab=2000, width=128, heads=4, layers=4, seq=32)
        x = torch.randint(0, cfg.vocab, (16, cfg.seq))
        return GPT(cfg), x, torch.randint(0, cfg.vocab, (16, cfg.seq)), \
            lambda out, y: F.cross_entropy(out.flatten(0, 1), y.flatten())
    x = torch.randn(16, 3, 16, 16)
    return InceptionNet(c=32), x, torch.randint(0, 10, (16,)), F.cross_entropy


def main() -> None:
    name, out = sys.argv[1], sys.argv[2]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else ROUNDS
    kind, schedule, placement, replicas, _ = CONFIGS[name]
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, x, y, loss_fn = _data(kind)
    # Priced by the base model (a calibration path not yet written: the machine's saved one is not used) and no
    # refit after the first steps: "before" is the uncalibrated prediction.
    pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), micro_batches=MICRO_BATCHES,
                     schedule=schedule, placement=placement, replicas=replicas,  # type: ignore[arg-type]
                     calibrate=0, calibration=str(Path(out).with_suffix(".unused-calibration.json")))
    if not isinstance(pipe, DistributedPipeline):
        raise TypeError(f"partition() under torchrun gave a {type(pipe).__name__}; run this file with torchrun")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.numel()], lr=1e-3)

    def timed_step() -> float:
        dist.barrier()
        start = time.perf_counter()
        optimizer.zero_grad()
        pipe.train_step(x, y, loss_fn)
        optimizer.step()
        dist.barrier()
        return (time.perf_counter() - start) * 1e3

    for _ in range(WARMUP):
        timed_step()
    traced, traced_ms, measured = [], [], []
    for _ in range(rounds):  # interleaved, so traced and untraced steps see the same load on a shared machine
        pipe.clear_trace()  # one step's events per gathered trace
        pipe.tracing = True
        traced_ms.append(timed_step())
        pipe.tracing = False
        traced.append(pipe.gather_trace())
        measured += [timed_step() for _ in range(MEASURED_PER_ROUND)]
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"config": name, "plan": pipe.plan.to_json(), "traced": traced,
                                         "traced_ms": traced_ms, "measured_ms": measured}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
