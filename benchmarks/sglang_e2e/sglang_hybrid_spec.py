"""SGLang on one GPU: a hybrid Qwen3-Next with its MTP draft (NEXTN), dcp-triton against SGLang's ``triton`` and
``fa3`` backends.

The checkpoint is ``q3n-mtp``: the Qwen3-Next of ``sglang_spec_gpu.py`` (8 layers, every fourth full attention with
16 Q / 2 KV heads of size 256, Gated-DeltaNet between, MoE) with one multi-token-prediction layer
(``num_nextn_predict_layers``), random-initialised and saved in float32 on the machine, draftable
(``common.save_random_model``: its MTP layer drafts what the target mostly predicts, so drafts get accepted).
Every job speculates with that MTP layer as SGLang serves Qwen3-Next: ``NEXTN``, a chain of 3 steps, topk 1, 4 draft
tokens. Jobs, each an offline ``sglang.Engine`` (token ids in) in its own process, in run order:

  q3n-bf16-triton, q3n-bf16-dcp-triton, q3n-bf16-fa3
                                         bf16, CUDA graphs (SGLang's defaults): greedy tokens and verify steps of the
                                         check prompts, then output tokens/s on each of ``LOADS`` (one warm-up with
                                         other prompts, then the best of 2). ``triton`` first: the first job of a
                                         machine also compiles SGLang's own GDN and MoE kernels into Triton's empty
                                         cache (about a minute on an H100), so the start-ups of the next two compare
  q3n-fp32-dcp-triton, q3n-fp32-triton   float32, eager (SGLang's torch ops: ``sglang_one_h200.use_native_ops``;
                                         its chunked GDN prefill, which refuses float32, on bf16 inputs in both:
                                         ``sglang_one_h200.bf16_chunked_gdn``): the greedy tokens and verify steps
                                         (fa3 takes no float32)
  q3n-bf16-triton-p64, q3n-bf16-dcp-triton-p64, q3n-bf16-fa3-p64
                                         the bf16 jobs again with 64-token pages (``--page-size 64``; SGLang's
                                         default is 1, and dcp-triton reads a cache through tensor descriptors on
                                         an H100/H200 only in pages of 64 tokens, as its quickstart asks for)

The summary (``summary``): float32 greedy tokens of dcp-triton against triton (every sequence equal or not) and both
mean accepted lengths (tokens per verify step: SGLang's ``spec_verify_ct``); per bf16 peer the accepted-length ratio,
the greedy agreement and dcp-triton's output tokens/s over the peer's per load (``bf16_vs``; both on 64-token pages:
``bf16_p64_vs``). A job whose results file is already
in the work folder (an earlier call of the same machine) is not run again (``--force`` reruns it).

    python -m benchmarks.sglang_e2e.sglang_hybrid_spec --budget-s 420   # the GPU machine: run_h200_sglang.sh bench
    python -m benchmarks.sglang_e2e.sglang_hybrid_spec --dry-run        # no GPU, no SGLang: jobs and engine kwargs
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from benchmarks import common
from benchmarks.sglang_e2e import sglang_one_h200 as one  # in a job process, applies float32 jobs' native ops
from benchmarks.sglang_e2e import sglang_spec_gpu as spec_gpu

MODELS = {"q3n-mtp": dict(spec_gpu.MODELS["q3n"], num_nextn_predict_layers=1, draftable=common.DRAFTABLE)}
NEXTN = dict(speculative_algorithm="NEXTN", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4, draft="q3n-mtp")
PEERS = ("fa3", "triton")
JOBS = [dict(name=f"q3n-{dtype}-{backend}", model="q3n-mtp", backend=backend, dtype=dtype, spec=NEXTN)
        for dtype, backends in (("bf16", ("triton", "dcp-triton", "fa3")), ("fp32", ("dcp-triton", "triton")))
        for backend in backends]
JOBS += [dict(job, name=f"{job['name']}-p64", page_size=64) for job in JOBS if job["dtype"] == "bf16"]
PAGES = {"": "bf16_vs", "-p64": "bf16_p64_vs"}  # job-name suffix -> the summary's key of that page size
LOADS = {"decode": dict(requests=32, prompt_len=512, output_len=256),
         "long_prompt": dict(requests=4, prompt_len=7168, output_len=64)}
OUTPUT_LEN = 64
REPEATS = 2


def run_job(job: dict, models: dict[str, Path], tp: int) -> dict:
    import sglang

    began = time.perf_counter()
    engine = sglang.Engine(**spec_gpu.engine_kwargs(job, models, tp))
    result = dict(job, init_s=round(time.perf_counter() - began, 1), loads={})
    try:
        params = dict(max_new_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=one.check_prompts(), sampling_params=params)
        result["greedy"] = [list(o["output_ids"]) for o in outs]
        result["verify_steps"] = [o["meta_info"].get("spec_verify_ct") for o in outs]
        if job["dtype"] == "bf16":
            for i, (name, load) in enumerate(LOADS.items()):
                one.run_load(engine, load, seed=1000 * i)  # warm-up: same shapes, other prompts
                result["loads"][name] = [one.run_load(engine, load, seed=1000 * i + r + 1) for r in range(REPEATS)]
    finally:
        engine.shutdown()
    return result


def accepted_length(result: dict) -> float | None:
    """Tokens per verify step over the check prompts: accepted drafts plus the bonus token."""
    steps = sum(v for v in result.get("verify_steps") or [] if v)
    return sum(len(t) for t in result["greedy"]) / steps if steps else None


def best_tok_s(result: dict, load: str) -> float | None:
    runs = result.get("loads", {}).get(load)
    return max(r["output_tok_s"] for r in runs) if runs else None


def ratio(ours: float | None, theirs: float | None) -> float | None:
    return round(ours / theirs, 3) if ours and theirs else None


def summarise(results: list[dict]) -> dict:
    done = {r["name"]: r for r in results if "error" not in r}
    summary: dict = dict(failed=[r["name"] for r in results if "error" in r],
                         init_s={n: r["init_s"] for n, r in done.items()},
                         accepted_length={n: accepted_length(r) for n, r in done.items()},
                         output_tok_s={n: {load: best_tok_s(r, load) for load in LOADS} for n, r in done.items()
                                       if r["dtype"] == "bf16"})
    ours, ref = done.get("q3n-fp32-dcp-triton"), done.get("q3n-fp32-triton")
    if ours and ref:
        agreement = one.greedy_agreement(ours["greedy"], ref["greedy"])
        summary["fp32_vs_triton"] = dict(greedy=agreement,
                                         greedy_identical=agreement["equal"] == agreement["sequences"],
                                         acceptance_ratio=ratio(accepted_length(ours), accepted_length(ref)))
    for suffix, key in PAGES.items():
        ours = done.get(f"q3n-bf16-dcp-triton{suffix}")
        summary[key] = {}
        for peer in PEERS:
            theirs = done.get(f"q3n-bf16-{peer}{suffix}")
            if ours and theirs:
                summary[key][peer] = dict(
                    greedy=one.greedy_agreement(ours["greedy"], theirs["greedy"]),
                    acceptance_ratio=ratio(accepted_length(ours), accepted_length(theirs)),
                    tok_s_ratio={load: ratio(best_tok_s(ours, load), best_tok_s(theirs, load)) for load in LOADS})
    return summary


def main() -> None:
    parser = spec_gpu.job_parser(__doc__, name_default=None,
                                 name_help="results file stem (default: sglang_hybrid_spec_<gpu>)")
    parser.add_argument("--force", action="store_true", help="rerun jobs whose results are in the work folder")
    args = parser.parse_args()
    if args.child:
        return spec_gpu.child(args.child, run=run_job)
    chosen = spec_gpu.chosen_jobs(JOBS, args)
    work = Path(os.environ.get("DCP_BENCH_WORK", "/tmp/dcp_sglang_hybrid_spec"))
    paths = {name: work / name for name in MODELS}
    if args.dry_run:
        print(json.dumps(dict(models=MODELS, loads=LOADS, jobs=[dict(j, engine=spec_gpu.engine_kwargs(j, paths))
                                                                for j in chosen]), indent=1))
        return
    name = args.name or f"sglang_hybrid_spec_{common.gpu_tag()}"
    work.mkdir(parents=True, exist_ok=True)
    for model, config in MODELS.items():
        common.save_random_model(config, paths[model], seed=0)
    spec = dict(models={m: str(p) for m, p in paths.items()}, tp=1)
    spec_gpu.run_jobs(chosen, spec, work, module=__spec__.name, budget_s=args.budget_s, summarise_fn=summarise,
                      keep_earlier=not args.force,
                      save=lambda results: common.save(name, dict(summary=summarise(results), models=MODELS,
                                                                  loads=LOADS, gpu=common.gpu_name(), jobs=results)))


if __name__ == "__main__":
    main()
