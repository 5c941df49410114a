"""Compile-ahead's worker processes (``_compile_ahead``): the variants Triton's cache lacks, compiled in other Python
processes under the cache keys the engine's process computes.

``Workers`` starts up to N processes (this module run as ``__main__``) on one shared list of variants; each takes the
next variant no other has claimed, rebuilds its source from the recorded specialization (``_source``), checks that
its cache key's parts are the engine process's (``Plan``, ``key_parts``), compiles it with ``triton.compile`` and
builds its launcher, and reports what it compiled and where its seconds went. ``stand_by`` starts workers before
there is work (an engine's model construction), so their imports are done when ``Workers`` hands them a list.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import importlib
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time

import dcp_plugin.kernels._mode  # noqa: F401 - first: decides the interpreter before triton is imported
import triton

WORKER_TIMEOUT_S = 600  # a worker still compiling then is stopped (its variants compile at their first launch)
STANDBY_TIMEOUT_S = 600  # a worker started ahead (``stand_by``) that got no work by then exits
VARIANTS_FILE = "dcp-triton-variants.json"  # in Triton's cache folder: the keys of the last variants recorded


# A worker runs this module as ``-m`` would, without the working directory first on its path (``-m`` and ``-c`` put it
# there): a file in the engine's working directory must not shadow a module the worker imports.
_WORKER_MAIN = f"import runpy, sys; sys.path.pop(0); runpy.run_module({__name__!r}, run_name='__main__')"


class Workers:
    """Up to ``workers`` processes started on the variants Triton's cache lacks (``outcome["missing"]`` counts them,
    ``outcome["workers"]`` the processes), in a scratch folder of their own; ``wait`` collects. The workers share one
    list and each takes the next variant no other has claimed (a file created exclusively per variant), so one that
    drew cheap variants goes on to the next instead of idling while another compiles two expensive ones: fixed
    shares (every ``count``-th variant) left the last of 8 workers compiling two for 8.3 s on one H200 (16 variants,
    docs/performance.md)."""

    def __init__(self, variants: list, workers: int, launchers: bool, outcome: dict) -> None:
        plan = Plan(triton.runtime.driver.active.get_current_target())
        keys = [plan.key(v) for v in variants]
        missing = [dict(v, key=key) for v, key in zip(variants, keys) if not plan.cached(key)]
        outcome["missing"] = len(missing)
        _remember(keys)
        if not missing:
            release()  # the cache is warm: workers started ahead have nothing to do
        self.started: list = []
        self.scratch = tempfile.mkdtemp(prefix="dcp-triton-compile-") if missing else None
        if not missing:
            return
        count = min(workers, len(missing))
        self.spawned = time.monotonic()  # the workers' times are counted from here (CLOCK_MONOTONIC: system-wide)
        work, claims = os.path.join(self.scratch, "work.json"), os.path.join(self.scratch, "claims")
        os.mkdir(claims)
        # The workers find every module where this process finds it (its sys.path first) and compile into its
        # cache (a worker started ahead takes both from here: they may have changed since).
        with open(work, "w") as f:
            json.dump({"target": [plan.target.backend, plan.target.arch, plan.target.warp_size], "claims": claims,
                       "launchers": launchers, "backend_hash": plan.backend_hash, "env_vars": plan.env_vars,
                       "cache_dir": triton.knobs.cache.dir, "path": [p for p in sys.path if p],
                       "variants": missing}, f)
        try:
            for i in range(count):
                done = os.path.join(self.scratch, f"done{i}.json")
                self.started.append((_handed(work, done) or _spawn([work, done], subprocess.DEVNULL), done))
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


def _spawn(argv: list, stdin) -> subprocess.Popen:
    """A worker process (this module as ``__main__``) with ``argv``; its environment is this process's, off the
    interpreter, with this process's module path."""
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=triton.knobs.cache.dir,
               PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    return subprocess.Popen([sys.executable, "-c", _WORKER_MAIN, *argv], stdin=stdin, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, env=env, text=True)


# Workers started ahead (``stand_by``) and not yet handed work, with the process that started them (a forked child
# inherits the list, not the workers' pipes to use).
_standby: dict = {"pid": None, "procs": []}


def stand_by(count: int) -> int:
    """Start workers now, before there is work, so their start (Python, torch and Triton imported: the 4.9 s before
    the last of 8 workers was ready on one H200) overlaps what the engine does meanwhile (building its model,
    loading its weights); the next ``Workers`` hands its list to them first. Up to ``count`` wait at once; none
    start where the variants the last compile-ahead recorded are all in Triton's cache already (``_remember``: a warm
    restart spends nothing on them). A worker with no work after ``STANDBY_TIMEOUT_S`` exits; ``release`` lets them
    all go. Returns how many wait."""
    if _standby["pid"] != os.getpid():
        _standby.update(pid=os.getpid(), procs=[])
    waiting = _standby["procs"] = [p for p in _standby["procs"] if p.poll() is None]
    if len(waiting) < count and not _remembered_cached():
        for _ in range(count - len(waiting)):
            waiting.append(_spawn([], subprocess.PIPE))
    return len(waiting)


def _handed(work: str, done: str) -> subprocess.Popen | None:
    """A worker started ahead, given ``work`` (None when none waits)."""
    if _standby["pid"] != os.getpid():
        return None
    while _standby["procs"]:
        proc = _standby["procs"].pop(0)
        try:
            proc.stdin.write(json.dumps([work, done]) + "\n")
            proc.stdin.flush()  # left open: ``Workers.wait`` (communicate) closes it
            return proc
        except (BrokenPipeError, ValueError):  # it exited (its time ran out): the next, else a new one
            proc.kill()
            proc.communicate()
    return None


@atexit.register
def release() -> None:
    """Every worker started ahead and still waiting told to exit (its input closed)."""
    if _standby["pid"] == os.getpid():
        for proc in _standby["procs"]:
            with contextlib.suppress(OSError, ValueError):
                proc.stdin.close()
    _standby["procs"] = []


def _remember(keys: list) -> None:
    """The cache keys of the variants just recorded, kept in Triton's cache folder (replaced atomically)."""
    path = os.path.join(triton.knobs.cache.dir, VARIANTS_FILE)
    with contextlib.suppress(OSError):
        os.makedirs(triton.knobs.cache.dir, exist_ok=True)
        with open(f"{path}.{os.getpid()}", "w") as f:
            json.dump([{"hash": k["hash"], "file": k["file"]} for k in keys], f)
        os.replace(f"{path}.{os.getpid()}", path)


def _remembered_cached() -> bool:
    """Whether the variants the last compile-ahead recorded (``_remember``) are all in Triton's cache now."""
    try:
        with open(os.path.join(triton.knobs.cache.dir, VARIANTS_FILE)) as f:
            keys = json.load(f)
        return bool(keys) and all(Plan.cached(key) for key in keys)
    except (OSError, ValueError, KeyError, TypeError):
        return False


class Plan:
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

    ready_at = time.monotonic()  # this module's imports done (Python, torch, Triton), or its work came (stand_by)
    with open(work_path) as f:
        work = json.load(f)
    # As the engine's process is now (a worker started ahead took this process's environment then): its cache
    # folder, its module path, its cache-invalidating variables.
    os.environ["TRITON_CACHE_DIR"] = work["cache_dir"]
    sys.path[:0] = [p for p in work["path"] if p not in sys.path]
    for name in set(get_cache_invalidating_env_vars()) | set(work["env_vars"]):
        if name in work["env_vars"]:
            os.environ[name] = work["env_vars"][name]
        else:
            os.environ.pop(name, None)
    for module in dict.fromkeys(variant["module"] for variant in work["variants"]):
        with contextlib.suppress(Exception):  # a module that cannot be imported fails its variants below
            importlib.import_module(module)
    imports_s = time.monotonic() - ready_at
    target = GPUTarget(*work["target"])
    backend = make_backend(target)
    if get_cache_invalidating_env_vars() != work["env_vars"]:
        raise RuntimeError("the cache-invalidating environment differs from the engine process's")
    backend_hash = work["backend_hash"]
    type(backend).hash = lambda self: backend_hash  # the recording process's (see Plan)
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


def _stand_by() -> None:
    """A worker started ahead: waits for one line on its input naming its work and report files (JSON), then is
    ``_worker``; its input closed, or no line after ``STANDBY_TIMEOUT_S``, it exits."""
    if not select.select([sys.stdin], [], [], STANDBY_TIMEOUT_S)[0]:
        return
    line = sys.stdin.readline()
    if line.strip():
        _worker(*json.loads(line))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2]) if len(sys.argv) == 3 else _stand_by()
