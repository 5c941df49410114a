"""Compile-ahead in worker processes: the warm-up's kernel variants are compiled side by side before it launches any.

Inside ``compile_ahead(workers)`` a ``Launch`` asks Triton for its variant (``kernel.warmup``), and Triton's
``jit_cache_hook`` stops the compile before it starts: the variant's specialization is recorded instead, in
Triton's own serialization (the one ``JITFunction.preload`` reads). ``workers`` Python processes are started on
entry (``python -m dcp_plugin.kernels._compile_ahead``), so they import torch and Triton while the steps are
recorded. On exit each is handed a share of the variants: it imports their modules, compiles each for this GPU with
``triton.compile`` into Triton's cache and builds its launcher (a C module, from the host's compiler) into the same
cache. The warm-up's steps then run for real and find every variant there. Threads do not do this: Triton's
compiler holds Python's lock through most of a compile (a warm-up on 8 threads made an eager engine start 34.8 s
against 37.9 s). A worker that fails is reported in one warning line and its variants compile at their first launch,
as without compile-ahead.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import json
import logging
import os
import subprocess
import sys
import threading

import triton

from dcp_plugin.kernels import _launch
from dcp_plugin.kernels._mode import INTERPRET

WORKERS_ENV = "DCP_TRITON_COMPILE_WORKERS"
MAX_DEFAULT_WORKERS = 8
_log = logging.getLogger("dcp_plugin")


def hook_supported() -> bool:
    """Whether this Triton lets a hook skip a compile and hands it the specialization (``jit_cache_hook``)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and hasattr(runtime, "jit_cache_hook")


def compile_workers() -> int:
    """Worker processes for the warm-up's compile-ahead: $DCP_TRITON_COMPILE_WORKERS (0: off, each variant compiles at
    its first launch), by default one per available CPU up to 8 (none with one CPU); 0 where nothing compiles (the
    interpreter) or this Triton cannot hand a compile over."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{WORKERS_ENV} must be a whole number of worker processes (0: off), got {value!r}")
    if INTERPRET or not hook_supported():
        return 0
    if value:
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(MAX_DEFAULT_WORKERS, cpus) if cpus > 1 else 0


# One hook for every thread (Triton keeps one): it records for the recorder of the calling thread's context, if
# that thread is inside ``compile_ahead`` and in compile-only mode, and hands every other compile to the hook that
# was set before the first ``compile_ahead`` began (ranks run as threads in one process each have a recorder).
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("dcp_triton_recording", default=None)
_installed = {"users": 0, "before": None}
_install_lock = threading.Lock()


def _hook(*, fn, compile, is_manual_warmup, **kwargs):
    recording = _RECORDING.get()
    if recording is not None and is_manual_warmup and _launch.compile_only():
        variant = {"module": fn.module, "name": fn.name, "spec": compile["specialization_data"]}
        if variant not in recording:
            recording.append(variant)
        return True  # skip the compile: a worker does it
    before = _installed["before"]
    return before(fn=fn, compile=compile, is_manual_warmup=is_manual_warmup, **kwargs) if before else None


def _install(on: bool) -> None:
    runtime = triton.knobs.runtime
    with _install_lock:
        if on and not _installed["users"]:
            _installed["before"], runtime.jit_cache_hook = runtime.jit_cache_hook, _hook
        _installed["users"] += 1 if on else -1
        if not on and not _installed["users"]:
            runtime.jit_cache_hook, _installed["before"] = _installed["before"], None


@contextlib.contextmanager
def compile_ahead(workers: int, *, launchers: bool = True, report: dict | None = None):
    """Within: every ``Launch`` records its kernel variant and launches nothing (``launches_run`` lifts that); on
    exit ``workers`` processes compile the variants (and, with ``launchers``, build their launchers) into Triton's
    cache. ``report``, when given, receives ``variants``, ``workers`` and ``failed`` (workers that failed)."""
    # The workers find every module where this process found it (its sys.path first), and compile into its cache.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=triton.knobs.cache.dir,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, env=env, text=True) for _ in range(workers)]
    variants: list = []
    _install(True)
    tokens = _RECORDING.set(variants), _launch.set_compile_only(True)
    try:
        yield
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.communicate()
        raise
    finally:
        _launch.reset_compile_only(tokens[1])
        _RECORDING.reset(tokens[0])
        _install(False)
    target = triton.runtime.driver.active.get_current_target() if procs else None
    working = []
    for i, proc in enumerate(procs):  # every worker its share first, so that all compile at once
        share = variants[i::len(procs)]
        if not share:  # more workers than variants
            proc.kill()
            proc.communicate()
            continue
        work = {"target": [target.backend, target.arch, target.warp_size], "launchers": launchers, "variants": share}
        try:
            proc.stdin.write(json.dumps(work))
            proc.stdin.close()
        except OSError:  # it died before it read its share: reported below
            proc.kill()
        working.append(proc)
    failed = []
    for proc in working:
        with proc.stderr:
            err = proc.stderr.read()
        if proc.wait() != 0:
            failed.append(err.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"])
    if failed:
        _log.warning("dcp-triton: %d of %d compile-ahead workers failed (their kernel variants compile at their first "
                     "launch instead): %s", len(failed), len(procs), failed[0][0])
    if report is not None:
        report.update(variants=len(variants), workers=len(procs), failed=len(failed))


def _compile(target, variant: dict, launchers: bool) -> None:
    """Compile one recorded variant into Triton's cache (and build its launcher), as ``JITFunction.preload`` would
    rebuild it: the same source, signature, constants, attributes and options, so the same cache key."""
    import triton.language as tl
    from triton.compiler import ASTSource
    from triton.runtime.jit import convert_to_tuple_if_list

    fn = getattr(importlib.import_module(variant["module"]), variant["name"])
    spec = json.loads(variant["spec"])

    def constant(value):
        if tl.dtype.is_dtype(value):
            return tl.dtype(value)
        if isinstance(value, dict) and "constexpr" in value:
            return tl.constexpr(convert_to_tuple_if_list(value["constexpr"]))
        if isinstance(value, dict) and "jit_function" in value:
            module, name = value["jit_function"].split(":")
            return getattr(importlib.import_module(module), name)
        return convert_to_tuple_if_list(value)

    constexprs = {tuple(k): constant(v) for k, v in zip(spec["constant_keys"], spec["constant_vals"])}
    attrs = {tuple(k): v for k, v in zip(spec["attrs_keys"], spec["attrs_vals"])}
    signature = {k: convert_to_tuple_if_list(v) for k, v in spec["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in spec["options"].items()}
    source = ASTSource
    if fn.is_gluon():  # Triton names the source class only once a GPU's binder exists
        from triton.experimental.gluon._runtime import GluonASTSource as source
    kernel = triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options)
    if launchers:
        triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)


def _worker() -> None:
    """A worker: import what compiling needs, then compile the share read from stdin (JSON)."""
    from triton.backends.compiler import GPUTarget

    import dcp_plugin.kernels  # noqa: F401 - torch, Triton and the kernels' package, before the share arrives

    work = json.loads(sys.stdin.read())
    target = GPUTarget(*work["target"])
    for variant in work["variants"]:
        _compile(target, variant, work["launchers"])


if __name__ == "__main__":
    _worker()
