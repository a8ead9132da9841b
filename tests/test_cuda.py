"""The GPU suite: equivalence, streams, memory and launch on CUDA (marked `cuda`; skipped without a GPU),
plus a CPU dry run of benchmarks/gpu_check.py so the script cannot rot where no GPU is lent."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from partitioner import partition
from tests.zoo import ZOO, rel

ROOT = Path(__file__).resolve().parent.parent



def _gpus(n: int) -> list[str]:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA devices")
    return [f"cuda:{i}" for i in range(n)]


@pytest.fixture(autouse=True)
def _no_tf32() -> object:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _check(name: str, devices: list[str], threads: bool | None = None, micro_batches: int = 3) -> None:
    torch.manual_seed(0)
    model, args, kwargs = ZOO[name]()
    model = model.eval()  # dropout off: the same function on both sides
    reference = copy.deepcopy(model).to(devices[0])
    ref_args = pytree.tree_map(lambda t: t.to(devices[0]) if isinstance(t, torch.Tensor) else t, args)
    ref_kwargs = pytree.tree_map(lambda t: t.to(devices[0]) if isinstance(t, torch.Tensor) else t, kwargs)
    extra = {} if threads is None else {"threads": threads}
    pipe = partition(model, devices, example_inputs=args, example_kwargs=kwargs, micro_batches=micro_batches,
                     **extra)  # type: ignore[arg-type]
    out, ref = pipe(*args, **kwargs), reference(*ref_args, **ref_kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    refs = [t for t in pytree.tree_leaves(ref) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    assert len(outs) == len(refs) > 0
    for a, b in zip(outs, refs):
        assert rel(a, b.to(a.device)) < 1e-5
    sum(t.float().square().mean() for t in outs).backward()  # type: ignore[union-attr]
    sum(t.float().square().mean() for t in refs).backward()  # type: ignore[union-attr]
    for p, q in zip(model.parameters(), reference.parameters()):
        if q.grad is not None:
            assert p.grad is not None and rel(p.grad, q.grad.to(p.device)) < 1e-5


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["mlp", "rescnn", "tiny_gpt", "inception", "keyword_dict", "in_place"])
def test_zoo_on_one_gpu_equals_the_plain_model(name: str) -> None:
    _check(name, ["cuda:0", "cuda:0"])


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["tiny_gpt", "inception"])
def test_input_on_the_cpu_and_stages_on_gpus(name: str) -> None:
    _check(name, ["cpu", "cuda:0"])  # the example and the calls stay on the CPU; stage 1 on the GPU


@pytest.mark.cuda
@pytest.mark.parametrize("threads", [True, False])
def test_two_gpus_through_copy_streams(threads: bool) -> None:
    _check("tiny_gpt", _gpus(2), threads=threads, micro_batches=4)


@pytest.mark.cuda
def test_branch_slots_sharing_a_gpu_run_on_their_own_streams() -> None:
    torch.manual_seed(0)
    model, (x,), _ = ZOO["inception"]()
    reference = copy.deepcopy(model).cuda()
    pipe = partition(model, ["cuda:0", "cuda:0"], example_inputs=(x,), placement="branches", threads=True)
    y = torch.randint(0, 3, (x.shape[0],))
    loss = pipe.train_step(x, y, lambda out, t: F.cross_entropy(out.float(), t.to(out.device)))
    expected = F.cross_entropy(reference(x.cuda()).float(), y.cuda())
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-5 * abs(expected.item())
    for p, q in zip(model.parameters(), reference.parameters()):
        assert rel(p.grad, q.grad) < 1e-5  # type: ignore[arg-type]


@pytest.mark.cuda
def test_autocast_reaches_worker_threads_on_cuda() -> None:
    torch.manual_seed(0)
    model, (x,), _ = ZOO["mlp"]()
    pipe = partition(model, ["cuda:0", "cuda:0"], example_inputs=(x,), micro_batches=2, threads=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = pipe(x.cuda())
    assert out.dtype == torch.bfloat16


@pytest.mark.cuda
def test_peak_memory_prediction_holds_on_cuda() -> None:
    sys.path.insert(0, str(ROOT / "examples"))
    from models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab=4096, width=512, heads=8, layers=4, seq=128)
    model = GPT(cfg).cuda()
    x = torch.randint(0, cfg.vocab, (8, cfg.seq), device="cuda")
    pipe = partition(model, ["cuda:0", "cuda:0"], example_inputs=(x,), micro_batches=4, schedule="1f1b")

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), y.flatten())

    pipe.train_step(x, x, loss_fn)
    model.zero_grad(set_to_none=True)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    pipe.train_step(x, x, loss_fn)
    measured = torch.cuda.max_memory_allocated() - base + weights
    predicted = sum(s.memory_bytes for s in pipe.plan.stages)
    assert 0.5 < predicted / measured < 2.0, (predicted, measured)  # the benchmark reports the exact error


def test_gpu_check_dry_run_on_cpu() -> None:
    """benchmarks/gpu_check.py end to end on the CPU, tiny: every section runs, the last line is its figure."""
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--device", "cpu", "--repeats", "2", "--warmup",
         "1", "--batch", "4", "--seq", "8", "--width", "32", "--layers", "2", "--vocab", "64"],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    lines = run.stdout.strip().splitlines()
    assert "equivalence: all equal" in run.stdout
    assert lines[-1].startswith("gpu: overhead ") and "step-time error" in lines[-1] and "memory error" in lines[-1]
