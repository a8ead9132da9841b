"""A stage's predicted memory per rank by kind (weights, master, gradients, optimizer, activations), read off the plan.

    with plan.precision (P = param_bytes / the compute dtype's bytes, d = replicas x context ranks (FSDP2's mesh
    holds both), mode = sharding, m micro-batches per replica; cost_model.training_memory's table):
        master, optimizer   P p (mixed) / d where sharded;  S s / d where sharded
        gradients           P g unsharded, or accumulated unsharded (the stage's gradient_sync "last", m > 1);
                            else P p / d (reduce-scattered every micro-batch, FULL_SHARD)
        weights             P c (P p unmixed); zero3: what the rest of memory_bytes leaves beside
                            activation_bytes (its gathered blocks, the transient gradients)
        activations         the rest: activations in flight and the messages held
    without (every state at the model's dtype, the planner's Adam: 2 states):
        weights, gradients  param_bytes each;  optimizer 2 x param_bytes;  master 0;  activations the rest

The kinds add up to `memory_bytes` (0 everywhere a plan has no prediction). Buffers (running
statistics, masks) count with the weights where the planner put them there.
"""

from __future__ import annotations

from cost_model.precision import Precision
from cost_model.training_memory import state_bytes
from rules.sharding import accumulates_unsharded
from runtime.plan import Plan, StagePlan

__all__ = ["KINDS", "memory_kinds"]

KINDS = ("weights", "master", "gradients", "optimizer", "activations")


def memory_kinds(plan: Plan, stage: StagePlan) -> dict[str, int]:
    """Bytes one rank of `stage` holds at its peak, by kind (module docstring); they sum to `memory_bytes`."""
    total = stage.memory_bytes
    if not total:
        return dict.fromkeys(KINDS, 0)
    if plan.precision is None:
        held = {"weights": stage.param_bytes, "master": 0, "gradients": stage.param_bytes,
                "optimizer": 2 * stage.param_bytes}
    else:
        precision = Precision.from_dict(plan.precision)
        params = stage.param_bytes / precision.itemsize("compute")
        per_replica = max(1, plan.pieces // stage.replicas)  # the micro-batches each replica runs (Plan.pieces)
        degree = stage.replicas * (stage.context if isinstance(stage.context, int) else 1)  # ranks sharding states
        weights, master, _, optimizer = state_bytes(params, precision, mode=stage.sharding, degree=degree,
                                                    micro_batches=per_replica, gradient_sync=stage.gradient_sync,
                                                    root=0.0, unit=0.0, second=0.0)
        if stage.sharding == "none" or accumulates_unsharded(stage.sharding, stage.gradient_sync, per_replica):
            gradients = params * precision.itemsize("grad")
        else:
            gradients = -(-params // degree) * precision.itemsize("param")
        if stage.sharding == "zero3":
            weights = max(0.0, total - master - gradients - optimizer - stage.activation_bytes)
        else:
            weights = params * (precision.itemsize("compute") if precision.mixed else precision.itemsize("param"))
        held = {"weights": int(weights), "master": int(master), "gradients": int(gradients),
                "optimizer": int(optimizer)}
    room = total - held["weights"] - held["master"] - held["gradients"]
    held["optimizer"] = max(0, min(held["optimizer"], room))  # a planner that counted fewer states (SGD)
    held["activations"] = max(0, total - sum(held.values()))
    return held
