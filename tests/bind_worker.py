"""Worker for tests/test_bind.py: a plan made on a described cluster from a model on meta, run with real weights.

    python -m torch.distributed.run --nproc_per_node=4 tests/bind_worker.py CASE [CASE ...]

A CASE is FAMILY[:AXIS[:WEIGHTS]]: a Hugging Face family of tests/zoo.py (default config, sizes shrunk, dropout
off), the axis forced on the search ("tensor2": tensor=2, "zero3": sharding="zero3"; "" or none: the search's own
choice), and how the run gets its weights: "real" (default: the model built with them, as the plain one) or "meta"
(built on meta again, `weights=` the plain model's state dict). Rank 0 plans it as README's flow does
(`plan(model_on_meta, cluster="1x4xH100", replicas="auto", ...)`) and sends the plan as JSON; every rank runs
`partition(model, ["cpu"] * 4, plan=...)`, so a plan traced on meta binds to a trace with real weights
(partitioner.make.bind: Falcon and GPT-J name some nodes otherwise there). One step's loss and every gradient this
rank holds, and the weights after one Adam step, are compared with the plain model's. Prints 'RESULT ... ok=...'
per case and rank.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from partitioner import partition, plan  # noqa: E402
from partitioner.meta import empty_weights  # noqa: E402
from runtime.plan import Plan  # noqa: E402
from tests import zoo  # noqa: E402
from tests.split_worker import adam, full  # noqa: E402

BATCH, SEQ = 8, 8
AXES: dict[str, dict[str, Any]] = {"": {}, "tensor2": {"tensor": 2}, "zero3": {"sharding": "zero3"}}


def build(family: str) -> nn.Module:
    case = zoo.hf_case(family)
    for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop", "attention_dropout", "hidden_dropout", "dropout",
                "attention_probs_dropout_prob", "hidden_dropout_prob", "activation_dropout"):
        if isinstance(getattr(case.config, key, None), float):
            setattr(case.config, key, 0.0)
    case.config.use_cache = False
    return case.cls(case.config)


def loss_fn(out: Any, y: torch.Tensor) -> torch.Tensor:
    logits = getattr(out, "logits", out)
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def check(case: str) -> bool:
    family, axis, source = [*case.split(":"), "", ""][:3]
    torch.manual_seed(0)
    reference = build(family)
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    x = torch.randint(0, 128, (BATCH, SEQ))
    y = torch.randint(0, 128, (BATCH, SEQ))
    made: list[Any] = [None]
    if dist.get_rank() == 0:
        with empty_weights():
            meta = build(family)
        made[0] = plan(meta, cluster="1x4xH100", example_inputs=(x,), micro_batches=2, replicas="auto",
                       precision="fp32", **AXES[axis]).to_json()
    dist.broadcast_object_list(made, src=0)
    planned = Plan.from_json(made[0])
    if source == "meta":
        with empty_weights():
            model = build(family)
        pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), plan=planned, weights=weights)
    else:
        torch.manual_seed(0)
        model = build(family)  # the plain model's weights (same seed)
        pipe = partition(model, ["cpu"] * dist.get_world_size(), example_inputs=(x,), plan=planned)
    held = {n: q for n, q in model.named_parameters() if id(q) in pipe.held_tensor_ids()}
    opt, ref_opt = adam(held.values()), adam(reference.parameters())
    loss = pipe.train_step(x, y, loss_fn)
    ref_loss = loss_fn(reference(x), y)
    ref_loss.backward()
    ref = dict(reference.named_parameters())
    worst = {"loss": zoo.rel(loss, ref_loss.detach()) if loss is not None else 0.0, "grad": 0.0, "weight": 0.0}
    for n, q in held.items():
        if q.grad is not None or ref[n].grad is not None:
            worst["grad"] = max(worst["grad"], zoo.rel(full(q.grad), ref[n].grad))
    opt.step()
    ref_opt.step()
    for n, q in held.items():
        worst["weight"] = max(worst["weight"], zoo.rel(full(q.detach()), ref[n].detach()))
    shape = [(s.ranks, s.tensor, s.sharding) for s in pipe.plan.stages]
    ok = bool(held) and all(v < 1e-4 for v in worst.values())
    renamed = sum(1 for name, _ in planned.node_keys if name not in {k for k, _ in pipe.plan.node_keys})
    print(f"RESULT case={case} rank={dist.get_rank()} stages={shape} renamed={renamed} "
          + " ".join(f"{k}={v:.1e}" for k, v in worst.items()) + f" ok={ok}", flush=True)
    return ok


def main(argv: list[str]) -> int:
    dist.init_process_group("gloo")
    try:
        return 0 if all([check(c) for c in argv]) else 1  # noqa: C419 - every case runs
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
