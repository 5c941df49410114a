"""Compile-ahead in worker processes (on by default on a GPU, ``compile_workers``): the warm-up's kernel variants
compiled side by side.

Inside ``compile_ahead(workers)`` a ``Launch`` asks Triton for its variant (``kernel.warmup``), and Triton's
``jit_cache_hook`` stops the compile before it starts: the variant's specialization is recorded instead, in
Triton's own serialization (the one ``JITFunction.preload`` reads). Only dcp-triton's kernels are recorded; the
kernels the warm-up runs for real (``launches_run``) compile in this process as usual. On exit the variants Triton's
cache lacks are handed to up to ``workers`` Python processes (``_compile_workers``, run as ``__main__``, the
working directory off their path), which take them one at a time from one list:
each imports the variants' modules, compiles them for this GPU with ``triton.compile`` under this process's backend
hash and cache-invalidating environment (``_compile_workers.Plan``), checks that each lands under the cache key this
process computed, and builds its launcher (a C module, from the host's compiler) into the same cache. The warm-up's steps
then run for real and look every variant up there. Anything that fails (a worker, a variant, this process's
planning) is said in one warning line and costs only the speed: what no worker compiled compiles at its first launch,
as without compile-ahead. Threads (Triton's ``AsyncCompileMode``, which this replaced) made an eager engine start
34.8 s against 37.9 s; what the processes gain inside vLLM: ``compile_workers``.
With ``wait=False`` the workers are left compiling while the process goes on (an engine's profiling run, before its
KV cache exists: ``dcp_plugin.warmup.warm_up_early``); ``join_early`` waits for them (the warm-up proper, first).
"""

from __future__ import annotations

import atexit
import contextlib
import contextvars
import logging
import os
import threading
import time

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton

from dcp_plugin.kernels import _launch
from dcp_plugin.kernels._compile_workers import Workers

WORKERS_ENV = "DCP_TRITON_COMPILE_WORKERS"
_RECORDED_PACKAGES = ("dcp_plugin.",)  # whose kernels are recorded (others compile as usual)
_log = logging.getLogger("dcp_plugin")


def hook_supported() -> bool:
    """Whether this Triton lets a hook skip a compile and hands it the specialization (``jit_cache_hook``)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and hasattr(runtime, "jit_cache_hook")


DEFAULT_WORKERS = 8  # unset: this many, at most this process's share of its CPUs (``compile_workers``)
_said_off: list[str] = []  # compile_workers warned once that an asked-for count cannot start


def compile_workers() -> int:
    """Worker processes for the warm-up's compile-ahead: $DCP_TRITON_COMPILE_WORKERS (0: off, each variant compiles at
    its first launch; unset: ``DEFAULT_WORKERS``, at most the CPUs this process may run on over the GPUs it sees, at
    least 1: each engine process, each rank, starts its own, and a host's ranks start together). 0 where nothing
    compiles (the interpreter), where this Triton cannot hand a compile over, and where a worker could not reproduce
    this process's compile: a stages-inspection hook changes the compiled code, ``always_compile`` recompiles whatever
    the cache holds (a count asked for there gets one warning saying why). Inside vLLM on one H200 (32 Q / 8 KV, CUDA
    graphs, an empty Triton cache) 8 workers took the engine's start from 70.7 to 55.2 s, its warm-up from 19.3 to
    9.3 s (docs/performance.md, start-up)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{WORKERS_ENV} must be a whole number of worker processes (0: off), got {value!r}")
    if INTERPRET:
        return 0
    off = ("this Triton cannot hand a compile over" if not hook_supported() else
           "a stages-inspection hook changes the compiled code"
           if getattr(triton.knobs.runtime, "add_stages_inspection_hook", None) else
           "always_compile recompiles whatever the cache holds"
           if getattr(getattr(triton.knobs, "compilation", None), "always_compile", False) else None)
    if off is not None:
        if value and int(value) and not _said_off:
            _said_off.append(off)
            _log.warning("dcp-triton: %s=%s starts no worker processes: %s; each kernel variant compiles at its "
                         "first launch", WORKERS_ENV, value, off)
        return 0
    if value:
        return int(value)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(DEFAULT_WORKERS, cpus // max(1, torch.cuda.device_count())))


# One hook for every thread (Triton keeps one): it records for the list of the calling thread's context, if that
# thread is inside ``compile_ahead`` and in compile-only mode and the kernel is dcp-triton's, and hands every other
# compile to the hook that was set before the first ``compile_ahead`` began (ranks run as threads in one process
# each have their own list).
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("dcp_triton_recording", default=None)
_installed = {"users": 0, "before": None}
_install_lock = threading.Lock()


def _hook(*, fn, compile, is_manual_warmup, **kwargs):
    recording = _RECORDING.get()
    if recording is not None and is_manual_warmup and _launch.compile_only() and \
            str(fn.module).startswith(_RECORDED_PACKAGES):
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
            if runtime.jit_cache_hook is _hook:  # else someone set another since: theirs stays
                runtime.jit_cache_hook = _installed["before"]
            _installed["before"] = None


@contextlib.contextmanager
def compile_ahead(workers: int, *, launchers: bool = True, report: dict | None = None, wait: bool = True):
    """Within: every ``Launch`` records its kernel variant and launches nothing (``launches_run`` lifts that); on
    exit the variants missing from Triton's cache are compiled by up to ``workers`` processes (with ``launchers``,
    their launchers built too). ``report``, when given, receives ``variants`` (recorded), ``missing`` (not in the
    cache, handed to the workers), ``compiled`` (by them), ``workers`` (started), ``failed`` (workers that failed or
    ran out of time), after a failure its last line (``reason``) and, once a worker finished, ``times``: where the
    slowest one's seconds went (``_compile_workers.Workers.wait``). With ``wait`` False the workers are started and
    left compiling while this process goes on; ``join_early`` waits for them and gives their report, with
    ``waited_s``: how long this process waited for them (what the head start left on the critical path)."""
    variants: list = []
    _install(True)
    tokens = _RECORDING.set(variants), _launch.set_compile_only(True)
    try:
        yield
    finally:
        _launch.reset_compile_only(tokens[1])
        _RECORDING.reset(tokens[0])
        _install(False)
    outcome = dict(variants=len(variants), missing=0, compiled=0, workers=0, failed=0)
    if variants and workers > 0:
        try:
            started = Workers(variants, workers, launchers, outcome)
        except Exception as error:  # planning in this process failed: nothing lost but the speed
            outcome.update(failed=outcome["failed"] + 1, reason=f"{type(error).__name__}: {error}")
        else:
            if not wait:
                _early.append((started, outcome, report))
                if report is not None:
                    report.update(outcome)
                return
            started.wait(outcome)
    _finish(outcome, report)


def _finish(outcome: dict, report: dict | None) -> None:
    """A compile-ahead's outcome: its failure said in one warning line, ``report`` filled."""
    if outcome["failed"]:
        reason = outcome["reason"].strip()
        outcome["reason"] = reason.splitlines()[-1][-200:] if reason else "?"
        _log.warning("dcp-triton: compile-ahead compiled %d of the %d kernel variants it was to (the rest compile at "
                     "their first launch): %s", outcome["compiled"], outcome["missing"], outcome["reason"])
    if report is not None:
        report.update(outcome)


# Compile-aheads started with ``wait=False`` whose workers nobody has waited for yet: (workers, outcome, report).
_early: list = []


def join_early() -> dict | None:
    """Wait for the workers of every compile-ahead started without waiting (``compile_ahead(wait=False)``) and give
    their report, summed (``variants``, ``missing``, ``compiled``, ``workers``, ``failed``, ``reason`` after a
    failure), with ``waited_s`` (the seconds this call waited) and the ``times`` of the one that ended last; None
    when none was started."""
    if not _early:
        return None
    total = dict(variants=0, missing=0, compiled=0, workers=0, failed=0)
    began = time.monotonic()
    while _early:
        started, outcome, report = _early.pop(0)
        waiting = time.monotonic()
        started.wait(outcome)
        outcome["waited_s"] = round(time.monotonic() - waiting, 2)
        _finish(outcome, report)
        for key in total:
            total[key] += outcome[key]
        if outcome["failed"]:
            total.setdefault("reason", outcome["reason"])
        if "times" in outcome and outcome["times"]["end_s"] > total.get("times", {}).get("end_s", -1.0):
            total["times"] = outcome["times"]
    total["waited_s"] = round(time.monotonic() - began, 2)
    return total


@atexit.register
def _stop_early() -> None:
    """No worker outlives this process (an engine that stopped before its warm-up waited for them)."""
    while _early:
        _early.pop()[0].stop()
