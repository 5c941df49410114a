"""The job runner shared by the vLLM end-to-end benchmarks (``vllm_gpu_e2e.py``, ``vllm_dcp_e2e.py``).

A job is one process (``python -m benchmarks.vllm_e2e.vllm_e2e_engine SPEC.json``: build a checkpoint or run one vLLM
engine) with its own log and timeout. The runner starts jobs in catalogue order, at most ``--jobs`` at once, keeps
exclusive jobs alone, gives each job that names ``gpus`` its own GPUs (``CUDA_VISIBLE_DEVICES``), reuses finished jobs'
results (resumable), rewrites the summary after every job (its ``meta`` stamped with ``common.provenance()``: which
commit and Triton), and mirrors what it wrote (``$OUT`` on the GPU machine). Job logs are cited relative to the
repository root when they lie under it (``common.repo_relative``), so committed summaries name no machine's folders.
Also here: the log facts the summaries read (backend start-up line, KV-cache capacity, JIT compiles after warm-up) and
the CLI options both scripts share. No torch, no vLLM.
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import tarfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import common

DCP_STARTUP = "dcp-triton attention: backend=DCP_TRITON"
STAGGER_S = 2.0  # between job starts: engines pick ports and fill compile caches at start-up
MIN_START_S = 40  # a job needs at least this much budget left to be worth starting (engine init ~20 s)
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
# vLLM's JIT monitor (vllm/utils/jit_monitor.py): "<runtime> [kernel ]JIT compilation during inference: <kernel>..."
JIT_EVENT = re.compile(r"(Triton|CuTeDSL|TileLang) [\w ]*?JIT compilation during inference: ([A-Za-z_<][\w<>]*)")


@dataclass
class Job:
    name: str
    spec: dict
    timeout_s: float
    needs: list[str] = field(default_factory=list)
    exclusive: bool = False  # timing runs have the machine to themselves
    gpus: int = 0  # > 0: the job gets this many GPUs of its own; 0: no pinning (jobs share what is visible)
    env: dict[str, str] = field(default_factory=dict)  # on top of job_env
    estimate_s: float | None = None  # expected wall time: not started when less budget is left; --plan
    group: str = ""


Summarise = Callable[[dict[str, dict]], list[Path]]


class Runner:
    """Runs jobs as process groups (at most ``args.jobs`` at once), within an optional wall-clock budget.

    ``summarise(jobs)`` gets every engine job with a result or a state this run (name -> spec, result, status,
    elapsed_s, log, backend_line) and returns the files it wrote; it runs in the repository root, to which ``log``
    is relative when the log lies under it (``common.repo_relative``). With ``pack``, job logs and raw results are
    kept in one tarball, rewritten after every job and mirrored instead of the single files (``unpack`` restores
    them into the state folders: a cold machine resumes from the tarball that travelled back)."""

    def __init__(self, args, jobs: list[Job], all_jobs: list[Job], paths: dict[str, Path], *, engine_module: str,
                 summarise: Summarise, gpu_ids: list[str] | None = None, pack: Path | None = None) -> None:
        self.args, self.jobs, self.all_jobs, self.paths = args, jobs, all_jobs, paths
        self.engine_module, self.summarise, self.pack = engine_module, summarise, pack
        self.gpu_ids, self.free_gpus = list(gpu_ids or []), list(gpu_ids or [])
        self.state: dict[str, dict] = {}
        self.provenance = common.provenance()  # once: the code that runs the jobs
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None

    def run(self) -> None:
        pending, running = list(self.jobs), {}
        while pending or running:
            for name in list(running):
                if self._reap(**running[name]):
                    del running[name]
            for job in list(pending):
                if self._ready(job, pending, running):
                    pending.remove(job)
                    running[job.name] = self._start(job)
                    time.sleep(STAGGER_S)
            time.sleep(0.5)

    def _ready(self, job: Job, pending: list[Job], running: dict) -> bool:
        if job_done(job) and not self.args.force:
            return self._drop(job, pending, "cached")
        failed = [n for n in job.needs if self.state.get(n, {}).get("status") not in (None, "ok", "cached")]
        if failed:
            return self._drop(job, pending, f"skipped (needs {failed[0]})")
        if job.gpus > len(self.gpu_ids):
            return self._drop(job, pending, f"skipped (needs {job.gpus} GPUs, {len(self.gpu_ids)} visible)")
        if any(n not in self.state for n in job.needs):
            return False
        if len(running) >= self.args.jobs or any(r["job"].exclusive for r in running.values()):
            return False
        if (job.exclusive and running) or len(self.free_gpus) < job.gpus:
            return False
        left = self._left()
        if left is not None and left < max(MIN_START_S, job.estimate_s or 0):
            return self._drop(job, pending, "not started (budget)")
        return True

    def _drop(self, job: Job, pending: list[Job], status: str) -> bool:
        pending.remove(job)
        self._finish(job, status, None)
        return False

    def _start(self, job: Job) -> dict:
        log = self.paths["logs"] / f"{job.name}.log"
        env = {**job_env(job, spawn=self.args.spawn, triton_f32=self.args.triton_f32), **job.env}
        gpus, self.free_gpus = self.free_gpus[:job.gpus], self.free_gpus[job.gpus:]
        if job.gpus:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        spec = dict(job.spec, env=env, log=str(log))
        if "out" in spec:  # a (forced) rerun's failure or timeout must not leave the earlier run's result
            Path(spec["out"]).unlink(missing_ok=True)
        spec_path = self.paths["work"] / "specs" / f"{job.name}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec, indent=1))
        limit = job.timeout_s * self.args.timeout_scale
        if self._left() is not None:
            limit = min(limit, self._left())
        print(f"[{time.strftime('%H:%M:%S')}] start {job.name} (limit {limit:.0f} s"
              + (f", GPUs {env['CUDA_VISIBLE_DEVICES']})" if job.gpus else ")"), flush=True)
        with open(log, "w") as sink:  # in the work folder; the repository root after any install (common.child_env)
            proc = subprocess.Popen(common.module_command(self.engine_module, str(spec_path)), stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True, cwd=self.paths["work"],
                                    env=common.child_env())
        return {"job": job, "proc": proc, "began": time.monotonic(), "limit": limit, "gpus": gpus}

    def _reap(self, job: Job, proc: subprocess.Popen, began: float, limit: float, gpus: list[str]) -> bool:
        code = proc.poll()
        timed_out = code is None and time.monotonic() - began > limit
        if code is None and not timed_out:
            return False
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: its engine core and workers
        except ProcessLookupError:
            pass
        proc.wait()
        self.free_gpus += gpus
        if timed_out:
            status = f"timeout after {limit:.0f} s"
        elif code != 0:
            status = f"failed (exit {code})"
        else:
            status = "ok" if job_done(job) else "incomplete"
        self._finish(job, status, round(time.monotonic() - began, 1))
        return True

    def _finish(self, job: Job, status: str, elapsed: float | None) -> None:
        log = self.paths["logs"] / f"{job.name}.log"
        self.state[job.name] = {"status": status, "elapsed_s": elapsed, "log": common.repo_relative(log)}
        print(f"[{time.strftime('%H:%M:%S')}] {status}: {job.name}" + (f" in {elapsed} s" if elapsed else ""),
              flush=True)
        if status not in ("ok", "cached") and log.exists() and not status.startswith(("skipped", "not started")):
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), flush=True)
        self.write_summary(job)

    def collect(self) -> dict[str, dict]:
        """Every engine job with a result on disk or a state in this run."""
        jobs = {}
        for j in self.all_jobs:
            if j.spec["kind"] != "engine":
                continue
            result = load_result(Path(j.spec["out"]))
            state = self.state.get(j.name) or ({"status": "earlier run"} if result else None)
            if state is None:
                continue
            log = self.paths["logs"] / f"{j.name}.log"
            jobs[j.name] = {"spec": j.spec, "result": result, "log": common.repo_relative(log), **state,
                            "backend_line": backend_line(log, j.spec["backend"])}
        return jobs

    def write_summary(self, job: Job | None = None) -> None:
        with common.working_dir(common.REPO):  # where the jobs' repository-relative log paths lead
            written = self.summarise(self.collect())
        common.stamp(written, self.provenance)
        if self.pack is not None:
            written.append(write_pack(self.pack, {"raw": self.paths["raw"], "logs": self.paths["logs"]}))
        elif job is not None and job.spec["kind"] == "engine":
            written += [Path(job.spec["out"]), self.paths["logs"] / f"{job.name}.log"]
        mirror(written, self.paths["results"], self.args.mirror)

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


def job_done(job: Job) -> bool:
    if job.spec["kind"] == "build":
        return (Path(job.spec["model_dir"]) / "config.json").exists()
    result = load_result(Path(job.spec["out"]))
    return bool(result and result.get("complete"))


def job_env(job: Job, *, spawn: bool, triton_f32: str = "ieee") -> dict[str, str]:
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "VLLM_USE_FLASHINFER_SAMPLER": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER", "0"),  # no FlashInfer there
           "DCP_TRITON_KERNELS": "triton"}
    if job.spec.get("dtype") == "float32" and triton_f32 != "default":
        # vLLM's Triton kernels leave tl.dot's float32 precision at Triton's default, TF32 on this GPU: make the
        # float32 reference float32 (dcp-triton's kernels ask for IEEE float32 explicitly; a cache-keyed knob).
        env["TRITON_F32_DEFAULT"] = triton_f32
    if spawn:  # the path where engine-core and worker processes unpickle the config before loading plugins
        env["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    return env


def load_result(path: Path) -> dict | None:
    try:
        with gzip.open(path, "rt") as f:
            return json.load(f)
    except (OSError, EOFError, ValueError):
        return None


def backend_line(log: Path, backend: str) -> str | None:
    """The log line proving which attention backend the engine's worker built."""
    if not log.exists():
        return None
    needle = DCP_STARTUP if backend == "dcp-triton" else f"Using AttentionBackendEnum.{backend} backend"
    return next((line.strip()[-300:] for line in log.read_text(errors="replace").splitlines() if needle in line), None)


def kv_cache_tokens(text: str) -> int | None:
    """The KV-cache capacity vLLM logs at start-up ("GPU KV cache size: 1,234 tokens"), or None."""
    found = KV_TOKENS.search(text)
    return int(found.group(1).replace(",", "")) if found else None


DCP_KERNELS = {"prefix_attention_kernel", "chunk_attention_kernel", "merge_kernel", "write_kv_cache_kernel",
               "split_merge_kernel"}
JIT_DEF = re.compile(r"@triton\.jit\b(?:\([^)]*\))?[^\n]*\n\s*def\s+(\w+)")


def dcp_kernel_names(kernels_dir: Path = common.REPO / "kernels") -> set[str]:
    """dcp-triton's kernels: the named ones and every ``@triton.jit`` function defined under kernels/."""
    found = {m.group(1) for path in sorted(kernels_dir.rglob("*.py")) for m in JIT_DEF.finditer(path.read_text())}
    return DCP_KERNELS | found


def jit_compiles(text: str) -> list[str]:
    """Kernel names of every JIT compile vLLM's JIT monitor warned about (after warm-up), in log order."""
    return [m.group(2) for m in JIT_EVENT.finditer(text)]


def mirror(paths: list[Path], root: Path, target: str | None) -> None:
    """Copy what was just written to ``target`` (``$OUT`` on the GPU machine), so a run cut short keeps it."""
    if not target or Path(target).resolve() == root.resolve():  # the results are already there
        return
    for path in paths:
        if path.exists():
            dest = Path(target) / path.resolve().relative_to(root.resolve())
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


def write_pack(pack: Path, folders: dict[str, Path]) -> Path:
    """One gzipped tarball of the given folders' files, as ``<key>/<file name>``; atomic."""
    pack.parent.mkdir(parents=True, exist_ok=True)
    tmp = pack.with_name(pack.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        for key, folder in folders.items():
            for path in sorted(folder.glob("*")) if folder.is_dir() else []:
                if path.is_file() and not path.name.endswith(".tmp"):
                    tar.add(path, arcname=f"{key}/{path.name}")
    tmp.replace(pack)
    return pack


def unpack(pack: Path, folders: dict[str, Path]) -> int:
    """Restore ``write_pack``'s files that are missing from ``folders``; nothing outside them is written."""
    if not pack.exists():
        return 0
    restored = 0
    with tarfile.open(pack, "r:gz") as tar:
        for member in tar.getmembers():
            key, _, name = member.name.partition("/")
            if key not in folders or not member.isfile() or not name or "/" in name or name.startswith("."):
                continue
            dest = folders[key] / name
            if not dest.exists():
                dest.parent.mkdir(parents=True, exist_ok=True)
                dest.write_bytes(tar.extractfile(member).read())
                restored += 1
    return restored


def select_only(jobs: list[Job], only: str) -> list[Job]:
    """Jobs whose names match any of the comma-separated glob patterns, in catalogue order."""
    patterns = [p.strip() for p in only.split(",") if p.strip()]
    chosen = [j for j in jobs if any(fnmatch.fnmatchcase(j.name, p) for p in patterns)]
    if not chosen:
        raise SystemExit(f"--only {only!r} matches no job; see --list")
    return chosen


def with_needs(jobs: list[Job], chosen: list[Job], *, pending_only: bool = False) -> list[Job]:
    """``chosen`` preceded by the jobs they need (builds), in catalogue order; with ``pending_only``, only what the
    chosen jobs that are not finished yet need (a resumed run does not rebuild a checkpoint it will not use)."""
    needed = {n for j in chosen if not (pending_only and job_done(j)) for n in j.needs}
    return [j for j in jobs if j.name in needed and j not in chosen] + chosen


def simulate(jobs: list[Job], *, gpus: int, parallel: int, done: set[str]) -> dict[str, tuple[float, float] | None]:
    """Start and end of every job if each took its ``estimate_s``, under the runner's rules (order, ``parallel`` at
    once, exclusive jobs alone, GPUs); finished jobs (``done``) take no time; None: the job can never start."""
    t, free, pending, running = 0.0, gpus, [j for j in jobs if j.name not in done], {}
    times: dict[str, tuple[float, float] | None] = {j.name: (0.0, 0.0) for j in jobs if j.name in done}
    while pending:
        for job in list(pending):
            if job.gpus > gpus or any(times.get(n, (0, 0)) is None for n in job.needs):
                times[job.name] = None
                pending.remove(job)
            elif (all(n in times and n not in running for n in job.needs if n in {j.name for j in jobs})
                  and len(running) < parallel and not any(j.exclusive for j, _ in running.values())
                  and not (job.exclusive and running) and free >= job.gpus):
                times[job.name] = (t, t + (job.estimate_s or 0))
                running[job.name], free = (job, t + (job.estimate_s or 0)), free - job.gpus
                pending.remove(job)
        if not running:
            break
        name = min(running, key=lambda n: running[n][1])
        job, t = running.pop(name)
        free += job.gpus
    return times


def visible_gpus() -> list[str]:
    """The GPU ids jobs may be given: CUDA_VISIBLE_DEVICES when set, else one per ``nvidia-smi -L`` line."""
    ids = os.environ.get("CUDA_VISIBLE_DEVICES")
    if ids is not None:
        return [i.strip() for i in ids.split(",") if i.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i in range(sum(line.startswith("GPU ") for line in listed.splitlines()))]


def print_list(jobs: list[Job]) -> None:
    for job in jobs:
        print(f"{job.name:48s} timeout {job.timeout_s:4.0f} s" + ("  exclusive" if job.exclusive else "")
              + (f"  gpus {job.gpus}" if job.gpus else ""))


def parser_for(doc: str, *, name: str, work_dir: str) -> argparse.ArgumentParser:
    """The options every end-to-end script has; the script adds its own."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0], epilog="\n".join(doc.splitlines()[2:]),
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", help="comma-separated glob patterns of job names (see --list); builds added")
    parser.add_argument("--list", action="store_true", help="print the selected jobs and exit")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget: later jobs are not "
                        "started and running ones are cut at its end (default: none)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every job's timeout")
    parser.add_argument("--force", action="store_true", help="rerun jobs whose results exist")
    parser.add_argument("--spawn", action="store_true", help="VLLM_WORKER_MULTIPROC_METHOD=spawn in every job")
    parser.add_argument("--triton-f32", choices=("ieee", "tf32", "default"), default="ieee",
                        help="TRITON_F32_DEFAULT of float32 jobs (default: ieee; 'default' leaves Triton's TF32)")
    parser.add_argument("--name", default=name, help=f"summary file name (default: {name})")
    parser.add_argument("--results-dir", type=Path, default=common.RESULTS)
    parser.add_argument("--work-dir", type=Path, default=Path(work_dir), help="models and job specs")
    parser.add_argument("--mirror", default=os.environ.get("OUT"), help="also copy results here as they finish "
                        "(default: $OUT)")
    return parser


def check_jobs_option(parser: argparse.ArgumentParser, jobs: int) -> None:
    if jobs < 1:
        parser.error(f"--jobs {jobs}: need at least 1")


def require(modules: tuple[str, ...]) -> None:
    """Fail in a second, not after every job's engine start, when a job process could not import its modules."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not importable here; on the H200 source the vLLM bundle's setup.sh "
                         "first (run_h200.sh's bench stage does once vLLM is in /tmp/vs: see its unpack stage)"
                         + ("; dcp_plugin: install dcp-triton (run_h200.sh installs it into /tmp/dcp and puts that on "
                            "PYTHONPATH)" if "dcp_plugin" in missing else ""))


def state_paths(results: Path, logs: Path, raw: Path, work: Path) -> dict[str, Path]:
    """The folders a run uses, absolute (jobs run in ``work``)."""
    return {"results": results.resolve(), "logs": logs.resolve(), "raw": raw.resolve(), "work": work.resolve()}


def run_jobs(runner: Runner, summary_md: Path) -> None:
    """Make the state folders, run, write the final summary and print it."""
    for key in ("logs", "raw", "work"):
        runner.paths[key].mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runner.run()
    runner.write_summary()
    print(f"done in {time.monotonic() - started:.0f} s: {summary_md}", flush=True)
    if summary_md.exists():
        print(summary_md.read_text(), flush=True)
