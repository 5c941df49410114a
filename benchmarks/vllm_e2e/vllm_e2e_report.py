"""Pure-Python half of ``vllm_gpu_e2e.py``: prompts, backend-vs-backend agreement, the summary (JSON, markdown, PNG).

No torch, no vLLM: the CPU unit test drives everything here with fake job results.
"""

from __future__ import annotations

import importlib.util
import json
import math
import random
from pathlib import Path

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_e2e_bursts as bursts

FP32_LOGPROB_TOL = 1e-3  # max |logprob(dcp-triton) - logprob(TRITON_ATTN)| in float32
# A float32 greedy divergence is explained when both backends see a top-2 gap this small there: two logprobs that
# each move by <= FP32_LOGPROB_TOL can swap order only if they were within 2 * FP32_LOGPROB_TOL.
FP32_TIE_GAP = 2 * FP32_LOGPROB_TOL
OURS = "dcp-triton"
WARMED_UP = "dcp-triton: compiled the kernels of"  # the start-up warm-up's log line (dcp_plugin/warmup.py)


def make_prompts(*, count: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` prompts of random token ids in ``[3, vocab)`` (0-2: special ids), lengths spread geometrically from
    ``min_len`` to ``max_len`` inclusive (both ends present); the same arguments give the same prompts anywhere."""
    if count < 1 or not 1 <= min_len <= max_len or vocab <= 3:
        raise ValueError(f"prompt set needs count >= 1, 1 <= min_len <= max_len and vocab > 3; got count={count}, "
                         f"min_len={min_len}, max_len={max_len}, vocab={vocab}")
    rng = random.Random(seed)
    ratio = max_len / min_len
    lengths = [round(min_len * ratio ** (i / max(count - 1, 1))) for i in range(count)]
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_prefix_prompts(*, prefix_len: int, suffix_lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    """Prompts sharing one ``prefix_len``-token prefix, each with its own random suffix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, vocab) for _ in range(prefix_len)]
    return [prefix + [rng.randrange(3, vocab) for _ in range(n)] for n in suffix_lens]


def compare_logprobs(ours: dict, ref: dict) -> dict:
    """Teacher-forced agreement of two ``logprobs`` task results (per prompt: the logprob of every prompt token
    after the first, and the top-1 token there)."""
    _same_prompts(ours, ref)
    worst, total, count, same_top1 = None, 0.0, 0, 0
    for i, (a, b) in enumerate(zip(ours["token_logprobs"], ref["token_logprobs"])):
        for pos, (x, y) in enumerate(zip(a, b)):
            diff = abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf
            total, count = total + diff, count + 1
            if worst is None or diff > worst["abs_diff"]:
                first = ours["first_positions"][i] if "first_positions" in ours else 1
                worst = {"prompt": i, "position": pos + first, "ours": x, "ref": y, "abs_diff": diff}
        same_top1 += sum(p == q for p, q in zip(ours["top1_ids"][i], ref["top1_ids"][i]))
    return {
        "prompts": len(ours["token_logprobs"]), "positions": count,
        "max_abs_diff": worst["abs_diff"] if worst else 0.0, "mean_abs_diff": total / max(count, 1),
        "top1_agreement": same_top1 / max(count, 1), "worst": worst,
    }


def compare_greedy(ours: dict, ref: dict, *, tie_gap: float) -> dict:
    """Greedy agreement of two ``greedy`` task results: tokens up to the first divergence per prompt, and each
    divergence's top-2 logprob gap in both runs (a near tie when both gaps are <= ``tie_gap``). Before a prompt's
    first divergence both runs saw the same context and chose the same token, so the chosen token's logprob there
    is a teacher-forced comparison too (``shared_max_abs_dlogprob`` over ``shared_steps``)."""
    _same_prompts(ours, ref)
    divergences, agreed, generated, shared_worst = [], 0, 0, 0.0
    for i, (a, b) in enumerate(zip(ours["tokens"], ref["tokens"])):
        common = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        agreed, generated = agreed + common, generated + max(len(a), len(b))
        for k in range(common):
            x, y = ours["top2_logprobs"][i][k][0], ref["top2_logprobs"][i][k][0]
            shared_worst = max(shared_worst, abs(x - y) if math.isfinite(x) and math.isfinite(y) else math.inf)
        if common < min(len(a), len(b)):
            gap_ours, gap_ref = _top2_gap(ours, i, common), _top2_gap(ref, i, common)
            divergences.append({
                "prompt": i, "position": common, "ours_token": a[common], "ref_token": b[common],
                "gap_ours": gap_ours, "gap_ref": gap_ref, "near_tie": max(gap_ours, gap_ref) <= tie_gap,
            })
    return {
        "prompts": len(ours["tokens"]), "exact_sequences": sum(a == b for a, b in zip(ours["tokens"], ref["tokens"]))
        / max(len(ours["tokens"]), 1),
        "token_agreement": agreed / max(generated, 1), "divergences": divergences,
        "all_divergences_near_ties": all(d["near_tie"] for d in divergences), "tie_gap": tie_gap,
        "shared_steps": agreed, "shared_max_abs_dlogprob": shared_worst,
    }


def compare_prefix(ours: dict, ref: dict, *, tie_gap: float) -> dict:
    """Prefix-cache case: first generated token's top-k logprobs (computed over a cached prefix), greedy tokens,
    and the cache hits each run saw."""
    first_diff = 0.0
    for a, b in zip(ours["first_topk"], ref["first_topk"]):
        common = set(a) & set(b)
        first_diff = max([first_diff, *(abs(a[t] - b[t]) for t in common)])
    return {
        "first_token_max_abs_diff": first_diff,
        "cached_tokens_ours": ours["cached_tokens"], "cached_tokens_ref": ref["cached_tokens"],
        "greedy": compare_greedy(ours, ref, tie_gap=tie_gap),
    }


def analyse(jobs: dict[str, dict]) -> dict:
    """Every comparison and check the finished jobs allow. ``jobs``: name -> {"spec": ..., "status": ...,
    "result": raw worker result or None}; missing or failed jobs only drop the rows that need them."""
    done = {name: job for name, job in jobs.items() if job.get("result") and job["spec"]["kind"] == "engine"}
    groups: dict[tuple, dict[str, dict]] = {}
    for job in done.values():
        spec = job["spec"]
        if spec["case"] in bursts.CASES:  # nothing to compare: vllm_e2e_bursts reports them
            continue
        groups.setdefault((spec["model"], spec["dtype"], spec["case"]), {})[spec["backend"]] = job["result"]
    rows, checks = [], []
    for (model, dtype, case), by_backend in sorted(groups.items()):
        pairs = [(OURS, ref) for ref in sorted(by_backend) if ref != OURS and OURS in by_backend]
        if dtype != "float32" and "TRITON_ATTN" in by_backend and "FLASH_ATTN" in by_backend:
            pairs.append(("TRITON_ATTN", "FLASH_ATTN"))  # vLLM vs vLLM: the bf16 noise floor, for context
        for a, b in pairs:
            tasks_a, tasks_b = by_backend[a]["tasks"], by_backend[b]["tasks"]
            for task in sorted(set(tasks_a) & set(tasks_b)):
                row = _compare_task(task, tasks_a[task], tasks_b[task], dtype)
                rows.append({"model": model, "dtype": dtype, "case": case, "task": task, "ours": a, "ref": b,
                             **row})
                if a == OURS and dtype == "float32" and b == "TRITON_ATTN":
                    checks.append(_check(model, case, task, row))
    for (model, dtype, case), by_backend in sorted(groups.items()):  # fp8 KV against each backend's own bf16 KV
        for backend in sorted(by_backend) if case == "fp8" else ():
            bf16 = groups.get((model, dtype, "main"), {}).get(backend)
            for task in sorted(set(by_backend[backend]["tasks"]) & set(bf16["tasks"] if bf16 else ())):
                row = _compare_task(task, by_backend[backend]["tasks"][task], bf16["tasks"][task], dtype)
                rows.append({"model": model, "dtype": dtype, "case": "fp8 KV vs bf16 KV", "task": task,
                             "ours": f"{backend} fp8", "ref": f"{backend} bf16", **row})
    for name, job in sorted(done.items()):
        if job["spec"]["backend"] == OURS:  # the run really used our kernels, compiled (not a fallback)
            line = job.get("backend_line") or ""
            ok = "backend=DCP_TRITON" in line and "kernels=triton" in line and "interpreter" not in line
            checks.append({"name": f"{name}: worker built dcp-triton", "pass": ok,
                           "detail": line[line.find("backend="):][:160] or "no dcp-triton startup line in the log"})
            log = Path(job.get("log") or "")
            text = log.read_text(errors="replace") if log.is_file() else ""
            if WARMED_UP in text:  # runs of releases before the start-up warm-up are not held to it
                compiled = sorted(set(runner.jit_compiles(text)) & runner.dcp_kernel_names())
                checks.append({"name": f"{name}: no dcp-triton kernel compiled after start-up", "pass": not compiled,
                               "detail": ", ".join(compiled) or "vLLM's JIT monitor named none of our kernels"})
    throughput = [{"model": job["spec"]["model"], "backend": job["spec"]["backend"], "mode": job["spec"]["mode"],
                   "kv": _kv_dtype(job["spec"]), **w}
                  for job in done.values() for w in job["result"].get("throughput", [])]
    capacity = [{"job": name, "backend": job["spec"]["backend"], "kv": _kv_dtype(job["spec"]),
                 "kv_cache_tokens": job["result"]["kv_cache_tokens"]} for name, job in sorted(done.items())
                if job["spec"]["case"] in ("main", "fp8") and job["result"].get("kv_cache_tokens")]
    burst = bursts.rows(jobs)
    checks += bursts.checks(burst)
    return {"agreement": rows, "checks": checks, "throughput": throughput, "kv_capacity": capacity,
            "repeatability": repeatability(done), "bursts": burst,
            "jobs": {n: {k: j.get(k) for k in ("status", "elapsed_s", "log", "backend_line")} for n, j in
                     sorted(jobs.items())}}


def repeatability(done: dict[str, dict]) -> list[dict]:
    """The same batch on two fresh engines (jobs whose spec has ``repeat``: {"set", "run"}): per set, backend and
    greedy task, run 2 against run 1 (``compare_greedy``; divergences reported, not judged). A set without both runs
    gives no row."""
    runs: dict[tuple[str, str], dict[int, dict]] = {}
    for job in done.values():
        if rep := job["spec"].get("repeat"):
            runs.setdefault((rep["set"], job["spec"]["backend"]), {})[rep["run"]] = job["result"]["tasks"]
    rows = []
    for (name, backend), by_run in sorted(runs.items()):
        first, second = by_run.get(1), by_run.get(2)
        for task in sorted(set(first or ()) & set(second or ())):
            row = compare_greedy(second[task], first[task], tie_gap=math.inf)
            pairs = list(zip(second[task]["tokens"], first[task]["tokens"]))
            identical, tokens = sum(a == b for a, b in pairs), sum(max(len(a), len(b)) for a, b in pairs)
            earliest = min((d["position"] for d in row["divergences"]), default=None)
            rows.append({"set": name, "backend": backend, "task": task, "prompts": row["prompts"],
                         "identical": identical, "tokens": tokens, "shared_steps": row["shared_steps"],
                         "earliest_divergence": earliest, "max_abs_dlogprob": row["shared_max_abs_dlogprob"],
                         "bitwise": identical == row["prompts"] and row["shared_max_abs_dlogprob"] == 0.0,
                         "divergences": row["divergences"]})
    return rows


def write_summary(summary: dict, meta: dict, out_dir: Path, name: str, *, render=None, draw=None) -> list[Path]:
    """``<name>.json`` (everything), ``<name>.md`` (tables) and ``<name>.png`` (when matplotlib is present), with
    ``render(summary, meta)`` / ``draw(summary, meta, path)`` (default: this module's ``markdown`` and ``plot``)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.json", out_dir / f"{name}.md"]
    atomic_write(paths[0], json.dumps({"meta": meta, **summary}, indent=1))
    atomic_write(paths[1], (render or markdown)(summary, meta))
    if importlib.util.find_spec("matplotlib") is None:
        return paths
    if summary.get("agreement") or summary.get("throughput"):
        paths.append(out_dir / f"{name}.png")
        (draw or plot)(summary, meta, paths[-1])
    return paths


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# vLLM end to end on {meta.get('gpu', '?')}: dcp-triton vs vLLM's attention backends", "",
             f"vLLM {meta.get('vllm', '?')}, torch {meta.get('torch', '?')}. Random-initialised Llama checkpoints "
             "(transformers default init), greedy, `ignore_eos`. float32 runs: `TRITON_F32_DEFAULT="
             f"{meta.get('triton_f32', 'ieee')}` (with Triton's default, vLLM's Triton kernels round float32 dot "
             "inputs to TF32).", ""]
    if summary["checks"]:
        lines += ["## Checks", "", "| check | result | detail |", "|---|---|---|"]
        lines += [f"| {c['name']} | {'PASS' if c['pass'] else 'FAIL'} | {c['detail']} |" for c in summary["checks"]]
        lines.append("")
    if summary["agreement"]:
        lines += ["## Agreement", "", "| model | dtype | case | task | ours | ref | result |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['dtype']} | {r['case']} | {r['task']} | {r['ours']} | {r['ref']} | "
                  f"{r['text']} |" for r in summary["agreement"]]
        lines.append("")
    if summary["throughput"]:
        lines += ["## Offline throughput", "", "| model | workload | backend | mode | KV | requests | prompt | "
                  "output | s | output tok/s |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {t['model']} | {t['workload']} | {t['backend']} | {t['mode']} | {t.get('kv', 'auto')} | "
                  f"{t['requests']} | {t['prompt_len']} | {t['output_len']} | {t['elapsed_s']:.2f} | "
                  f"{t['output_tok_s']:.0f} |" for t in summary["throughput"]]
        lines.append("")
    if summary.get("repeatability"):
        lines += ["## Repeatability (fresh engine, same batch)", "", "Run 2 against run 1 of the same greedy batch, "
                  "each on a newly started engine.", "", "| set | backend | task | identical sequences | tokens "
                  "before first divergence | earliest divergence (step) | max abs chosen-token dlogprob (shared "
                  "steps) |", "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['set']} | {r['backend']} | {r['task']} | {r['identical']}/{r['prompts']} | "
                  f"{r['shared_steps']}/{r['tokens']} | "
                  f"{'none' if r['earliest_divergence'] is None else r['earliest_divergence']} | "
                  f"{r['max_abs_dlogprob']:.3g} |" for r in summary["repeatability"]]
        lines.append("")
    if summary.get("kv_capacity"):
        lines += ["## KV cache capacity (vLLM's log, same KV memory)", "", "| job | backend | KV | tokens |",
                  "|---|---|---|---|"]
        lines += [f"| {c['job']} | {c['backend']} | {c['kv']} | {c['kv_cache_tokens']:,} |"
                  for c in summary["kv_capacity"]]
        lines.append("")
    lines += bursts.markdown(summary.get("bursts") or [])
    lines += ["## Jobs", "", "| job | status | s |", "|---|---|---|"]
    lines += [f"| {n} | {j['status']} | {j['elapsed_s'] if j['elapsed_s'] is not None else ''} |"
              for n, j in summary["jobs"].items()]
    return "\n".join(lines) + "\n"


def plot(summary: dict, meta: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    logprob_rows = [r for r in summary["agreement"] if "max_abs_diff" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    labels = [f"{r['model']} {short.get(r['dtype'], r['dtype'])} {r['case']} {r['task']}\n{r['ours']} vs {r['ref']}"
              for r in logprob_rows]
    values = [max(r["max_abs_diff"], 1e-8) for r in logprob_rows]  # log axis: an exact 0 shows at the floor
    ax.barh(range(len(labels)), values, color=["tab:blue" if r["dtype"] == "float32" else "tab:orange"
                                               for r in logprob_rows])
    for i, r in enumerate(logprob_rows):
        ax.text(values[i], i, f" {r['max_abs_diff']:.2g}", va="center", fontsize=7)
    ax.axvline(FP32_LOGPROB_TOL, color="red", linestyle="--", label=f"float32 bound {FP32_LOGPROB_TOL:g}")
    ax.set(xscale="log", yticks=range(len(labels)), xlabel="max abs logprob difference (teacher-forced)")
    ax.set_yticklabels(labels, fontsize=7)
    ax.legend(fontsize=8)
    ax = axes[1]
    rows = summary["throughput"]
    names = [f"{t['workload']}\n{t['backend']} {t['mode']}" for t in rows]
    ax.barh(range(len(rows)), [t["output_tok_s"] for t in rows],
            color=["tab:green" if t["backend"] == OURS else "tab:gray" for t in rows])
    ax.set(yticks=range(len(rows)), xlabel="output tokens / s (offline, one GPU)")
    ax.set_yticklabels(names, fontsize=7)
    fig.suptitle(f"dcp-triton in vLLM {meta.get('vllm', '?')} on {meta.get('gpu', '?')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _compare_task(task: str, a: dict, b: dict, dtype: str) -> dict:
    tie = FP32_TIE_GAP if dtype == "float32" else math.inf  # bf16: divergences are reported, not judged
    if task.startswith("logprobs"):
        row = compare_logprobs(a, b)
        return {**row, "text": f"max abs dlogprob {row['max_abs_diff']:.3g}, mean {row['mean_abs_diff']:.2g}, top-1 "
                               f"agree {row['top1_agreement']:.2%} over {row['positions']} positions"}
    if task.startswith("greedy"):
        row = compare_greedy(a, b, tie_gap=tie)
        return {**row, "text": _greedy_text(row)}
    if task.startswith("prefix"):
        row = compare_prefix(a, b, tie_gap=tie)
        return {**row, "text": f"first-token max abs dlogprob {row['first_token_max_abs_diff']:.3g}, cached "
                               f"{row['cached_tokens_ours']} / {row['cached_tokens_ref']}; "
                               f"{_greedy_text(row['greedy'])}"}
    raise ValueError(f"unknown task {task!r}: expected logprobs*, greedy* or prefix*")


def _kv_dtype(spec: dict) -> str:
    return spec.get("engine", {}).get("kv_cache_dtype", "auto")


def _greedy_text(row: dict) -> str:
    gaps = ", ".join(f"{d['gap_ref']:.2g}" for d in row["divergences"][:6])
    return (f"{row['exact_sequences']:.0%} identical, {row['token_agreement']:.1%} tokens before divergence; "
            f"{len(row['divergences'])} divergences" + (f" (top-2 gaps {gaps})" if gaps else "") +
            f"; chosen-token logprob max abs diff {row['shared_max_abs_dlogprob']:.2g} over {row['shared_steps']} "
            "shared steps")


def _check(model: str, case: str, task: str, row: dict) -> dict:
    name = f"{model} {case} {task}"
    if task.startswith("logprobs"):
        ok = row["max_abs_diff"] <= FP32_LOGPROB_TOL
        worst = row["worst"] or {}
        return {"name": name, "pass": ok, "detail": f"max abs dlogprob {row['max_abs_diff']:.3g} (bound "
                f"{FP32_LOGPROB_TOL:g}) at prompt {worst.get('prompt')} position {worst.get('position')}"}
    if task.startswith("greedy"):
        return {"name": name, "pass": row["all_divergences_near_ties"],
                "detail": f"{len(row['divergences'])} divergences; max top-2 gap there "
                f"{max([0.0, *(max(d['gap_ours'], d['gap_ref']) for d in row['divergences'])]):.3g} (bound "
                f"{FP32_TIE_GAP:g})"}
    later_hits = row["cached_tokens_ours"][1:]
    ok = row["first_token_max_abs_diff"] <= FP32_LOGPROB_TOL and all(h > 0 for h in later_hits) and \
        row["greedy"]["all_divergences_near_ties"]
    return {"name": name, "pass": ok, "detail": f"first-token max abs dlogprob {row['first_token_max_abs_diff']:.3g}, "
                                                f"cache hits {later_hits}, divergences at near ties"}


def _same_prompts(a: dict, b: dict) -> None:
    if a["prompt_lens"] != b["prompt_lens"]:
        raise ValueError(f"the two runs saw different prompts: lengths {a['prompt_lens'][:4]}... vs "
                         f"{b['prompt_lens'][:4]}...")


def _top2_gap(run: dict, prompt: int, step: int) -> float:
    top2 = run["top2_logprobs"][prompt][step]
    return top2[0] - top2[1] if len(top2) == 2 else math.inf


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
