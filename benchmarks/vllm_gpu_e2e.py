"""dcp-triton inside real vLLM on one GPU: agreement with vLLM's TRITON_ATTN and FLASH_ATTN, and throughput.

Random-initialised Llama checkpoints are built on the machine (transformers' default init, float32): ``gqa5-d64``
(20 Q / 4 KV heads, head_dim 64) and ``llama-d128`` (32 Q / 8 KV heads, head_dim 128), 4 layers each. Every
configuration is one job: its own process (one vLLM engine), its own log, under a timeout; a finished job's result
is saved at once and reused by later invocations (resumable), and the summary is rewritten after every job:

    benchmarks/results/<name>.json / .md / .png        comparisons, checks, throughput, job table
    benchmarks/results/vllm_e2e_raw/<job>.json.gz      per-job raw results (tokens, logprobs)
    benchmarks/results/vllm_e2e_logs/<job>.log         per-job vLLM log

Full set: float32 teacher-forced prompt logprobs (32 prompts of 64-2000 tokens), greedy 64 tokens, a prefix-cache
case (dcp-triton vs TRITON_ATTN: max |logprob difference| <= 1e-3; every greedy divergence at a near tie), a
chunked-prefill case (max_num_batched_tokens=256), the same in bf16 against TRITON_ATTN and FLASH_ATTN (reported),
a float32 case with CUDA graphs (vLLM's default FULL_AND_PIECEWISE: decode steps replay full graphs), and offline
throughput (64 x 8K-token prompts / 256 output tokens; a decode-heavy batch) for the three backends, eager and with
CUDA graphs. ``--quick``: float32 prompt-logprob agreement (gqa5, 32
prompts up to 2000 tokens) and bf16 greedy agreement against both on 8 prompts, five engines at once. float32
jobs run with TRITON_F32_DEFAULT=ieee, so vLLM's Triton kernels compute float32 dots in float32, not TF32.

    python benchmarks/vllm_gpu_e2e.py --quick --budget-s 220
    python benchmarks/vllm_gpu_e2e.py --only 'agree-gqa5-*' --jobs 3
    python benchmarks/vllm_gpu_e2e.py --list
"""

from __future__ import annotations

import argparse
import fnmatch
import gzip
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vllm_e2e_report as report  # noqa: E402

HERE = Path(__file__).resolve().parent
ENGINE_SCRIPT = HERE / "vllm_e2e_engine.py"
_LLAMA = dict(num_hidden_layers=4, vocab_size=8192, max_position_embeddings=16384, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MODELS = {
    "gqa5-d64": dict(hidden_size=1280, intermediate_size=3456, num_attention_heads=20, num_key_value_heads=4,
                     head_dim=64, **_LLAMA),
    "llama-d128": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, **_LLAMA),
}
MAIN_PROMPTS = dict(count=32, min_len=64, max_len=2000, seed=1)
LONG_PROMPTS = dict(count=6, min_len=1200, max_len=2000, seed=2)
PREFIX_PROMPTS = dict(prefix_len=1040, suffix_lens=[7, 19, 33, 48], seed=4)
WORKLOADS = [dict(workload="prefill-8k", requests=64, prompt_len=8192, output_len=256),
             dict(workload="decode-heavy", requests=256, prompt_len=256, output_len=1024)]
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
DCP_STARTUP = "dcp-triton attention: backend=DCP_TRITON"
REQUIRED_MODULES = ("vllm", "transformers")  # what the job processes import
STAGGER_S = 2.0  # between job starts: engines pick ports and fill compile caches at start-up
MIN_START_S = 40  # a job needs at least this much budget left to be worth starting (engine init ~20 s)


@dataclass
class Job:
    name: str
    spec: dict
    timeout_s: float
    needs: list[str] = field(default_factory=list)
    exclusive: bool = False  # timing runs have the GPU to themselves


def catalogue(work: Path, raw: Path) -> list[Job]:
    """Every job the script knows, builds first, in the order they should run."""
    jobs = [Job(f"build-{m}", {"kind": "build", "model_dir": str(work / "models" / m), "seed": 0, "config": cfg}, 240)
            for m, cfg in MODELS.items()]

    def engine(name, model, backend, dtype, case, tasks, timeout, *, mode="eager", exclusive=False, **overrides):
        engine_kwargs = dict(
            model=str(work / "models" / model), skip_tokenizer_init=True, dtype=dtype, seed=0,
            enforce_eager=mode == "eager", max_model_len=2304, kv_cache_memory_bytes=4 << 30,
            gpu_memory_utilization=0.12, attention_backend=backend, enable_prefix_caching=True, max_num_seqs=64)
        if mode == "graphs":  # vLLM's default FULL_AND_PIECEWISE, over fewer capture sizes (start-up time)
            engine_kwargs["compilation_config"] = {"cudagraph_capture_sizes": GRAPH_SIZES}
        engine_kwargs.update(overrides)
        spec = {"kind": "engine", "model": model, "backend": backend, "dtype": dtype, "case": case, "mode": mode,
                "vocab": MODELS[model]["vocab_size"], "engine": engine_kwargs, "tasks": tasks,
                "out": str(raw / f"{name}.json.gz")}
        return Job(name, spec, timeout, [f"build-{model}"], exclusive)

    logprobs = {"name": "logprobs", "type": "logprobs", "prompts": MAIN_PROMPTS}
    greedy = {"name": "greedy", "type": "greedy", "prompts": MAIN_PROMPTS, "max_tokens": 64}
    prefix = {"name": "prefix", "type": "prefix", "prompts": PREFIX_PROMPTS, "max_tokens": 16}
    long_logprobs = {"name": "logprobs-long", "type": "logprobs", "prompts": LONG_PROMPTS}
    long_greedy = {"name": "greedy-long", "type": "greedy", "prompts": LONG_PROMPTS, "max_tokens": 32}
    greedy8 = {"name": "greedy", "type": "greedy", "prompts": {**MAIN_PROMPTS, "count": 8, "seed": 3},
               "max_tokens": 64}
    for backend in ("dcp-triton", "TRITON_ATTN"):
        jobs.append(engine(f"quick-gqa5-fp32-{backend}", "gqa5-d64", backend, "float32", "quick", [logprobs], 200))
    for backend in ("dcp-triton", "TRITON_ATTN", "FLASH_ATTN"):
        jobs.append(engine(f"quick-gqa5-bf16-{backend}", "gqa5-d64", backend, "bfloat16", "quick", [greedy8], 200))
    for model in MODELS:
        short = model.split("-")[0]
        for backend in ("dcp-triton", "TRITON_ATTN"):
            jobs.append(engine(f"agree-{short}-fp32-main-{backend}", model, backend, "float32", "main",
                               [logprobs, greedy, prefix], 300))
            jobs.append(engine(f"agree-{short}-fp32-chunked-{backend}", model, backend, "float32", "chunked",
                               [long_logprobs, long_greedy], 300, max_num_batched_tokens=256, max_num_seqs=16))
        for backend in ("dcp-triton", "TRITON_ATTN", "FLASH_ATTN"):  # FLASH_ATTN has no float32
            jobs.append(engine(f"agree-{short}-bf16-main-{backend}", model, backend, "bfloat16", "main",
                               [logprobs, greedy, prefix], 300))
        for backend in ("dcp-triton", "TRITON_ATTN"):  # greedy decode steps replay full CUDA graphs
            jobs.append(engine(f"agree-{short}-fp32-graphs-{backend}", model, backend, "float32", "graphs",
                               [logprobs, greedy], 400, mode="graphs"))
    throughput = [{"name": "throughput", "type": "throughput", "workloads": WORKLOADS}]
    for backend, mode in [(b, m) for m in ("eager", "graphs") for b in ("dcp-triton", "TRITON_ATTN", "FLASH_ATTN")]:
        jobs.append(engine(f"tput-llama-bf16-{backend}-{mode}", "llama-d128", backend, "bfloat16", "throughput",
                           throughput, 480 if mode == "eager" else 600, mode=mode, exclusive=True,
                           max_model_len=8192 + 256 + 64, kv_cache_memory_bytes=24 << 30,
                           gpu_memory_utilization=0.5, max_num_seqs=256))
    return jobs


def select(jobs: list[Job], *, quick: bool, only: str | None) -> list[Job]:
    if only:
        patterns = [p.strip() for p in only.split(",") if p.strip()]
        chosen = [j for j in jobs if any(fnmatch.fnmatchcase(j.name, p) for p in patterns)]
        if not chosen:
            raise SystemExit(f"--only {only!r} matches no job; see --list")
    else:
        chosen = [j for j in jobs if j.name.startswith("quick-") == quick and not j.name.startswith("build-")]
    needed = {n for j in chosen for n in j.needs}
    return [j for j in jobs if j.name in needed and j not in chosen] + chosen


class Runner:
    """Runs jobs as process groups (at most ``parallel`` at once), within an optional wall-clock budget."""

    def __init__(self, args, jobs: list[Job], all_jobs: list[Job], paths: dict[str, Path]) -> None:
        self.args, self.jobs, self.all_jobs, self.paths = args, jobs, all_jobs, paths
        self.state: dict[str, dict] = {}
        self.deadline = time.monotonic() + args.budget_s if args.budget_s else None

    def run(self) -> None:
        pending, running = list(self.jobs), {}
        while pending or running:
            for name in list(running):
                if self._reap(name, *running[name]):
                    del running[name]
            for job in list(pending):
                if self._ready(job, pending, running):
                    pending.remove(job)
                    running[job.name] = self._start(job)
                    time.sleep(STAGGER_S)
            time.sleep(0.5)

    def _ready(self, job: Job, pending: list[Job], running: dict) -> bool:
        if self._done(job) and not self.args.force:
            pending.remove(job)
            self._finish(job, "cached", None)
            return False
        failed = [n for n in job.needs if self.state.get(n, {}).get("status") not in (None, "ok", "cached")]
        if failed:
            pending.remove(job)
            self._finish(job, f"skipped (needs {failed[0]})", None)
            return False
        if any(n not in self.state for n in job.needs):
            return False
        if len(running) >= self.args.jobs or any(r[0].exclusive for r in running.values()):
            return False
        if job.exclusive and running:
            return False
        left = self._left()
        if left is not None and left < MIN_START_S:
            pending.remove(job)
            self._finish(job, "not started (budget)", None)
            return False
        return True

    def _start(self, job: Job):
        spec = dict(job.spec, env=job_env(job, spawn=self.args.spawn, triton_f32=self.args.triton_f32))
        spec_path = self.paths["work"] / "specs" / f"{job.name}.json"
        spec_path.parent.mkdir(parents=True, exist_ok=True)
        spec_path.write_text(json.dumps(spec, indent=1))
        log = self.paths["logs"] / f"{job.name}.log"
        limit = job.timeout_s * self.args.timeout_scale
        if self._left() is not None:
            limit = min(limit, self._left())
        print(f"[{time.strftime('%H:%M:%S')}] start {job.name} (limit {limit:.0f} s)", flush=True)
        with open(log, "w") as sink:
            proc = subprocess.Popen([sys.executable, str(ENGINE_SCRIPT), str(spec_path)], stdout=sink,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        return job, proc, time.monotonic(), limit

    def _reap(self, name: str, job: Job, proc: subprocess.Popen, began: float, limit: float) -> bool:
        code = proc.poll()
        timed_out = code is None and time.monotonic() - began > limit
        if code is None and not timed_out:
            return False
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the job's own session: its engine core and workers
        except ProcessLookupError:
            pass
        proc.wait()
        if timed_out:
            status = f"timeout after {limit:.0f} s"
        elif code != 0:
            status = f"failed (exit {code})"
        else:
            status = "ok" if self._done(job) else "incomplete"
        self._finish(job, status, round(time.monotonic() - began, 1))
        return True

    def _finish(self, job: Job, status: str, elapsed: float | None) -> None:
        log = self.paths["logs"] / f"{job.name}.log"
        self.state[job.name] = {"status": status, "elapsed_s": elapsed, "log": str(log)}
        print(f"[{time.strftime('%H:%M:%S')}] {status}: {job.name}" + (f" in {elapsed} s" if elapsed else ""),
              flush=True)
        if status not in ("ok", "cached") and log.exists() and not status.startswith(("skipped", "not started")):
            print("".join(log.read_text(errors="replace").splitlines(keepends=True)[-40:]), flush=True)
        self.write_summary(job)

    def write_summary(self, job: Job | None = None) -> None:
        jobs = {}
        for j in self.all_jobs:
            if j.spec["kind"] != "engine":
                continue
            result = load_result(Path(j.spec["out"]))
            state = self.state.get(j.name) or ({"status": "earlier run"} if result else None)
            if state is None:
                continue
            jobs[j.name] = {"spec": j.spec, "result": result, **state,
                            "backend_line": backend_line(self.paths["logs"] / f"{j.name}.log", j.spec["backend"])}
        summary = report.analyse(jobs)
        meta = next(({k: r["result"].get(k) for k in ("gpu", "vllm", "torch")} for r in jobs.values() if r["result"]),
                    {})
        meta.update(models=MODELS, triton_f32=self.args.triton_f32)
        written = report.write_summary(summary, meta, self.paths["results"], self.args.name)
        if job is not None and job.spec["kind"] == "engine":
            written += [Path(job.spec["out"]), self.paths["logs"] / f"{job.name}.log"]
        mirror(written, self.paths["results"], self.args.mirror)

    def _done(self, job: Job) -> bool:
        if job.spec["kind"] == "build":
            return (Path(job.spec["model_dir"]) / "config.json").exists()
        result = load_result(Path(job.spec["out"]))
        return bool(result and result.get("complete"))

    def _left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


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


def mirror(paths: list[Path], root: Path, target: str | None) -> None:
    """Copy what was just written to ``target`` (``$OUT`` on the GPU machine), so a run cut short keeps it."""
    if not target:
        return
    for path in paths:
        if path.exists():
            dest = Path(target) / path.resolve().relative_to(root.resolve())
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[2:]))
    parser.add_argument("--quick", action="store_true", help="the quick subset (jobs named quick-*)")
    parser.add_argument("--only", help="comma-separated glob patterns of job names (see --list); builds added")
    parser.add_argument("--list", action="store_true", help="print the selected jobs and exit")
    parser.add_argument("--jobs", type=int, default=None, help="jobs at once (default: 5 with --quick, else 3)")
    parser.add_argument("--budget-s", type=float, default=None, help="wall-clock budget: later jobs are not "
                        "started and running ones are cut at its end (default: none)")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every job's timeout")
    parser.add_argument("--force", action="store_true", help="rerun jobs whose results exist")
    parser.add_argument("--spawn", action="store_true", help="VLLM_WORKER_MULTIPROC_METHOD=spawn in every job")
    parser.add_argument("--triton-f32", choices=("ieee", "tf32", "default"), default="ieee",
                        help="TRITON_F32_DEFAULT of float32 jobs (default: ieee; 'default' leaves Triton's TF32)")
    parser.add_argument("--name", default="vllm_e2e", help="summary file name (default: vllm_e2e)")
    parser.add_argument("--results-dir", type=Path, default=HERE / "results")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/dcp_vllm_e2e"), help="models and job specs")
    parser.add_argument("--mirror", default=os.environ.get("OUT"), help="also copy results here as they finish "
                        "(default: $OUT)")
    args = parser.parse_args(argv)
    if args.jobs is None:
        args.jobs = 5 if args.quick else 3
    if args.jobs < 1:
        parser.error(f"--jobs {args.jobs}: need at least 1")
    paths = {"results": args.results_dir, "logs": args.results_dir / "vllm_e2e_logs",
             "raw": args.results_dir / "vllm_e2e_raw", "work": args.work_dir}
    all_jobs = catalogue(paths["work"], paths["raw"])
    jobs = select(all_jobs, quick=args.quick, only=args.only)
    if args.list:
        for job in jobs:
            print(f"{job.name:48s} timeout {job.timeout_s:4.0f} s" + ("  exclusive" if job.exclusive else ""))
        return
    missing = [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]
    if missing:  # fail in a second, not after every job's engine start
        raise SystemExit(f"{', '.join(missing)} not importable here; on the H200 source the vLLM bundle's setup.sh "
                         "first (run_h200.sh's bench stage does when /tmp/vs/vllm was unpacked by its tests stage)")
    for key in ("logs", "raw", "work"):
        paths[key].mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runner = Runner(args, jobs, all_jobs, paths)
    runner.run()
    runner.write_summary()
    print(f"done in {time.monotonic() - started:.0f} s: {paths['results'] / args.name}.md", flush=True)
    print((paths["results"] / f"{args.name}.md").read_text(), flush=True)


if __name__ == "__main__":
    main()
