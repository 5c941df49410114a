"""The start-up side of ``vllm_one_h200.py``: its start-up jobs, the caches each one starts over, and what an engine's
log says about its start (vLLM's stages, dcp-triton's warm-up)."""

from __future__ import annotations

import re
from pathlib import Path


def startup_jobs(modes: tuple[str, ...]) -> list[dict]:
    """Engine start-up alone (llama8, no loads), per mode and backend: ``cold`` into empty caches of its own
    (Triton's, vLLM's, inductor's: a machine's first start, whichever job ran before), dcp-triton's by default
    (compile-ahead on up to 8 worker processes) and with each variant compiled at its first launch in the engine's
    process (``cold-serial``), then ``warm`` over the cold job's filled caches (what is left once nothing compiles). ``compile_workers``: the ``DCP_TRITON_COMPILE_WORKERS`` a job sets
    (``None``: the default)."""
    out = []
    for mode in modes:
        base = dict(model="llama8", mode=mode, kind="startup")
        for backend, tag in (("dcp-triton", "dcp"), ("FLASH_ATTN", "fa")):
            name = f"startup-{backend}-{mode}"
            out += [dict(base, name=f"{name}-cold", backend=backend, caches=f"{tag}-{mode}", empty_cache=True,
                         compile_workers=None)]
            if backend == "dcp-triton":
                out += [dict(base, name=f"{name}-cold-serial", backend=backend, caches=f"{tag}-{mode}-serial",
                             empty_cache=True, compile_workers=0)]
            out += [dict(base, name=f"{name}-warm", backend=backend, caches=f"{tag}-{mode}", compile_workers=None)]
    return out


# Every cache an engine start fills, by the variable that places it (vLLM's compile cache lives under its root).
STARTUP_CACHES = {"TRITON_CACHE_DIR": "triton", "VLLM_CACHE_ROOT": "vllm", "TORCHINDUCTOR_CACHE_DIR": "inductor"}


def set_caches(env: dict, job: dict, root: Path) -> None:
    """A start-up job's environment: its caches under ``root``, its compile-ahead workers as the job says."""
    env.update({var: str(root / sub) for var, sub in STARTUP_CACHES.items()})
    env.pop("DCP_TRITON_COMPILE_WORKERS", None)
    if job["compile_workers"] is not None:
        env["DCP_TRITON_COMPILE_WORKERS"] = str(job["compile_workers"])


def warmup_lines(log: str) -> list[str]:
    """dcp-triton's warm-up log lines (its compiles, built and from Triton's cache, and the compile-ahead's workers)."""
    marker = "dcp-triton: compiled the kernels of"
    return [line[line.index(marker):][:400] for line in log.splitlines() if marker in line]


def warmup_seconds(log: str) -> list[float]:
    """dcp-triton's warm-up inside a start-up, from its log lines (``dcp_plugin.warmup.warmed_up_line``, one per
    worker process)."""
    return [float(s) for s in re.findall(r"step kinds before serving in ([0-9.]+) s", log)]


# vLLM's own start-up lines (0.26): where an engine's start goes, per job (``init_breakdown``).
INIT_LINES = {
    "model_load_s": r"Model loading took .*? and ([0-9.]+) seconds",
    "torch_compile_s": r"torch\.compile took ([0-9.]+) s in total",
    "graph_capture_s": r"Graph capturing finished in ([0-9.]+) secs",
    "init_engine_s": r"init engine \(profile, create kv cache, warmup model\) took ([0-9.]+) s",
    # What vLLM's memory profiling left for the KV cache: anything else on the GPU during its profiling run (a
    # process started then, as compile-ahead's workers are) would show here as less.
    "kv_cache_gib": r"Available KV cache memory: ([0-9.]+) GiB",
}


def init_breakdown(log: str) -> dict:
    """The seconds of each of vLLM's start-up stages that the log names (``INIT_LINES``; the first of each)."""
    found = {key: re.search(pattern, log) for key, pattern in INIT_LINES.items()}
    return {key: float(m[1]) for key, m in found.items() if m}
