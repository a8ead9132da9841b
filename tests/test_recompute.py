"""Activation recomputation (runtime.recompute, cost_model.recompute_cost): the plain model's results, dropout
and BatchNorm included, in one process with threads on and off; less kept, as predicted; "auto" under a cap."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import pipe_split

from cost_model.analytic import AnalyticCostModel
from cost_model.devices import DeviceSpec
from cost_model.recompute_cost import recompute_costs
from partitioner import PartitionError, partition, plan
from runtime.recompute import kept_bytes
from tests import zoo
from tests.zoo import rel

MODES = ["selective", "full"]
SETTINGS = [(schedule, threads) for schedule in ("gpipe", "1f1b") for threads in (False, True)]



def assert_same_grads(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert rel(p.grad, q.grad) < 1e-5, name  # type: ignore[arg-type]


def cost(memory_bytes: int = 1 << 34) -> AnalyticCostModel:
    spec = DeviceSpec(name="test", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=memory_bytes)
    return AnalyticCostModel(measure=lambda d: spec)


class DropBlock(nn.Module):
    """A transformer block with dropout on the attention probabilities and both residual branches."""

    def __init__(self, width: int = 16, heads: int = 2, p: float = 0.2) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = (h.view(b, t, self.heads, c // self.heads).transpose(1, 2)
                   for h in self.qkv(self.ln1(x)).split(c, dim=2))
        att = self.drop((q @ k.transpose(-2, -1) / math.sqrt(c // self.heads)).softmax(dim=-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


def drop_net() -> nn.Module:
    return nn.Sequential(*[DropBlock() for _ in range(3)], nn.Linear(16, 5)).train()


def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).mean()


@pytest.mark.parametrize("schedule,threads", SETTINGS)
@pytest.mark.parametrize("mode", MODES)
def test_dropout_masks_replay_and_results_equal_the_plain_model(mode: str, schedule: str, threads: bool) -> None:
    # One micro-batch: the pipeline draws the plain model's random numbers in its order (see test_semantics)
    torch.manual_seed(0)
    model = drop_net()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 6, 16), torch.randn(4, 6, 5)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), schedule=schedule, threads=threads,  # type: ignore[arg-type]
                     cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
    assert [s.recompute for s in pipe.plan.stages] == [mode] * 3
    torch.manual_seed(1)
    loss = pipe.train_step(x, y, mse)
    torch.manual_seed(1)
    ref_loss = mse(reference(x), y)
    ref_loss.backward()
    assert rel(loss, ref_loss) < 1e-5
    assert_same_grads(model, reference)
    model.zero_grad()
    reference.zero_grad()
    torch.manual_seed(2)  # the plain call: the caller's backward recomputes
    out = pipe(x)
    mse(out, y).backward()
    torch.manual_seed(2)
    ref_out = reference(x)
    mse(ref_out, y).backward()
    assert rel(out, ref_out) < 1e-5
    assert_same_grads(model, reference)
    with torch.no_grad():  # forward only: nothing to recompute, the eval graph is exact
        pipe.eval()
        reference.eval()
        assert rel(pipe(x), reference(x)) < 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uneven_micro_batches_with_dropout_equal_the_pipeline_without_recomputation(schedule: str) -> None:
    torch.manual_seed(0)
    model = drop_net()
    plain_model = copy.deepcopy(model)
    x, y = torch.randn(7, 6, 16), torch.randn(7, 6, 5)
    kwargs: dict[str, Any] = {"schedule": schedule, "micro_batches": 3, "threads": False, "cost_model": cost()}
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), recompute=["full", "none", "selective"], **kwargs)
    plain = partition(plain_model, ["cpu"] * 3, example_inputs=(x,), **kwargs)
    assert [s.nodes for s in pipe.plan.stages] == [s.nodes for s in plain.plan.stages]
    for seed in (1, 2):
        torch.manual_seed(seed)
        loss = pipe.train_step(x, y, mse)
        torch.manual_seed(seed)
        assert rel(loss, plain.train_step(x, y, mse)) < 1e-5
    assert_same_grads(model, plain_model)


LOG: list[torch.Tensor] = []


@torch.fx.wrap
def noise(h: torch.Tensor) -> torch.Tensor:
    """Multiplicative noise that logs every draw: a forward's and its recomputation's must be the same."""
    r = torch.rand_like(h)
    LOG.append(r.detach().clone())
    return h * r


class Noisy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(128, 128) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = noise(torch.tanh(layer(x)))
        return x


@pytest.mark.parametrize("mode", MODES)
def test_worker_threads_recompute_the_random_numbers_their_forward_drew(mode: str) -> None:
    # Workers share the CPU generator: without runtime.recompute.RNG_LOCK most recomputed draws differ.
    torch.manual_seed(0)
    model, x = Noisy(), torch.randn(32, 128)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=8, schedule="1f1b", threads=True,
                     cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
    for _ in range(3):
        LOG.clear()
        pipe.train_step(x, torch.zeros_like(x), mse)
        assert len(LOG) == 2 * 6 * 8  # every draw twice: in the forward and in its recomputation
        unpaired = list(LOG)
        while unpaired:
            first = unpaired.pop()
            twin = next((k for k, t in enumerate(unpaired) if torch.equal(t, first)), None)
            assert twin is not None, "a recomputation drew other random numbers than its forward"
            unpaired.pop(twin)


@pytest.mark.parametrize("schedule,threads", SETTINGS)
@pytest.mark.parametrize("mode", MODES)
def test_tiny_gpt_equals_the_plain_model(mode: str, schedule: str, threads: bool) -> None:
    # Tokens in: the first stage has no input needing a gradient; full recomputation still runs.
    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    reference = copy.deepcopy(model)
    y = torch.randn(x.shape[0], x.shape[1], 50)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=3, schedule=schedule,  # type: ignore[arg-type]
                     threads=threads, cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
    loss = pipe.train_step(x, y, mse)
    ref_loss = mse(reference(x), y)
    ref_loss.backward()
    assert rel(loss, ref_loss) < 1e-5
    assert_same_grads(model, reference)


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_batchnorm_statistics_update_once_per_step(mode: str, threads: bool) -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.rescnn()
    reference = copy.deepcopy(model)
    y = torch.randn(x.shape[0], 5)
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), schedule="1f1b", threads=threads, cost_model=cost(),
                     recompute=mode)  # type: ignore[arg-type]

    def assert_same_buffers() -> None:
        for name, buffer in reference.named_buffers():
            assert rel(dict(model.named_buffers())[name].float(), buffer.float()) < 1e-6, name

    pipe.train_step(x, y, mse)  # one micro-batch: exactly plain BatchNorm
    mse(reference(x), y).backward()
    assert_same_grads(model, reference)
    assert_same_buffers()
    model.zero_grad()
    reference.zero_grad()
    mse(pipe(x), y).backward()  # the caller's backward recomputes after the step: no second update either
    mse(reference(x), y).backward()
    assert_same_grads(model, reference)
    assert_same_buffers()
    assert int(model.stem[1].num_batches_tracked) == 2


def test_batchnorm_statistics_over_micro_batches_equal_the_pipeline_without_recomputation() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.rescnn()
    plain_model = copy.deepcopy(model)
    y = torch.randn(x.shape[0], 5)
    kwargs: dict[str, Any] = {"micro_batches": 4, "schedule": "1f1b", "cost_model": cost()}
    partition(model, ["cpu"] * 2, example_inputs=(x,), recompute="full", **kwargs).train_step(x, y, mse)
    partition(plain_model, ["cpu"] * 2, example_inputs=(x,), **kwargs).train_step(x, y, mse)
    for name, buffer in plain_model.state_dict().items():
        assert rel(model.state_dict()[name].float(), buffer.float()) < 1e-5, name
    assert_same_grads(model, plain_model)


class WritesInputs(nn.Module):
    """Stage 0 writes into the caller's input; the cut before `h.add_(1)` makes stage 1 write into what it receives."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        h = self.b(torch.tanh(self.a(x)))
        pipe_split()
        h.add_(1)
        return self.c(torch.tanh(h)) + x


@pytest.mark.parametrize("threads", [False, True])
@pytest.mark.parametrize("m", [1, 2])
def test_in_place_writes_recompute_from_the_values_before_the_write(m: int, threads: bool) -> None:
    torch.manual_seed(0)
    model = WritesInputs()
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 8), torch.randn(6, 8)
    x_ref = x.clone()
    pipe = partition(model, ["cpu"] * 2, example_inputs=(x.clone(),), micro_batches=m, schedule="1f1b",
                     threads=threads, cost_model=cost(), recompute="full")
    assert [bool(s.writes) for s in pipe.stages] == [True, True]
    pipe.train_step(x, y, mse)
    mse(reference(x_ref), y).backward()
    assert_same_grads(model, reference)
    assert torch.equal(x, x_ref)  # the caller's tensor written as the plain model writes it


def test_selective_refuses_a_write_into_a_kept_matmul_output() -> None:
    model, _, _ = zoo.in_place()  # h = layers[0](x); h.mul_(2): selective would keep h, then see it written
    x = torch.randn(256, 8)  # activations outweigh the weights
    with pytest.raises(PartitionError, match="recompute='full'"):
        plan(model, ["cpu"], example_inputs=(x,), cost_model=cost(), recompute="selective")
    # GPipe holds 4 micro-batches: full recomputation keeps none of them (the backward rebuilds one at a time)
    args: dict[str, Any] = {"example_inputs": (x,), "micro_batches": 4, "schedule": "gpipe"}
    none, full = (plan(model, ["cpu"], cost_model=cost(), recompute=m, **args).stages[0] for m in ("none", "full"))
    assert full.memory_bytes < none.memory_bytes
    tight = plan(model, ["cpu"], cost_model=cost(full.memory_bytes), recompute="auto", **args)
    assert tight.stages[0].recompute == "full"  # auto skips selective there


def stage_inputs(pipe: Any, x: torch.Tensor) -> list[list[Any]]:
    """Each stage's inputs on `x` (leaves that need gradients, as the runtime passes them)."""
    seen: list[list[Any]] = [[] for _ in pipe.stages]
    hooks = [s.module.register_forward_pre_hook(lambda m, args, k=k: seen[k].extend(args))
             for k, s in enumerate(pipe.stages)]
    with torch.no_grad():
        pipe(x)
    for h in hooks:
        h.remove()
    return [[t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t for t in ins]
            for ins in seen]


def predicted_kept(model: nn.Module, x: torch.Tensor, stages: int, mode: str) -> list[int]:
    """Each stage's predicted bytes kept per micro-batch, received inputs included (as kept_bytes measures them),
    from plans alone: GPipe on x (one micro-batch) and on x twice (two alike) differ by one micro-batch in flight."""
    one, two = (plan(model, ["cpu"] * stages, example_inputs=(batch,), micro_batches=m, schedule="gpipe",
                     cost_model=cost(), recompute=mode).stages  # type: ignore[arg-type]
                for batch, m in ((x, 1), (torch.cat([x, x]), 2)))
    assert [s.nodes for s in one] == [s.nodes for s in two]
    return [b.activation_bytes - a.activation_bytes for a, b in zip(one, two)]


def test_kept_bytes_fall_with_the_mode_and_match_the_prediction() -> None:
    torch.manual_seed(0)
    model = zoo.TinyGPT(vocab=64, width=64, heads=4, layers=2, seq=16)
    x = torch.randint(0, 64, (4, 16))
    measured: dict[str, list[int]] = {}
    for mode in ("none", "selective", "full"):
        pipe = partition(model, ["cpu"] * 2, example_inputs=(x,), cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
        inputs = stage_inputs(pipe, x)
        tokens = [[t for t in ins if isinstance(t, torch.Tensor) and not t.is_floating_point()] for ins in inputs]
        batch = [sum(t.numel() * t.element_size() for t in ts) for ts in tokens]
        # kept_bytes counts the token batch a stage reads, which the step holds in every mode and plans leave out
        measured[mode] = [kept_bytes(s.module, *ins) - b for s, ins, b in zip(pipe.stages, inputs, batch)]
        predicted = predicted_kept(model, x, 2, mode)
        for m, p in zip(measured[mode], predicted):
            assert abs(p - m) <= 0.25 * m, (mode, predicted, measured[mode])
    for s in range(2):
        assert measured["none"][s] > measured["selective"][s] > measured["full"][s]


def test_kept_bytes_of_a_block_per_mode() -> None:
    # The module docstring's table on one block: 64 wide, 4 heads, 4 x 16 tokens (16 KiB per activation)
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    model = nn.Sequential(zoo.Block(64, 4, 16))
    kept = {}
    for mode in ("none", "selective", "full"):
        pipe = partition(copy.deepcopy(model), ["cpu"], example_inputs=(x,), cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
        kept[mode] = kept_bytes(pipe.stages[0].module, x.clone().requires_grad_())
        predicted = predicted_kept(model, x, 1, mode)[0]
        assert kept[mode] - 16384 == predicted or mode == "none", (mode, predicted)  # x is the batch
    # none: x, ln1, qkv (q k v copies), mask, softmax, attention out, residual, ln2, fc, gelu (+ norms' stats)
    assert kept == {"none": 279808, "selective": 196608, "full": 16384}


def test_recompute_costs_of_a_hand_made_stage() -> None:
    def node(name: str, kind: str, out: int, inputs: list[tuple[str, int]], flops: int = 0) -> dict[str, Any]:
        return {"name": name, "op": "call_module", "kind": kind, "target": name, "out_bytes": out,
                "shapes": [[4, out // 16]], "dtypes": ["float32"], "flops": flops, "inputs": inputs,
                "forward_s": 1e-3 if flops else 1e-4}

    stage = [
        node("fc", "Linear", 400, [("x", 100), ("w", 1000)], flops=10),  # keeps x (received: not counted)
        node("act", "GELU", 400, [("fc", 400)]),  # keeps fc
        node("out", "Linear", 100, [("act", 400)], flops=10),  # keeps act
        node("drop", "Dropout", 100, [("out", 100)]),  # keeps a mask (float on CPU)
    ]
    costs = recompute_costs(stage)
    assert costs["none"].kept_bytes == 400 + 400 + 100
    # backward of `out` (the worst moment): fc and act alive, the gradients of out (100) and of act (400)
    assert costs["none"].peak_bytes == 400 + 400 + 100 + 400
    # products kept; GELU, dropout run again; the recomputation rebuilds fc, act and the mask: the same peak
    assert costs["selective"] == type(costs["none"])(400 + 100, 2e-4, 1300)
    assert costs["full"] == type(costs["none"])(0, 2.2e-3, 1300)
    assert recompute_costs(stage, "cuda")["none"].kept_bytes == 400 + 400 + 25  # a byte per mask element


def test_recomputation_is_priced_into_backward() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    plans = {mode: plan(model, ["cpu"] * 2, example_inputs=(x,), micro_batches=2, cost_model=cost(), recompute=mode)  # type: ignore[arg-type]
             for mode in ("none", "selective", "full")}
    none, selective, full = (plans[m].stages for m in ("none", "selective", "full"))
    for a, b, c in zip(none, selective, full):
        assert c.backward_ms == pytest.approx(a.backward_ms + a.forward_ms)  # full: the whole forward again
        assert a.backward_ms < b.backward_ms < c.backward_ms
        assert a.activation_bytes > b.activation_bytes > c.activation_bytes
        assert c.memory_bytes - a.memory_bytes == c.activation_bytes - a.activation_bytes
    assert plans["none"].predicted_step_ms < plans["full"].predicted_step_ms


def test_auto_recomputes_under_a_tight_capacity_only() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.tiny_gpt()
    args: dict[str, Any] = {"example_inputs": (x,), "micro_batches": 4, "schedule": "gpipe"}
    stages = {mode: plan(model, ["cpu"] * 2, cost_model=cost(), recompute=mode, **args).stages  # type: ignore[arg-type]
              for mode in ("none", "full")}
    # two stages share the device: each may fill half; half fits every stage only when it recomputes
    tight = 2 * max(s.memory_bytes for s in stages["full"])
    assert tight < 2 * min(s.memory_bytes for s in stages["none"])
    chosen = plan(model, ["cpu"] * 2, cost_model=cost(tight), recompute="auto", **args)
    assert all(s.recompute != "none" and s.memory_bytes <= tight // 2 for s in chosen.stages), chosen.summary()
    loose = plan(model, ["cpu"] * 2, cost_model=cost(1 << 34), recompute="auto", **args)
    assert [s.recompute for s in loose.stages] == ["none", "none"]
    assert "recompute" in chosen.summary().splitlines()[-1] and "recompute" not in loose.summary()


def test_bad_recompute_arguments_are_named() -> None:
    model, (x,), _ = zoo.mlp()
    with pytest.raises(PartitionError, match="'none', 'selective', 'full', 'auto'"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), recompute="sometimes")  # type: ignore[arg-type]
    with pytest.raises(PartitionError, match="3 modes for a plan of 2 stages"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), cost_model=cost(), recompute=["full"] * 3)
    made = plan(model, ["cpu"] * 2, example_inputs=(x,), cost_model=cost(), recompute="full")
    with pytest.raises(PartitionError, match=r"plan.stages\[s\].recompute"):
        partition(model, ["cpu"] * 2, example_inputs=(x,), plan=made, recompute="full")
    assert next(model.parameters()).device.type == "cpu"
