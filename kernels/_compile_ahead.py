"""Compile-ahead in worker processes (on by default on a GPU, ``compile_workers``): the warm-up's kernel variants
compiled side by side.

Inside ``compile_ahead(workers)`` a ``Launch`` asks Triton for its variant (``kernel.warmup``), and Triton's
``jit_cache_hook`` stops the compile before it starts: the variant's specialization is recorded instead, in
Triton's own serialization (the one ``JITFunction.preload`` reads). Only dcp-triton's kernels are recorded; the
kernels the warm-up runs for real (``launches_run``) compile in this process as usual. On exit the variants Triton's
cache lacks are handed to up to ``workers`` Python processes (this module run as ``__main__``, the working
directory off their path), which take them one at a time from one list:
each imports the variants' modules, compiles them for this GPU with ``triton.compile`` under this process's backend
hash and cache-invalidating environment (``_Plan``), checks that each lands under the cache key this process
computed, and builds its launcher (a C module, from the host's compiler) into the same cache. The warm-up's steps
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
import hashlib
import importlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import torch

from dcp_plugin.kernels._mode import INTERPRET  # first: decides the interpreter before triton is imported
import triton

from dcp_plugin.kernels import _launch

WORKERS_ENV = "DCP_TRITON_COMPILE_WORKERS"
WORKER_TIMEOUT_S = 600  # a worker still compiling then is stopped (its variants compile at their first launch)
_RECORDED_PACKAGES = ("dcp_plugin.",)  # whose kernels are recorded (others compile as usual)
_log = logging.getLogger("dcp_plugin")


def hook_supported() -> bool:
    """Whether this Triton lets a hook skip a compile and hands it the specialization (``jit_cache_hook``)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and hasattr(runtime, "jit_cache_hook")


DEFAULT_WORKERS = 8  # unset: this many, at most this process's share of its CPUs (``compile_workers``)


def compile_workers() -> int:
    """Worker processes for the warm-up's compile-ahead: $DCP_TRITON_COMPILE_WORKERS (0: off, each variant compiles
    at its first launch; unset: ``DEFAULT_WORKERS``, at most the CPUs this process may run on over the GPUs it sees,
    at least 1: each engine process, each rank, starts its own, and a host's ranks start together). 0 where nothing compiles (the interpreter), where this Triton cannot hand a compile over, and
    where a worker could not reproduce this process's compile: a stages-inspection hook changes the compiled code,
    ``always_compile`` recompiles whatever the cache holds. Inside vLLM on one H200 (32 Q / 8 KV, CUDA graphs, an
    empty Triton cache) 8 workers took the engine's start from 70.7 to 55.2 s, its warm-up from 19.3 to 9.3 s
    (docs/performance.md, start-up)."""
    value = os.environ.get(WORKERS_ENV, "").strip()
    if value and not value.isdigit():
        raise ValueError(f"{WORKERS_ENV} must be a whole number of worker processes (0: off), got {value!r}")
    if INTERPRET or not hook_supported() or getattr(triton.knobs.runtime, "add_stages_inspection_hook", None):
        return 0
    if getattr(getattr(triton.knobs, "compilation", None), "always_compile", False):
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
    slowest one's seconds went (``_Workers.wait``). With ``wait`` False the workers are started and left compiling
    while this process goes on; ``join_early`` waits for them and gives their report, with ``waited_s``: how long
    this process waited for them (what the head start left on the critical path)."""
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
            started = _Workers(variants, workers, launchers, outcome)
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


# A worker runs this module as ``-m`` would, without the working directory first on its path (``-m`` and ``-c`` put it
# there): a file in the engine's working directory must not shadow a module the worker imports.
_WORKER_MAIN = f"import runpy, sys; sys.path.pop(0); runpy.run_module({__name__!r}, run_name='__main__')"


class _Workers:
    """Up to ``workers`` processes started on the variants Triton's cache lacks (``outcome["missing"]`` counts them,
    ``outcome["workers"]`` the processes), in a scratch folder of their own; ``wait`` collects. The workers share one
    list and each takes the next variant no other has claimed (a file created exclusively per variant), so one that
    drew cheap variants goes on to the next instead of idling while another compiles two expensive ones: fixed
    shares (every ``count``-th variant) left the last of 8 workers compiling two for 8.3 s on one H200 (16 variants,
    docs/performance.md)."""

    def __init__(self, variants: list, workers: int, launchers: bool, outcome: dict) -> None:
        plan = _Plan(triton.runtime.driver.active.get_current_target())
        missing = [dict(v, key=key) for v in variants if not plan.cached(key := plan.key(v))]
        outcome["missing"] = len(missing)
        self.started: list = []
        self.scratch = tempfile.mkdtemp(prefix="dcp-triton-compile-") if missing else None
        if not missing:
            return
        # The workers find every module where this process found it (its sys.path first), and compile into its cache.
        env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=triton.knobs.cache.dir,
                   PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        count = min(workers, len(missing))
        self.spawned = time.monotonic()  # the workers' times are counted from here (CLOCK_MONOTONIC: system-wide)
        work, claims = os.path.join(self.scratch, "work.json"), os.path.join(self.scratch, "claims")
        os.mkdir(claims)
        with open(work, "w") as f:
            json.dump({"target": [plan.target.backend, plan.target.arch, plan.target.warp_size], "claims": claims,
                       "launchers": launchers, "backend_hash": plan.backend_hash, "env_vars": plan.env_vars,
                       "variants": missing}, f)
        try:
            for i in range(count):
                done = os.path.join(self.scratch, f"done{i}.json")
                self.started.append((subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, work, done],
                                                      stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                      stderr=subprocess.PIPE, env=env, text=True), done))
                outcome["workers"] += 1
        except BaseException:
            self.stop()
            raise
        self.deadline = time.monotonic() + WORKER_TIMEOUT_S

    def wait(self, outcome: dict) -> None:
        """Each worker's end (stopped at the deadline) counted into ``outcome``, and ``times``: the seconds of the
        worker that finished last, from the start of the first worker: ``start_s`` (until it was ready: Python,
        torch and Triton imported), ``imports_s`` (its variants' modules), ``compile_s`` (``triton.compile``),
        ``launcher_s`` (their launchers), ``end_s`` (when it finished); the scratch folder removed."""
        try:
            for proc, done in self.started:
                try:
                    _, err = proc.communicate(timeout=max(1.0, self.deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    _, err = proc.communicate()
                    err = f"{err}\nstopped after {WORKER_TIMEOUT_S} s"
                result = {"compiled": 0, "reason": None}
                if os.path.exists(done):
                    with open(done) as f:
                        result = json.load(f)
                outcome["compiled"] += result["compiled"]
                if "done_at" in result and result["done_at"] - self.spawned > outcome.get("times", {}).get(
                        "end_s", -1.0):
                    outcome["times"] = {"start_s": round(result["ready_at"] - self.spawned, 2),
                                        **{k: round(result[k], 2) for k in ("imports_s", "compile_s", "launcher_s")},
                                        "end_s": round(result["done_at"] - self.spawned, 2)}
                if proc.returncode != 0:
                    outcome["failed"] += 1
                    outcome.setdefault("reason", result["reason"] or err or f"exit status {proc.returncode}")
        finally:
            self.stop()

    def stop(self) -> None:
        """Every worker still running killed, the scratch folder removed."""
        for proc, _ in self.started:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)
            self.scratch = None


class _Plan:
    """What this process's Triton would key a compile on, beyond the variant itself: the backend's hash (the ptxas
    version it read first: torch.compile may point ``TRITON_PTXAS_PATH`` at another ptxas afterwards, which a new
    process would read instead) and the cache-invalidating environment. The workers compile under the same."""

    def __init__(self, target) -> None:
        from triton._C.libtriton import get_cache_invalidating_env_vars
        from triton.compiler import make_backend

        self.target, self.backend = target, make_backend(target)
        self.backend_hash, self.env_vars = self.backend.hash(), get_cache_invalidating_env_vars()

    def key(self, variant: dict) -> dict:
        """The hash Triton's ``compile`` looks the variant up by in its cache (``get_cache_key``'s, hashed), the
        file its metadata is kept in there, and what went into the hash (``key_parts``), for a worker to check."""
        from triton.runtime.cache import get_cache_key

        src, options = _source(variant)
        options = self.backend.parse_options(options)
        digest = hashlib.sha256(get_cache_key(src, self.backend, options, self.env_vars).encode()).hexdigest()
        return {"hash": digest, "file": f"{src.name[:150]}.json", "parts": key_parts(src, options)}

    @staticmethod
    def cached(key: dict) -> bool:
        from triton.runtime.cache import get_cache_manager

        return key["file"] in (get_cache_manager(key["hash"]).get_group(key["file"]) or {})


def key_parts(src, options) -> dict:
    """The parts of Triton's cache key (``get_cache_key``) that a worker derives itself, each hashed: where its
    key would differ, which part (the backend's hash and the environment it takes from the engine's process)."""
    from triton.runtime.cache import triton_key

    parts = {"triton": triton_key(), "source": src.hash(), "options": options.hash()}
    return {name: hashlib.sha256(str(part).encode()).hexdigest()[:16] for name, part in parts.items()}


def _source(variant: dict):
    """The variant's source and options, rebuilt from its recorded specialization as ``JITFunction.preload`` does."""
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
    return source(fn, signature, constexprs, attrs), options


def _worker(work_path: str, done_path: str) -> None:
    """A worker: compile each variant of the shared list (``work_path``, JSON) that no other worker claimed first,
    as the process that recorded it would, each checked to land under the key that process computed, and build each
    launcher; every variant it claims is tried. Writes ``{"compiled", "reason"}`` and its seconds to ``done_path``;
    exits 1 when a variant failed."""
    from triton._C.libtriton import get_cache_invalidating_env_vars
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    ready_at = time.monotonic()  # this module's imports done: Python, torch, Triton
    with open(work_path) as f:
        work = json.load(f)
    for module in dict.fromkeys(variant["module"] for variant in work["variants"]):
        with contextlib.suppress(Exception):  # a module that cannot be imported fails its variants below
            importlib.import_module(module)
    imports_s = time.monotonic() - ready_at
    target = GPUTarget(*work["target"])
    backend = make_backend(target)
    if get_cache_invalidating_env_vars() != work["env_vars"]:
        raise RuntimeError("the cache-invalidating environment differs from the engine process's")
    backend_hash = work["backend_hash"]
    type(backend).hash = lambda self: backend_hash  # the recording process's (see _Plan)
    compiled, reasons, seconds = 0, [], {"compile_s": 0.0, "launcher_s": 0.0}
    for index, variant in enumerate(work["variants"]):
        try:  # the next variant no other worker has taken
            os.close(os.open(os.path.join(work["claims"], str(index)), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            continue
        try:
            src, options = _source(variant)
            parts = key_parts(src, backend.parse_options(options))
            differ = [name for name, part in parts.items() if part != variant["key"]["parts"][name]]
            if differ:  # compiled here it would land where the engine's process does not look
                raise RuntimeError(f"{variant['name']}: the cache key's {' and '.join(differ)} "
                                   f"{'parts differ' if len(differ) > 1 else 'part differs'} from the engine process's")
            began = time.monotonic()
            kernel = triton.compile(src, target=target, options=options, _env_vars=work["env_vars"])
            seconds["compile_s"] += time.monotonic() - began
            if kernel.hash != variant["key"]["hash"]:
                raise RuntimeError(f"{variant['name']}: compiled under another cache key than the engine process's")
            if work["launchers"]:
                began = time.monotonic()
                triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
                seconds["launcher_s"] += time.monotonic() - began
            compiled += 1
        except Exception as error:  # the rest of the share still compiles
            reasons.append(f"{type(error).__name__}: {error}".strip().splitlines()[-1])
    with open(done_path, "w") as f:
        json.dump({"compiled": compiled, "reason": reasons[0] if reasons else None, "ready_at": ready_at,
                   "imports_s": imports_s, **seconds, "done_at": time.monotonic()}, f)
    sys.exit(1 if reasons else 0)


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
