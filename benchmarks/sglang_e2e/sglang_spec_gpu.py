"""SGLang on one GPU with dcp-triton: a hybrid model (Gated-DeltaNet beside attention) and speculative decoding.

Checkpoints, random-initialised and saved in float32 on the machine (``common.save_random_model``): ``q3n`` (a
Qwen3-Next: 8 layers, every fourth full attention with 16 Q / 2 KV heads of head size 256, as Qwen3.5's; GDN layers
with 4 key / 8 value heads; MoE of 8 experts), ``llama`` (Llama-3-8B's layer, 32 Q / 8 KV heads of size 128, twice)
and ``draft`` (a 2-layer Llama of the same vocabulary). Jobs, each an offline ``sglang.Engine`` (token ids in) in
its own process (``sglang_one_h200.run_one``), in run order:

  q3n-dcp-triton         bf16, CUDA graphs: greedy tokens of the check prompts, output tokens/s of one load
  q3n-triton             the same on SGLang's own ``triton`` backend (how far two backends part in bf16)
  q3n-dcp-triton-chain   + STANDALONE speculation with ``draft`` (3 steps, topk 1, 4 draft tokens): SGLang's hybrid
                         wrapper around dcp-triton's verify steps, dcp-triton's draft backends with their graphs
  llama-fp32-dcp-triton  float32, eager: greedy tokens (the reference of the next job)
  llama-fp32-dcp-triton-tree  + STANDALONE with the target as its own draft (3 steps, topk 4, 8 draft tokens):
                         draft trees, nearly all accepted, so SGLang moves accepted branches in the KV cache

The summary compares greedy tokens (sequences equal, first difference) of q3n-dcp-triton with q3n-triton, of the
chain with q3n-dcp-triton and of the tree with its float32 reference, and gives each speculative job's mean
accepted length (SGLang's ``spec_verify_ct``) and output tokens/s.

    python -m benchmarks.sglang_e2e.sglang_spec_gpu --budget-s 480   # the GPU machine: run_h200_sglang.sh bench
    python -m benchmarks.sglang_e2e.sglang_spec_gpu --tp 2 --budget-s 480   # two GPUs: every job at DCP = 2
    python -m benchmarks.sglang_e2e.sglang_spec_gpu --dry-run        # no GPU, no SGLang: jobs and engine kwargs
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import sys
import time
from pathlib import Path

from benchmarks import common
from benchmarks.sglang_e2e import sglang_one_h200 as one  # in a job process, applies float32 jobs' native ops
from benchmarks.vllm_e2e.vllm_hybrid_gpu import CONFIG as Q3N, FULL_EVERY

MODELS = {
    "q3n": {**{k: v for k, v in Q3N.items() if k not in ("num_nextn_predict_layers", "draftable")},
            "full_attention_interval": FULL_EVERY},
    "llama": dict(one.MODEL, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2),
    "draft": dict(one.MODEL, model_type="llama", architectures=["LlamaForCausalLM"], num_hidden_layers=2,
                  hidden_size=512, intermediate_size=1024,
                  num_attention_heads=8, num_key_value_heads=2, head_dim=64),
}
CHAIN = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=1,
             speculative_num_draft_tokens=4)
TREE = dict(speculative_algorithm="STANDALONE", speculative_num_steps=3, speculative_eagle_topk=4,
            speculative_num_draft_tokens=8)
JOBS = [
    dict(name="q3n-dcp-triton", model="q3n", backend="dcp-triton", dtype="bf16"),
    dict(name="q3n-triton", model="q3n", backend="triton", dtype="bf16"),
    dict(name="q3n-dcp-triton-chain", model="q3n", backend="dcp-triton", dtype="bf16", spec=dict(CHAIN, draft="draft"),
         reference="q3n-dcp-triton"),
    dict(name="llama-fp32-dcp-triton", model="llama", backend="dcp-triton", dtype="fp32"),
    dict(name="llama-fp32-dcp-triton-tree", model="llama", backend="dcp-triton", dtype="fp32",
         spec=dict(TREE, draft="llama"), reference="llama-fp32-dcp-triton"),
]
LOAD = dict(requests=16, prompt_len=1024, output_len=128)
OUTPUT_LEN = 64


def models_for(tp: int) -> dict[str, dict]:
    """The checkpoints' configs: ``MODELS``, or at ``tp`` 2 (DCP = 2 on two GPUs) each with one KV head, which both
    TP ranks then hold, as SGLang's DCP needs (SGLang 0.5.17's models split KV heads by TP)."""
    return MODELS if tp == 1 else {name: dict(config, num_key_value_heads=1) for name, config in MODELS.items()}


def engine_kwargs(job: dict, models: dict[str, Path], tp: int = 1) -> dict:
    """``sglang.Engine(**kwargs)`` of one job (ServerArgs fields of SGLang 0.5.17 and 0.5.23); ``tp`` 2: DCP = 2."""
    kwargs = dict(model_path=str(models[job["model"]]), skip_tokenizer_init=True, dtype=one.DTYPES[job["dtype"]],
                  attention_backend=job["backend"], random_seed=0, context_length=8192, mem_fraction_static=0.7,
                  log_level="info", sampling_backend="pytorch", disable_flashinfer_autotune=True)
    if tp > 1:
        kwargs.update(tp_size=tp, dcp_size=tp)
    if job["dtype"] == "fp32":
        kwargs["disable_cuda_graph"] = True
    if job.get("page_size"):
        kwargs["page_size"] = job["page_size"]
    if job.get("spec"):
        spec = dict(job["spec"])
        draft = spec.pop("draft")
        kwargs.update(spec, speculative_draft_model_path=str(models[draft]))
    return kwargs


def run_job(job: dict, models: dict[str, Path], tp: int) -> dict:
    import sglang

    began = time.perf_counter()
    engine = sglang.Engine(**engine_kwargs(job, models, tp))
    result = dict(job, init_s=round(time.perf_counter() - began, 1))
    try:
        params = dict(max_new_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
        outs = engine.generate(input_ids=one.check_prompts(), sampling_params=params)
        result["greedy"] = [list(o["output_ids"]) for o in outs]
        result["verify_steps"] = [o["meta_info"].get("spec_verify_ct") for o in outs]
        one.run_load(engine, LOAD, seed=7)  # warm-up
        result["load"] = one.run_load(engine, LOAD, seed=8)
    finally:
        engine.shutdown()
    return result


def summarise(results: list[dict]) -> dict:
    done = {r["name"]: r for r in results if "error" not in r}
    summary = dict(failed=[r["name"] for r in results if "error" in r], jobs={})
    pairs = [("q3n-dcp-triton", "q3n-triton")] + [(j["name"], j["reference"]) for j in JOBS if j.get("reference")]
    for name, r in done.items():
        row = dict(init_s=r["init_s"], output_tok_s=r["load"]["output_tok_s"])
        verify = [v for v in r.get("verify_steps") or [] if v]
        if verify:  # tokens per verify step: the accepted drafts and the bonus token
            row["mean_accepted_length"] = sum(len(t) for t in r["greedy"]) / sum(verify)
        versus = dict(pairs).get(name)
        if versus in done:
            row.update(versus=versus, greedy=one.greedy_agreement(r["greedy"], done[versus]["greedy"]),
                       speedup=r["load"]["output_tok_s"] / done[versus]["load"]["output_tok_s"])
        summary["jobs"][name] = row
    return summary


def child(spec_path: str, run=None) -> None:
    """A job process (``one.run_one`` starts it as ``python -m MODULE --child SPEC``): ``run(job, models, tp)`` (default
    ``run_job``) into the spec's out file."""
    spec = json.loads(Path(spec_path).read_text())
    result = (run or run_job)(spec["job"], {name: Path(p) for name, p in spec["models"].items()}, spec["tp"])
    Path(spec["out"]).write_text(json.dumps(result))
    os._exit(0)


def job_parser(doc: str, *, name_default: str | None, name_help: str) -> argparse.ArgumentParser:
    """The options this script and ``sglang_hybrid_spec.py`` share."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--only", default="*", help="comma-separated job-name patterns (--list shows them)")
    parser.add_argument("--budget-s", type=float, default=0, help="start no job after this many seconds")
    parser.add_argument("--name", default=name_default, help=name_help)
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--dry-run", action="store_true", help="print the jobs and engine kwargs; run none")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser


def chosen_jobs(jobs: list[dict], args) -> list[dict]:
    """The jobs ``--only`` names; ``--list`` (or no match) prints the names and exits."""
    chosen = [j for j in jobs if any(fnmatch.fnmatch(j["name"], p) for p in args.only.split(","))]
    if args.list or not chosen:
        print("\n".join(j["name"] for j in jobs) if args.list else f"--only {args.only!r} matches no job")
        sys.exit(0 if args.list else 2)
    return chosen


def run_jobs(chosen: list[dict], spec: dict, work: Path, *, module: str, budget_s: float, save, summarise_fn,
             keep_earlier: bool = False) -> None:
    """Each job in its own process (``one.run_one``), none started past ``budget_s``; ``save(results)`` after each
    returns the results file. ``keep_earlier``: a job whose results file an earlier call left in ``work`` is not
    run again (``run_one`` writes it only for a job that finished)."""
    began, results, path = time.monotonic(), [], None
    for job in chosen:
        earlier = work / f"{job['name']}.json"
        if keep_earlier and earlier.exists():
            results.append(dict(json.loads(earlier.read_text()), log=str(work / f"{job['name']}.log")))
            print(f"{job['name']}: results of an earlier run kept", flush=True)
        elif budget_s and time.monotonic() - began > budget_s:
            print(f"not started (budget): {job['name']}", flush=True)
            continue
        else:
            results.append(one.run_one(job, spec, work, module=module))
        path = save(results)
        print(f"[{time.strftime('%H:%M:%S')}] {job['name']} done", flush=True)
    print(json.dumps(summarise_fn(results), indent=1))
    print(f"wrote {common.repo_relative(path)}" if path else "no results")


def main() -> None:
    parser = job_parser(__doc__, name_default="sglang_spec_h100", name_help="results file stem")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1, help="2: every job at tp = DCP = 2 (two GPUs)")
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    chosen = chosen_jobs(JOBS, args)
    work = Path(os.environ.get("DCP_BENCH_WORK", "/tmp/dcp_sglang_spec"))
    models = models_for(args.tp)
    paths = {name: work / (name if args.tp == 1 else f"{name}-kv1") for name in models}
    if args.tp == 2 and args.name == "sglang_spec_h100":
        args.name = "sglang_spec_2xh100"
    if args.dry_run:
        print(json.dumps(dict(models=models, jobs=[dict(j, engine=engine_kwargs(j, paths, args.tp))
                                                   for j in chosen]), indent=1))
        return
    work.mkdir(parents=True, exist_ok=True)
    for name in {m for j in chosen for m in (j["model"], (j.get("spec") or {}).get("draft")) if m}:
        common.save_random_model(models[name], paths[name], seed=0)
    spec = dict(models={name: str(p) for name, p in paths.items()}, tp=args.tp)
    run_jobs(chosen, spec, work, module=__spec__.name, budget_s=args.budget_s, summarise_fn=summarise,
             save=lambda results: common.save(args.name, dict(summary=summarise(results), models=models, tp=args.tp,
                                                              jobs=results)))


if __name__ == "__main__":
    main()
