"""The OOM test of benchmarks/vllm_e2e/vllm_gpu_e2e.py on CPU: its jobs, the engine-side burst task on a stand-in
engine, and how benchmarks/vllm_e2e/vllm_e2e_bursts.py judges fake results (served, memory growth, budget)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.vllm_e2e import vllm_e2e_engine as engine
from benchmarks.vllm_e2e import vllm_e2e_report as report
from benchmarks.vllm_e2e import vllm_gpu_e2e as e2e

MIB, GIB = 1 << 20, 1 << 30


def _listed_pair(capsys, prefix: str, case: str):
    """The catalogue lists the model build and one job per backend for ``prefix``: (dcp-triton's, FLASH_ATTN's)."""
    e2e.main(["--only", f"{prefix}-*", "--list"])
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["build-long-d128", f"{prefix}-{case}-dcp-triton", f"{prefix}-{case}-FLASH_ATTN"]
    jobs = {j.name: j for j in e2e.catalogue(Path("/w"), Path("/r")) if j.name.startswith(f"{prefix}-")}
    return jobs[f"{prefix}-{case}-dcp-triton"], jobs[f"{prefix}-{case}-FLASH_ATTN"]


def test_oom_burst_jobs_run_one_burst_per_backend_in_process(capsys):
    ours, fa = _listed_pair(capsys, "oom", "burst-bf16")
    args = ours.spec["engine"]
    assert args["gpu_memory_utilization"] == 0.95 and args["kv_cache_memory_bytes"] is None
    assert args["max_num_batched_tokens"] == 32768 and not args["enforce_eager"]
    assert {k: v for k, v in args.items() if k != "attention_backend"} == {
        k: v for k, v in fa.spec["engine"].items() if k != "attention_backend"} and ours.spec["tasks"] == fa.spec["tasks"]
    for job in (ours, fa):  # torch's figures are the engine's only in the job's own process
        assert job.exclusive and job.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_burst_task_sends_every_prompt_at_once_and_counts_the_served(monkeypatch):
    calls = []

    class FakeLLM:  # the third request stops one token short
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(len(prompts))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3] * (params.max_tokens - (i == 2)))])
                    for i in range(len(prompts))]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    task = {"prompts": {"count": 4, "min_len": 20, "max_len": 30, "seed": 8}, "max_tokens": 5}
    out = engine.burst_task(FakeLLM(), task, 100)
    assert calls == [4] and (out["requests"], out["completed"]) == (4, 3) and 80 <= out["prompt_tokens"] <= 120
    assert out["peak_reserved_bytes"] is None and out["reserved_before_bytes"] is None  # no GPU: no figures
    assert out["device_total_bytes"] is None


def burst_job(backend, status="ok", *, completed=16, peak=100 * GIB, growth=10 * MIB, total=140 * GIB,
              allocated=None):
    spec = {"kind": "engine", "model": "m", "dtype": "bfloat16", "case": "burst", "backend": backend,
            "mode": "graphs", "engine": {"gpu_memory_utilization": 0.95}}
    task = {"requests": 16, "completed": completed, "prompt_tokens": 450_000, "timed_s": 9.5,
            "reserved_before_bytes": peak - growth, "peak_reserved_bytes": peak, "device_used_bytes": peak,
            "device_total_bytes": total, **({} if allocated is None else {"peak_allocated_bytes": allocated})}
    result = None if status != "ok" else {"tasks": {"burst": task}, "complete": True}
    return {"spec": spec, "result": result, "status": status, "elapsed_s": 60.0, "log": "x.log", "backend_line": None}


FAILED, NOT_RUN = "failed (exit 1)", "not started (budget)"


OK = {"served": True, "grew": True, "peak": True, "reserved": True}


@pytest.mark.parametrize(("ours", "fa", "expected"), [
    (burst_job("dcp-triton"), burst_job("FLASH_ATTN"), OK),
    (burst_job("dcp-triton", FAILED), burst_job("FLASH_ATTN"), {"served": False}),
    (burst_job("dcp-triton", FAILED), burst_job("FLASH_ATTN", FAILED), {"served": True}),  # both failed it
    (burst_job("dcp-triton", FAILED), burst_job("FLASH_ATTN", NOT_RUN), {"served": False}),  # excuses nothing
    (burst_job("dcp-triton", FAILED), None, {"served": False}),
    (burst_job("dcp-triton", completed=15), burst_job("FLASH_ATTN"), {**OK, "served": False}),
    # no allocated peak (older results): the reserved one is judged against the budget
    (burst_job("dcp-triton", peak=134 * GIB), burst_job("FLASH_ATTN"), {**OK, "peak": False, "reserved": False}),
    # reserved past the budget, allocated inside it, FLASH_ATTN's reserved as high (the H200 bursts' case)
    (burst_job("dcp-triton", peak=134 * GIB, allocated=132.6 * GIB), burst_job("FLASH_ATTN", peak=134 * GIB), OK),
    (burst_job("dcp-triton", peak=134 * GIB, allocated=133.5 * GIB), burst_job("FLASH_ATTN", peak=134 * GIB),
     {**OK, "peak": False}),
    (burst_job("dcp-triton", peak=134 * GIB, allocated=132 * GIB), burst_job("FLASH_ATTN", peak=133 * GIB),
     {**OK, "reserved": False}),
    (burst_job("dcp-triton", growth=200 * MIB), burst_job("FLASH_ATTN"), {**OK, "grew": False}),
    (burst_job("dcp-triton", growth=70 * MIB), burst_job("FLASH_ATTN"), OK),
    (burst_job("dcp-triton", growth=70 * MIB), None, {"served": True, "grew": False, "peak": True}),
])
def test_oom_burst_is_judged_against_flash_attn_and_the_budget(ours, fa, expected):
    jobs = {"oom-burst-bf16-dcp-triton": ours} | ({"oom-burst-bf16-FLASH_ATTN": fa} if fa else {})
    summary = report.analyse(jobs)
    names = {"dcp-triton served it where FLASH_ATTN did": "served", "dcp-triton's peak memory inside vLLM's budget":
             "peak", "dcp-triton's memory grew no more than FLASH_ATTN's over the burst": "grew",
             "dcp-triton's reserved peak no higher than FLASH_ATTN's": "reserved"}
    checks = {names[c["name"].split(": ", 1)[1]]: c["pass"] for c in summary["checks"]
              if c["name"].startswith("oom burst")}
    assert checks == expected, summary["checks"]
    assert not summary["agreement"] and [r["backend"] for r in summary["bursts"]] == ["FLASH_ATTN", "dcp-triton"][
        0 if fa else 1:]
    if fa is not None:
        fa_task = fa["result"]["tasks"]["burst"] if fa["result"] else {}
        fa_peak = f"{fa_task.get('peak_reserved_bytes', 0) / GIB:.2f}"
        row = (f"| ok | 16/16 | 450000 | 9.5 | 10 | {fa_peak} |  | 133.00 |" if fa["status"] == "ok"
               else f"| {fa['status']} | 0/? |  |  |  |  |  |  |")
        assert f"| oom-burst-bf16-FLASH_ATTN | FLASH_ATTN {row}" in report.markdown(summary, {})


def test_128k_beside_64_streams_jobs_send_both_sets_at_once_in_process(capsys, monkeypatch):
    ours, fa = _listed_pair(capsys, "mix128k", "bf16")
    args = ours.spec["engine"]
    assert args["max_model_len"] == 131072 and args["gpu_memory_utilization"] == 0.95 and args["max_num_seqs"] >= 65
    assert ours.spec["tasks"] == fa.spec["tasks"] and ours.env == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    sent = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            sent.append(sorted(len(p["prompt_token_ids"]) for p in prompts))
            return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[3] * params.max_tokens)]) for _ in prompts]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    out = engine.burst_task(FakeLLM(), ours.spec["tasks"][0], 8192)
    (lengths,) = sent
    assert len(lengths) == 65 and lengths[-1] == 131072 - 64 and lengths[-2] <= 4096 and lengths[0] >= 256
    assert (out["requests"], out["completed"]) == (65, 65)


def test_each_burst_case_is_judged_on_its_own():
    mix_ours = burst_job("dcp-triton", FAILED)
    mix_ours["spec"]["case"] = "burst-128k-mix"
    mix_fa = burst_job("FLASH_ATTN")
    mix_fa["spec"]["case"] = "burst-128k-mix"
    jobs = {"oom-burst-bf16-dcp-triton": burst_job("dcp-triton"), "oom-burst-bf16-FLASH_ATTN": burst_job("FLASH_ATTN"),
            "mix128k-bf16-dcp-triton": mix_ours, "mix128k-bf16-FLASH_ATTN": mix_fa}
    checks = {c["name"]: c["pass"] for c in report.analyse(jobs)["checks"]}
    assert checks["oom burst: dcp-triton served it where FLASH_ATTN did"]
    assert not checks["128K beside 64 streams: dcp-triton served it where FLASH_ATTN did"]
