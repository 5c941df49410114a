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
a float32 case with CUDA graphs (vLLM's default FULL_AND_PIECEWISE: decode steps replay full graphs), an fp8 KV
cache (bf16 model, ``kv_cache_dtype="fp8"``: dcp-triton against TRITON_ATTN's fp8 cache, and each against its own
bf16 cache; KV capacity from vLLM's log), and offline throughput (64 x 8K-token prompts / 256 output tokens; a
decode-heavy batch) for the three backends, eager and with CUDA graphs, and dcp-triton's fp8 cache with graphs.
Repeatability (``repeat-*``): the greedy batch (32 prompts x 64 tokens, llama-d128, CUDA graphs) on two fresh
engines each, bf16 for dcp-triton and FLASH_ATTN, float32 for dcp-triton and TRITON_ATTN, run 2 against run 1. Long context (``long-*``): 4 x 128K-token prompts
and 128 greedy tokens at ``gpu_memory_utilization=0.9`` against FLASH_ATTN (bf16), and 2 x 32K in float32 against
TRITON_ATTN, prompt logprobs on the last 4K positions. The OOM test (``oom-burst-*``): 16 prompts of 24-32K
tokens at once, ``gpu_memory_utilization=0.95``, ``max_num_batched_tokens=32768``, against FLASH_ATTN; torch's
peak memory over the burst against vLLM's budget (utilization x device memory); ``mix128k-*``: one 128K-token prompt
beside 64 short ones (256-4K tokens), 64 greedy tokens each, judged the same way.
``--quick``: float32 prompt-logprob agreement (gqa5, 32 prompts up to 2000 tokens) and bf16 greedy agreement
against both on 8 prompts, five engines at once. float32 jobs run with TRITON_F32_DEFAULT=ieee, so vLLM's Triton
kernels compute float32 dots in float32, not TF32.

    python -m benchmarks.vllm_e2e.vllm_gpu_e2e --quick --budget-s 220
    python -m benchmarks.vllm_e2e.vllm_gpu_e2e --only 'agree-gqa5-*' --jobs 3
    python -m benchmarks.vllm_e2e.vllm_gpu_e2e --only 'repeat-*' --jobs 2 --name vllm_e2e_repeat_h200
    python -m benchmarks.vllm_e2e.vllm_gpu_e2e --list
"""

from __future__ import annotations

from pathlib import Path

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_e2e_report as report
from benchmarks.vllm_e2e.e2e_runner import Job

ENGINE_MODULE = "benchmarks.vllm_e2e.vllm_e2e_engine"  # each job's process
LLAMA_COMMON = dict(num_hidden_layers=4, vocab_size=8192, max_position_embeddings=16384, rms_norm_eps=1e-5,
              rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
MODELS = {
    "gqa5-d64": dict(hidden_size=1280, intermediate_size=3456, num_attention_heads=20, num_key_value_heads=4,
                     head_dim=64, **LLAMA_COMMON),
    "llama-d128": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, **LLAMA_COMMON),
}
MODELS["long-d128"] = {**MODELS["llama-d128"], "max_position_embeddings": 131072}
MAIN_PROMPTS = dict(count=32, min_len=64, max_len=2000, seed=1)
PROMPTS_128K = dict(count=4, min_len=131072 - 128, max_len=131072 - 128, seed=6)  # + 128 decode tokens
PROMPTS_32K = dict(count=2, min_len=32768 - 64, max_len=32768 - 64, seed=7)
PROMPTS_BURST = dict(count=16, min_len=24576, max_len=32768 - 16, seed=8)  # + 16 greedy tokens
PROMPTS_128K_MIX = [dict(count=1, min_len=131072 - 64, max_len=131072 - 64, seed=9),  # + 64 greedy tokens each
                    dict(count=64, min_len=256, max_len=4096, seed=10)]
LONG_PROMPTS = dict(count=6, min_len=1200, max_len=2000, seed=2)
PREFIX_PROMPTS = dict(prefix_len=1040, suffix_lens=[7, 19, 33, 48], seed=4)
WORKLOADS = [dict(workload="prefill-8k", requests=64, prompt_len=8192, output_len=256),
             dict(workload="decode-heavy", requests=256, prompt_len=256, output_len=1024)]
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256]
REQUIRED_MODULES = ("vllm", "transformers")  # what the job processes import


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
    for model in ("gqa5-d64", "llama-d128"):
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
        for backend in ("dcp-triton", "TRITON_ATTN"):  # fp8 KV cache (vLLM's default scales), against bf16 KV
            jobs.append(engine(f"fp8-{short}-bf16-{backend}", model, backend, "bfloat16", "fp8", [logprobs, greedy],
                               300, kv_cache_dtype="fp8"))
    # Repeatability: the same bf16 greedy batch on a fresh engine, twice per backend, under vLLM's default CUDA
    # graphs (what users run); run 2 against run 1 in the report's "Repeatability" section. Runs 1 come first in
    # the catalogue, so with --jobs 2 each run 2 starts on the compile cache its run 1 left, like a restart.
    # float32 beside bf16, where no near tie excuses a divergence (FLASH_ATTN has no float32: TRITON_ATTN there).
    for run in (1, 2):
        for short, dtype, backends in [("bf16", "bfloat16", ("dcp-triton", "FLASH_ATTN")),
                                       ("fp32", "float32", ("dcp-triton", "TRITON_ATTN"))]:
            for backend in backends:
                job = engine(f"repeat-llama-{short}-{backend}-run{run}", "llama-d128", backend, dtype,
                             f"repeat-run{run}", [greedy], 360, mode="graphs")
                job.spec["repeat"] = {"set": f"llama-d128 {short} graphs", "run": run}
                jobs.append(job)
    throughput = [{"name": "throughput", "type": "throughput", "workloads": WORKLOADS}]
    # Long context at DCP = 1 with vLLM's own memory sizing: 4 x 128K-token prompts then 128 greedy tokens at
    # gpu_memory_utilization=0.9 (bf16, against FLASH_ATTN), and float32 at 32K against TRITON_ATTN (bound 1e-3);
    # prompt logprobs compared on the last 4K positions.
    whole_gpu = dict(exclusive=True, kv_cache_memory_bytes=None, gpu_memory_utilization=0.9, max_num_seqs=4)
    for backend in ("dcp-triton", "FLASH_ATTN"):
        jobs.append(engine(f"long-128k-bf16-{backend}", "long-d128", backend, "bfloat16", "128k",
                           [{"name": "logprobs-last4k", "type": "logprobs", "prompts": PROMPTS_128K, "last": 4096},
                            {"name": "greedy-128", "type": "greedy", "prompts": PROMPTS_128K, "max_tokens": 128}],
                           540, max_model_len=131072, **whole_gpu))
    for backend in ("dcp-triton", "TRITON_ATTN"):
        jobs.append(engine(f"long-32k-fp32-{backend}", "long-d128", backend, "float32", "32k",
                           [{"name": "logprobs-last4k", "type": "logprobs", "prompts": PROMPTS_32K, "last": 4096}],
                           420, max_model_len=32768, **whole_gpu))
    # The OOM test: a burst of 16 prompts of 24-32K tokens at gpu_memory_utilization=0.95 with 32K-token steps,
    # vLLM's default CUDA graphs. The engine runs in the job's process, which reads torch's peak over the burst.
    burst = dict(mode="graphs", exclusive=True, kv_cache_memory_bytes=None, gpu_memory_utilization=0.95,
                 max_model_len=32768, max_num_batched_tokens=32768, max_num_seqs=16)
    for backend in ("dcp-triton", "FLASH_ATTN"):
        job = engine(f"oom-burst-bf16-{backend}", "long-d128", backend, "bfloat16", "burst",
                     [{"name": "burst", "type": "burst", "prompts": PROMPTS_BURST, "max_tokens": 16}], 420, **burst)
        job.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        jobs.append(job)
    # One 128K-token request beside 64 short streams, all at once, same memory setting: the long prefill's chunks
    # share steps with the streams' decodes.
    for backend in ("dcp-triton", "FLASH_ATTN"):
        job = engine(f"mix128k-bf16-{backend}", "long-d128", backend, "bfloat16", "burst-128k-mix",
                     [{"name": "burst", "type": "burst", "prompts": PROMPTS_128K_MIX, "max_tokens": 64}], 540,
                     **{**burst, "max_model_len": 131072, "max_num_seqs": 72})
        job.env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        jobs.append(job)
    tput = dict(mode="graphs", exclusive=True, max_model_len=8192 + 256 + 64, kv_cache_memory_bytes=24 << 30,
                gpu_memory_utilization=0.5, max_num_seqs=256)
    for backend, mode in [(b, m) for m in ("eager", "graphs") for b in ("dcp-triton", "TRITON_ATTN", "FLASH_ATTN")]:
        jobs.append(engine(f"tput-llama-bf16-{backend}-{mode}", "llama-d128", backend, "bfloat16", "throughput",
                           throughput, 480 if mode == "eager" else 600, **{**tput, "mode": mode}))
    jobs.append(engine("tput-llama-bf16-dcp-triton-graphs-fp8kv", "llama-d128", "dcp-triton", "bfloat16",
                       "throughput", throughput, 600, kv_cache_dtype="fp8", **tput))
    return jobs


def select(jobs: list[Job], *, quick: bool, only: str | None) -> list[Job]:
    if only:
        chosen = runner.select_only(jobs, only)
    else:
        chosen = [j for j in jobs if j.name.startswith("quick-") == quick and not j.name.startswith("build-")]
    return runner.with_needs(jobs, chosen)


def summarise(args, paths: dict[str, Path], jobs: dict[str, dict]) -> list[Path]:
    """Agreement rows, checks and throughput of the finished jobs: <name>.json / .md / .png."""
    summary = report.analyse(jobs)
    meta = next(({k: r["result"].get(k) for k in ("gpu", "vllm", "torch")} for r in jobs.values() if r["result"]),
                {})
    meta.update(models=MODELS, triton_f32=args.triton_f32)
    return report.write_summary(summary, meta, paths["results"], args.name)


def main(argv: list[str] | None = None) -> None:
    parser = runner.parser_for(__doc__, name="vllm_e2e", work_dir="/tmp/dcp_vllm_e2e")
    parser.add_argument("--quick", action="store_true", help="the quick subset (jobs named quick-*)")
    parser.add_argument("--jobs", type=int, default=None, help="jobs at once (default: 5 with --quick, else 3)")
    args = parser.parse_args(argv)
    if args.jobs is None:
        args.jobs = 5 if args.quick else 3
    runner.check_jobs_option(parser, args.jobs)
    paths = runner.state_paths(args.results_dir, args.results_dir / "vllm_e2e_logs", args.results_dir / "vllm_e2e_raw",
                               args.work_dir)
    all_jobs = catalogue(paths["work"], paths["raw"])
    jobs = select(all_jobs, quick=args.quick, only=args.only)
    if args.list:
        runner.print_list(jobs)
        return
    runner.require(REQUIRED_MODULES)
    run = runner.Runner(args, jobs, all_jobs, paths, engine_module=ENGINE_MODULE,
                        summarise=lambda found: summarise(args, paths, found))
    runner.run_jobs(run, paths["results"] / f"{args.name}.md")


if __name__ == "__main__":
    main()
