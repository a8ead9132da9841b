"""Measure links: gloo sends between two local processes, tensor copies between local devices.

Each measurement is fitted to a `Link` (latency + bytes / bandwidth) by `fit_link`.

    rank 0                         rank 1
    send(b) ────────────────────►  recv(b)
    recv(b) ◄────────────────────  send(b)
    one way = round trip / 2; rounds go through every size once, and each size keeps
    the median over rounds (a burst of load then spoils a round, not a size)

Two processes started with torch.multiprocessing (spawn) meet over TCP on 127.0.0.1; the
parent waits with a deadline and terminates them if they hang, so a measurement always ends.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import time
from datetime import timedelta
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from cost_model.cache import cache_dir, cache_key, read_json, write_json
from cost_model.comm import LINK_KINDS, Link
from cost_model.devices import device_present

__all__ = ["fit_link", "loopback_link", "measure_copy_link", "measure_gloo_link", "measure_gloo_p2p"]

LOOPBACK_SIZES = (4 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)  # small ones fix the latency


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _worker(rank: int, port: int, sizes: Sequence[int], repeats: int, timeout_s: float, results: Any) -> None:
    import torch.distributed as dist

    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=timeout_s)
    )
    try:
        buffers = {int(n): torch.zeros(max(int(n), 1), dtype=torch.uint8) for n in sizes}
        times: dict[int, list[float]] = {n: [] for n in buffers}
        for round_ in range(repeats + 2):  # two warm-up rounds; sizes interleaved in each round
            for nbytes, buf in buffers.items():
                start = time.perf_counter()
                if rank == 0:
                    dist.send(buf, 1)
                    dist.recv(buf, 1)
                else:
                    dist.recv(buf, 0)
                    dist.send(buf, 0)
                if round_ >= 2:
                    times[nbytes].append((time.perf_counter() - start) / 2)
        if rank == 0:
            results.put({n: statistics.median(t) for n, t in times.items()})
        dist.barrier()
    finally:
        dist.destroy_process_group()


def measure_gloo_p2p(sizes: Sequence[int], repeats: int = 5, timeout_s: float = 120.0) -> dict[int, float]:
    """One-way seconds of a gloo send of each size in bytes between two processes on 127.0.0.1.

    Raises:
        RuntimeError: the processes failed or did not finish within `timeout_s`; the message
            says which, and both processes are gone when it is raised.
    """
    import torch.multiprocessing as mp

    if not sizes:
        return {}
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    port = _free_port()
    procs = [
        ctx.Process(target=_worker, args=(rank, port, list(sizes), repeats, timeout_s, results), daemon=True)
        for rank in range(2)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(deadline - time.monotonic(), 0.1))
    hung = [p for p in procs if p.is_alive()]
    for p in hung:
        p.terminate()
        p.join(5)
    if hung:
        raise RuntimeError(
            f"the gloo measurement did not finish within {timeout_s:.0f} s and was stopped; "
            "check that 127.0.0.1 is reachable and no firewall blocks local TCP, or raise timeout_s"
        )
    codes = [p.exitcode for p in procs]
    if any(code != 0 for code in codes) or results.empty():
        raise RuntimeError(
            f"the gloo measurement processes exited with codes {codes}; run them by hand "
            "(cost_model.links.measure_gloo_p2p) to see their error output"
        )
    return dict(results.get())


def fit_link(measured: Mapping[int, float], kind: str = "loopback") -> Link:
    """The line latency + bytes / bandwidth closest to the measurements in relative error.

    Weighted least squares over all sizes (each point weighted by 1 / its time), so small
    sends fix the latency and large ones the bandwidth.

    Raises:
        ValueError: fewer than two distinct sizes.
    """
    sizes = sorted(measured)
    if len(sizes) < 2:
        raise ValueError(f"fit_link needs two or more sizes, got {sizes}; measure a small and a large send")
    t = np.array([measured[s] for s in sizes], dtype=float)
    a = np.stack([1.0 / t, np.array(sizes, dtype=float) / t], axis=1)
    (latency, per_byte), *_ = np.linalg.lstsq(a, np.ones(len(sizes)), rcond=None)
    if per_byte <= 0:  # flat or falling times: all latency, bandwidth from the largest send
        per_byte = max(float(t[-1]) / sizes[-1], 1e-15)
        latency = 0.0
    if latency < 0:  # the line through the origin instead
        latency, per_byte = 0.0, float(np.sum(np.array(sizes) / t) / np.sum((np.array(sizes) / t) ** 2))
    return Link(kind, float(latency), 1.0 / float(per_byte))


def measure_gloo_link(sizes: Sequence[int] = (256 << 10, 2 << 20, 8 << 20, 32 << 20), repeats: int = 7) -> Link:
    """The loopback link measured once: gloo sends of several sizes, fitted by `fit_link`."""
    return fit_link(measure_gloo_p2p(sizes, repeats=repeats))


def loopback_link(*, measure: bool = True, cache: str | os.PathLike[str] | None = None) -> Link:
    """This machine's gloo loopback link, measured once (small and large sends) and kept in the cost cache.

    With `measure=False` a machine never measured gets the typical `LINK_KINDS["loopback"]`.
    """
    path = cache_dir(cache) / "links" / f"{cache_key('gloo-loopback', platform.node(), torch.__version__)}.json"
    saved = read_json(path)
    if isinstance(saved, dict):
        try:
            return Link.from_dict(saved)
        except (ValueError, TypeError):
            pass  # a damaged entry is a miss
    if not measure:
        return LINK_KINDS["loopback"]
    link = fit_link(measure_gloo_p2p(LOOPBACK_SIZES, repeats=9))
    write_json(path, link.to_dict())
    return link


def measure_copy_link(
    src: torch.device | str,
    dst: torch.device | str,
    sizes: Sequence[int] = (64 << 10, 1 << 20, 16 << 20, 64 << 20),
    repeats: int = 5,
) -> Link:
    """Time `dst_buffer.copy_(src_buffer)` between two devices of this process, and fit a Link.

    GPU to GPU copies go peer-to-peer where the driver allows (NVLink or PCIe), else
    through host memory; CPU to GPU copies use pinned host memory. The kind is named after
    the device types ("copy:cuda->cuda").

    Raises:
        ValueError: a device is not present here.
    """
    a, b = torch.device(src), torch.device(dst)
    for d in (a, b):
        if not device_present(d):
            raise ValueError(f"cannot measure a copy with {d}: it is not present here; describe the link instead")

    def sync() -> None:
        for d in (a, b):
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    measured: dict[int, float] = {}
    for nbytes in sizes:
        pin = a.type == "cpu" and b.type == "cuda" and torch.cuda.is_available()
        source = torch.empty(int(nbytes), dtype=torch.uint8, device=a, pin_memory=pin)
        target = torch.empty(int(nbytes), dtype=torch.uint8, device=b)
        target.copy_(source)
        sync()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            sync()
            times.append(time.perf_counter() - start)
        measured[int(nbytes)] = statistics.median(times)
    return fit_link(measured, kind=f"copy:{a.type}->{b.type}")
