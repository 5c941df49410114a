"""The CPU-checkable parts of benchmarks/vllm_e2e/vllm_dcp_e2e.py: the CLI without torch or vLLM, the job catalogue
(engine arguments of every job, order), the summary (results contract, host-overhead merge) and the log parsers. The
runner end to end: test_vllm_dcp_e2e_runner.py."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_dcp_e2e as dcp
from benchmarks.vllm_e2e import vllm_dcp_report as dcp_report
from tests.helpers.bench_scripts import run_module


def run_script(*args: str) -> tuple[subprocess.CompletedProcess, set[str]]:
    return run_module("benchmarks.vllm_e2e.vllm_dcp_e2e", *args)


def test_help_list_and_plan_run_without_torch_or_vllm(tmp_path):
    done, imported = run_script("--help")
    assert done.returncode == 0 and "--plan" in done.stdout and "--budget-s" in done.stdout, done.stderr[-2000:]
    assert "argparse" in imported and not imported & {"torch", "vllm", "transformers", "matplotlib"}
    done, imported = run_script("--list", "--no-eager")
    names = [line.split()[0] for line in done.stdout.splitlines()]
    assert done.returncode == 0 and names[0] == "build-mqa-d128" and not any(n.endswith("-eager") for n in names)
    assert "tp2-dcp-triton-dcp2-a2a-graphs" in names and not imported & {"torch", "vllm", "transformers"}
    done, imported = run_script("--plan", "--gpus", "2", "--budget-s", "540", "--work-dir", str(tmp_path / "w"),
                                "--results-dir", str(tmp_path / "r"))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[1].split()[:2] == ["build-mqa-d128", "build"] and "(past budget)" in done.stdout
    assert lines[-1].startswith("estimated wall time:") and int(lines[-1].split()[-2]) > 540
    assert not imported & {"torch", "vllm", "transformers"}


def by_name(tmp_path) -> dict[str, runner.Job]:
    return {j.name: j for j in dcp.catalogue(tmp_path / "work", tmp_path / "raw")}


def test_model_and_loads_are_the_requested_ones():
    cfg = dcp.CONFIG
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["hidden_size"]) == (16, 1, 128,
                                                                                                             2048)
    assert (cfg["num_hidden_layers"], cfg["vocab_size"]) == (4, 8192) and cfg["max_position_embeddings"] >= 40000
    assert dcp.LOADS == {"decode-heavy": (256, 512, 512), "small-batch": (64, 512, 128),
                         "prefill-heavy": (32, 8192, 64), "long-context": (16, 32768, 64)}
    assert dcp.KV_BYTES_PER_TOKEN == 4 * 2 * 128 * 2
    requests, prompt, output = dcp.LOADS[dcp.LONG_LOAD]
    need = requests * (prompt + output)  # DCP = 1 cannot hold all 16 at once, DCP = 2 can
    assert dcp.kv_capacity_tokens(dcp.LONG_KV_BYTES, 1) < need <= dcp.kv_capacity_tokens(dcp.LONG_KV_BYTES, 2)


def test_two_gpu_jobs_have_the_right_engine_arguments(tmp_path):
    jobs = by_name(tmp_path)
    expected = {"dcp-triton-dcp2-ag_rs": ("dcp-triton", 2, "ag_rs"), "dcp-triton-dcp2-a2a": ("dcp-triton", 2, "a2a"),
                "FLASH_ATTN-dcp2": ("FLASH_ATTN", 2, "ag_rs"), "dcp-triton-dcp1": ("dcp-triton", 1, None),
                "FLASH_ATTN-dcp1": ("FLASH_ATTN", 1, None)}
    for slug, (backend, dcp_size, comm) in expected.items():
        for mode in ("graphs", "eager"):
            job = jobs[f"tp2-{slug}-{mode}"]
            kw = job.spec["engine"]
            assert (kw["tensor_parallel_size"], kw["decode_context_parallel_size"]) == (2, dcp_size)
            assert kw.get("dcp_comm_backend") == comm and kw["attention_backend"] == backend
            assert kw["dtype"] == "bfloat16" and kw["enforce_eager"] == (mode == "eager")
            assert ("compilation_config" in kw) == (mode == "graphs")
            assert kw["skip_tokenizer_init"] and kw["max_num_seqs"] == 256 and kw["disable_log_stats"] is False
            assert job.gpus == 2 and job.exclusive and job.env == dcp.NO_MULTICAST
            loads = [w["workload"] for t in job.spec["tasks"] for w in t["workloads"]]
            assert all(t["warmup"] == "quarter" for t in job.spec["tasks"])
            assert loads == ["decode-heavy", "small-batch", "prefill-heavy", "long-context"]
            assert kw["kv_cache_memory_bytes"] == dcp.LONG_KV_BYTES and kw["max_model_len"] == 32768 + 128
    graphs = jobs["tp2-dcp-triton-dcp2-a2a-graphs"].spec["engine"]["compilation_config"]
    assert graphs == {"cudagraph_capture_sizes": dcp.GRAPH_SIZES}  # default mode (FULL_AND_PIECEWISE) kept


def test_fp32_one_gpu_and_compile_check_jobs(tmp_path):
    jobs = by_name(tmp_path)
    fp32 = [j for j in jobs.values() if j.name.startswith("fp32-")]
    assert sorted((j.spec["backend"], j.spec["dcp"], j.spec["comm"]) for j in fp32) == [
        ("TRITON_ATTN", 1, None), ("dcp-triton", 2, "a2a"), ("dcp-triton", 2, "ag_rs")]
    for job in fp32:
        assert job.spec["engine"]["dtype"] == "float32" and job.spec["engine"]["tensor_parallel_size"] == 2
        assert [t["type"] for t in job.spec["tasks"]] == ["logprobs", "greedy"]
        assert runner.job_env(job, spawn=False)["TRITON_F32_DEFAULT"] == "ieee"
    assert "TRITON_F32_DEFAULT" not in runner.job_env(jobs["tp2-dcp-triton-dcp1-graphs"], spawn=False)
    tp1 = [j for j in jobs.values() if j.name.startswith("tp1-")]
    assert sorted((j.spec["backend"], j.spec["mode"]) for j in tp1) == sorted(
        (b, m) for b in ("dcp-triton", "FLASH_ATTN", "TRITON_ATTN") for m in ("eager", "graphs"))
    for job in tp1:
        kw = job.spec["engine"]
        assert (kw["tensor_parallel_size"], kw["decode_context_parallel_size"], job.gpus) == (1, 1, 1)
        assert not job.exclusive and "dcp_comm_backend" not in kw
        assert [w["workload"] for t in job.spec["tasks"] for w in t["workloads"]] == ["decode-heavy", "small-batch"]
    jit = jobs["jit-tp1-dcp-triton-graphs"]
    kw = jit.spec["engine"]
    assert (kw["jit_monitor_mode"], kw["jit_monitor_verbose"], kw["tensor_parallel_size"]) == ("warn", True, 1)
    batches = jit.spec["tasks"][0]["batches"]
    assert [b["prompts"] for b in batches[:2]] == [dict(count=16, min_len=512, max_len=512, seed=21)] * 2
    assert batches[0]["max_tokens"] == 48 and batches[-1]["name"] == "decode"
    chunked = next(b for b in batches if b["name"] == "chunked prefill")
    assert chunked["prompts"]["max_len"] > kw["max_num_batched_tokens"]  # the long prompt takes several steps


def test_job_order_puts_the_most_valuable_first(tmp_path):
    names = [j.name for j in dcp.catalogue(tmp_path / "work", tmp_path / "raw")]
    # DCP = 2 against FLASH_ATTN, float32 exactness (ag_rs, its reference), the DCP = 1 baselines, float32 a2a.
    assert names[1:9] == ["tp2-dcp-triton-dcp2-ag_rs-graphs", "tp2-dcp-triton-dcp2-a2a-graphs",
                          "tp2-FLASH_ATTN-dcp2-graphs", "fp32-tp2-dcp-triton-dcp2-ag_rs", "fp32-tp2-TRITON_ATTN-dcp1",
                          "tp2-dcp-triton-dcp1-graphs", "tp2-FLASH_ATTN-dcp1-graphs", "fp32-tp2-dcp-triton-dcp2-a2a"]

    def rank(name: str) -> int:  # build, tp2 graphs and fp32, eager, one GPU, compile check
        order = [("build-", ""), ("tp2-", "-graphs"), ("fp32-", ""), ("tp2-", "-eager"), ("tp1-", ""), ("jit-", "")]
        found = next(i for i, (head, tail) in enumerate(order) if name.startswith(head) and name.endswith(tail))
        return 1 if found == 2 else found

    ranks = [rank(n) for n in names]
    assert ranks == sorted(ranks) and set(ranks) == {0, 1, 3, 4, 5}


def test_full_graphs_flag_reaches_only_the_dcp_triton_jobs(tmp_path):
    jobs = {j.name: j for j in dcp.catalogue(tmp_path / "work", tmp_path / "raw", full_graphs="1")}
    assert jobs["tp2-dcp-triton-dcp2-ag_rs-graphs"].env["DCP_TRITON_DCP_FULL_GRAPHS"] == "1"
    assert "DCP_TRITON_DCP_FULL_GRAPHS" not in jobs["tp2-FLASH_ATTN-dcp2-graphs"].env
    default = {j.name: j for j in dcp.catalogue(tmp_path / "work", tmp_path / "raw")}
    assert "DCP_TRITON_DCP_FULL_GRAPHS" not in default["tp2-dcp-triton-dcp2-ag_rs-graphs"].env


def test_log_parsers():
    log = textwrap.dedent("""\
        (EngineCore pid=7) INFO 07-01 kv_cache_utils.py:2177] GPU KV cache size: 393,216 tokens
        (Worker_TP0 pid=9) WARNING 07-01 jit_monitor.py:140] Triton kernel JIT compilation during inference: \
prefix_attention_kernel (constexprs={BLOCK=16}; signature={}). This causes a latency spike; consider ...
        (Worker_TP1 pid=10) WARNING 07-01 jit_monitor.py:140] Triton kernel JIT compilation during inference: \
_fwd_kernel. This causes a latency spike; consider extending warmup to cover this shape/config.
        INFO unrelated line mentioning JIT compilation
        """)
    assert runner.kv_cache_tokens(log) == 393216 and runner.kv_cache_tokens("nothing") is None
    assert runner.jit_compiles(log) == ["prefix_attention_kernel", "_fwd_kernel"]


def test_dcp_kernel_names_scan_kernel_sources(tmp_path):
    (tmp_path / "k.py").write_text('@triton.jit(do_not_specialize=("a",\n    "b"))  # why\ndef my_kernel(x):\n'
                                   "    pass\n\n\n@triton.jit\ndef helper(y):\n    pass\n\ndef not_a_kernel():\n")
    names = dcp_report.dcp_kernel_names(tmp_path)
    assert {"my_kernel", "helper", "merge_kernel"} <= names and "not_a_kernel" not in names
    assert "prefix_attention_kernel" in dcp_report.dcp_kernel_names()  # the repository's own kernels/


def tput(load: str, tok_s: float) -> dict:
    requests, prompt, output = dcp.LOADS[load]
    return {"workload": load, "requests": requests, "prompt_len": prompt, "output_len": output, "elapsed_s": 2.0,
            "output_tokens": requests * output, "output_tok_s": tok_s, "total_tok_s": 3 * tok_s, "warmup_s": 1.5,
            "warmup_requests": requests // 4, "ttft_median_s": 0.25, "tpot_median_s": 0.004}


def fake_job(spec: dict, *, throughput=(), tasks=None, kv=None, line="") -> dict:
    result = {"tasks": tasks or {}, "complete": True, "throughput": list(throughput), "vllm": "0.26.0",
              "gpu": "NVIDIA H200", "kv_cache_tokens": kv}
    return {"spec": spec, "result": result, "status": "ok", "elapsed_s": 50.0, "log": None, "backend_line": line}


def fake_summary_jobs(tmp_path) -> dict:
    jobs = by_name(tmp_path)
    lp = {"prompt_lens": [4, 3], "token_logprobs": [[-1.0, -2.0, -3.0], [-1.5, -2.5]], "top1_ids": [[5, 6, 7], [8, 9]]}
    off = {"ag_rs": 2e-6, "a2a": 7e-6}
    out = {}
    speeds = {"dcp-triton-dcp2-ag_rs": {"decode-heavy": 900, "small-batch": 500, "prefill-heavy": 300},
              "dcp-triton-dcp2-a2a": {"decode-heavy": 950, "small-batch": 450},  # a2a wins decode-heavy only
              "FLASH_ATTN-dcp2": {"decode-heavy": 1000, "small-batch": 600, "prefill-heavy": 350},
              "dcp-triton-dcp1": {"decode-heavy": 800, "small-batch": 550, "prefill-heavy": 320}}
    for slug, loads in speeds.items():  # FLASH_ATTN DCP=1 missing entirely
        spec = jobs[f"tp2-{slug}-graphs"].spec
        comm = spec["comm"] or "ag_rs"
        line = "Using AttentionBackendEnum.FLASH_ATTN backend" if spec["backend"] == "FLASH_ATTN" else (
            f"dcp-triton attention: backend=DCP_TRITON dcp_size={spec['dcp']} comm={comm} kernels=triton")
        long = {"dcp-triton-dcp2-ag_rs": 40, "dcp-triton-dcp1": 25}.get(slug)
        rows = [tput(k, v) for k, v in loads.items()] + ([tput("long-context", long)] if long else [])
        kv = dcp.kv_capacity_tokens(dcp.LONG_KV_BYTES, spec["dcp"]) if long else None
        out[f"tp2-{slug}-graphs"] = fake_job(spec, throughput=rows, line=line if slug != "dcp-triton-dcp1" else "",
                                             kv=kv)
    eager = jobs["tp2-dcp-triton-dcp2-a2a-eager"].spec
    out["tp2-dcp-triton-dcp2-a2a-eager"] = fake_job(eager, throughput=[tput("decode-heavy", 111)])
    for name in ("fp32-tp2-dcp-triton-dcp2-ag_rs", "fp32-tp2-dcp-triton-dcp2-a2a", "fp32-tp2-TRITON_ATTN-dcp1"):
        spec = jobs[name].spec
        shift = off.get(spec["comm"], 0.0) if spec["backend"] == "dcp-triton" else 0.0
        mine = {**lp, "token_logprobs": [[v + shift for v in p] for p in lp["token_logprobs"]]}
        out[name] = fake_job(spec, tasks={"logprobs": mine})
    tp1 = [("dcp-triton", "eager", 70), ("FLASH_ATTN", "eager", 90), ("TRITON_ATTN", "graphs", 80)]
    for backend, mode, tok_s in tp1:
        spec = jobs[f"tp1-{backend}-{mode}"].spec
        out[f"tp1-{backend}-{mode}"] = fake_job(spec, throughput=[tput("decode-heavy", tok_s), tput("small-batch", 9)])
    batches = [{"name": "first", "jit_compiles": ["_fwd_kernel"], "elapsed_s": 1.0, "cached_tokens": 0},
               {"name": "new lengths", "jit_compiles": ["merge_kernel", "prefix_attention_kernel", "_x"],
                "elapsed_s": 1.0, "cached_tokens": 0}]
    spec = jobs["jit-tp1-dcp-triton-graphs"].spec
    out["jit-tp1-dcp-triton-graphs"] = fake_job(spec, tasks={"compile-check": {"batches": batches, "log_read": True}})
    out["tp2-FLASH_ATTN-dcp1-graphs"] = {"spec": jobs["tp2-FLASH_ATTN-dcp1-graphs"].spec, "result": None,
                                         "status": "timeout after 9 s", "elapsed_s": 9.0, "log": None}
    return out


def test_summary_fills_the_results_contract(tmp_path):
    summary = dcp_report.analyse(fake_summary_jobs(tmp_path))
    loads = summary["summary"]["loads"]
    assert set(loads) == set(dcp.LOADS) and summary["summary"]["long_context_load"] == "long-context"
    assert loads["decode-heavy"] == {"dcp_triton_dcp2": 950, "flash_attn_dcp2": 1000, "dcp_triton_dcp1": 800,
                                     "flash_attn_dcp1": None}  # a2a better here
    assert loads["small-batch"]["dcp_triton_dcp2"] == 500  # ag_rs better here
    assert loads["prefill-heavy"]["dcp_triton_dcp2"] == 300  # only ag_rs ran
    assert loads["long-context"] == {"dcp_triton_dcp2": 40, "flash_attn_dcp2": None, "dcp_triton_dcp1": 25,
                                     "flash_attn_dcp1": None}
    assert summary["by_mode"]["graphs"]["decode-heavy"]["dcp_triton_dcp2_ag_rs"] == 900  # both comms kept
    assert summary["by_mode"]["eager"]["decode-heavy"] == {"dcp_triton_dcp2_a2a": 111}  # eager not in the contract
    assert summary["summary"]["fp32_max_abs_logprob_diff"] == pytest.approx(7e-6)  # the worse of ag_rs and a2a
    assert summary["fp32"]["compared"] == ["fp32-tp2-dcp-triton-dcp2-a2a", "fp32-tp2-dcp-triton-dcp2-ag_rs"]
    kv = {r["job"]: r for r in summary["kv_capacity"]}
    assert kv["tp2-dcp-triton-dcp1-graphs"]["requests_at_once"] == 11
    assert kv["tp2-dcp-triton-dcp2-ag_rs-graphs"]["holds_all_requests"] is True
    check = summary["compile_check"]["jit-tp1-dcp-triton-graphs"]
    assert [(b["dcp_triton_compiles"], b["all_compiles"]) for b in check["batches"]] == [(0, 1), (2, 3)]
    host = summary["host_overhead"]["summary"]
    assert set(host) == {"eager_decode_heavy", "eager_small_batch", "graphs_decode_heavy", "graphs_small_batch"}
    assert host["eager_decode_heavy"] == {"dcp_triton": 70, "flash_attn": 90, "triton_attn": None}
    assert host["graphs_decode_heavy"] == {"dcp_triton": None, "flash_attn": None, "triton_attn": 80}
    checks = {c["name"]: c["pass"] for c in summary["checks"]}
    assert checks["tp2-dcp-triton-dcp2-a2a-graphs: worker built dcp-triton"] is True
    assert checks["tp2-dcp-triton-dcp1-graphs: worker built dcp-triton"] is False  # no start-up line given
    assert checks["float32 logprobs: fp32-tp2-dcp-triton-dcp2-a2a vs fp32-tp2-TRITON_ATTN-dcp1"] is True
    assert checks["jit-tp1-dcp-triton-graphs: no dcp-triton JIT compile after warm-up"] is False
    assert checks["tp2-dcp-triton-dcp1-graphs: KV cache holds all 16 requests only at DCP > 1"] is True
    assert summary["jobs"]["tp2-FLASH_ATTN-dcp1-graphs"]["status"].startswith("timeout")

    paths = dcp_report.write_summary(summary, {"gpu": "NVIDIA H200", "vllm": "0.26.0"}, tmp_path, "dcp")
    saved = json.loads((tmp_path / "dcp.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(summary["summary"]))
    assert saved["summary"]["loads"]["decode-heavy"]["flash_attn_dcp1"] is None
    md = (tmp_path / "dcp.md").read_text()
    assert "| decode-heavy | 950 | 900 | 950 | 1,000 | 800 | - |" in md
    assert "| jit-tp1-dcp-triton-graphs | new lengths | 2 | 3 | _x, merge_kernel, prefix_attention_kernel |" in md
    pytest.importorskip("matplotlib")
    assert tmp_path / "dcp.png" in paths and (tmp_path / "dcp.png").read_bytes()[:4] == b"\x89PNG"


def test_fp32_diff_is_null_without_a_reference(tmp_path):
    jobs = {n: j for n, j in fake_summary_jobs(tmp_path).items() if n != "fp32-tp2-TRITON_ATTN-dcp1"}
    summary = dcp_report.analyse(jobs)
    assert summary["summary"]["fp32_max_abs_logprob_diff"] is None and summary["fp32"]["rows"] == []


def test_host_overhead_merge_keeps_other_keys(tmp_path):
    path = tmp_path / "host_overhead_h200.json"
    path.write_text(json.dumps({"summary": {"forward_host_us_dcp2_decode": {"dcp_triton": 123.0}},
                                "forward_host": {"rows": [1, 2]}, "vllm_dcp1_jobs": {"stale": {}}}))
    summary = dcp_report.analyse(fake_summary_jobs(tmp_path))
    part = dcp_report.host_overhead_part(summary)
    assert dcp_report.merge_host_overhead(path, part, {"gpu": "H200", "model": "m"}) == path
    data = json.loads(path.read_text())
    assert data["summary"]["forward_host_us_dcp2_decode"] == {"dcp_triton": 123.0}
    assert data["forward_host"] == {"rows": [1, 2]}
    assert data["summary"]["vllm_dcp1"]["eager_decode_heavy"]["flash_attn"] == 90
    assert set(data["vllm_dcp1_jobs"]) == {"tp1-dcp-triton-eager", "tp1-FLASH_ATTN-eager", "tp1-TRITON_ATTN-graphs"}
    assert data["vllm_dcp1_meta"]["gpu"] == "H200"
    fresh = tmp_path / "new.json"
    dcp_report.merge_host_overhead(fresh, part, {})
    assert set(json.loads(fresh.read_text())["summary"]) == {"vllm_dcp1"}
    path.write_text("{not json")
    assert dcp_report.merge_host_overhead(path, part, {}) is None and path.read_text() == "{not json"
    no_tp1 = {n: j for n, j in fake_summary_jobs(tmp_path).items() if not n.startswith("tp1-")}
    assert dcp_report.host_overhead_part(dcp_report.analyse(no_tp1)) is None
