"""A hybrid model (Gated-DeltaNet layers beside full attention, the seeds' Qwen3.5 family) on dcp-triton in vLLM 0.26.

The model is a random Qwen3-Next (``CONFIG``: 8 layers, every fourth full attention with 16 Q / 2 KV heads of head
size 256, as Qwen3.5's; GDN layers with 4 key / 8 value heads; MoE of 8 experts; one MTP layer), built on the
machine in float32 with its multi-token-prediction weights, draftable (``common.save_random_model``: most greedy
tokens are the current token's embedding's own prediction, which the MTP layer drafts) and served in bf16 (vLLM's
GDN kernels take no float32). vLLM gives the full-attention layers a KV-cache group of their own whose block size
makes a page as large as a GDN layer's state, and hands dcp-triton only those layers. Jobs, each one engine in its
own process, CUDA graphs on (vLLM's default FULL_AND_PIECEWISE), one GPU, in run order (``ENGINES``):

  q3n-dcp-triton, q3n-FLASH_ATTN                       no speculation
  q3n-mtp-dcp-triton, q3n-mtp-FLASH_ATTN               MTP drafts (``qwen3_next_mtp``, 2 tokens; the draft's
                                                       attention layer on the same backend: vLLM picks a draft's
                                                       backend apart from the target's unless the speculative
                                                       config names one, so each job names its own)
  q3n-TRITON_ATTN                                      no speculation (how far two vLLM backends part in bf16)

``--tp 2``: the DCP = 2 set on two GPUs (``ENGINES_TP2``, the model with one KV head: vLLM's DCP needs more TP ranks
than KV heads), dcp-triton and FLASH_ATTN at DCP = 2 and dcp-triton with MTP drafts against dcp-triton at DCP = 1.

Tasks per job: teacher-forced prompt logprobs (``LOGPROB_PROMPTS``), then greedy tokens with their top-2 logprobs of
``GREEDY`` prompts, all at once and timed after a warm-up (vLLM's speculative counters over that run). The summary
compares each job with the one it names: dcp-triton's prompt logprobs and greedy tokens with FLASH_ATTN's, beside
TRITON_ATTN's against FLASH_ATTN's (how far two vLLM backends part in bf16), each MTP job's greedy tokens with its
backend's plain job, and gives the attention block size each engine ran with.

    python -m benchmarks.vllm_e2e.vllm_hybrid_gpu --budget-s 520      # the GPU machine, after run_h200.sh's unpack
                                                                       # and moe calls (vLLM's MoE extension)
    python -m benchmarks.vllm_e2e.vllm_hybrid_gpu --tp 2 --budget-s 520  # two GPUs (run_2xh200.sh's unpack first)
    python -m benchmarks.vllm_e2e.vllm_hybrid_gpu --plan               # the order and estimated times; no vLLM
    python -m benchmarks.vllm_e2e.vllm_hybrid_gpu --summarise          # here, from the tarball that came back

Results: ``benchmarks/results/<name>.json / .md`` and ``<name>_jobs.tar.gz`` (every job's log and raw result).
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from benchmarks import common
from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_dcp_e2e as dcp_e2e
from benchmarks.vllm_e2e import vllm_e2e_report as report
from benchmarks.vllm_e2e import vllm_spec_dcp as spec_dcp
from benchmarks.vllm_e2e.e2e_runner import Job
from benchmarks.vllm_e2e.vllm_gpu_e2e import GRAPH_SIZES

MODEL = "qwen3next-h256-draftable"
FULL_EVERY = 4
# vLLM's Qwen3-Next runs MoE layers only, which need vLLM's MoE extension on the GPU machine: make_moe_ext.sh.
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=512, shared_expert_intermediate_size=512,
           decoder_sparse_step=1, norm_topk_prob=True, mlp_only_layers=[])
CONFIG = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=8192, hidden_size=1024,
    intermediate_size=2048, num_hidden_layers=8,
    layer_types=["full_attention" if (i + 1) % FULL_EVERY == 0 else "linear_attention" for i in range(8)],
    num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=4, linear_num_value_heads=8,
    linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, max_position_embeddings=16384,
    rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, initializer_range=0.1, num_nextn_predict_layers=1, **MOE,
    draftable=common.DRAFTABLE,  # drafts the MTP layer gets accepted (common.save_random_model)
)
MTP = {"method": "qwen3_next_mtp", "num_speculative_tokens": 2}
LOGPROB_PROMPTS = dict(count=8, min_len=64, max_len=4000, seed=21)
GREEDY = dict(count=16, min_len=100, max_len=3000, seed=22)
WARMUP = dict(count=4, min_len=100, max_len=3000, seed=23)
MAX_TOKENS = 64
REPEATS = 3  # the greedy batch timed three times, the best kept: its first run compiles for new prompt lengths
# name, backend, MTP drafts, DCP size, the job it is compared with; in run order. One GPU (tp = 1):
ENGINES = [("q3n-dcp-triton", "dcp-triton", False, 1, "q3n-FLASH_ATTN"), ("q3n-FLASH_ATTN", "FLASH_ATTN", False, 1, None),
           ("q3n-mtp-dcp-triton", "dcp-triton", True, 1, "q3n-dcp-triton"),
           ("q3n-mtp-FLASH_ATTN", "FLASH_ATTN", True, 1, "q3n-FLASH_ATTN"),
           ("q3n-TRITON_ATTN", "TRITON_ATTN", False, 1, "q3n-FLASH_ATTN")]
# Two GPUs (tp = 2; one KV head, so that vLLM allows DCP = 2): dcp-triton and FLASH_ATTN sharding the cache, and
# dcp-triton at DCP = 1 as the reference of both.
ENGINES_TP2 = [("q3n-tp2-dcp1-dcp-triton", "dcp-triton", False, 1, None),
               ("q3n-tp2-dcp2-dcp-triton", "dcp-triton", False, 2, "q3n-tp2-dcp1-dcp-triton"),
               ("q3n-tp2-dcp2-FLASH_ATTN", "FLASH_ATTN", False, 2, "q3n-tp2-dcp1-dcp-triton"),
               ("q3n-tp2-dcp2-mtp-dcp-triton", "dcp-triton", True, 2, "q3n-tp2-dcp2-dcp-triton")]
# An engine job's seconds on one H100 (6ec93d6): 166-195 s, most of it start-up (vLLM's profiling run ~90 s); with
# MTP drafts 270 s on one H200 (26e3d81: the draft's compile and graphs too). A job starts only while that much of
# --budget-s is left: one started with less timed out without a result. Two MTP jobs do not fit one 10-minute device
# call: run them as two calls of one machine (--only each), the second resuming the first's work folder.
ESTIMATE_S = {"build": 40, "engine": 190, "mtp": 270}
BLOCK_SIZE = re.compile(r"Setting attention block size to (\d+) tokens")


def catalogue(work: Path, raw: Path, *, tp: int = 1) -> list[Job]:
    """The build, then every engine job in run order (``tp``: 1, or 2 for the DCP = 2 set on two GPUs)."""
    model, config = (MODEL, CONFIG) if tp == 1 else (f"{MODEL}-kv1", dict(CONFIG, num_key_value_heads=1))
    model_dir = work / "models" / model
    build = Job(f"build-{model}", {"kind": "build", "model_dir": str(model_dir), "seed": 0, "config": config}, 240,
                estimate_s=ESTIMATE_S["build"], group="build")
    vocab = CONFIG["vocab_size"]
    tasks = [{"name": "logprobs", "type": "logprobs", "prompts": LOGPROB_PROMPTS},
             {"name": "greedy", "type": "spec_decode", "max_tokens": MAX_TOKENS, "repeats": REPEATS,
              "prompt_ids": report.make_prompts(vocab=vocab, **GREEDY),
              "warmup_ids": report.make_prompts(vocab=vocab, **WARMUP)}]
    jobs = [build]
    for name, backend, mtp, dcp, versus in ENGINES if tp == 1 else ENGINES_TP2:
        kwargs = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0, max_model_len=8192,
                      kv_cache_memory_bytes=4 << 30, gpu_memory_utilization=0.5, attention_backend=backend,
                      max_num_seqs=64, disable_log_stats=False, tensor_parallel_size=tp,
                      decode_context_parallel_size=dcp, compilation_config={"cudagraph_capture_sizes": GRAPH_SIZES},
                      additional_config={"gdn_prefill_backend": "triton"})  # FlashInfer's is not in the bundle
        if mtp:
            kwargs["speculative_config"] = dict(MTP, attention_backend=backend)
        spec = {"kind": "engine", "model": model, "backend": backend, "dtype": "bfloat16", "mode": "graphs",
                "method": "mtp" if mtp else None, "dcp": dcp, "versus": versus, "vocab": vocab, "engine": kwargs,
                "tasks": tasks, "out": str(raw / f"{name}.json.gz")}
        estimate = ESTIMATE_S["mtp" if mtp else "engine"]
        jobs.append(Job(name, spec, 3 * estimate, [build.name], exclusive=True, gpus=tp,
                        env=dict(dcp_e2e.NO_MULTICAST), estimate_s=estimate,
                        group="mtp" if mtp else "plain"))
    return jobs


def logprob_diffs(ours: dict, ref: dict) -> dict:
    """|difference| of the prompt tokens' logprobs, position by position (the same prompts, teacher-forced)."""
    diffs = [abs(a - b) for x, y in zip(ours["token_logprobs"], ref["token_logprobs"]) for a, b in zip(x, y)]
    return {"positions": len(diffs), "max_abs": max(diffs), "median_abs": statistics.median(diffs),
            "top1_agree": sum(a == b for x, y in zip(ours["top1_ids"], ref["top1_ids"]) for a, b in zip(x, y))}


def analyse(jobs: dict[str, dict]) -> dict:
    """Per job: status, the block size, tok/s and acceptance; against the job it names (``versus``): greedy tokens,
    and prompt logprobs where neither drafts."""
    tasks = {name: (job.get("result") or {}).get("tasks") or {} for name, job in jobs.items()}
    rows = {}
    for name, job in jobs.items():
        spec = job["spec"]
        if spec.get("kind") != "engine":
            continue
        log = Path(job["log"]).read_text(errors="replace") if job.get("log") and Path(job["log"]).exists() else ""
        sizes = sorted({int(m) for m in BLOCK_SIZE.findall(log)})
        row = {"status": job.get("status"), "backend": spec["backend"], "method": spec["method"],
               "block_size": sizes[-1] if sizes else None, "dcp_triton_ran": bool(job.get("backend_line")),
               "commit": (job.get("result") or {}).get("commit")}  # the run behind the numbers (older: None)
        greedy = tasks[name].get("greedy")
        if greedy is not None:
            row.update(output_tok_s=greedy["output_tok_s"], timed_runs=len(greedy.get("timed_runs_s", [None])),
                       **spec_dcp.acceptance(greedy["spec_decode"]))
        versus = spec["versus"]
        if versus in tasks and greedy is not None and tasks[versus].get("greedy") is not None:
            row["versus"] = versus
            row["greedy"] = spec_dcp.compare_greedy(greedy, tasks[versus]["greedy"])
            if spec["method"] is None and jobs[versus]["spec"]["method"] is None and "logprobs" in tasks[name] \
                    and "logprobs" in tasks[versus]:
                row["logprobs"] = logprob_diffs(tasks[name]["logprobs"], tasks[versus]["logprobs"])
        rows[name] = row
    return {"jobs": rows}


def write_summary(summary: dict, meta: dict, results: Path, name: str) -> list[Path]:
    lines = [f"# A hybrid model (Qwen3-Next, GDN + attention) on dcp-triton ({meta.get('vllm')}, {meta.get('gpu')}, "
             "bf16, CUDA graphs)", "",
             "| job | versus | block size | prompt logprobs max / median abs diff | greedy = versus | acceptance | "
             "output tok/s | commit |", "|---|---|---|---|---|---|---|---|"]
    fmt = spec_dcp.fmt
    for job, row in summary["jobs"].items():
        lp, greedy = row.get("logprobs"), row.get("greedy")
        logprobs = "-" if lp is None else f"{lp['max_abs']:.3f} / {lp['median_abs']:.4f} ({lp['positions']})"
        same = "-" if greedy is None else f"{greedy['identical']}/{greedy['prompts']}" + (
            "" if not greedy["divergences"] else " (first at gaps " + ", ".join(
                f"{d['ref_top2_gap']:.3f}" for d in greedy["divergences"]) + ")")
        lines.append(f"| {job} | {row.get('versus', '-')} | {row['block_size'] or '-'} | {logprobs} | {same} | "
                     f"{fmt(row.get('acceptance_rate'))} | {fmt(row.get('output_tok_s'), '{:,.0f}')} | "
                     f"{(row.get('commit') or '-')[:7]} |")
    return spec_dcp.write_files(summary, meta, results, name, lines)


def summarise(args, paths: dict[str, Path], jobs: dict[str, dict]) -> list[Path]:
    meta = next(({k: r["result"].get(k) for k in ("gpu", "vllm", "torch")} for r in jobs.values() if r["result"]),
                {})
    meta.update(model=MODEL, config=CONFIG, mtp=MTP, logprob_prompts=LOGPROB_PROMPTS, greedy=GREEDY,
                max_tokens=MAX_TOKENS, tp=args.tp)
    return write_summary(analyse(jobs), meta, paths["results"], args.name)


def main(argv: list[str] | None = None) -> None:
    parser = dcp_e2e.catalogue_parser(__doc__, name="vllm_hybrid_h100", work_dir="/tmp/dcp_vllm_hybrid")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=1, help="1: one GPU (default); 2: the DCP = 2 "
                        "set on two GPUs")
    args = parser.parse_args(argv)
    if args.tp == 2 and args.name == "vllm_hybrid_h100":
        args.name = "vllm_hybrid_2xh100"
    paths = dcp_e2e.catalogue_paths(args)
    dcp_e2e.one_engine_at_a_time(args, catalogue(paths["work"], paths["raw"], tp=args.tp),
                                 lambda found: summarise(args, paths, found), gpu_ids=runner.visible_gpus(),
                                 plan_gpus=args.tp, required=spec_dcp.REQUIRED_MODULES)

if __name__ == "__main__":
    main()
