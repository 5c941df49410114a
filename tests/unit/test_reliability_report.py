"""benchmarks/server/reliability_report.py on CPU: the engine jobs' burst and repeatability figures, judged by
vllm_e2e_report.py from hand-made job results, folded into a hand-made server run's results file."""

from __future__ import annotations

import json

from benchmarks.server import reliability_report
from benchmarks.vllm_e2e import vllm_e2e_report as report

GIB, MIB = 1 << 30, 1 << 20
SERVER = {"summary": {"errors": 0, "nan": 0, "aborted": 80}, "passed": True,  # server_reliability.py's form
          "checks": {"no_request_errors_or_timeouts": True, "no_nan": True}}


def _burst(backend, case, completed):
    spec = {"kind": "engine", "model": "m", "dtype": "bfloat16", "case": case, "backend": backend, "mode": "graphs",
            "engine": {"gpu_memory_utilization": 0.95}}
    task = {"requests": 16, "completed": completed, "prompt_tokens": 450_000, "timed_s": 9.5,
            "reserved_before_bytes": 99 * GIB, "peak_reserved_bytes": 100 * GIB, "device_used_bytes": 100 * GIB,
            "device_total_bytes": 140 * GIB}
    return {"spec": spec, "result": {"tasks": {"burst": task}, "complete": True}, "status": "ok", "elapsed_s": 60.0,
            "log": "x.log", "backend_line": None}


def _repeat(backend, short, run, tokens):
    spec = {"kind": "engine", "model": "m", "dtype": "bfloat16", "case": f"repeat-run{run}", "backend": backend,
            "mode": "graphs", "engine": {}, "repeat": {"set": f"m {short} graphs", "run": run}}
    greedy = {"prompt_lens": [10] * len(tokens), "tokens": tokens,
              "top2_logprobs": [[[-1.0, -2.0] for _ in row] for row in tokens]}
    return {"spec": spec, "result": {"tasks": {"greedy": greedy}}, "status": "ok", "elapsed_s": 60.0, "log": "x.log",
            "backend_line": None}


def _engine_report(fp32_second_run):
    same = [[1, 2, 3], [4, 5, 6]]
    jobs = {"oom-ours": _burst("dcp-triton", "burst", 16), "oom-fa": _burst("FLASH_ATTN", "burst", 16),
            "mix-ours": _burst("dcp-triton", "burst-128k-mix", 65), "mix-fa": _burst("FLASH_ATTN", "burst-128k-mix", 65),
            "r1": _repeat("dcp-triton", "bf16", 1, same), "r2": _repeat("dcp-triton", "bf16", 2, same),
            "f1": _repeat("dcp-triton", "fp32", 1, same), "f2": _repeat("dcp-triton", "fp32", 2, fp32_second_run),
            "fa1": _repeat("FLASH_ATTN", "bf16", 1, same), "fa2": _repeat("FLASH_ATTN", "bf16", 2, same)}
    for name in ("mix-ours", "mix-fa"):
        jobs[name]["result"]["tasks"]["burst"]["requests"] = 65
    return json.loads(json.dumps(report.analyse(jobs)))  # as the engine run's results file holds it


def test_fold_adds_memory_and_repeatability_and_keeps_the_server_figures():
    out = reliability_report.fold(SERVER, _engine_report([[1, 2, 3], [4, 5, 6]]), "engine.json")
    summary = out["summary"]
    assert (summary["errors"], summary["nan"], summary["aborted"]) == (0, 0, 80)
    oom = summary["memory"]["oom burst"]["dcp-triton"]
    assert (oom["served"], oom["completed"], oom["requests"]) == (True, 16, 16)
    assert oom["peak_reserved_bytes"] == 100 * GIB and oom["growth_bytes"] == GIB
    assert oom["budget_bytes"] == 0.95 * 140 * GIB
    assert summary["memory"]["128K beside 64 streams"]["FLASH_ATTN"]["completed"] == 65
    assert summary["repeatability"]["m fp32 graphs"]["dcp-triton"]["identical"] == 2
    assert summary["repeatability"]["m bf16 graphs"]["FLASH_ATTN"]["bitwise"] is True
    names = [c["name"] for c in out["checks"]]
    assert names[:2] == ["no_request_errors_or_timeouts", "no_nan"]
    assert "oom burst: dcp-triton served it where FLASH_ATTN did" in names
    assert "128K beside 64 streams: dcp-triton's peak memory inside vLLM's budget" in names
    assert "repeatability, m fp32 graphs: dcp-triton gave the same tokens on both engines" in names
    assert out["passed"] is True


def test_a_divergent_rerun_fails_the_file_and_a_second_fold_replaces_its_own_checks():
    first = reliability_report.fold(SERVER, _engine_report([[1, 2, 3], [4, 5, 6]]), "engine.json")
    again = reliability_report.fold(first, _engine_report([[1, 2, 3], [4, 5, 9]]), "engine.json")
    assert len(again["checks"]) == len(first["checks"])  # replaced, not appended twice
    fp32 = [c for c in again["checks"] if "fp32" in c["name"]]
    assert [(c["pass"], c["detail"]) for c in fp32] == [(False, "1/2 prompts identical")]
    assert again["passed"] is False


def test_main_rewrites_the_server_file(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(reliability_report, "RESULTS", tmp_path)
    (tmp_path / "srv.json").write_text(json.dumps(SERVER))
    (tmp_path / "eng.json").write_text(json.dumps(_engine_report([[1, 2, 3], [4, 5, 6]])))
    assert reliability_report.main(["--server", "srv", "--engine", "eng"]) == 0
    written = json.loads((tmp_path / "srv.json").read_text())
    assert written["provenance"]["engine_results"] == "eng.json" and written["summary"]["memory"]
    assert "wrote srv.json: passed=True" in capsys.readouterr().out
    assert reliability_report.main(["--server", "srv", "--engine", "missing"]) == 1
