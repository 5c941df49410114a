"""Compile-ahead in worker processes: the warm-up's kernel variants are compiled side by side before it launches any.

Inside ``compile_ahead(workers)`` a ``Launch`` asks Triton for its variant (``kernel.warmup``), and Triton's
``jit_cache_hook`` stops the compile before it starts: the variant's specialization is recorded instead, in
Triton's own serialization (the one ``JITFunction.preload`` reads). On exit the variants Triton's cache lacks are
shared out to up to ``workers`` Python processes (``python -m dcp_plugin.kernels._compile_ahead``): each imports the
variants' modules, compiles them for this GPU with ``triton.compile`` under the cache keys this process computed
(``_Plan``; checked) and builds each launcher (a C module, from the host's compiler) into the same cache. The
warm-up's steps then run for real and find every variant there. Threads do not do this: a warm-up on 8 threads
(Triton's ``AsyncCompileMode``) made an eager engine start 34.8 s against 37.9 s. A worker that fails is said in one
warning line, and its variants compile at their first launch, as without compile-ahead.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
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
_log = logging.getLogger("dcp_plugin")


def hook_supported() -> bool:
    """Whether this Triton lets a hook skip a compile and hands it the specialization (``jit_cache_hook``)."""
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    return runtime is not None and hasattr(runtime, "jit_cache_hook")


def compile_workers() -> int:
    """Worker processes for the warm-up's compile-ahead: $DCP_TRITON_COMPILE_WORKERS (unset or 0, the default: off,
    each variant compiles at its first launch); 0 where nothing compiles (the interpreter) or this Triton cannot hand
    a compile over."""
    value = os.environ.get(WORKERS_ENV, "").strip() or "0"
    if not value.isdigit():
        raise ValueError(f"{WORKERS_ENV} must be a whole number of worker processes (0: off), got {value!r}")
    if INTERPRET or not hook_supported() or getattr(triton.knobs.runtime, "add_stages_inspection_hook", None):
        return 0  # a stages-inspection hook keys compiles on what a new process cannot see
    return int(value)


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
    exit the variants missing from Triton's cache are compiled by up to ``workers`` processes (with ``launchers``,
    their launchers built too). ``report``, when given, receives ``variants`` (recorded), ``compiled`` (by the
    workers), ``workers`` (started), ``failed`` (workers that failed) and the first failure's last line
    (``reason``)."""
    variants: list = []
    _install(True)
    tokens = _RECORDING.set(variants), _launch.set_compile_only(True)
    try:
        yield
    finally:
        _launch.reset_compile_only(tokens[1])
        _RECORDING.reset(tokens[0])
        _install(False)
    plan = _Plan(triton.runtime.driver.active.get_current_target()) if variants else None
    missing = [dict(v, key=key) for v in variants if not plan.cached(key := plan.key(v))] if plan else []
    procs, failed = _compile_elsewhere(missing, workers, plan, launchers), []
    for proc in procs:
        with proc.stderr:
            err = proc.stderr.read()
        if proc.wait() != 0:
            failed.append(err.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"])
    if failed:
        _log.warning("dcp-triton: %d of %d compile-ahead workers failed (their kernel variants compile at their first "
                     "launch instead): %s", len(failed), len(procs), failed[0][0])
    if report is not None:
        report.update(variants=len(variants), compiled=len(missing), workers=len(procs), failed=len(failed),
                      **({"reason": failed[0][0][-160:]} if failed else {}))


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
        return {"hash": digest, "file": f"{src.name[:150]}.json", "parts": key_parts(src, self.backend, options,
                                                                                     self.env_vars)}

    @staticmethod
    def cached(key: dict) -> bool:
        from triton.runtime.cache import get_cache_manager

        return key["file"] in (get_cache_manager(key["hash"]).get_group(key["file"]) or {})


def key_parts(src, backend, options, env_vars) -> dict:
    """The parts of Triton's cache key (``get_cache_key``), each hashed: where a worker's key differs, which part."""
    from triton.runtime.cache import triton_key

    parts = {"triton": triton_key(), "source": src.hash(), "backend": backend.hash(), "options": options.hash(),
             "environment": str(sorted(env_vars.items()))}
    return {name: hashlib.sha256(str(part).encode()).hexdigest()[:16] for name, part in parts.items()}


def _compile_elsewhere(variants: list, workers: int, plan, launchers: bool) -> list:
    """Start up to ``workers`` processes, each handed its share of ``variants``: the started processes."""
    if not variants or workers < 1:
        return []
    # The workers find every module where this process found it (its sys.path first), and compile into its cache.
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=triton.knobs.cache.dir,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    count = min(workers, len(variants))
    procs = []
    for i in range(count):
        proc = subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, env=env, text=True)
        work = {"target": [plan.target.backend, plan.target.arch, plan.target.warp_size], "launchers": launchers,
                "backend_hash": plan.backend_hash, "env_vars": plan.env_vars, "variants": variants[i::count]}
        try:
            proc.stdin.write(json.dumps(work))
            proc.stdin.close()
        except OSError:  # it died before it read its share: its exit status says so
            proc.kill()
        procs.append(proc)
    return procs


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


def _worker() -> None:
    """A worker: compile the share read from stdin (JSON) as the process that recorded it would, checking that each
    lands under the key that process computed, and build each launcher."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    work = json.loads(sys.stdin.read())
    target = GPUTarget(*work["target"])
    backend = make_backend(target)
    backend_hash = work["backend_hash"]
    type(backend).hash = lambda self: backend_hash  # the recording process's (see _Plan)
    for variant in work["variants"]:
        src, options = _source(variant)
        parts = key_parts(src, backend, backend.parse_options(options), work["env_vars"])
        differ = [name for name, part in parts.items() if part != variant["key"]["parts"][name]]
        if differ:  # compiled here it would land where the engine's process does not look
            raise RuntimeError(f"{variant['name']}: the cache key's {' and '.join(differ)} part differs from the "
                               "engine process's")
        kernel = triton.compile(src, target=target, options=options, _env_vars=work["env_vars"])
        if work["launchers"]:
            triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)


if __name__ == "__main__":
    _worker()
