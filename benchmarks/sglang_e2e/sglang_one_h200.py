"""SGLang on one GPU at DCP = 1: ``--attention-backend dcp-triton`` against SGLang's own ``triton`` backend.

Model: Llama-3-8B's layer (hidden 4096, 32 Q / 8 KV heads, head size 128, MLP 14336) times 4 layers, vocabulary
8192, random initialisation (transformers', seed 0: ``common.save_random_llama``) saved once in float32, so every
engine loads the same weights. ``--dummy`` runs SGLang's ``load_format="dummy"`` on the config alone instead: no
checkpoint to build, but it fills every weight, the norms' too, from U(-1e-3, 1e-3), so the logits are all near zero
and the agreement checks pass whatever attention computes; use it for throughput only.

Per backend, two offline engines (``sglang.Engine``, token ids in, ``skip_tokenizer_init``), each in its own
process, run one after the other:
  ``<backend>-bf16``  greedy tokens of the check prompts (lengths ``CHECK_LENS``), then output tokens/s on each of
                      ``LOADS`` (every request at once, ``ignore_eos``: one warm-up with other prompts, then the best
                      of ``--repeats``), SGLang's defaults otherwise (CUDA graphs for decode, breakable graphs for
                      prefill; ``--no-prefill-graph`` turns those off for both backends)
  ``<backend>-fp32``  float32, eager: prompt logprobs (``return_logprob``, ``logprob_start_len=0``) and greedy
                      tokens of the check prompts

    python -m benchmarks.sglang_e2e.sglang_one_h200              # the GPU machine: scripts/device/run_h200_sglang.sh
    python -m benchmarks.sglang_e2e.sglang_one_h200 --dry-run    # no GPU, no SGLang: config, jobs, engine kwargs

Results: ``benchmarks/results/<--name>.json`` (``common.save``): ``summary`` = greedy agreement per dtype (sequences
equal, differing positions, each prompt's first difference), ``fp32_max_abs_logprob_diff`` against
``logprob_bound`` (1e-3), ``throughput.<load>`` = dcp-triton's and triton's best tok/s and their ratio, each
job's start-up seconds; ``jobs`` holds every job's raw results and the backend line of its log.
"""

from __future__ import annotations

import argparse
import contextlib
import fnmatch
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common

MODEL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
             num_hidden_layers=4, vocab_size=8192, max_position_embeddings=16384, rms_norm_eps=1e-5,
             rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
LOADS = {
    "64x512-128": dict(requests=64, prompt_len=512, output_len=128),
    "8x8k-32": dict(requests=8, prompt_len=8192, output_len=32),
}
CHECK_LENS = (17, 100, 511, 2048)  # odd lengths: partial pages and tiles
CHECK_OUTPUT_LEN = 32
BACKENDS = {"dcp-triton": "dcp_triton", "triton": "triton"}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
LOGPROB_BOUND = 1e-3
CONTEXT_LEN = 8192 + 128
JOB_TIMEOUT_S = 480
BACKEND_LINE = "dcp-triton attention: backend="
NATIVE_OPS_ENV = "DCP_BENCH_SGLANG_NATIVE_OPS"


def use_native_ops() -> None:
    """Every SGLang ``MultiPlatformOp`` (RMSNorm, SiluAndMul, RoPE, ...) runs its torch ``forward_native``: SGLang
    0.5.17's CUDA RMSNorm refuses float32 ("failed to dispatch data type Float"), and the float32 jobs need the whole
    model in float32. Set for the float32 jobs of both backends, through NATIVE_OPS_ENV: SGLang starts its scheduler
    with multiprocessing's spawn, whose child processes import the parent's main module (this script) first."""
    from sglang.srt.layers.utils.multi_platform import MultiPlatformOp

    if not hasattr(MultiPlatformOp, "dispatch_forward"):  # 0.5.23 picks its ops otherwise
        from sglang.version import __version__

        raise RuntimeError(f"the float32 jobs run SGLang 0.5.17's ops dispatch; SGLang {__version__} has none")
    MultiPlatformOp.dispatch_forward = lambda self: self.forward_native


def bf16_chunked_gdn(chunk):
    """SGLang's chunked Gated-DeltaNet prefill (``chunk_gated_delta_rule``, hybrid models' linear-attention layers)
    refuses float32 by a check of its own (0.5.17 and 0.5.23): in the float32 jobs its ``q``, ``k``, ``v`` and
    ``beta`` go in as bf16 (``g``, the log decay, stays float32, as in SGLang's bf16 runs) and ``o`` and the
    intermediate states come back as float32. Both backends' float32 jobs run it the same way: the full-attention
    layers, the backends' part, stay float32, and so do the GDN decode and verify kernels."""
    import torch

    def chunk_fp32(q, k, v, g, beta, **kwargs):
        if q.dtype != torch.float32:
            return chunk(q, k, v, g, beta, **kwargs)
        o, final, states = chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta.bfloat16(), **kwargs)
        wide = lambda t: t.float() if t is not None and t.is_floating_point() else t  # noqa: E731
        return wide(o), wide(final), wide(states)

    return chunk_fp32


def use_bf16_chunked_gdn() -> None:
    """``bf16_chunked_gdn`` in place of the function SGLang's Triton GDN kernels call (no-op where SGLang has none)."""
    try:
        from sglang.srt.layers.attention.linear.kernels import gdn_triton
    except ImportError:
        return
    gdn_triton.chunk_gated_delta_rule = bf16_chunked_gdn(gdn_triton.chunk_gated_delta_rule)


if os.environ.get(NATIVE_OPS_ENV) == "1":
    use_native_ops()
    use_bf16_chunked_gdn()


def jobs() -> list[dict]:
    """bf16 first (throughput and greedy of both backends), then the float32 checks."""
    return [dict(name=f"{b}-{d}", backend=b, dtype=d) for d in DTYPES for b in BACKENDS]


def config_json() -> dict:
    """config.json for ``--dummy`` (``save_random_llama`` writes its own from ``MODEL``)."""
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", torch_dtype="float32", hidden_act="silu",
                **MODEL)


def engine_kwargs(job: dict, model_dir: Path, *, dummy: bool = False, prefill_graph: bool = True) -> dict:
    """``sglang.Engine(**kwargs)`` for one job: ServerArgs fields of SGLang 0.5.17."""
    kwargs = dict(model_path=str(model_dir), skip_tokenizer_init=True, dtype=DTYPES[job["dtype"]],
                  attention_backend=job["backend"], load_format="dummy" if dummy else "auto", random_seed=0,
                  context_length=CONTEXT_LEN, mem_fraction_static=0.8, log_level="info",
                  sampling_backend="pytorch", disable_flashinfer_autotune=True)
    if job["dtype"] == "fp32":  # prompt logprobs come from prefill: no graphs to capture
        kwargs["disable_cuda_graph"] = True
    elif not prefill_graph:
        kwargs["disable_prefill_cuda_graph"] = True
    return kwargs


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, MODEL["vocab_size"]) for _ in range(length)] for _ in range(count)]


def check_prompts() -> list[list[int]]:
    return [prompts(1, n, seed=100 + i)[0] for i, n in enumerate(CHECK_LENS)]


def run_load(engine, load: dict, seed: int) -> dict:
    params = dict(max_new_tokens=load["output_len"], temperature=0.0, ignore_eos=True)
    batch = prompts(load["requests"], load["prompt_len"], seed)
    began = time.perf_counter()
    outs = engine.generate(input_ids=batch, sampling_params=params)
    elapsed = time.perf_counter() - began
    tokens = sum(len(o["output_ids"]) for o in outs)
    return dict(elapsed_s=elapsed, output_tokens=tokens, output_tok_s=tokens / elapsed)


def run_job(job: dict, model_dir: Path, repeats: int, *, dummy: bool, prefill_graph: bool) -> dict:
    import sglang

    began = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(job, model_dir, dummy=dummy, prefill_graph=prefill_graph))
    result = dict(job, init_s=round(time.perf_counter() - began, 1), runs={})
    try:
        run_tasks(engine, result, repeats)
    finally:
        engine.shutdown()  # the scheduler's GPU memory is free before the next job starts
    return result


def run_tasks(engine, result: dict, repeats: int) -> None:
    """Greedy tokens of the check prompts; float32: their prompt logprobs, bf16: throughput on every load."""
    fp32 = result["dtype"] == "fp32"
    params = dict(max_new_tokens=CHECK_OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    logprobs = dict(return_logprob=True, logprob_start_len=0) if fp32 else {}
    outs = engine.generate(input_ids=check_prompts(), sampling_params=params, **logprobs)
    result["greedy"] = [list(o["output_ids"]) for o in outs]
    if fp32:  # (logprob, token id, text) per prompt token; the first token's is None
        result["prompt_logprobs"] = [[lp for lp, _, _ in o["meta_info"]["input_token_logprobs"]] for o in outs]
        return
    for i, (name, load) in enumerate(LOADS.items()):
        run_load(engine, load, seed=1000 * i)  # warm-up: same shapes, other prompts
        result["runs"][name] = [run_load(engine, load, seed=1000 * i + r + 1) for r in range(repeats)]
        print(f"{result['name']} {name}: best {max(r['output_tok_s'] for r in result['runs'][name]):.0f} tok/s",
              flush=True)


def first_difference(x: list[int], y: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None if len(x) == len(y) else min(len(x), len(y)))


def greedy_agreement(ours: list[list[int]], theirs: list[list[int]]) -> dict:
    firsts = [first_difference(x, y) for x, y in zip(ours, theirs)]
    differing = sum(sum(a != b for a, b in zip(x, y)) + abs(len(x) - len(y)) for x, y in zip(ours, theirs))
    return dict(sequences=len(ours), equal=sum(f is None for f in firsts), differing_positions=differing,
                positions=sum(len(x) for x in ours), first_difference=firsts)


def max_abs_diff(ours: list[list], theirs: list[list]) -> float:
    return max((abs(a - b) for x, y in zip(ours, theirs) for a, b in zip(x, y) if a is not None and b is not None),
               default=float("nan"))


def summarise(results: list[dict]) -> dict:
    done = {r["name"]: r for r in results if "error" not in r}
    summary: dict = dict(greedy={}, throughput={}, init_s={n: r["init_s"] for n, r in done.items()},
                         failed=[r["name"] for r in results if "error" in r], logprob_bound=LOGPROB_BOUND)
    for dtype in DTYPES:
        ours, theirs = done.get(f"dcp-triton-{dtype}"), done.get(f"triton-{dtype}")
        if ours and theirs:
            summary["greedy"][dtype] = greedy_agreement(ours["greedy"], theirs["greedy"])
    ours, theirs = done.get("dcp-triton-fp32"), done.get("triton-fp32")
    if ours and theirs:
        diff = max_abs_diff(ours["prompt_logprobs"], theirs["prompt_logprobs"])
        summary.update(fp32_max_abs_logprob_diff=diff, logprobs_within_bound=diff <= LOGPROB_BOUND,
                       logprob_positions=sum(len(x) - 1 for x in ours["prompt_logprobs"]))
    for load in LOADS:
        best = {BACKENDS[b]: round(max(x["output_tok_s"] for x in done[f"{b}-bf16"]["runs"][load]), 1)
                for b in BACKENDS if load in done.get(f"{b}-bf16", {}).get("runs", {})}
        if len(best) == 2:
            best["ratio"] = round(best["dcp_triton"] / best["triton"], 3)
        summary["throughput"][load] = best
    return summary


def model_dir(work: Path, dummy: bool) -> Path:
    """The checkpoint every job loads: the config alone for ``--dummy``, else the random-initialised weights."""
    if dummy:
        target = work / "llama8x4-config"
        target.mkdir(parents=True, exist_ok=True)
        (target / "config.json").write_text(json.dumps(config_json()))
        return target
    return common.save_random_llama(MODEL, work / "llama8x4-random", seed=0)


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = run_job(spec["job"], Path(spec["model_dir"]), spec["repeats"], dummy=spec["dummy"],
                     prefill_graph=spec["prefill_graph"])
    Path(spec["out"]).write_text(json.dumps(result))
    os._exit(0)  # the engine is shut down: skip the interpreter's teardown of SGLang's threads


def job_env(job: dict) -> dict:
    """The job process's environment: the float32 jobs run SGLang's torch ops (``use_native_ops``) and Triton's
    float32 products in full precision (TRITON_F32_DEFAULT=ieee: by default SGLang's ``triton`` backend rounds
    their inputs to TF32, about 1e-3 relative, the size of the logprob bound), and a hybrid model's convolution
    state in float32 (SGLANG_MAMBA_CONV_DTYPE: SGLang keeps it in bf16 whatever the model's dtype, and its GDN
    prefill then fails to store a float32 state), its chunked GDN prefill on bf16 inputs (``bf16_chunked_gdn``)."""
    env = dict(os.environ, **{NATIVE_OPS_ENV: "1" if job["dtype"] == "fp32" else "0"})
    if job["dtype"] == "fp32":
        env.update(TRITON_F32_DEFAULT="ieee", SGLANG_MAMBA_CONV_DTYPE="float32")
    return env


def run_one(job: dict, spec: dict, work: Path, *, module: str = __spec__.name) -> dict:
    """One job in its own process (``python -m module --child SPEC``: this one, or another benchmark's that reuses this
    runner); its log in ``work``; its results, or ``error`` with the log's tail."""
    spec_path, out, log = (work / f"{job['name']}{ext}" for ext in (".spec.json", ".json", ".log"))
    spec_path.write_text(json.dumps(dict(spec, job=job, out=str(out))))
    out.unlink(missing_ok=True)
    began = time.monotonic()
    with open(log, "w") as sink:  # its own process group, so the scheduler processes it starts end with it
        proc = subprocess.Popen(common.module_command(module, "--child", str(spec_path)), stdout=sink,
                                stderr=subprocess.STDOUT, cwd=work, process_group=0, env=common.child_env(job_env(job)))
        try:
            code = proc.wait(timeout=JOB_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = "timeout"
        finally:  # also on the parent's SIGINT (run_h200_sglang.sh's BENCH_TIMEOUT_S)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    text = log.read_text(errors="replace")
    if code != 0 or not out.exists():
        print(f"FAILED ({code}): {job['name']}\n" + "".join(text.splitlines(keepends=True)[-30:]), flush=True)
        return dict(job, error=str(code), log=str(log))
    result = json.loads(out.read_text())
    result.update(wall_s=round(time.monotonic() - began, 1), log=str(log),
                  backend_line=next((line[-240:] for line in text.splitlines() if BACKEND_LINE in line), None))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="*", help="comma-separated job-name patterns (--list shows them)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget-s", type=float, default=0, help="start no job after this many seconds")
    parser.add_argument("--name", default="sglang_one_h200", help="results file stem")
    parser.add_argument("--dummy", action="store_true", help="SGLang's dummy weights (throughput only, see above)")
    parser.add_argument("--no-prefill-graph", action="store_true", help="no prefill CUDA graphs in the bf16 jobs")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the config, jobs and engine kwargs; run none")
    parser.add_argument("--merge", nargs="+", help="result files whose jobs to merge into --name (no GPU)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.merge:
        common.merge_jobs(args.name, args.merge, summarise)
        return
    chosen = [j for j in jobs() if any(fnmatch.fnmatch(j["name"], p) for p in args.only.split(","))]
    if args.list or not chosen:
        print("\n".join(j["name"] for j in jobs()) if args.list else f"--only {args.only!r} matches no job")
        sys.exit(0 if args.list else 2)
    work = Path(os.environ.get("DCP_BENCH_WORK", "/tmp/dcp_sglang_one_h200"))
    if args.dry_run:
        target = work / ("llama8x4-config" if args.dummy else "llama8x4-random")
        print(json.dumps(dict(model=config_json(), loads=LOADS, check_lens=CHECK_LENS, jobs=[
            dict(job, engine=engine_kwargs(job, target, dummy=args.dummy, prefill_graph=not args.no_prefill_graph))
            for job in chosen]), indent=1))
        return
    work.mkdir(parents=True, exist_ok=True)
    spec = dict(model_dir=str(model_dir(work, args.dummy)), repeats=args.repeats, dummy=args.dummy,
                prefill_graph=not args.no_prefill_graph)
    began, results, path = time.monotonic(), [], None
    for job in chosen:
        if args.budget_s and time.monotonic() - began > args.budget_s:
            print(f"not started (budget): {job['name']}", flush=True)
            continue
        results.append(run_one(job, spec, work))
        path = common.save(args.name, dict(summary=summarise(results), jobs=results))
        print(f"[{time.strftime('%H:%M:%S')}] {job['name']} done", flush=True)
    print(json.dumps(summarise(results), indent=1))
    print(f"wrote {common.repo_relative(path)}" if path else "no results")


if __name__ == "__main__":
    main()
