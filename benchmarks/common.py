"""Timing helpers shared by the GPU benchmarks: cold-L2 medians, CUDA-graph replay, copy-bandwidth ceiling."""

from __future__ import annotations

import json
import platform
import statistics
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


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
        times.append(start.elapsed_time(end) / (replays * len(fns)))
    return statistics.median(times)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth counting bytes read plus written: the ceiling for memory-bound kernels."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), rep_ms=200)
    return 2 * nbytes / ms / 1e6


def save(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2))
    return path
