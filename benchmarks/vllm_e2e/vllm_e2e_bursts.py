"""The OOM test of ``vllm_gpu_e2e.py`` (jobs of case ``burst``, 16 long prompts at once at
``gpu_memory_utilization=0.95``): its rows, checks and markdown section. Pure Python, like vllm_e2e_report.py.

dcp-triton passes when it serves the burst (or FLASH_ATTN, run the same way, failed it too: a FLASH_ATTN that did
not run excuses nothing), when torch's reserved memory grows over the burst by no more than FLASH_ATTN's growth plus
GROWTH_SLACK (memory vLLM did not set aside at start-up), when the peak torch allocated stays inside vLLM's budget
(gpu_memory_utilization x device memory: vLLM sizes the KV cache from the allocated peak of its profile run; results
without that figure are judged by the reserved peak), and when the peak torch reserved (blocks its caching allocator
keeps, handed out or not) is no higher than FLASH_ATTN's plus GROWTH_SLACK.
"""

from __future__ import annotations

OURS, REF = "dcp-triton", "FLASH_ATTN"
GROWTH_SLACK = 64 << 20
# case -> the name its checks carry: 16 long prompts at once; one 128K-token prompt beside 64 short ones
CASES = {"burst": "oom burst", "burst-128k-mix": "128K beside 64 streams"}


def rows(jobs: dict[str, dict]) -> list[dict]:
    """One row per burst job, finished or not (``jobs``: name -> {"spec", "status", "result"})."""
    found = []
    for name, job in sorted(jobs.items()):
        spec = job["spec"]
        if spec.get("kind") != "engine" or spec.get("case") not in CASES:
            continue
        task = ((job.get("result") or {}).get("tasks") or {}).get("burst")
        row = {"job": name, "case": spec["case"], "backend": spec["backend"], "status": job.get("status"),
               "served": bool(task) and task["completed"] == task["requests"]}
        if task:
            total, peak, before = task["device_total_bytes"], task["peak_reserved_bytes"], task.get(
                "reserved_before_bytes")
            row.update({k: task[k] for k in ("requests", "completed", "prompt_tokens", "timed_s",
                                             "peak_reserved_bytes", "device_used_bytes")},
                       peak_allocated_bytes=task.get("peak_allocated_bytes"),
                       budget_bytes=total and spec["engine"]["gpu_memory_utilization"] * total,
                       growth_bytes=None if peak is None or before is None else peak - before)
        found.append(row)
    return found


def checks(burst_rows: list[dict]) -> list[dict]:
    """Each case's checks, dcp-triton against FLASH_ATTN run the same way."""
    return [c for case in CASES for c in _case_checks(
        {r["backend"]: r for r in burst_rows if r.get("case", "burst") == case}, CASES[case])]


def _case_checks(by_backend: dict[str, dict], label: str) -> list[dict]:
    ours, ref = by_backend.get(OURS), by_backend.get(REF)
    if ours is None:
        return []
    ref_ran = ref is not None and (ref["status"] or "").startswith(("ok", "failed", "timeout", "incomplete"))
    served = f"{ours.get('completed', 0)}/{ours.get('requests', '?')}"
    found = [{"name": f"{label}: dcp-triton served it where FLASH_ATTN did",
              "pass": ours["served"] or (ref_ran and not ref["served"]),
              "detail": f"dcp-triton {ours['status']}, {served} served; {REF} " + (
                  f"{ref['status']}, {ref.get('completed', 0)}/{ref.get('requests', '?')}" if ref_ran
                  else "did not run")}]
    if ours.get("growth_bytes") is not None:
        ref_growth = (ref or {}).get("growth_bytes") or 0
        allowed = max(0, ref_growth) + GROWTH_SLACK
        found.append({"name": f"{label}: dcp-triton's memory grew no more than FLASH_ATTN's over the burst",
                      "pass": ours["growth_bytes"] <= allowed,
                      "detail": f"torch reserved grew {ours['growth_bytes'] / 2**20:.0f} MiB (allowed "
                                f"{allowed / 2**20:.0f}: {REF}'s {ref_growth / 2**20:.0f} + 64)"})
    if ours.get("peak_reserved_bytes") is not None and ours.get("budget_bytes"):
        allocated = ours.get("peak_allocated_bytes")
        peak = ours["peak_reserved_bytes"] if allocated is None else allocated
        found.append({"name": f"{label}: dcp-triton's peak memory inside vLLM's budget",
                      "pass": peak <= ours["budget_bytes"],
                      "detail": ("" if allocated is None else f"torch peak allocated {allocated / 2**30:.2f} GiB, ")
                      + f"peak reserved {ours['peak_reserved_bytes'] / 2**30:.2f} GiB, budget "
                        f"{ours['budget_bytes'] / 2**30:.2f} GiB"})
    if ours.get("peak_reserved_bytes") is not None and (ref or {}).get("peak_reserved_bytes") is not None:
        allowed = ref["peak_reserved_bytes"] + GROWTH_SLACK
        found.append({"name": f"{label}: dcp-triton's reserved peak no higher than FLASH_ATTN's",
                      "pass": ours["peak_reserved_bytes"] <= allowed,
                      "detail": f"torch peak reserved {ours['peak_reserved_bytes'] / 2**30:.2f} GiB, {REF}'s "
                                f"{ref['peak_reserved_bytes'] / 2**30:.2f} + 64 MiB"})
    return found


def markdown(burst_rows: list[dict]) -> list[str]:
    if not burst_rows:
        return []

    def gib(b):
        return "" if b is None else f"{b / 2**30:.2f}"

    lines = ["## OOM burst", "", "All requests at once; in the engine's process, how much torch's reserved memory "
             "grew over the burst, its peak, the peak torch allocated, and vLLM's budget (gpu_memory_utilization x "
             "device memory).", "",
             "| job | backend | status | served | prompt tokens | s | growth MiB | peak reserved GiB | "
             "peak allocated GiB | budget GiB |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['job']} | {r['backend']} | {r['status']} | {r.get('completed', 0)}/{r.get('requests', '?')} | "
              f"{r.get('prompt_tokens', '')} | {r.get('timed_s', '')} | "
              f"{'' if r.get('growth_bytes') is None else round(r['growth_bytes'] / 2**20)} | "
              f"{gib(r.get('peak_reserved_bytes'))} | {gib(r.get('peak_allocated_bytes'))} | "
              f"{gib(r.get('budget_bytes'))} |" for r in burst_rows]
    return lines + [""]
