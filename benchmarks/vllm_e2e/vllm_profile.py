"""The in-process profile jobs of ``vllm_one_h200.py`` (``--profile``): host time per step in a backend's metadata
``build`` and its attention ``forward`` (perf_counter around vLLM's calls; for dcp-triton also its ``PARTS``) and
GPU time per kernel (torch profiler)."""

from __future__ import annotations

import time


def install_timers(backend: str) -> dict:
    """perf_counter totals around the backend's ``build`` and ``forward``, installed on its classes before the
    engine exists (vLLM's runners keep bound methods of the builders they make)."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if backend == "dcp-triton":
        from vllm.platforms import current_platform

        from dcp_plugin.adapters.vllm.registration import register, route_cpu_attn

        register()
        if current_platform.is_cpu():  # --smoke, in-process: route CPU_ATTN here as a spawned worker would
            route_cpu_attn(reason="the benchmark's in-process engine selects dcp-triton")
    cls = AttentionBackendEnum["DCP_TRITON" if backend == "dcp-triton" else backend].get_class()
    timers = {"build": [0.0, 0], "forward": [0.0, 0]}

    def timed(owner, attr, key):
        inner = getattr(owner, attr)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timers[key][0] += time.perf_counter() - t
                timers[key][1] += 1
        setattr(owner, attr, wrapper)

    timed(cls.get_builder_cls(), "build", "build")
    timed(cls.get_impl_cls(), "forward", "forward")
    if backend == "dcp-triton":  # where its forward's and build's host time goes (``parts_us_per_step``)
        from dcp_plugin import DcpAttention, DcpBatch
        from dcp_plugin.kernels._launch import Launch

        timers.update({key: [0.0, 0] for key in PARTS})
        timed(DcpBatch, "build", "batch")  # a classmethod, called on the class: the wrapper calls it bound
        timed(DcpAttention, "forward", "core")
        timed(DcpAttention, "_plan", "plan")
        timed(Launch, "__call__", "launch")
    return timers


# dcp-triton's parts, timed inside its ``build`` and ``forward``: the batch it builds (``DcpBatch.build``), its core's
# forward (``DcpAttention.forward``), of which the step's launches prepared by its first layer (``_plan``), and every
# kernel launch (``Launch.__call__``, a few hundred ns of timer each).
PARTS = ("batch", "core", "plan", "launch")


def profile_load(llm, timers: dict, run_load) -> dict:
    """Host time per step in the builder's ``build`` and the attention impl's ``forward`` (engine and worker in
    this process), and GPU time per kernel over the load ``run_load(seed)`` runs (torch profiler)."""
    import torch

    run_load(seed=7)  # warm-up
    for t in timers.values():
        t[:] = [0.0, 0]
    run = run_load(seed=8)  # timers only: the profiler's own host cost stays out
    (build_s, steps), (forward_s, calls) = timers["build"], timers["forward"]
    steps = max(steps, 1)
    parts = {key: dict(us_per_step=total * 1e6 / steps, calls_per_step=count / steps)
             for key, (total, count) in timers.items() if key in PARTS}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                            torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_load(seed=9)
    kernels = sorted(((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages()
                      if e.device_time_total > 0), key=lambda x: -x[1])[:15]
    return dict(run=run, steps=steps, step_ms=run["elapsed_s"] * 1e3 / steps, build_us_per_step=build_s * 1e6 / steps,
                forward_calls_per_step=calls / steps, forward_us_per_step=forward_s * 1e6 / steps,
                kernels_ms=[dict(name=k[:90], ms=round(ms, 3), count=c) for k, ms, c in kernels],
                **({"parts": parts} if parts else {}))
