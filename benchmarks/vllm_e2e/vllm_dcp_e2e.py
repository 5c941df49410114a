"""dcp-triton inside real vLLM on two GPUs: decode context parallelism (DCP = 2) against FLASH_ATTN and DCP = 1.

One random-initialised Llama checkpoint, ``mqa-d128`` (16 Q heads / 1 KV head, head_dim 128, hidden 2048, 4 layers,
vocab 8192; transformers' default init, saved float32), built on the machine. With one KV head, tensor parallelism
at tp = 2 stores the whole KV cache on both GPUs; DCP = 2 shards it along tokens, halving the KV bytes per GPU.
Every configuration is one job (one engine process, its own log and timeout; see e2e_runner.py), run in this order
(most valuable first; ``--plan`` prints it with estimated times):

  1. tp=2, bf16, vLLM's default CUDA-graph mode (FULL_AND_PIECEWISE, fewer capture sizes): dcp-triton DCP=2 with
     dcp_comm_backend ag_rs and a2a, FLASH_ATTN DCP=2 (``tp2-*``), each engine running the loads decode-heavy
     (256 x 512-token prompts -> 512 tokens), small-batch (64 x 512 -> 128), prefill-heavy (32 x 8192 -> 64) and
     long-context (16 x 32768 -> 64) with a KV cache of 768 MiB per GPU, which holds all 16 long requests at
     DCP = 2 and about 12 at DCP = 1 (vLLM's logged capacity is reported);
  2. float32 agreement, tp=2: dcp-triton DCP=2 ag_rs vs TRITON_ATTN DCP=1, teacher-forced prompt logprobs (32
     prompts of 64-4000 tokens, chunked prefill of 512 tokens so later chunks read the sharded prefix) and greedy
     32 tokens (``fp32-*``; TRITON_F32_DEFAULT=ieee); then the DCP=1 engines of 1 (dcp-triton, FLASH_ATTN), then
     float32 a2a;
  3. the jobs of 1 eager (``*-eager``; ``--no-eager`` leaves them out);
  4. one GPU (tp=1, DCP=1): dcp-triton, FLASH_ATTN, TRITON_ATTN, eager and with graphs, decode-heavy and
     small-batch (``tp1-*``; two at once on two GPUs) -> host_overhead_h200.json's ``vllm_dcp1`` part (merged);
  5. compile check (``jit-*``): dcp-triton, tp=1, vLLM's JIT monitor verbose; batches in order (16 x 512 -> 48,
     the same again, new lengths, a chunked prefill, decode steps) and the JIT compiles logged after each.

Throughput: output tokens/s after a warm-up of a quarter of the requests (other prompts, same shapes, full output
length; its time is recorded too), so compiles at larger batches show in the numbers. TTFT / TPOT medians come
from vLLM's RequestOutput.metrics (engines run with disable_log_stats=False). NVLink multicast stays off in every
job (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1). Results:

    benchmarks/results/<name>.json / .md / .png    summary (contract: "summary"), tables, plot
    benchmarks/results/<name>_jobs.tar.gz          every job's log and raw result (also unpacked to resume)
    benchmarks/results/host_overhead_h200.json     summary.vllm_dcp1 and vllm_dcp1_jobs (other keys kept)

The state (checkpoint, logs, raw results) lives in --work-dir; finished jobs are reused, so a second call
continues where the first stopped (a cold machine resumes from the tarball).

    python -m benchmarks.vllm_e2e.vllm_dcp_e2e --budget-s 540         # 2 GPUs: everything, in order
    python -m benchmarks.vllm_e2e.vllm_dcp_e2e --dcp-full-graphs 1    # dcp-triton DCP > 1 decode in full CUDA graphs
    python -m benchmarks.vllm_e2e.vllm_dcp_e2e --only 'tp1-*,jit-*'   # 1 GPU: the single-GPU set, the compile check
    python -m benchmarks.vllm_e2e.vllm_dcp_e2e --plan --budget-s 540
    python -m benchmarks.vllm_e2e.vllm_dcp_e2e --summarise            # here, from a tarball that came back
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_dcp_report as dcp_report
from benchmarks.vllm_e2e.e2e_runner import Job
from benchmarks.vllm_e2e.vllm_dcp_report import LOADS, LONG_LOAD
from benchmarks.vllm_e2e.vllm_gpu_e2e import ENGINE_MODULE, GRAPH_SIZES, LLAMA_COMMON

MODEL = "mqa-d128"
CONFIG = dict(LLAMA_COMMON, hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=1,
              head_dim=128, max_position_embeddings=40960)
# Per GPU and token: K and V of the one KV head, bf16, every layer (tp replicates it; DCP = 2 halves it).
KV_BYTES_PER_TOKEN = CONFIG["num_hidden_layers"] * 2 * CONFIG["head_dim"] * 2
LONG_KV_BYTES = 768 << 20  # 393,216 tokens at DCP = 1 (16 x 32,832 need 525,312), 786,432 at DCP = 2
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
FP32_PROMPTS = dict(count=32, min_len=64, max_len=4000, seed=1)
FP32_GREEDY = dict(count=8, min_len=64, max_len=4000, seed=3)
REQUIRED_MODULES = ("vllm", "transformers", "dcp_plugin")  # what the job processes import
# (config, backend, dcp, comm) of the two-GPU throughput jobs, in run order
TP2 = [("dcp_triton_dcp2_ag_rs", "dcp-triton", 2, "ag_rs"), ("dcp_triton_dcp2_a2a", "dcp-triton", 2, "a2a"),
       ("flash_attn_dcp2", "FLASH_ATTN", 2, "ag_rs"), ("dcp_triton_dcp1", "dcp-triton", 1, None),
       ("flash_attn_dcp1", "FLASH_ATTN", 1, None)]
FP32 = [("dcp_triton_dcp2_ag_rs", "dcp-triton", 2, "ag_rs"), ("dcp_triton_dcp2_a2a", "dcp-triton", 2, "a2a"),
        ("triton_attn_dcp1", "TRITON_ATTN", 1, None)]
TP1_BACKENDS = ("dcp-triton", "FLASH_ATTN", "TRITON_ATTN")
COMPILE_BATCHES = [
    {"name": "first", "prompts": dict(count=16, min_len=512, max_len=512, seed=21), "max_tokens": 48},
    {"name": "repeat (prefix-cache hits)", "prompts": dict(count=16, min_len=512, max_len=512, seed=21),
     "max_tokens": 48},
    {"name": "new lengths", "prompts": dict(count=16, min_len=37, max_len=1500, seed=22), "max_tokens": 48},
    {"name": "chunked prefill", "prompts": dict(count=2, min_len=3000, max_len=6000, seed=23), "max_tokens": 16},
    {"name": "decode", "prompts": dict(count=32, min_len=64, max_len=300, seed=24), "max_tokens": 256},
]
COMPILE_CHUNK = 2048  # max_num_batched_tokens of the compile check: the 3,000-6,000-token prompts take 2-3 steps
LOG_SETTLE_S = 1.0  # compile check: wait after each batch before reading the log
# Expected wall time per job (vLLM import ~15 s, engine start ~40-70 s with graphs at tp = 2, loads), for --plan and
# the budget rule (a job is not started with less budget left than this); timeouts are twice these.
ESTIMATE_S = {("tp2", "all", "graphs"): 150, ("tp2", "all", "eager"): 130, ("fp32", "", "graphs"): 100,
              ("tp1", "", "graphs"): 95,
              ("tp1", "", "eager"): 75, ("jit", "", "graphs"): 90, ("jit", "", "eager"): 70}


def kv_capacity_tokens(kv_bytes: int, dcp: int) -> int:
    """Tokens of context a KV cache of ``kv_bytes`` per GPU holds: each GPU stores 1/dcp of every request's tokens."""
    return kv_bytes // KV_BYTES_PER_TOKEN * dcp


def catalogue(work: Path, raw: Path, *, full_graphs: str | None = None) -> list[Job]:
    """Every job, in the order they should run (the build first). ``full_graphs``: DCP_TRITON_DCP_FULL_GRAPHS for
    the dcp-triton jobs (None: the library's default)."""
    model_dir = work / "models" / MODEL
    build = Job(f"build-{MODEL}", {"kind": "build", "model_dir": str(model_dir), "seed": 0, "config": CONFIG}, 240,
                env=dict(NO_MULTICAST), estimate_s=40, group="build")

    def engine(name: str, group: str, part: str, config: tuple, mode: str, tasks: list, *, tp: int = 2,
               dtype: str = "bfloat16", **overrides) -> Job:
        key, backend, dcp, comm = config
        kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=0,
                      enforce_eager=mode == "eager", max_model_len=8192 + 128, kv_cache_memory_bytes=4 << 30,
                      gpu_memory_utilization=0.3, attention_backend=backend, max_num_seqs=256,
                      tensor_parallel_size=tp, decode_context_parallel_size=dcp, disable_log_stats=False)
        if comm is not None:
            kwargs["dcp_comm_backend"] = comm
        if mode == "graphs":  # vLLM's default FULL_AND_PIECEWISE, over fewer capture sizes (start-up time)
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": GRAPH_SIZES}
        kwargs.update(overrides)
        spec = {"kind": "engine", "model": MODEL, "backend": backend, "dtype": dtype, "mode": mode, "group": group,
                "part": part, "config": key, "tp": tp, "dcp": dcp, "comm": comm,
                "vocab": CONFIG["vocab_size"], "engine": kwargs, "tasks": tasks, "out": str(raw / f"{name}.json.gz")}
        estimate = ESTIMATE_S[(group, part, mode)]
        env = dict(NO_MULTICAST)
        if backend == "dcp-triton" and full_graphs is not None:
            env["DCP_TRITON_DCP_FULL_GRAPHS"] = full_graphs
            spec["dcp_full_graphs"] = full_graphs
        return Job(name, spec, 2 * estimate, [build.name], exclusive=tp > 1, gpus=tp, env=env,
                   estimate_s=estimate, group=f"{group} {mode}")

    def loads(*names: str) -> list[dict]:  # one task per load: a job cut short keeps the loads it finished
        return [{"name": f"throughput-{n}", "type": "throughput", "warmup": "quarter", "workloads": [
            dict(workload=n, requests=LOADS[n][0], prompt_len=LOADS[n][1], output_len=LOADS[n][2])]} for n in names]

    def slug(config: tuple) -> str:
        return f"{config[1]}-dcp{config[2]}" + (f"-{config[3]}" if config[1] == "dcp-triton" and config[3] else "")

    every_load = loads("decode-heavy", "small-batch", "prefill-heavy", LONG_LOAD)
    long_kw = dict(max_model_len=LOADS[LONG_LOAD][1] + 128, kv_cache_memory_bytes=LONG_KV_BYTES)
    fp32_tasks = [{"name": "logprobs", "type": "logprobs", "prompts": FP32_PROMPTS},
                  {"name": "greedy", "type": "greedy", "prompts": FP32_GREEDY, "max_tokens": 32}]

    def tp2(configs, mode):
        return [engine(f"tp2-{slug(c)}-{mode}", "tp2", "all", c, mode, every_load, **long_kw) for c in configs]

    def fp32(configs):
        return [engine(f"fp32-tp2-{slug(c)}", "fp32", "", c, "graphs", fp32_tasks, dtype="float32",
                       max_num_batched_tokens=512, max_num_seqs=32) for c in configs]

    # Most valuable first: DCP = 2 against FLASH_ATTN, float32 exactness, then the DCP = 1 baselines.
    jobs = [build, *tp2(TP2[:3], "graphs"), *fp32([FP32[0], FP32[2]]), *tp2(TP2[3:], "graphs"), *fp32([FP32[1]]),
            *tp2(TP2, "eager")]
    tp1 = [(f"{b.lower().replace('-', '_')}_dcp1", b, 1, None) for b in TP1_BACKENDS]
    for mode in ("eager", "graphs"):
        jobs += [engine(f"tp1-{c[1]}-{mode}", "tp1", "", c, mode, loads("decode-heavy", "small-batch"), tp=1,
                        max_model_len=512 + 512 + 128) for c in tp1]
    check = [{"name": "compile-check", "type": "compile_check", "batches": COMPILE_BATCHES, "settle_s": LOG_SETTLE_S}]
    for mode in ("graphs", "eager"):
        jobs.append(engine(f"jit-tp1-dcp-triton-{mode}", "jit", "", tp1[0], mode, check, tp=1,
                           max_num_batched_tokens=COMPILE_CHUNK, jit_monitor_mode="warn", jit_monitor_verbose=True))
    return jobs


def select(jobs: list[Job], *, only: str | None, eager: bool, force: bool) -> list[Job]:
    chosen = runner.select_only(jobs, only) if only else [j for j in jobs if j.spec["kind"] == "engine"]
    if not eager:
        chosen = [j for j in chosen if j.spec.get("mode") != "eager"]
    return runner.with_needs(jobs, chosen, pending_only=not force)


def print_plan(jobs: list[Job], *, gpus: int, parallel: int, budget_s: float | None) -> None:
    """The job order with estimated start and end times (finished jobs take none), and the total per group."""
    done = {j.name for j in jobs if runner.job_done(j)}
    times = runner.simulate(jobs, gpus=gpus, parallel=parallel, done=done)
    print(f"{'job':44s} {'group':12s} gpus  est s  start -> end (s)   [{gpus} GPUs, {parallel} jobs at once"
          + (f", budget {budget_s:.0f} s]" if budget_s else "]"))
    groups: dict[str, float] = {}
    for job in jobs:
        span = times.get(job.name)
        note = "done" if job.name in done else "never (too few GPUs)" if span is None else \
            f"{span[0]:5.0f} -> {span[1]:5.0f}" + (" (past budget)" if budget_s and span[1] > budget_s else "")
        est = 0 if job.name in done else job.estimate_s or 0
        groups[job.group] = groups.get(job.group, 0) + est
        print(f"{job.name:44s} {job.group:12s} {job.gpus:4d} {est:6.0f}  {note}")
    ends = [span[1] for span in times.values() if span]
    print("per group (sum of estimates): " + ", ".join(f"{g} {s:.0f} s" for g, s in groups.items()))
    print(f"estimated wall time: {max(ends, default=0):.0f} s")


def catalogue_parser(doc: str, *, name: str, work_dir: str):
    """``runner.parser_for`` with the two options ``one_engine_at_a_time`` reads besides (a catalogue script adds
    its own after them)."""
    parser = runner.parser_for(doc, name=name, work_dir=work_dir)
    parser.add_argument("--plan", action="store_true", help="print the job order and estimated times, and exit")
    parser.add_argument("--summarise", action="store_true", help="run nothing: rewrite the summary from the results "
                        "in --work-dir or the tarball; needs no vLLM and no GPU")
    return parser


def catalogue_paths(args) -> dict[str, Path]:
    """Where a catalogue script's state lives: results in --results-dir, logs, raw results and models in
    --work-dir."""
    return runner.state_paths(args.results_dir, args.work_dir / "logs", args.work_dir / "raw", args.work_dir)


def one_engine_at_a_time(args, all_jobs: list[Job], summarise: runner.Summarise, *, gpu_ids: list[str],
                         plan_gpus: int, required: tuple[str, ...]) -> None:
    """The rest of a catalogue script's main once its options are parsed (``vllm_spec_dcp.py``,
    ``vllm_hybrid_gpu.py``): ``--list``, ``--summarise`` (no vLLM, no GPU), ``--plan`` (``plan_gpus``), else the
    pending jobs of ``--only`` (every engine job by default) with their builds, one engine at a time on ``gpu_ids``.
    ``summarise(found)`` writes the summary; results and logs pack into ``<name>_jobs.tar.gz``."""
    paths = catalogue_paths(args)
    pack = paths["results"] / f"{args.name}_jobs.tar.gz"
    chosen = runner.select_only(all_jobs, args.only) if args.only else [j for j in all_jobs
                                                                          if j.spec["kind"] == "engine"]
    if args.list:
        runner.print_list(runner.with_needs(all_jobs, chosen))
        return

    def job_runner(jobs: list[Job], **options) -> runner.Runner:
        return runner.Runner(args, jobs, all_jobs, paths, engine_module=ENGINE_MODULE, pack=pack,
                             summarise=summarise, **options)

    runner.unpack(pack, {"raw": paths["raw"], "logs": paths["logs"]})  # what an earlier machine finished
    if args.summarise:
        job_runner([]).write_summary()
        return
    jobs = runner.with_needs(all_jobs, chosen, pending_only=not args.force)
    if args.plan:
        print_plan(jobs, gpus=plan_gpus, parallel=1, budget_s=args.budget_s)
        return
    runner.require(required)
    args.jobs = 1  # one engine job at a time (at tp = 2 each takes both GPUs)
    runner.run_jobs(job_runner(jobs, gpu_ids=gpu_ids), paths["results"] / f"{args.name}.md")


def summarise(args, paths: dict[str, Path], jobs: dict[str, dict]) -> list[Path]:
    summary = dcp_report.analyse(jobs)
    meta = next(({k: r["result"].get(k) for k in ("gpu", "vllm", "torch")} for r in jobs.values() if r["result"]),
                {})
    meta.update(model=MODEL, config=CONFIG, loads=LOADS, long_kv_cache_bytes_per_gpu=LONG_KV_BYTES,
                kv_bytes_per_token_per_gpu_dcp1=KV_BYTES_PER_TOKEN, env=NO_MULTICAST, triton_f32=args.triton_f32)
    written = dcp_report.write_summary(summary, meta, paths["results"], args.name)
    host = dcp_report.host_overhead_part(summary)
    if host is not None:
        merged = dcp_report.merge_host_overhead(paths["results"] / f"{args.host_name}.json", host, meta)
        written += [merged] if merged else []
    return written


def main(argv: list[str] | None = None) -> None:
    parser = runner.parser_for(__doc__, name="vllm_dcp_2xh200", work_dir="/tmp/dcp_vllm_dcp")
    parser.add_argument("--jobs", type=int, default=2, help="jobs at once (default 2: two one-GPU jobs on two GPUs; "
                        "two-GPU jobs always run alone)")
    parser.add_argument("--plan", action="store_true", help="print the job order and estimated times, and exit")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: CUDA_VISIBLE_DEVICES, else "
                        "nvidia-smi -L; --plan assumes 2 when neither says)")
    parser.add_argument("--no-eager", action="store_true", help="leave out the eager jobs (names *-eager)")
    parser.add_argument("--summarise", action="store_true", help="run nothing: rewrite the summary (and merge the "
                        "one-GPU part) from the results in --work-dir or the tarball; needs no vLLM and no GPU")
    parser.add_argument("--dcp-full-graphs", choices=("0", "1"), default=None, help="DCP_TRITON_DCP_FULL_GRAPHS for "
                        "the dcp-triton jobs (decode at DCP > 1 in full CUDA graphs; default: the library's default)")
    parser.add_argument("--host-name", default="host_overhead_h200", help="the one-GPU set's results file, merged "
                        "into (default: host_overhead_h200)")
    args = parser.parse_args(argv)
    runner.check_jobs_option(parser, args.jobs)
    paths = catalogue_paths(args)
    pack = paths["results"] / f"{args.name}_jobs.tar.gz"
    all_jobs = catalogue(paths["work"], paths["raw"], full_graphs=args.dcp_full_graphs)
    if args.list:
        runner.print_list(select(all_jobs, only=args.only, eager=not args.no_eager, force=True))
        return
    if not (args.plan or args.summarise):
        runner.require(REQUIRED_MODULES)
    runner.unpack(pack, {"raw": paths["raw"], "logs": paths["logs"]})  # what an earlier machine finished
    if args.summarise:
        runner.Runner(args, [], all_jobs, paths, engine_module=ENGINE_MODULE,
                      summarise=lambda found: summarise(args, paths, found)).write_summary()
        return
    jobs = select(all_jobs, only=args.only, eager=not args.no_eager, force=args.force)
    gpu_ids = [str(i) for i in range(args.gpus)] if args.gpus is not None else runner.visible_gpus()
    if args.plan:
        print_plan(jobs, gpus=len(gpu_ids) if args.gpus is not None or gpu_ids else 2, parallel=args.jobs,
                   budget_s=args.budget_s)
        return
    run = runner.Runner(args, jobs, all_jobs, paths, engine_module=ENGINE_MODULE, gpu_ids=gpu_ids, pack=pack,
                        summarise=lambda found: summarise(args, paths, found))
    runner.run_jobs(run, paths["results"] / f"{args.name}.md")


if __name__ == "__main__":
    main()
