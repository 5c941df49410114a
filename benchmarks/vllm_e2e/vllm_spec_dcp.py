"""Speculative decoding on dcp-triton inside vLLM 0.26 at tp = 2, DCP = 2: n-gram and a draft model, exact and timed.

The target is vllm_dcp_e2e.py's random Llama ``mqa-d128`` (16 Q / 1 KV heads, head_dim 128, 4 layers, vocab 8192);
the draft, ``draft-d64``, a random Llama of the same vocabulary (2 layers, hidden 512, 8 Q / 1 KV heads, head_dim
64), both built on the machine. Every engine runs dcp-triton in float32 (TRITON_F32_DEFAULT=ieee) on vLLM's V1
model runner (VLLM_USE_V2_MODEL_RUNNER=0: 0.26's V2 runner runs neither ngram nor draft_model), with vLLM's default
CUDA-graph mode (``--eager``: enforce_eager) and one task: 24 prompts repeating a random unit (256-1024 tokens),
greedy, 128 tokens each, all at once, timed after a warm-up on 4 other prompts. Jobs, most valuable first:

  base-dcp2-ag_rs       no speculation (the reference of the next three)
  ngram-dcp2-ag_rs      method="ngram", 4 tokens, prompt_lookup 2..4
  draft-dcp2-ag_rs      method="draft_model" with draft-d64, 4 tokens, the draft on dcp-triton too
  selfdraft-dcp2-ag_rs  method="draft_model" with the target as its own draft (acceptance near 1)
  base-dcp1 / selfdraft-dcp1         the same at DCP = 1: acceptance without a sharded draft cache
  base-dcp2-a2a / ngram-dcp2-a2a     dcp_comm_backend="a2a"

``--tp 1`` runs the one-GPU set instead (tp = 1, DCP = 1: base-tp1, ngram-tp1, draft-tp1, selfdraft-tp1), the
speculation of a single H200, into ``vllm_spec_h200``; then base and n-gram on vLLM's TRITON_ATTN (``*-TRITON_ATTN``),
the speed-up speculation gives a vLLM backend on the same model.

Per speculative job the summary gives the greedy tokens against its reference (identical prompts, and the
reference's top-2 logprob gap where a prompt first differs: float32 near ties), vLLM's acceptance counters over the
timed run (``vllm:spec_decode_num_drafts``, ``_num_draft_tokens``, ``_num_accepted_tokens``,
``_num_accepted_tokens_per_pos``: acceptance rate, mean acceptance length, per-position rates) and output tokens/s
against the reference's (speed-up). Results:

    benchmarks/results/<name>.json / .md          summary (rows per job), table
    benchmarks/results/<name>_jobs.tar.gz         every job's log and raw result (also unpacked to resume)

    python -m benchmarks.vllm_e2e.vllm_spec_dcp --budget-s 540      # 2 GPUs: everything, in order (a rerun resumes)
    python -m benchmarks.vllm_e2e.vllm_spec_dcp --tp 1 --budget-s 540   # 1 GPU: DCP = 1
    python -m benchmarks.vllm_e2e.vllm_spec_dcp --plan               # the order and estimated times; no torch, no vLLM
    python -m benchmarks.vllm_e2e.vllm_spec_dcp --summarise          # here, from the tarball that came back
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_dcp_e2e as dcp_e2e
from benchmarks.vllm_e2e.e2e_runner import Job
from benchmarks.vllm_e2e.vllm_gpu_e2e import GRAPH_SIZES, LLAMA_COMMON

DRAFT_MODEL = "draft-d64"
DRAFT_CONFIG = dict(LLAMA_COMMON, num_hidden_layers=2, hidden_size=512, intermediate_size=1024,
                    num_attention_heads=8, num_key_value_heads=1, head_dim=64,
                    max_position_embeddings=dcp_e2e.CONFIG["max_position_embeddings"])
SPEC_TOKENS = 4
NGRAM = {"method": "ngram", "num_speculative_tokens": SPEC_TOKENS, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
PROMPTS = dict(count=24, min_len=256, max_len=1024, seed=5)
WARMUP = dict(count=4, min_len=256, max_len=1024, seed=6)
MAX_TOKENS = 128
NEAR_TIE = 1e-3  # float32: a greedy divergence where the reference's top-2 logprobs are this close is a tie
REQUIRED_MODULES = ("vllm", "transformers", "dcp_plugin")
# name, speculation ("ngram", "draft", "self" or None), dcp, comm, reference job; in run order
ENGINES = [("base-dcp2-ag_rs", None, 2, "ag_rs", None), ("ngram-dcp2-ag_rs", "ngram", 2, "ag_rs", "base-dcp2-ag_rs"),
           ("draft-dcp2-ag_rs", "draft", 2, "ag_rs", "base-dcp2-ag_rs"),
           ("selfdraft-dcp2-ag_rs", "self", 2, "ag_rs", "base-dcp2-ag_rs"), ("base-dcp1", None, 1, None, None),
           ("selfdraft-dcp1", "self", 1, None, "base-dcp1"), ("base-dcp2-a2a", None, 2, "a2a", None),
           ("ngram-dcp2-a2a", "ngram", 2, "a2a", "base-dcp2-a2a")]
ENGINES_ONE_GPU = [("base-tp1", None, 1, None, None), ("ngram-tp1", "ngram", 1, None, "base-tp1"),
                   ("draft-tp1", "draft", 1, None, "base-tp1"), ("selfdraft-tp1", "self", 1, None, "base-tp1"),
                   ("base-tp1-TRITON_ATTN", None, 1, None, None),
                   ("ngram-tp1-TRITON_ATTN", "ngram", 1, None, "base-tp1-TRITON_ATTN")]
ESTIMATE_S = {"build": 40, "graphs": 110, "eager": 80}  # engine start ~40-70 s at tp = 2, then the task
COUNTER = "vllm:spec_decode_num_"


def repeat_prompts(*, count: int, min_len: int, max_len: int, seed: int, vocab: int) -> list[list[int]]:
    """``count`` prompts, each a random unit of 8-64 token ids repeated up to a random length in
    ``[min_len, max_len]`` (n-gram speculation finds its proposals in them); the same arguments give the same
    prompts anywhere."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        unit = [rng.randrange(3, vocab) for _ in range(rng.randint(8, 64))]
        length = rng.randint(min_len, max_len)
        prompts.append((unit * (length // len(unit) + 1))[:length])
    return prompts


def speculative_config(kind: str | None, work: Path, tp: int = 2) -> dict | None:
    if kind is None:
        return None
    if kind == "ngram":
        return dict(NGRAM)
    model = work / "models" / (DRAFT_MODEL if kind == "draft" else dcp_e2e.MODEL)
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": SPEC_TOKENS,
            "draft_tensor_parallel_size": tp, "attention_backend": "dcp-triton"}


def backend_of(job: str) -> str:
    """The attention backend of an engine job: a vLLM backend named at the end of its name, else dcp-triton."""
    return "TRITON_ATTN" if job.endswith("-TRITON_ATTN") else "dcp-triton"


def catalogue(work: Path, raw: Path, *, eager: bool = False, tp: int = 2) -> list[Job]:
    """The two builds, then every engine job in run order (``tp``: 2, or 1 for the one-GPU set)."""
    builds = [Job(f"build-{name}", {"kind": "build", "model_dir": str(work / "models" / name), "seed": 0,
                                    "config": config}, 240, env=dict(dcp_e2e.NO_MULTICAST),
                  estimate_s=ESTIMATE_S["build"], group="build")
              for name, config in ((dcp_e2e.MODEL, dcp_e2e.CONFIG), (DRAFT_MODEL, DRAFT_CONFIG))]
    vocab = dcp_e2e.CONFIG["vocab_size"]
    task = {"name": "spec", "type": "spec_decode", "max_tokens": MAX_TOKENS,
            "prompt_ids": repeat_prompts(vocab=vocab, **PROMPTS), "warmup_ids": repeat_prompts(vocab=vocab, **WARMUP)}
    mode = "eager" if eager else "graphs"
    jobs = list(builds)
    for name, kind, dcp, comm, reference in ENGINES if tp == 2 else ENGINES_ONE_GPU:
        kwargs = dict(model=str(work / "models" / dcp_e2e.MODEL), skip_tokenizer_init=True, dtype="float32", seed=0,
                      enforce_eager=eager, max_model_len=2048, kv_cache_memory_bytes=2 << 30,
                      gpu_memory_utilization=0.3, attention_backend=backend_of(name), max_num_seqs=64,
                      tensor_parallel_size=tp, decode_context_parallel_size=dcp, disable_log_stats=False)
        if comm is not None:
            kwargs["dcp_comm_backend"] = comm
        if not eager:  # vLLM's default FULL_AND_PIECEWISE, over fewer capture sizes (start-up time)
            kwargs["compilation_config"] = {"cudagraph_capture_sizes": GRAPH_SIZES}
        if kind is not None:
            kwargs["speculative_config"] = speculative_config(kind, work, tp)
        spec = {"kind": "engine", "model": dcp_e2e.MODEL, "backend": backend_of(name), "dtype": "float32", "mode": mode,
                "method": kind, "dcp": dcp, "comm": comm, "reference": reference, "vocab": vocab, "engine": kwargs,
                "tasks": [task], "out": str(raw / f"{name}.json.gz")}
        env = {**dcp_e2e.NO_MULTICAST, "VLLM_USE_V2_MODEL_RUNNER": "0"}
        jobs.append(Job(name, spec, 2 * ESTIMATE_S[mode], [b.name for b in builds], exclusive=True, gpus=tp, env=env,
                        estimate_s=ESTIMATE_S[mode], group=f"{kind or 'base'} {mode}"))
    return jobs


def acceptance(counters: dict) -> dict:
    """Rates from vLLM's counters: accepted / proposed tokens, mean tokens per step (the bonus token included, as
    vLLM logs it) and each draft position's acceptance rate; all None when nothing was proposed."""
    drafts, proposed = counters.get(f"{COUNTER}drafts", 0), counters.get(f"{COUNTER}draft_tokens", 0)
    accepted, per_position = counters.get(f"{COUNTER}accepted_tokens", 0), counters.get(
        f"{COUNTER}accepted_tokens_per_pos", [])
    if not drafts or not proposed:
        return {"drafts": drafts, "acceptance_rate": None, "mean_acceptance_length": None, "per_position": None}
    return {"drafts": drafts, "proposed": proposed, "accepted": accepted, "acceptance_rate": accepted / proposed,
            "mean_acceptance_length": 1 + accepted / drafts, "per_position": [n / drafts for n in per_position]}


def compare_greedy(ours: dict, ref: dict) -> dict:
    """Prompts whose greedy tokens equal the reference's, and where the others first differ, with the reference's
    top-2 logprob gap there (the tokens before agree, so both engines saw the same context)."""
    divergences = []
    for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"])):
        step = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if step is not None:
            best, second = ref["top2_logprobs"][i][step]
            divergences.append({"prompt": i, "step": step, "ref_top2_gap": best - second})
    return {"prompts": len(ref["tokens"]), "identical": len(ref["tokens"]) - len(divergences),
            "divergences": divergences,
            "all_at_near_ties": all(d["ref_top2_gap"] <= NEAR_TIE for d in divergences)}


def analyse(jobs: dict[str, dict]) -> dict:
    """One row per engine job: status, acceptance, tokens/s and, for speculative jobs, the comparison with their
    reference job (greedy tokens, speed-up)."""
    data = {name: ((job.get("result") or {}).get("tasks") or {}).get("spec") for name, job in jobs.items()}
    rows = {}
    for name, job in jobs.items():
        spec, ours = job["spec"], data[name]
        row = {"status": job.get("status"), "method": spec["method"], "dcp": spec["dcp"], "comm": spec["comm"],
               "reference": spec["reference"], "dcp_triton_ran": bool(job.get("backend_line"))}
        if ours is not None:
            row.update(output_tok_s=ours["output_tok_s"], **acceptance(ours["spec_decode"]))
            ref = data.get(spec["reference"]) if spec["reference"] else None
            if ref is not None:
                row.update(greedy=compare_greedy(ours, ref), speedup=ours["output_tok_s"] / ref["output_tok_s"])
        rows[name] = row
    return {"jobs": rows}


def fmt(value, pattern="{:.3f}") -> str:
    """A table cell: ``pattern`` of ``value``, "-" for None."""
    return "-" if value is None else pattern.format(value)


def write_files(summary: dict, meta: dict, results: Path, name: str, lines: list[str]) -> list[Path]:
    """``<name>.json`` (summary and meta) and ``<name>.md`` (``lines``) in ``results``."""
    results.mkdir(parents=True, exist_ok=True)
    json_path, md_path = results / f"{name}.json", results / f"{name}.md"
    json_path.write_text(json.dumps({"summary": summary, "meta": meta}, indent=1))
    md_path.write_text("\n".join(lines) + "\n")
    return [json_path, md_path]


def write_summary(summary: dict, meta: dict, results: Path, name: str) -> list[Path]:
    lines = [f"# Speculative decoding on dcp-triton, tp = {meta.get('tp', 2)} ({meta.get('vllm')}, "
             f"{meta.get('gpu')})", "",
             "| job | method | DCP | comm | status | greedy = reference | acceptance | mean accepted length | "
             "output tok/s | speed-up |", "|---|---|---|---|---|---|---|---|---|---|"]
    for job, row in summary["jobs"].items():
        greedy = row.get("greedy")
        same = "-" if greedy is None else f"{greedy['identical']}/{greedy['prompts']}" + (
            "" if not greedy["divergences"] else " (near ties)" if greedy["all_at_near_ties"] else " (REAL)")
        lines.append(f"| {job} | {row['method'] or '-'} | {row['dcp']} | {row['comm'] or '-'} | {row['status']} | "
                     f"{same} | {fmt(row.get('acceptance_rate'))} | {fmt(row.get('mean_acceptance_length'))} | "
                     f"{fmt(row.get('output_tok_s'), '{:,.0f}')} | {fmt(row.get('speedup'), '{:.2f}x')} |")
    return write_files(summary, meta, results, name, lines)


def summarise(args, paths: dict[str, Path], jobs: dict[str, dict]) -> list[Path]:
    meta = next(({k: r["result"].get(k) for k in ("gpu", "vllm", "torch")} for r in jobs.values() if r["result"]),
                {})
    meta.update(target=dcp_e2e.MODEL, target_config=dcp_e2e.CONFIG, draft=DRAFT_MODEL, draft_config=DRAFT_CONFIG,
                prompts=PROMPTS, max_tokens=MAX_TOKENS, ngram=NGRAM, near_tie=NEAR_TIE, tp=args.tp)
    return write_summary(analyse(jobs), meta, paths["results"], args.name)


def main(argv: list[str] | None = None) -> None:
    parser = dcp_e2e.catalogue_parser(__doc__, name="vllm_spec_dcp_2xh200", work_dir="/tmp/dcp_vllm_spec")
    parser.add_argument("--eager", action="store_true", help="every engine with enforce_eager (no CUDA graphs)")
    parser.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: CUDA_VISIBLE_DEVICES, else "
                        "nvidia-smi -L; --plan assumes 2 when neither says)")
    parser.add_argument("--tp", type=int, choices=(1, 2), default=2, help="2: the DCP = 2 set on two GPUs (default); "
                        "1: the one-GPU set at DCP = 1")
    args = parser.parse_args(argv)
    if args.tp == 1 and args.name == "vllm_spec_dcp_2xh200":
        args.name = "vllm_spec_h200"
    paths = dcp_e2e.catalogue_paths(args)
    gpu_ids = [str(i) for i in range(args.gpus)] if args.gpus is not None else runner.visible_gpus()
    dcp_e2e.one_engine_at_a_time(
        args, catalogue(paths["work"], paths["raw"], eager=args.eager, tp=args.tp),
        lambda found: summarise(args, paths, found), gpu_ids=gpu_ids,
        plan_gpus=len(gpu_ids) if args.gpus is not None or gpu_ids else 2, required=REQUIRED_MODULES)

if __name__ == "__main__":
    main()
