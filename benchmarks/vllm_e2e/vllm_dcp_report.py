"""Pure-Python half of ``vllm_dcp_e2e.py``: the summary (results contract), its tables and plot, and the merge of the
one-GPU set into ``host_overhead_h200.json``. No torch, no vLLM: the CPU unit test drives it with fake job results.

Contract (``<name>.json``, key ``summary``): ``loads`` -> load -> {dcp_triton_dcp2, flash_attn_dcp2, dcp_triton_dcp1,
flash_attn_dcp1}: output tokens/s at tp = 2 in CUDA-graph mode (dcp_triton_dcp2: the better of ag_rs and a2a, both
kept under ``by_mode``); ``long_context_load``; ``fp32_max_abs_logprob_diff``: the worst float32 teacher-forced
prompt-logprob difference of every dcp-triton DCP=2 job against TRITON_ATTN DCP=1. A missing job gives null.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_e2e_report as report

LOADS = {"decode-heavy": (256, 512, 512), "small-batch": (64, 512, 128), "prefill-heavy": (32, 8192, 64),
         "long-context": (16, 32768, 64)}  # requests, prompt tokens, output tokens
LONG_LOAD = "long-context"
CONTRACT = ("dcp_triton_dcp2", "flash_attn_dcp2", "dcp_triton_dcp1", "flash_attn_dcp1")
DCP2_COMMS = {"ag_rs": "dcp_triton_dcp2_ag_rs", "a2a": "dcp_triton_dcp2_a2a"}
TP2_CONFIGS = (*DCP2_COMMS.values(), "flash_attn_dcp2", "dcp_triton_dcp1", "flash_attn_dcp1")
MODES = ("graphs", "eager")
TP1_LOADS = ("decode-heavy", "small-batch")
TP1_BACKENDS = ("dcp_triton", "flash_attn", "triton_attn")
ROW_KEYS = ("requests", "prompt_len", "output_len", "elapsed_s", "output_tok_s", "total_tok_s", "warmup_s",
            "warmup_requests", "ttft_median_s", "tpot_median_s")
dcp_kernel_names = runner.dcp_kernel_names  # the report's name for it (tests)


def analyse(jobs: dict[str, dict]) -> dict:
    """Everything the finished jobs allow. ``jobs``: name -> {"spec", "result" (raw or None), "status", "log", ...}."""
    done = {name: job for name, job in sorted(jobs.items()) if job.get("result")}
    logs = {name: _log_text(job) for name, job in done.items()}
    rows = throughput_rows(done, logs)
    by_mode = {mode: _by_load([r for r in rows if r["group"] == "tp2" and r["mode"] == mode]) for mode in MODES}
    fp32 = fp32_agreement(done)
    kv = kv_capacity(done, logs)
    compile_check = compile_checks(done)
    summary = {"loads": contract_loads(by_mode["graphs"]), "long_context_load": LONG_LOAD,
               "fp32_max_abs_logprob_diff": fp32["worst"]}
    return {
        "summary": summary, "by_mode": by_mode, "throughput": rows, "fp32": fp32, "kv_capacity": kv,
        "compile_check": compile_check, "checks": checks(done, fp32, kv, compile_check),
        "host_overhead": _tp1_table([r for r in rows if r["group"] == "tp1"]),
        "request_timing": "TTFT / TPOT medians from vLLM's RequestOutput.metrics (RequestStateStats: "
                          "first_token_latency; (last_token_ts - first_token_ts) / (generated - 1)); offline, all "
                          "requests arrive at once, so TTFT includes queueing"
                          if any(r.get("ttft_median_s") is not None for r in rows) else
                          "no request metrics in the results (RequestOutput.metrics was None)",
        "jobs": {name: {**{k: job.get(k) for k in ("status", "elapsed_s", "log", "backend_line")},
                        "init_s": (job.get("result") or {}).get("init_s"),
                        "kv_cache_tokens": _kv_tokens(job, logs.get(name, "")),
                        "jit_after_warmup": sorted(set(runner.jit_compiles(logs.get(name, ""))))}
                 for name, job in sorted(jobs.items())},
    }


def throughput_rows(done: dict[str, dict], logs: dict[str, str]) -> list[dict]:
    rows = []
    for name, job in done.items():
        spec = job["spec"]
        for w in job["result"].get("throughput", []):
            rows.append({"job": name, **{k: spec.get(k) for k in ("group", "config", "backend", "tp", "dcp", "comm",
                                                                    "mode")},
                         "load": w["workload"], **{k: w.get(k) for k in ROW_KEYS},
                         "kv_cache_tokens": _kv_tokens(job, logs[name])})
    return rows


def contract_loads(graphs: dict[str, dict]) -> dict[str, dict]:
    """load -> the four contract configurations' output tok/s (None where the job is missing)."""
    loads = {}
    for load in LOADS:
        got = graphs.get(load, {})
        comms = [got[key] for key in DCP2_COMMS.values() if got.get(key) is not None]
        loads[load] = {key: got.get(key) for key in CONTRACT}
        loads[load]["dcp_triton_dcp2"] = max(comms) if comms else None
    return loads


def fp32_agreement(done: dict[str, dict]) -> dict:
    """Every dcp-triton DCP=2 float32 job against TRITON_ATTN DCP=1: prompt logprobs and greedy, per task."""
    fp32 = {name: job for name, job in done.items() if job["spec"].get("group") == "fp32"}
    refs = [(n, j) for n, j in fp32.items() if j["spec"]["backend"] == "TRITON_ATTN" and j["spec"]["dcp"] == 1]
    rows = []
    for name, job in fp32.items():
        if job["spec"]["backend"] != report.OURS or job["spec"]["dcp"] < 2 or not refs:
            continue
        ref_name, ref = refs[0]
        ours_tasks, ref_tasks = job["result"]["tasks"], ref["result"]["tasks"]
        for task in sorted(set(ours_tasks) & set(ref_tasks)):
            if task.startswith("logprobs"):
                row = report.compare_logprobs(ours_tasks[task], ref_tasks[task])
            else:
                row = report.compare_greedy(ours_tasks[task], ref_tasks[task], tie_gap=report.FP32_TIE_GAP)
            rows.append({"ours": name, "ref": ref_name, "comm": job["spec"]["comm"], "task": task, **row})
    diffs = [r["max_abs_diff"] for r in rows if r["task"].startswith("logprobs")]
    return {"rows": rows, "worst": max(diffs) if diffs else None, "bound": report.FP32_LOGPROB_TOL,
            "compared": sorted({r["ours"] for r in rows if r["task"].startswith("logprobs")})}


def kv_capacity(done: dict[str, dict], logs: dict[str, str]) -> list[dict]:
    """vLLM's logged KV capacity of the long-context jobs, and whether it holds all the load's requests at once."""
    requests, prompt, output = LOADS[LONG_LOAD]
    need = requests * (prompt + output)
    rows = []
    for name, job in done.items():
        if job["spec"].get("group") != "tp2" or not any(w["workload"] == LONG_LOAD
                                                        for w in job["result"].get("throughput", [])):
            continue
        tokens = _kv_tokens(job, logs[name])
        rows.append({"job": name, "config": job["spec"]["config"], "mode": job["spec"]["mode"],
                     "dcp": job["spec"]["dcp"], "kv_cache_tokens": tokens, "needed_tokens": need,
                     "requests_at_once": tokens // (prompt + output) if tokens else None,
                     "holds_all_requests": tokens >= need if tokens else None})
    return rows


def compile_checks(done: dict[str, dict]) -> dict[str, dict]:
    """Per compile-check job and batch: JIT compiles after warm-up of dcp-triton's kernels and of all kernels."""
    ours = dcp_kernel_names()
    out = {}
    for name, job in done.items():
        check = job["result"]["tasks"].get("compile-check")
        if job["spec"].get("group") != "jit" or not check:
            continue
        batches = [{"batch": b["name"], "dcp_triton_compiles": sum(k in ours for k in b["jit_compiles"]),
                    "all_compiles": len(b["jit_compiles"]), "kernels": sorted(set(b["jit_compiles"])),
                    "elapsed_s": b["elapsed_s"], "cached_tokens": b["cached_tokens"]} for b in check["batches"]]
        out[name] = {"mode": job["spec"]["mode"], "log_read": check.get("log_read", False), "batches": batches,
                     "dcp_triton_total": sum(b["dcp_triton_compiles"] for b in batches),
                     "all_total": sum(b["all_compiles"] for b in batches)}
    return out


def checks(done: dict[str, dict], fp32: dict, kv: list[dict], compile_check: dict) -> list[dict]:
    out = []
    for name, job in done.items():
        spec, line = job["spec"], job.get("backend_line") or ""
        if spec["backend"] == report.OURS:
            want = ["backend=DCP_TRITON", f"dcp_size={spec['dcp']}", "kernels=triton"]
            want += [f"comm={spec['comm']}"] if spec["dcp"] > 1 else []
            ok = all(w in line for w in want) and "interpreter" not in line
        else:
            ok = bool(line)
        out.append({"name": f"{name}: worker built {spec['backend']}", "pass": ok,
                    "detail": line[-160:] or "no start-up line of that backend in the log"})
    for r in fp32["rows"]:
        ok = r["max_abs_diff"] <= fp32["bound"] if r["task"].startswith("logprobs") else r["all_divergences_near_ties"]
        detail = (f"max abs dlogprob {r['max_abs_diff']:.3g} (bound {fp32['bound']:g}) over {r['positions']} positions"
                  if "max_abs_diff" in r else f"{len(r['divergences'])} divergences, all at near ties: {ok}")
        out.append({"name": f"float32 {r['task']}: {r['ours']} vs {r['ref']}", "pass": ok, "detail": detail})
    for r in kv:
        if r["holds_all_requests"] is not None:
            ok = r["holds_all_requests"] == (r["dcp"] > 1)
            out.append({"name": f"{r['job']}: KV cache holds all {LOADS[LONG_LOAD][0]} requests only at DCP > 1",
                        "pass": ok, "detail": f"{r['kv_cache_tokens']:,} tokens, {r['requests_at_once']} requests"})
    for name, c in compile_check.items():
        out.append({"name": f"{name}: no dcp-triton JIT compile after warm-up", "pass": c["dcp_triton_total"] == 0,
                    "detail": f"dcp-triton {c['dcp_triton_total']}, all kernels {c['all_total']}"})
    return out


def host_overhead_part(summary: dict) -> dict | None:
    """The one-GPU set for host_overhead_h200.json, or None when no one-GPU job has a result."""
    if not summary["host_overhead"]["jobs"]:
        return None
    return summary["host_overhead"]


def merge_host_overhead(path: Path, part: dict, meta: dict) -> Path | None:
    """Update ``summary.vllm_dcp1``, ``vllm_dcp1_jobs`` and ``vllm_dcp1_meta`` of the JSON file at ``path``, keeping
    every other key; a file that is not a JSON object is left alone (None)."""
    data: dict = {}
    if path.exists():
        try:
            data = json.loads(path.read_text())
        except ValueError:
            data = None
        if not isinstance(data, dict) or not isinstance(data.get("summary", {}), dict):
            print(f"not merging into {path}: not a JSON object with an object 'summary'", flush=True)
            return None
    data.setdefault("summary", {})["vllm_dcp1"] = part["summary"]
    data["vllm_dcp1_jobs"] = part["jobs"]
    data["vllm_dcp1_meta"] = {k: meta.get(k) for k in ("gpu", "vllm", "torch", "model")}
    report.atomic_write(path, json.dumps(data, indent=1))
    return path


def write_summary(summary: dict, meta: dict, out_dir: Path, name: str) -> list[Path]:
    """``<name>.json`` (everything), ``<name>.md`` (tables) and ``<name>.png`` (when matplotlib is present)."""
    return report.write_summary(summary, meta, out_dir, name, render=markdown, draw=plot)


def markdown(summary: dict, meta: dict) -> str:
    lines = [f"# dcp-triton in vLLM {meta.get('vllm', '?')} on 2 x {meta.get('gpu', '?')}: DCP = 2 vs FLASH_ATTN "
             "and DCP = 1", "", f"Model `{meta.get('model', '?')}` (16 Q / 1 KV heads, head_dim 128, 4 layers, random "
             f"init), bf16, torch {meta.get('torch', '?')}. Output tokens/s after a warm-up of a quarter of each load. "
             f"{summary['request_timing']}.", ""]
    for mode, values in summary["by_mode"].items():
        head = ["dcp-triton DCP=2 (best)", "ag_rs", "a2a", "FLASH_ATTN DCP=2", "dcp-triton DCP=1", "FLASH_ATTN DCP=1"]
        keys = ["dcp_triton_dcp2", *DCP2_COMMS.values(), *CONTRACT[1:]]
        best = contract_loads(values)
        lines += [f"## tp = 2, {mode}: output tokens/s", "", "| load | " + " | ".join(head) + " |",
                  "|---" * (len(head) + 1) + "|"]
        lines += [f"| {load} | " + " | ".join(_num({**values.get(load, {}), **best[load]}.get(k), ",.0f") for k in keys)
                  + " |" for load in LOADS]
        lines.append("")
    lines += [f"float32 worst |prompt-logprob difference|, dcp-triton DCP=2 vs TRITON_ATTN DCP=1: "
              f"{_num(summary['summary']['fp32_max_abs_logprob_diff'], '.3g')}", ""]
    lines += _table("Per job and load", ["job", "load", "output tok/s", "total tok/s", "s", "warm-up s",
                                         "TTFT median ms", "TPOT median ms"],
                    [[r["job"], r["load"], _num(r["output_tok_s"], ",.0f"), _num(r["total_tok_s"], ",.0f"),
                      _num(r["elapsed_s"], ".2f"), _num(r["warmup_s"], ".2f"), _ms(r["ttft_median_s"]),
                      _ms(r["tpot_median_s"])] for r in summary["throughput"]])
    lines += _table("KV-cache capacity (long-context jobs, as vLLM logs it)", ["job", "tokens", "needed",
                    "requests at once"], [[r["job"], _num(r["kv_cache_tokens"], ",d"), f"{r['needed_tokens']:,}",
                                           _num(r["requests_at_once"], "d")] for r in summary["kv_capacity"]])
    lines += _table("float32 agreement", ["ours", "ref", "task", "result"],
                    [[r["ours"], r["ref"], r["task"], f"max abs dlogprob {r['max_abs_diff']:.3g} over {r['positions']}"
                      if "max_abs_diff" in r else f"{r['exact_sequences']:.0%} identical, {len(r['divergences'])} "
                      f"divergences"] for r in summary["fp32"]["rows"]])
    lines += _table("Compile check: JIT compiles after warm-up", ["job", "batch", "dcp-triton", "all", "kernels"],
                    [[n, b["batch"], str(b["dcp_triton_compiles"]), str(b["all_compiles"]), ", ".join(b["kernels"])]
                     for n, c in summary["compile_check"].items() for b in c["batches"]])
    host = summary["host_overhead"]["summary"]
    lines += _table("One GPU (tp = 1, DCP = 1): output tokens/s", ["mode, load", *TP1_BACKENDS],
                    [[k, *(_num(v.get(b), ",.0f") for b in TP1_BACKENDS)] for k, v in host.items()])
    lines += _table("Checks", ["check", "result", "detail"],
                    [[c["name"], "PASS" if c["pass"] else "FAIL", c["detail"]] for c in summary["checks"]])
    lines += _table("Jobs", ["job", "status", "s", "KV tokens", "JIT after warm-up"],
                    [[n, j["status"], _num(j["elapsed_s"], ".1f"), _num(j["kv_cache_tokens"], ",d"),
                      ", ".join(j["jit_after_warmup"])] for n, j in summary["jobs"].items()])
    return "\n".join(lines) + "\n"


def plot(summary: dict, meta: dict, path: Path) -> None:
    """Output tokens/s per load: the tp = 2 configurations (four loads), then the one-GPU set; graphs and eager."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    host = summary["host_overhead"]["summary"]
    panels = [(f"{load}, tp = 2", TP2_CONFIGS, {m: summary["by_mode"][m].get(load, {}) for m in MODES})
              for load in LOADS]
    panels += [(f"{load}, one GPU", TP1_BACKENDS, {m: host[f"{m}_{load.replace('-', '_')}"] for m in MODES})
               for load in TP1_LOADS]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8.5))
    for ax, (title, keys, by_mode) in zip(axes.flat, panels):
        for i, mode in enumerate(MODES):
            ax.bar([x + 0.4 * i for x in range(len(keys))], [by_mode[mode].get(k) or 0 for k in keys], width=0.4,
                   label=mode, hatch="//" if mode == "eager" else None, edgecolor="black", linewidth=0.3,
                   color=["tab:green" if k.startswith("dcp_triton") else "tab:gray" for k in keys])
        ax.set_xticks([x + 0.2 for x in range(len(keys))])
        ax.set_xticklabels([k.replace("_", " ") for k in keys], rotation=30, ha="right", fontsize=7)
        ax.set(title=title, ylabel="output tokens / s")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"dcp-triton in vLLM {meta.get('vllm', '?')} on {meta.get('gpu', '?')} (missing jobs: no bar)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _by_load(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        out.setdefault(r["load"], {})[r["config"]] = r["output_tok_s"]
    return out


def _tp1_table(rows: list[dict]) -> dict:
    table = {f"{mode}_{load.replace('-', '_')}": {b: None for b in TP1_BACKENDS} for mode in sorted(MODES)
             for load in TP1_LOADS}
    jobs: dict[str, dict] = {}
    for r in rows:
        key = f"{r['mode']}_{r['load'].replace('-', '_')}"
        if key in table:
            table[key][r["config"].removesuffix("_dcp1")] = r["output_tok_s"]
        jobs.setdefault(r["job"], {"backend": r["backend"], "mode": r["mode"], "loads": {}})["loads"][r["load"]] = {
            k: r[k] for k in ROW_KEYS}
    return {"summary": table, "jobs": jobs}


def _kv_tokens(job: dict, log_text: str) -> int | None:
    return (job.get("result") or {}).get("kv_cache_tokens") or runner.kv_cache_tokens(log_text)


def _log_text(job: dict) -> str:
    log = Path(job["log"]) if job.get("log") else None
    return log.read_text(errors="replace") if log and log.exists() else ""


def _table(title: str, head: list[str], rows: list[list[str]]) -> list[str]:
    if not rows:
        return []
    return [f"## {title}", "", "| " + " | ".join(head) + " |", "|---" * len(head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows), ""]


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _ms(seconds: float | None) -> str:
    return _num(None if seconds is None else seconds * 1e3, ".1f")
