"""The CPU-checkable parts of benchmarks/vllm_e2e/vllm_gpu_e2e.py: prompts, agreement metrics, summary files, and the
job runner (parallel jobs, timeouts, resuming, mirroring) driven with a stand-in for the vLLM engine process."""

from __future__ import annotations

import gzip
import json
import math
import os
import textwrap
from pathlib import Path

import pytest

from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_e2e_report as report
from benchmarks.vllm_e2e import vllm_gpu_e2e as e2e
from dcp_plugin.warmup import warmed_up_line
from tests.helpers.bench_scripts import run_module


def test_help_runs_without_torch_or_vllm():
    done, imported = run_module("benchmarks.vllm_e2e.vllm_gpu_e2e", "--help")
    assert done.returncode == 0 and "--quick" in done.stdout and "--only" in done.stdout, done.stderr[-2000:]
    assert "argparse" in imported and not imported & {"torch", "vllm", "transformers"}


def test_prompts_are_deterministic_and_span_the_range():
    prompts = report.make_prompts(count=32, min_len=64, max_len=2000, vocab=8192, seed=1)
    assert len(prompts) == 32 and len(prompts[0]) == 64 and len(prompts[-1]) == 2000
    assert all(3 <= t < 8192 for p in prompts for t in p)
    assert [len(p) for p in prompts] == sorted(len(p) for p in prompts) and len({len(p) for p in prompts}) > 25
    assert prompts == report.make_prompts(count=32, min_len=64, max_len=2000, vocab=8192, seed=1)
    assert prompts != report.make_prompts(count=32, min_len=64, max_len=2000, vocab=8192, seed=2)
    with pytest.raises(ValueError, match="min_len <= max_len"):
        report.make_prompts(count=4, min_len=100, max_len=50, vocab=100, seed=0)


def test_prefix_prompts_share_the_prefix():
    prompts = report.make_prefix_prompts(prefix_len=40, suffix_lens=[3, 9], vocab=500, seed=4)
    assert [len(p) for p in prompts] == [43, 49] and prompts[0][:40] == prompts[1][:40]
    assert prompts[0][40:] != prompts[1][40:43]


def logprob_run(values: list[list[float]], top1: list[list[int]]) -> dict:
    return {"prompt_lens": [len(v) + 1 for v in values], "token_logprobs": values, "top1_ids": top1,
            "top1_logprobs": values}


def test_logprob_agreement_finds_the_worst_position():
    ours = logprob_run([[-1.0, -2.0], [-3.0, -4.0, -5.0]], [[5, 6], [7, 8, 9]])
    ref = logprob_run([[-1.0, -2.0004], [-3.0, -4.002, -5.0]], [[5, 6], [7, 1, 9]])
    row = report.compare_logprobs(ours, ref)
    assert row["positions"] == 5 and row["top1_agreement"] == pytest.approx(4 / 5)
    assert row["max_abs_diff"] == pytest.approx(0.002) and row["worst"]["prompt"] == 1
    assert row["worst"]["position"] == 2  # 1-based prompt position: index 1 of the logprobs list
    assert row["mean_abs_diff"] == pytest.approx(0.0024 / 5)
    tail = report.compare_logprobs({**ours, "first_positions": [7, 4000]}, ref)  # only the last positions kept
    assert tail["worst"]["position"] == 4001
    nan = logprob_run([[-1.0, math.nan], [-3.0, -4.0, -5.0]], [[5, 6], [7, 8, 9]])
    assert report.compare_logprobs(nan, ref)["max_abs_diff"] == math.inf  # NaN never passes
    with pytest.raises(ValueError, match="different prompts"):
        report.compare_logprobs(logprob_run([[-1.0]], [[5]]), ref)


def greedy_run(tokens, gaps) -> dict:
    return {"prompt_lens": [10] * len(tokens), "tokens": tokens,
            "top2_logprobs": [[[-1.0, -1.0 - g] for g in row] for row in gaps]}


def test_greedy_divergences_are_judged_by_both_top2_gaps():
    ours = greedy_run([[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]], [[1, 1, 1, 1], [1, 0.0005, 1, 1], [1, 1, 0.5, 1]])
    ref = greedy_run([[1, 2, 3, 4], [5, 7, 7, 8], [9, 9, 8, 9]], [[1, 1, 1, 1], [1, 0.001, 1, 1], [1, 1, 1e-4, 1]])
    row = report.compare_greedy(ours, ref, tie_gap=0.002)
    assert row["exact_sequences"] == pytest.approx(1 / 3) and row["token_agreement"] == pytest.approx(7 / 12)
    first, second = row["divergences"]
    assert (first["prompt"], first["position"], first["ours_token"], first["ref_token"]) == (1, 1, 6, 7)
    assert first["near_tie"] and first["gap_ref"] == pytest.approx(0.001)
    assert not second["near_tie"]  # ours saw a gap of 0.5 there: a real disagreement
    assert not row["all_divergences_near_ties"]


def test_greedy_compares_logprobs_on_the_shared_steps_only():
    # Prompt 0 agrees on all 3 steps, prompt 1 diverges at step 1: the shared steps are 0-2 and 0.
    ours = {"prompt_lens": [4, 4], "tokens": [[1, 2, 3], [5, 6, 7]],
            "top2_logprobs": [[[-1.0, -2.0], [-0.5, -3.0], [-2.0, -2.5]], [[-0.25, -1.0], [-9.0, -9.5], [0.0, -1]]]}
    ref = {"prompt_lens": [4, 4], "tokens": [[1, 2, 3], [5, 8, 7]],
           "top2_logprobs": [[[-1.0, -2.0], [-0.53, -3.0], [-2.01, -2.5]], [[-0.2, -1.0], [-1.0, -9.5], [5.0, -1]]]}
    row = report.compare_greedy(ours, ref, tie_gap=math.inf)
    assert row["shared_steps"] == 4
    assert row["shared_max_abs_dlogprob"] == pytest.approx(0.05)  # prompt 1, step 0; later steps are not shared
    ours["top2_logprobs"][0][2][0] = math.nan
    assert report.compare_greedy(ours, ref, tie_gap=math.inf)["shared_max_abs_dlogprob"] == math.inf


def fake_jobs() -> dict:
    lp = logprob_run([[-2.0, -3.0, -4.0]] * 2, [[4, 5, 6]] * 2)
    lp_off = logprob_run([[-2.0, -3.01, -4.0]] * 2, [[4, 5, 6]] * 2)
    greedy = {**greedy_run([[1, 2, 3]], [[1, 1, 1]]), "first_topk": [{"1": -1.0, "4": -2.0}], "cached_tokens": [0]}
    greedy_fa = {**greedy_run([[1, 2, 4]], [[1, 1, 0.3]]), "first_topk": [{"1": -1.01}], "cached_tokens": [0]}
    ok_line = "INFO dcp-triton attention: backend=DCP_TRITON dcp_size=1 kernels=triton cpu_attn_routed=no"

    def job(model, dtype, case, backend, tasks, mode="eager", throughput=None, kv="auto", tokens=None):
        spec = {"kind": "engine", "model": model, "dtype": dtype, "case": case, "backend": backend, "mode": mode,
                "engine": {} if kv == "auto" else {"kv_cache_dtype": kv}}
        result = {"tasks": tasks, "complete": True, "vllm": "0.26.0", "gpu": "NVIDIA H200", "kv_cache_tokens": tokens}
        if throughput:
            result["throughput"] = throughput
        return {"spec": spec, "result": result, "status": "ok", "elapsed_s": 30.0, "log": "x.log",
                "backend_line": ok_line if backend == "dcp-triton" else None}

    tput = [{"workload": "prefill-8k", "requests": 64, "prompt_len": 8192, "output_len": 256, "elapsed_s": 10.0,
             "output_tokens": 16384, "output_tok_s": 1638.4, "total_tok_s": 54000.0}]
    return {
        "a": job("m", "float32", "quick", "dcp-triton", {"logprobs": lp}),
        "b": job("m", "float32", "quick", "TRITON_ATTN", {"logprobs": lp}),
        "c": job("m", "float32", "chunked", "dcp-triton", {"logprobs-long": lp_off}),
        "d": job("m", "float32", "chunked", "TRITON_ATTN", {"logprobs-long": lp}),
        "e": job("m", "bfloat16", "quick", "dcp-triton", {"greedy": greedy}),
        "f": job("m", "bfloat16", "quick", "TRITON_ATTN", {"greedy": greedy}),
        "g": job("m", "bfloat16", "quick", "FLASH_ATTN", {"greedy": greedy_fa}),
        "t": job("m", "bfloat16", "throughput", "dcp-triton", {}, throughput=tput),
        "t8": job("m", "bfloat16", "throughput", "dcp-triton", {}, throughput=tput, kv="fp8"),
        "m1": job("m", "bfloat16", "main", "dcp-triton", {"logprobs": lp}, tokens=1000),
        "m2": job("m", "bfloat16", "main", "TRITON_ATTN", {"logprobs": lp}, tokens=1000),
        "p1": job("m", "bfloat16", "fp8", "dcp-triton", {"logprobs": lp_off}, kv="fp8", tokens=2000),
        "p2": job("m", "bfloat16", "fp8", "TRITON_ATTN", {"logprobs": lp}, kv="fp8", tokens=2000),
        "x": {"spec": {"kind": "engine", "backend": "FLASH_ATTN"}, "result": None, "status": "timeout after 9 s",
              "elapsed_s": 9.0, "log": "x.log", "backend_line": None},
    }


def test_summary_from_fake_results(tmp_path):
    summary = report.analyse(fake_jobs())
    pairs = {(r["dtype"], r["case"], r["task"], r["ours"], r["ref"]) for r in summary["agreement"]}
    assert pairs == {("float32", "quick", "logprobs", "dcp-triton", "TRITON_ATTN"),
                     ("float32", "chunked", "logprobs-long", "dcp-triton", "TRITON_ATTN"),
                     ("bfloat16", "quick", "greedy", "dcp-triton", "TRITON_ATTN"),
                     ("bfloat16", "quick", "greedy", "dcp-triton", "FLASH_ATTN"),
                     ("bfloat16", "quick", "greedy", "TRITON_ATTN", "FLASH_ATTN"),
                     ("bfloat16", "main", "logprobs", "dcp-triton", "TRITON_ATTN"),
                     ("bfloat16", "fp8", "logprobs", "dcp-triton", "TRITON_ATTN"),
                     ("bfloat16", "fp8 KV vs bf16 KV", "logprobs", "dcp-triton fp8", "dcp-triton bf16"),
                     ("bfloat16", "fp8 KV vs bf16 KV", "logprobs", "TRITON_ATTN fp8", "TRITON_ATTN bf16")}
    fp8_rows = {r["ours"]: r["max_abs_diff"] for r in summary["agreement"] if r["case"] == "fp8 KV vs bf16 KV"}
    assert fp8_rows == {"dcp-triton fp8": pytest.approx(0.01), "TRITON_ATTN fp8": 0.0}
    assert [(c["job"], c["kv"], c["kv_cache_tokens"]) for c in summary["kv_capacity"]] == \
        [("m1", "auto", 1000), ("m2", "auto", 1000), ("p1", "fp8", 2000), ("p2", "fp8", 2000)]
    checks = {c["name"]: c["pass"] for c in summary["checks"]}
    assert checks == {"m quick logprobs": True, "m chunked logprobs-long": False, "a: worker built dcp-triton": True,
                      "c: worker built dcp-triton": True, "e: worker built dcp-triton": True,
                      "t: worker built dcp-triton": True, "t8: worker built dcp-triton": True,
                      "m1: worker built dcp-triton": True, "p1: worker built dcp-triton": True}
    fa = next(r for r in summary["agreement"] if r["ref"] == "FLASH_ATTN" and r["ours"] == "dcp-triton")
    assert fa["divergences"][0]["position"] == 2 and fa["exact_sequences"] == 0.0
    assert summary["throughput"][0]["output_tok_s"] == 1638.4 and summary["jobs"]["x"]["status"].startswith("timeout")

    meta = {"gpu": "NVIDIA H200", "vllm": "0.26.0", "torch": "2.11.0"}
    paths = report.write_summary(summary, meta, tmp_path, "e2e")
    saved = json.loads((tmp_path / "e2e.json").read_text())
    assert saved["meta"] == meta and len(saved["agreement"]) == 9
    md = (tmp_path / "e2e.md").read_text()
    assert "| m chunked logprobs-long | FAIL | max abs dlogprob 0.01 (bound 0.001) at prompt 0 position 2 |" in md
    assert "| m quick logprobs | PASS |" in md and "| x | timeout after 9 s | 9.0 |" in md
    assert "| m | prefill-8k | dcp-triton | eager | auto | 64 | 8192 | 256 | 10.00 | 1638 |" in md
    assert "| m | prefill-8k | dcp-triton | eager | fp8 | 64 | 8192 | 256 | 10.00 | 1638 |" in md
    assert "| p1 | dcp-triton | fp8 | 2,000 |" in md
    pytest.importorskip("matplotlib")
    assert tmp_path / "e2e.png" in paths and (tmp_path / "e2e.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_repeatability_compares_run_2_with_run_1_per_backend(tmp_path):
    def job(backend, run, tokens, top1):
        greedy = {"prompt_lens": [10] * len(tokens), "tokens": tokens,
                  "top2_logprobs": [[[lp, lp - 1.0] for lp in row] for row in top1]}
        spec = {"kind": "engine", "model": "m", "dtype": "bfloat16", "case": f"repeat-run{run}", "backend": backend,
                "mode": "graphs", "engine": {}, "repeat": {"set": "m bf16 graphs", "run": run}}
        return {"spec": spec, "result": {"tasks": {"greedy": greedy}}, "status": "ok", "elapsed_s": 60.0,
                "log": "x.log", "backend_line": None}

    same = ([[1, 2, 3], [4, 5, 6]], [[-1.0, -2.0, -3.0], [-1.0, -1.0, -1.0]])
    jobs = {"d1": job("dcp-triton", 1, *same), "d2": job("dcp-triton", 2, *same),
            "f1": job("FLASH_ATTN", 1, *same),  # prompt 1: step 1's logprob moves by 0.25, step 2 another token
            "f2": job("FLASH_ATTN", 2, [[1, 2, 3], [4, 5, 7]], [[-1.0, -2.0, -3.0], [-1.0, -1.25, -1.0]]),
            "t1": job("TRITON_ATTN", 1, *same)}  # no run 2: no row
    rows = {r["backend"]: r for r in report.analyse(jobs)["repeatability"]}
    assert set(rows) == {"dcp-triton", "FLASH_ATTN"}
    ours, fa = rows["dcp-triton"], rows["FLASH_ATTN"]
    assert (ours["identical"], ours["prompts"], ours["shared_steps"], ours["tokens"]) == (2, 2, 6, 6)
    assert ours["earliest_divergence"] is None and ours["max_abs_dlogprob"] == 0.0 and ours["bitwise"]
    assert (fa["identical"], fa["shared_steps"], fa["tokens"], fa["earliest_divergence"]) == (1, 5, 6, 2)
    assert fa["max_abs_dlogprob"] == pytest.approx(0.25) and not fa["bitwise"]
    assert (fa["divergences"][0]["ours_token"], fa["divergences"][0]["ref_token"]) == (7, 6)  # run 2 vs run 1
    md = report.markdown(report.analyse(jobs), {})
    assert "## Repeatability (fresh engine, same batch)" in md
    assert "| m bf16 graphs | FLASH_ATTN | greedy | 1/2 | 5/6 | 2 | 0.25 |" in md
    assert "| m bf16 graphs | dcp-triton | greedy | 2/2 | 6/6 | none | 0 |" in md
    assert "Repeatability" not in report.markdown(report.analyse(fake_jobs()), {})  # no repeat jobs, no section


def test_repeat_jobs_run_the_same_batch_on_fresh_engines(capsys):
    e2e.main(["--only", "repeat-*", "--list"])
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    sets = {"bf16": ("bfloat16", ("dcp-triton", "FLASH_ATTN")), "fp32": ("float32", ("dcp-triton", "TRITON_ATTN"))}
    assert names == ["build-llama-d128"] + [f"repeat-llama-{short}-{b}-run{n}" for n in (1, 2)
                                            for short, (_, backends) in sets.items() for b in backends]
    specs = {j.name: j.spec for j in e2e.catalogue(Path("/w"), Path("/r")) if j.name.startswith("repeat-")}
    for short, (dtype, backends) in sets.items():
        mine = {name: spec for name, spec in specs.items() if name.startswith(f"repeat-llama-{short}-")}
        assert {(s["backend"], s["repeat"]["run"]) for s in mine.values()} == {(b, n) for b in backends for n in (1, 2)}
        first = mine[f"repeat-llama-{short}-dcp-triton-run1"]
        for spec in mine.values():  # one batch, one engine configuration: vLLM's default CUDA graphs
            assert spec["repeat"]["set"] == f"llama-d128 {short} graphs"
            assert spec["tasks"] == first["tasks"] == specs["repeat-llama-bf16-dcp-triton-run1"]["tasks"]
            assert spec["dtype"] == dtype and spec["mode"] == "graphs" and not spec["engine"]["enforce_eager"]
            assert {k: v for k, v in spec["engine"].items() if k != "attention_backend"} == {
                k: v for k, v in first["engine"].items() if k != "attention_backend"}
    assert specs["repeat-llama-bf16-FLASH_ATTN-run2"]["tasks"][0]["max_tokens"] == 64


def test_jit_compiles_of_our_kernels_after_start_up_fail_the_run(tmp_path):
    jobs = {}
    logs = {"clean": "INFO dcp-triton: compiled the kernels of 9 step kinds before serving\n"
                     "WARNING Triton kernel JIT compilation during inference: _topk_log_softmax_kernel. This ...\n",
            "late": "INFO dcp-triton: compiled the kernels of 9 step kinds before serving\n"
                    "WARNING Triton kernel JIT compilation during inference: prefix_attention_kernel. This ...\n",
            "old": "WARNING Triton kernel JIT compilation during inference: prefix_attention_kernel. This ...\n"}
    for name, text in logs.items():
        (tmp_path / f"{name}.log").write_text(text)
        job = fake_jobs()["a"]
        jobs[name] = {**job, "log": str(tmp_path / f"{name}.log")}
    checks = {c["name"]: (c["pass"], c["detail"]) for c in report.analyse(jobs)["checks"] if "compiled" in c["name"]}
    # the line the check keys on is the one the adapter logs after its warm-up
    assert warmed_up_line(9, 1.25, 1, "torch.bfloat16").startswith(report.WARMED_UP)
    # vLLM's own kernels do not count; a log from before the start-up warm-up existed is not held to it
    assert checks == {"clean: no dcp-triton kernel compiled after start-up":
                      (True, "vLLM's JIT monitor named none of our kernels"),
                      "late: no dcp-triton kernel compiled after start-up": (False, "prefix_attention_kernel")}


FAKE_ENGINE = """
import gzip, json, sys, time
from pathlib import Path
from benchmarks.vllm_e2e import vllm_e2e_report as report
spec = json.loads(Path(sys.argv[1]).read_text())
if spec["kind"] == "build":
    Path(spec["model_dir"]).mkdir(parents=True)
    (Path(spec["model_dir"]) / "config.json").write_text("{{}}")
    sys.exit(0)
if spec["backend"] == "FLASH_ATTN" and spec["dtype"] == "bfloat16" and "HANG" in Path({flag!r}).read_text():
    time.sleep(600)
if spec["backend"] == "dcp-triton":
    print("INFO dcp-triton attention: backend=DCP_TRITON dcp_size=1 kernels=triton cpu_attn_routed=no", flush=True)
tasks = {{}}
for task in spec["tasks"]:
    prompts = report.make_prompts(vocab=spec["vocab"], **task["prompts"])
    if task["type"] == "logprobs":
        lp = [[-1.0 - (t % 7) / 10 for t in p[1:]] for p in prompts]
        tasks[task["name"]] = {{"prompt_lens": [len(p) for p in prompts], "token_logprobs": lp,
                               "top1_ids": [p[1:] for p in prompts], "top1_logprobs": lp}}
    else:
        tasks[task["name"]] = {{"prompt_lens": [len(p) for p in prompts], "tokens": [p[:4] for p in prompts],
                               "top2_logprobs": [[[-1.0, -2.0]] * 4 for p in prompts]}}
result = {{"tasks": tasks, "complete": True, "vllm": "fake", "torch": "fake", "gpu": "fake"}}
with gzip.open(spec["out"], "wt") as f:
    json.dump(result, f)
"""


def test_runner_runs_times_out_resumes_and_mirrors(tmp_path, monkeypatch, capsys):
    flag = tmp_path / "flag"
    flag.write_text("HANG")
    (tmp_path / "fake_engine.py").write_text(textwrap.dedent(FAKE_ENGINE.format(flag=str(flag))))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(e2e, "ENGINE_MODULE", "fake_engine")  # each job: python -m fake_engine SPEC
    monkeypatch.setattr(runner, "STAGGER_S", 0.0)
    monkeypatch.setattr(e2e, "REQUIRED_MODULES", ())  # the stand-in engine needs neither vLLM nor transformers
    results, out = tmp_path / "results", tmp_path / "out"
    args = ["--quick", "--results-dir", str(results), "--work-dir", str(tmp_path / "work"), "--mirror", str(out),
            "--timeout-scale", "0.03", "--name", "e2e"]  # 200 s job timeouts become 6 s
    e2e.main(args)
    summary = json.loads((results / "e2e.json").read_text())
    status = {name: job["status"] for name, job in summary["jobs"].items()}
    assert status["quick-gqa5-bf16-FLASH_ATTN"].startswith("timeout")
    assert all(s == "ok" for n, s in status.items() if n != "quick-gqa5-bf16-FLASH_ATTN"), status
    checks = {c["name"]: c["pass"] for c in summary["checks"]}
    assert checks["gqa5-d64 quick logprobs"] is True
    assert checks["quick-gqa5-fp32-dcp-triton: worker built dcp-triton"] is True
    assert {(r["dtype"], r["ref"]) for r in summary["agreement"]} == {("float32", "TRITON_ATTN"),
                                                                        ("bfloat16", "TRITON_ATTN")}
    for path in ("e2e.json", "e2e.md", "vllm_e2e_raw/quick-gqa5-fp32-dcp-triton.json.gz",
                 "vllm_e2e_logs/quick-gqa5-fp32-dcp-triton.log"):
        assert (out / path).exists(), path  # mirrored as each job finished
    with gzip.open(results / "vllm_e2e_raw/quick-gqa5-fp32-TRITON_ATTN.json.gz", "rt") as f:
        assert json.load(f)["complete"]

    flag.write_text("")  # second invocation: finished jobs are reused, the timed-out one reruns
    capsys.readouterr()
    e2e.main(args)
    printed = capsys.readouterr().out
    assert printed.count("cached: ") == 5 and "ok: quick-gqa5-bf16-FLASH_ATTN" in printed
    summary = json.loads((results / "e2e.json").read_text())
    assert ("bfloat16", "FLASH_ATTN") in {(r["dtype"], r["ref"]) for r in summary["agreement"]}


def test_missing_vllm_stops_before_any_job(tmp_path, monkeypatch):
    real = runner.importlib.util.find_spec
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    with pytest.raises(SystemExit, match="vllm not importable here"):
        e2e.main(["--quick", "--results-dir", str(tmp_path / "r"), "--work-dir", str(tmp_path / "w")])
    assert not (tmp_path / "w").exists()


def test_only_selects_jobs_and_their_builds(capsys):
    e2e.main(["--only", "tput-*-FLASH_ATTN-graphs,agree-llama-fp32-main-*", "--list"])
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert names == ["build-llama-d128", "agree-llama-fp32-main-dcp-triton", "agree-llama-fp32-main-TRITON_ATTN",
                     "tput-llama-bf16-FLASH_ATTN-graphs"]
    with pytest.raises(SystemExit, match="matches no job"):
        e2e.main(["--only", "nothing-*", "--list"])


def test_mirroring_into_the_results_folder_itself_is_a_no_op(tmp_path):
    # $OUT given as both --results-dir and --mirror (a run on the GPU machine): the files are already there
    written = tmp_path / "e2e.json"
    written.write_text("{}")
    runner.mirror([written], tmp_path, str(tmp_path))
    assert written.read_text() == "{}"
    other = tmp_path / "out"
    runner.mirror([written], tmp_path, str(other))
    assert (other / "e2e.json").read_text() == "{}"

