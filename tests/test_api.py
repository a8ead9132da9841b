"""partition() end to end: outputs and gradients equal the un-partitioned model's; bad input fails cleanly."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.utils._pytree as pytree
from torch import nn

from partitioner import PartitionError, TraceError, partition
from tests import zoo


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach() - b.detach()).norm() / b.detach().norm().clamp_min(1e-12))


def weighted_loss(out: Any, weights: list[torch.Tensor]) -> torch.Tensor:
    leaves = [x for x in pytree.tree_leaves(out) if isinstance(x, torch.Tensor) and x.is_floating_point()]
    return sum((leaf * w).sum() for leaf, w in zip(leaves, weights))


def run_and_compare(
    name: str, stages: int, micro_batches: int, train: bool = True, threads: bool | None = None,
    placement: str = "pipeline",
) -> None:
    if name == "hf_gpt2":
        pytest.importorskip("transformers")  # installed by the test extra
    torch.manual_seed(0)
    model, args, kwargs = zoo.ZOO[name]()
    model.train(train)
    reference = copy.deepcopy(model)
    params_before = {id(p) for p in model.parameters()}

    pipe = partition(
        model, ["cpu"] * stages, example_inputs=args, example_kwargs=kwargs,
        micro_batches=micro_batches, threads=threads, placement=placement,
    )
    assert len(pipe.plan.stages) == stages or placement != "pipeline"
    assert {id(p) for p in pipe.parameters()} == params_before

    out = pipe(*args, **kwargs)
    ref = reference(*args, **kwargs)
    zoo.assert_same_outputs(out, ref)

    weights = [
        torch.randn_like(x) for x in pytree.tree_leaves(ref) if isinstance(x, torch.Tensor) and x.is_floating_point()
    ]
    weighted_loss(out, weights).backward()
    weighted_loss(ref, weights).backward()
    ref_params = dict(reference.named_parameters())
    for pname, p in model.named_parameters():
        assert p.grad is not None, pname
        assert rel_err(p.grad, ref_params[pname].grad) < 1e-5, pname
    assert pipe.state_dict().keys() == reference.state_dict().keys()


MODELS_WITHOUT_BN = ["mlp", "tiny_gpt", "inception", "keyword_dict", "hf_gpt2"]


@pytest.mark.parametrize("micro_batches", [1, 3, 4])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("name", MODELS_WITHOUT_BN)
def test_equivalence(name: str, stages: int, micro_batches: int) -> None:
    run_and_compare(name, stages, micro_batches)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
@pytest.mark.parametrize("micro_batches", [1, 3, 4])
def test_batchnorm_eval_mode(stages: int, micro_batches: int) -> None:
    run_and_compare("rescnn", stages, micro_batches, train=False)


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_batchnorm_train_one_micro_batch_is_exact(stages: int) -> None:
    run_and_compare("rescnn", stages, 1, train=True)


@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("micro_batches", [3, 4])
def test_batchnorm_train_deferred_statistics(stages: int, micro_batches: int) -> None:
    """Train mode, several micro-batches: each is normalized by its own statistics (as the
    plain model run on each micro-batch); each BatchNorm's running statistics equal one
    full-batch update over all the inputs it saw in the step."""
    torch.manual_seed(0)
    model, (x,), _ = zoo.rescnn()
    per_chunk, full_batch = copy.deepcopy(model), copy.deepcopy(model)
    bn_names = [n for n, m in per_chunk.named_modules() if isinstance(m, nn.BatchNorm2d)]
    stat_refs = {n: copy.deepcopy(per_chunk.get_submodule(n)) for n in bn_names}
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in bn_names}
    for n in bn_names:
        per_chunk.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: seen[n].append(a[0].detach()))
    pipe = partition(model, ["cpu"] * stages, example_inputs=(x,), micro_batches=micro_batches)

    for _ in range(2):  # twice, so the momentum update compounds
        out = pipe(x)
        ref = torch.cat([per_chunk(c) for c in torch.tensor_split(x, micro_batches)])
        for n in bn_names:
            stat_refs[n](torch.cat(seen[n]))  # one full-batch update from everything it saw
            seen[n].clear()
        full_batch(x)
    assert rel_err(out, ref) < 1e-5
    w = torch.randn_like(ref)
    (out * w).sum().backward()
    (ref * w).sum().backward()
    ref_params = dict(per_chunk.named_parameters())
    for pname, p in model.named_parameters():
        assert rel_err(p.grad, ref_params[pname].grad) < 1e-5, pname
    for n in bn_names:
        mine, expected = model.get_submodule(n), stat_refs[n]
        assert rel_err(mine.running_mean, expected.running_mean) < 1e-5, n
        assert rel_err(mine.running_var, expected.running_var) < 1e-5, n
        assert int(mine.num_batches_tracked) == int(expected.num_batches_tracked) == 2, n
    # The first BatchNorm sees the raw input, so it matches true full-batch training too.
    assert rel_err(model.stem[1].running_mean, full_batch.stem[1].running_mean) < 1e-5
    assert rel_err(model.stem[1].running_var, full_batch.stem[1].running_var) < 1e-5


@pytest.mark.parametrize("micro_batches", [1, 3])
@pytest.mark.parametrize("devices", [2, 3])
@pytest.mark.parametrize("name", ["inception", "tiny_gpt", "keyword_dict", "hf_gpt2"])
def test_branch_placement_equivalence(name: str, devices: int, micro_batches: int) -> None:
    """Branches side by side on different workers (a DAG of stages), run concurrently."""
    run_and_compare(name, devices, micro_batches, placement="branches")


def test_branch_placement_uses_several_workers_for_inception() -> None:
    model, (x,), _ = zoo.inception()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, placement="branches")
    assert {s.ranks[0] for s in pipe.plan.stages} == {0, 1}
    assert pipe.plan.placement == "branches"


@pytest.mark.parametrize("name", ["mlp", "tiny_gpt", "inception"])
def test_threaded_workers_match(name: str) -> None:
    run_and_compare(name, 3, 4, threads=True)


def test_tied_weight_stays_one_parameter() -> None:
    torch.manual_seed(0)
    model, (idx,), _ = zoo.tiny_gpt()
    pipe = partition(model, ["cpu"] * 4, example_inputs=(idx,), micro_batches=2)
    assert model.head.weight is model.tok.weight
    first, last = pipe.plan.stage_of()[pipe.plan.stages[0].nodes[0]], len(pipe.plan.stages) - 1
    assert first == 0 and last == 3
    pipe(idx).sum().backward()
    assert model.tok.weight.grad is not None and model.head.weight.grad is model.tok.weight.grad


def test_optimizer_over_model_parameters_trains() -> None:
    torch.manual_seed(0)
    model, (x,), _ = zoo.mlp()
    reference = copy.deepcopy(model)
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    y = torch.randint(0, 10, (x.shape[0],))
    for _ in range(3):
        for net, o in ((pipe, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            o.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert rel_err(p, q) < 1e-5, n
    reference.load_state_dict(pipe.state_dict(), strict=True)


def test_plan_summary_and_json_round_trip() -> None:
    model, (x,), _ = zoo.tiny_gpt()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    text = pipe.plan.summary()
    assert "stage" in text and "cpu" in text and "bottleneck" in text
    from partitioner import Plan

    again = Plan.from_json(pipe.plan.to_json())
    assert again == pipe.plan
    fresh, _, _ = zoo.tiny_gpt()
    fresh.load_state_dict(model.state_dict())
    pipe2 = partition(fresh, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2, plan=again)
    assert rel_err(pipe2(x), pipe(x)) < 1e-6


# ---- bad input: a clear error, and the model untouched ----


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_untouched(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert after[k].device == v.device and torch.equal(after[k], v), k


@pytest.mark.parametrize(
    "devices, message",
    [
        ([], "devices is empty"),
        (["cuda:7"], "CUDA devices are visible"),
        (["tpu:0"], "not a device name"),
        ("cpu", "must be a list"),
        (["meta"], "meta device"),
    ],
)
def test_bad_devices(devices: Any, message: str) -> None:
    model, (x,), _ = zoo.rescnn()
    before = snapshot(model)
    with pytest.raises(PartitionError, match=message):
        partition(model, devices, example_inputs=(x,))
    assert_untouched(model, before)


def test_not_a_module() -> None:
    with pytest.raises(TypeError, match="torch.nn.Module"):
        partition(lambda x: x, ["cpu"], example_inputs=(torch.ones(2),))  # type: ignore[arg-type]


@pytest.mark.parametrize("micro_batches", [0, -1, 8, 2.5, True])
def test_bad_micro_batches(micro_batches: Any) -> None:
    model, (x,), _ = zoo.rescnn()  # batch of 7
    before = snapshot(model)
    with pytest.raises(PartitionError, match="micro_batches"):
        partition(model, ["cpu"], example_inputs=(x,), micro_batches=micro_batches)
    assert_untouched(model, before)


def test_more_stages_than_nodes() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(PartitionError, match="3 stages but the graph has only 2 compute nodes"):
        partition(model, ["cpu"] * 3, example_inputs=(torch.randn(4, 4),))


def test_inputs_without_batch_dimension() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.ones(()))

        def forward(self, s: torch.Tensor) -> torch.Tensor:
            return s * self.w

    with pytest.raises(PartitionError, match="no batch dimension"):
        partition(Scale(), ["cpu"], example_inputs=(torch.tensor(3.0),))
    with pytest.raises(PartitionError, match="example_inputs is empty"):
        partition(Scale(), ["cpu"])


def test_untraceable_model_names_module_and_operation() -> None:
    class DataDependent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.lin(x)
            if h.sum() > 0:
                return h.relu()
            return h

    model = DataDependent()
    before = snapshot(model)
    with pytest.raises(TraceError) as info:
        partition(model, ["cpu"], example_inputs=(torch.randn(3, 4),))
    text = str(info.value)
    assert "DataDependent" in text and "test_api.py" in text and "in forward" in text
    assert "torch.fx" in text and "torch.export" in text and "Fix:" in text
    assert_untouched(model, before)


def test_failure_after_placement_restores_model(monkeypatch: pytest.MonkeyPatch) -> None:
    import partitioner.make.pipeline

    model, (x,), _ = zoo.rescnn()
    model.train()
    before = snapshot(model)
    rng = torch.get_rng_state()

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("injected failure")

    monkeypatch.setattr(partitioner.make.pipeline, "Pipeline", broken)
    with pytest.raises(RuntimeError, match="injected"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2)
    assert_untouched(model, before)  # shape propagation ran BatchNorm in train mode: restored
    assert torch.equal(torch.get_rng_state(), rng)


def test_call_with_too_few_samples_for_micro_batches() -> None:
    model, (x,), _ = zoo.mlp()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=4)
    with pytest.raises(ValueError, match="micro_batches=4 but the batch has 2 samples"):
        pipe(x[:2])


def test_in_process_trace_records_every_forward_and_later_backwards() -> None:
    model, (x,), _ = zoo.tiny_gpt()
    pipe = partition(model, ["cpu"] * 3, example_inputs=(x,), micro_batches=3)
    pipe.tracing = True
    pipe(x).sum().backward()
    events = [e for d in pipe.measured_timeline()["devices"] for e in d["events"]]
    forwards = {(e["stage"], e["microbatch"]) for e in events if e["kind"] == "forward"}
    backwards = {(e["stage"], e["microbatch"]) for e in events if e["kind"] == "backward"}
    assert forwards == {(s, i) for s in range(3) for i in range(3)}
    assert backwards == {(s, i) for s in (1, 2) for i in range(3)}  # stage 0's inputs need no gradient
    assert all(e["end"] >= e["start"] >= 0 for e in events)


def test_model_too_big_for_the_devices_names_what_each_needs() -> None:
    from cost_model.analytic import AnalyticCostModel
    from cost_model.devices import DeviceSpec
    from partitioner.place.search.infeasible import InfeasibleError

    small = DeviceSpec(name="small", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=20_000)
    model, (x,), _ = zoo.tiny_gpt()  # about 160 KB of weights: no split of two 20 KB devices holds it
    before = snapshot(model)
    with pytest.raises(InfeasibleError, match=r"needs .* \(has .*\)"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2,
                  cost_model=AnalyticCostModel(measure=lambda d: small))
    assert_untouched(model, before)


def test_plan_fits_in_memory_when_it_can() -> None:
    from cost_model.analytic import AnalyticCostModel
    from cost_model.devices import DeviceSpec

    roomy = DeviceSpec(name="roomy", flops_per_s=1e10, bytes_per_s=1e10, op_overhead_s=1e-6, memory_bytes=1 << 30)
    model, (x,), _ = zoo.tiny_gpt()
    pipe = partition(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2,
                     cost_model=AnalyticCostModel(measure=lambda d: roomy))
    assert len(pipe.plan.stages) == 2


def test_plan_for_a_cluster_that_is_not_here() -> None:
    import partitioner
    from cost_model.gpu_table import GpuTable

    model, x = zoo.TinyGPT(), torch.randint(0, 50, (32, 12))
    made = partitioner.plan(model, cluster="2x8xH100", example_inputs=(x,), micro_batches=16, replicas="auto")
    assert made.gpus_per_host == 8 and made.ranks == 16  # every GPU is a torchrun rank, none of them here
    assert sorted(r for s in made.stages for r in s.ranks) == list(range(16))
    assert [made.host_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    h100 = GpuTable.load().get("H100")
    assert all(s.memory_bytes <= (s.capacity_bytes or 0) <= h100.memory_bytes for s in made.stages)
    assert made.predicted_step_ms > 0
    big = partitioner.plan(model, cluster="17x8xH100", example_inputs=(x,), micro_batches=8, replicas="auto")
    assert sorted(r for s in big.stages for r in s.ranks) == list(range(136))  # beyond torch's cuda:127
    with pytest.raises(PartitionError, match="both devices and cluster"):
        partitioner.plan(model, ["cpu"], cluster="2x8xH100", example_inputs=(x,))
    with pytest.raises(PartitionError, match="not a cluster shape|neither a cluster shape"):
        partitioner.plan(model, cluster="2x8", example_inputs=(x,))


def test_partition_runs_a_plan_saved_to_a_file(tmp_path: Any) -> None:
    import partitioner

    model, (x,) = zoo.tiny_gpt()[:2]
    ref = model(x)
    path = tmp_path / "plan.json"
    path.write_text(partitioner.plan(model, ["cpu", "cpu"], example_inputs=(x,), micro_batches=2).to_json())
    for given in (str(path), path):
        pipe = partition(copy.deepcopy(model), ["cpu", "cpu"], example_inputs=(x,), plan=given)
        assert len(pipe.plan.stages) == 2 and pipe.plan.micro_batches == 2
        assert rel_err(pipe(x), ref) < 1e-5  # the un-partitioned model's output
    with pytest.raises(PartitionError, match="cannot read it"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), plan=str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text('{"stages": [], "colour": 1}')
    with pytest.raises(PartitionError, match="is not a saved plan"):
        partition(model, ["cpu", "cpu"], example_inputs=(x,), plan=str(tmp_path / "bad.json"))
