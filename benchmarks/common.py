"""Timing helpers shared by the GPU benchmarks: cold-L2 medians, CUDA-graph replay, copy-bandwidth ceiling."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"
COLD_BYTES = 256 << 20  # disjoint data per timed graph until this many bytes (> 4x an H200's 60 MB L2)
MAX_COPIES = 32


def cold_copies(nbytes: int) -> int:
    """How many disjoint copies of ``nbytes`` of inputs a timed graph cycles through so replays miss the L2."""
    return max(1, min(MAX_COPIES, -(-COLD_BYTES // max(nbytes, 1))))


def gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu"


def median_ms(fn, *, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Median time of ``fn`` with the L2 flushed before every call (triton's do_bench)."""
    import triton

    return triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")


def graph_ms(fns: list, *, replays: int = 20, repeats: int = 5) -> float:
    """Median time per call of ``fns`` captured back to back in one CUDA graph (launch gaps removed).

    Give several calls over disjoint data whose total exceeds the L2 so replays do not run from cache.
    """
    return replay_ms(capture_graph(fns), len(fns), replays=replays, repeats=repeats)


def capture_graph(fns: list) -> torch.cuda.CUDAGraph:
    """``fns`` warmed up on a side stream (compilation, lazy communicator set-up), then captured in one graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in fns:  # compile and warm up outside the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    return graph


def replay_ms(graph: torch.cuda.CUDAGraph, calls: int, *, replays: int = 20, repeats: int = 5) -> float:
    """Median time per call of a captured ``graph`` holding ``calls`` calls (one warm replay first)."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / (replays * calls))
    return statistics.median(times)


def events_ms(fn, *, iters: int = 10, repeats: int = 5, before=None) -> float:
    """Median time per call of ``fn`` run ``iters`` times back to back, host launch overhead included: CUDA events
    on a GPU, the wall clock on CPU. ``before()`` (e.g. a barrier) runs before each repeat, outside the timing."""
    cuda = torch.cuda.is_initialized()
    fn()  # warm-up: compilation, lazy communicator set-up
    times = []
    for _ in range(repeats):
        if before is not None:
            before()
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / iters)
        else:
            began = time.perf_counter()
            for _ in range(iters):
                fn()
            times.append((time.perf_counter() - began) * 1e3 / iters)
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth counting bytes read plus written: the ceiling for memory-bound kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), rep_ms=200)
    return 2 * nbytes / ms / 1e6


def save(name: str, payload: dict, *, results_dir: Path = RESULTS) -> Path:
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
