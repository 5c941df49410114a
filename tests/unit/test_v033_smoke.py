"""The vLLM 0.33 smoke run's summary (benchmarks/vllm_e2e/v033_smoke.py), from a fake log folder: step statuses and
exact errors, which model runner each engine log shows, and the checks of the e2e runs."""

from __future__ import annotations

import json

from benchmarks.vllm_e2e import v033_smoke


def test_runner_of_reads_the_engine_log():
    assert v033_smoke.runner_of("INFO [gpu_worker.py:513] Using V2 Model Runner") == "V2"
    assert v033_smoke.runner_of("INFO [gpu_model_runner.py:4978] Starting to load model") == "V1"
    assert v033_smoke.runner_of("nothing") == "unknown"


def test_summary_of_a_log_folder(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    steps = {"a-versions": ("0 3", 'RESULT {"vllm": "0.33.0"}'),
             "b-generate-TRITON_ATTN-float32": ("0 70", 'Using V2 Model Runner\nRESULT {"tokens": [[1, 2, 3]]}'),
             "b-generate-TRITON_ATTN-bfloat16": ("0 70", 'Using V2 Model Runner\nRESULT {"tokens": [[1, 5, 3]]}'),
             "c-crash": ("1 9", "Traceback (most recent call last):\nModuleNotFoundError: No module named 'x'"),
             "d-late": ("skipped 0", "")}
    for name, (rc, log) in steps.items():
        (logs / f"{name}.rc").write_text(rc)
        (logs / f"{name}.log").write_text(log)
    run = logs / "e2e-runner-v1" / "results"
    (run / "vllm_e2e_logs").mkdir(parents=True)
    (run / "vllm_e2e.json").write_text(json.dumps({
        "checks": [{"name": "m quick logprobs", "pass": True, "detail": "max abs dlogprob 6e-06"}],
        "jobs": {"quick-dcp": {"status": "ok"}, "quick-ref": {"status": "timeout after 9 s"}}, "agreement": []}))
    (run / "vllm_e2e_logs" / "quick-dcp.log").write_text("[gpu_model_runner.py:1] Starting to load model")
    (run / "vllm_e2e_logs" / "quick-ref.log").write_text("RuntimeError: engine died")
    (logs / "e2e-runner-v1.rc").write_text("0 100")  # a step file beside the run folder is not a run
    out = tmp_path / "summary.json"
    v033_smoke.summary(str(logs), str(out))
    data = json.loads(out.read_text())
    status = {name: step["status"] for name, step in data["steps"].items()}
    assert status == {"a-versions": "ok", "b-generate-TRITON_ATTN-float32": "ok",
                      "b-generate-TRITON_ATTN-bfloat16": "ok", "c-crash": "fail", "d-late": "skipped",
                      "e2e-runner-v1": "fail", "generate-f32-vs-bf16": "info"}
    assert "No module named 'x'" in data["steps"]["c-crash"]["error"]
    assert data["steps"]["b-generate-TRITON_ATTN-float32"]["model_runner"] == "V2"
    assert data["steps"]["generate-f32-vs-bf16"]["common_prefix"] == [1]
    assert list(data["e2e"]) == ["e2e-runner-v1"]
    entry = data["e2e"]["e2e-runner-v1"]
    assert entry["job_runner"] == {"quick-dcp": "V1", "quick-ref": "unknown"}
    assert entry["checks"][0]["pass"] is True and "engine died" in entry["job_errors"]["quick-ref"]
