"""The CPU-checkable parts of the seeds' workload benchmarks: benchmarks/sglang_e2e/sglang_hybrid_spec.py (its jobs
and the summary of their results) and benchmarks/hybrid_spec.py (both engines' results summarised per engine)."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from benchmarks import common, hybrid_spec
from benchmarks.sglang_e2e import sglang_hybrid_spec as sglang_bench


def test_every_job_speculates_with_the_models_own_mtp_layer_and_only_the_backend_differs():
    models = {"q3n-mtp": Path("/m")}
    engines = {job["name"]: sglang_bench.spec_gpu.engine_kwargs(job, models) for job in sglang_bench.JOBS}
    assert sglang_bench.MODELS["q3n-mtp"]["num_nextn_predict_layers"] == 1
    # drafts that get accepted (common.save_random_model); the other SGLang jobs' Qwen3-Next stays as it was
    assert sglang_bench.MODELS["q3n-mtp"]["draftable"] == common.DRAFTABLE
    assert "draftable" not in sglang_bench.spec_gpu.MODELS["q3n"]
    assert {e["speculative_algorithm"] for e in engines.values()} == {"NEXTN"}
    assert {e["speculative_draft_model_path"] for e in engines.values()} == {"/m"}
    assert {n: e["attention_backend"] for n, e in engines.items() if "fp32" in n} == {
        "q3n-fp32-dcp-triton": "dcp-triton", "q3n-fp32-triton": "triton"}  # fa3 takes no float32
    assert {e["attention_backend"] for n, e in engines.items() if "bf16" in n} == {"dcp-triton", "triton", "fa3"}
    assert {n: e.get("page_size") for n, e in engines.items() if n.endswith("-p64")} == {
        "q3n-bf16-triton-p64": 64, "q3n-bf16-dcp-triton-p64": 64, "q3n-bf16-fa3-p64": 64}
    assert all("page_size" not in e for n, e in engines.items() if not n.endswith("-p64"))  # SGLang's default
    same = [dict(e, attention_backend=None, dtype=None, disable_cuda_graph=None, page_size=None)
            for e in engines.values()]
    assert all(e == same[0] for e in same)


def _job(name: str, greedy, verify, tok_s=None) -> dict:
    dtype = name.split("-")[1]
    loads = {} if tok_s is None else {load: [{"output_tok_s": t / 2}, {"output_tok_s": t}] for load, t in
                                      zip(sglang_bench.LOADS, tok_s)}
    return dict(name=name, dtype=dtype, init_s=1.0, greedy=greedy, verify_steps=verify, loads=loads)


def _sglang_results() -> list[dict]:
    """dcp-triton and triton agree in float32, fa3 parts from both in bf16; dcp-triton accepts as many tokens."""
    return [_job("q3n-fp32-dcp-triton", [[1, 2, 3, 4]], [2]), _job("q3n-fp32-triton", [[1, 2, 3, 4]], [2]),
            _job("q3n-bf16-dcp-triton", [[1, 2, 3, 4]], [2], (90.0, 40.0)),
            _job("q3n-bf16-fa3", [[1, 2, 9, 9]], [4], (100.0, 50.0)),
            dict(name="q3n-bf16-triton", dtype="bf16", error="-9", log="x")]


def test_sglang_summary_gives_float32_identity_acceptance_and_best_tok_s_ratios():
    summary = sglang_bench.summarise(_sglang_results())
    assert summary["failed"] == ["q3n-bf16-triton"]
    assert summary["fp32_vs_triton"]["greedy_identical"] is True and summary["fp32_vs_triton"]["acceptance_ratio"] == 1
    fa3 = summary["bf16_vs"]["fa3"]
    assert fa3["acceptance_ratio"] == 2.0  # 4 tokens in 2 verify steps against 4 in 4
    assert fa3["tok_s_ratio"] == {"decode": 0.9, "long_prompt": 0.8} and fa3["greedy"]["equal"] == 0
    assert "triton" not in summary["bf16_vs"]
    assert summary["bf16_p64_vs"] == {}  # no 64-token-page jobs: nothing compared there


def test_the_64_token_page_jobs_compare_among_themselves():
    results = [*_sglang_results(), _job("q3n-bf16-dcp-triton-p64", [[1, 2, 3, 4]], [2], (120.0, 60.0)),
               _job("q3n-bf16-triton-p64", [[1, 2, 3, 4]], [2], (100.0, 40.0))]
    summary = sglang_bench.summarise(results)
    assert summary["bf16_p64_vs"]["triton"]["tok_s_ratio"] == {"decode": 1.2, "long_prompt": 1.5}
    assert summary["bf16_vs"]["fa3"]["tok_s_ratio"] == {"decode": 0.9, "long_prompt": 0.8}  # page 1's unchanged
    assert "fa3" not in summary["bf16_p64_vs"]
    part = hybrid_spec.sglang_part(dict(summary=summary, jobs=results))
    assert part["tok_s_ratio_p64"] == {"decode": {"triton": 1.2}, "long_prompt": {"triton": 1.5}}
    assert part["tok_s_ratio"] == {"decode": {"fa3": 0.9}, "long_prompt": {"fa3": 0.8}}
    apart = [_job("q3n-bf16-dcp-triton-p64", [[1]], [1], (80.0, 60.0)),
             _job("q3n-bf16-fa3-p64", [[1]], [1], (100.0, 50.0))]
    main = _sglang_results()  # the page-1 run's file; the 64-token-page jobs ran into a file of their own
    part = hybrid_spec.sglang_part(dict(summary=sglang_bench.summarise(main), jobs=main),
                                   dict(summary=sglang_bench.summarise(apart), jobs=apart))
    assert part["tok_s_ratio_p64"] == {"decode": {"fa3": 0.8}, "long_prompt": {"fa3": 1.2}}
    assert part["tok_s_ratio"] == {"decode": {"fa3": 0.9}, "long_prompt": {"fa3": 0.8}}


def _jobs_tarball(path: Path, logs: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in logs.items():
            data = text.encode()
            info = tarfile.TarInfo(f"{name}.log")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _vllm_row(backend: str, method=None, versus=None, identical=None, tok_s=10.0, runs=1, accepted=None) -> dict:
    row = dict(status="ok", backend=backend, method=method, output_tok_s=tok_s, timed_runs=runs,
               mean_acceptance_length=accepted)
    if versus:
        row.update(versus=versus, greedy={"identical": identical, "prompts": 16},
                   logprobs=None if method else {"median_abs": 0.02})
    return row


def test_both_engines_summarised_with_what_is_missing_and_why(tmp_path):
    results = tmp_path / "r"
    results.mkdir()
    (results / "sglang_hybrid_spec_h100.json").write_text(json.dumps(dict(
        summary=sglang_bench.summarise(_sglang_results()), gpu="NVIDIA H100", jobs=_sglang_results(),
        provenance={"commit": "abc"})))
    _jobs_tarball(results / "sglang_hybrid_spec_h100_jobs.tar.gz",
                  {"q3n-bf16-triton": "Traceback\n  File x\nRuntimeError: no triton here\n[info] shut down\n"})
    rows = {"q3n-dcp-triton": _vllm_row("dcp-triton", versus="q3n-FLASH_ATTN", identical=3, tok_s=8.0, runs=3),
            "q3n-FLASH_ATTN": _vllm_row("FLASH_ATTN", tok_s=10.0, runs=3),
            "q3n-TRITON_ATTN": _vllm_row("TRITON_ATTN", versus="q3n-FLASH_ATTN", identical=2),
            "q3n-mtp-dcp-triton": _vllm_row("dcp-triton", "mtp", "q3n-dcp-triton", 5, accepted=1.5)}
    (results / "vllm_hybrid_h100.json").write_text(json.dumps(dict(summary={"jobs": rows}, meta={
        "gpu": "NVIDIA H100", "mtp": {"method": "qwen3_next_mtp"}, "provenance": {"commit": "def"}})))
    summary = json.loads(hybrid_spec.combine("h100", results).read_text())["summary"]
    sglang, vllm = summary["sglang"], summary["vllm"]
    assert summary["gpu"] == "NVIDIA H100" and sglang["greedy_identical"] is True
    assert sglang["acceptance_ratio"] == {"triton (float32)": 1.0, "fa3": 2.0}
    assert sglang["tok_s_ratio"] == {"decode": {"fa3": 0.9}, "long_prompt": {"fa3": 0.8}}
    assert sglang["greedy_bf16"] == {"dcp-triton vs fa3": "0/1"}
    assert sglang["missing"] == ["bf16 against triton: q3n-bf16-triton failed (RuntimeError: no triton here)"]
    assert vllm["greedy_identical"] is None
    assert vllm["greedy_bf16"] == {"dcp-triton vs FLASH_ATTN": "3/16", "TRITON_ATTN vs FLASH_ATTN": "2/16"}
    assert vllm["tok_s_ratio"] == {"plain": {"FLASH_ATTN": 0.8}}  # timed three times each; no MTP peer
    assert vllm["acceptance_ratio"] == {}
    assert any(m.startswith("MTP acceptance against FLASH_ATTN: q3n-mtp-dcp-triton ok, q3n-mtp-FLASH_ATTN not run")
               for m in vllm["missing"])
    assert any(m.startswith("tokens/s mtp against FLASH_ATTN") for m in vllm["missing"])


def test_the_mtp_jobs_run_apart_stand_for_the_main_files_mtp_rows(tmp_path):
    """vLLM's two MTP jobs ran as calls of their own (``vllm_hybrid_<gpu>_mtp.json``): their rows replace the main
    file's MTP rows (here one that timed out), and the MTP ratios come from that pair; the plain rows stay."""
    results = tmp_path / "r"
    results.mkdir()
    meta = {"gpu": "NVIDIA H100", "mtp": {"method": "qwen3_next_mtp"}, "provenance": {"commit": "def"}}
    rows = {"q3n-dcp-triton": _vllm_row("dcp-triton", versus="q3n-FLASH_ATTN", identical=3, tok_s=8.0, runs=3),
            "q3n-FLASH_ATTN": _vllm_row("FLASH_ATTN", tok_s=10.0, runs=3),
            "q3n-mtp-dcp-triton": dict(_vllm_row("dcp-triton", "mtp"), status="timeout after 160 s")}
    (results / "vllm_hybrid_h100.json").write_text(json.dumps(dict(summary={"jobs": rows}, meta=meta)))
    mtp = {"q3n-mtp-dcp-triton": _vllm_row("dcp-triton", "mtp", tok_s=9.0, runs=3, accepted=1.2),
           "q3n-mtp-FLASH_ATTN": _vllm_row("FLASH_ATTN", "mtp", tok_s=10.0, runs=3, accepted=1.5)}
    (results / "vllm_hybrid_h100_mtp.json").write_text(json.dumps(dict(summary={"jobs": mtp}, meta=meta)))
    out = json.loads(hybrid_spec.combine("h100", results).read_text())
    vllm = out["summary"]["vllm"]
    assert vllm["tok_s_ratio"] == {"plain": {"FLASH_ATTN": 0.8}, "mtp": {"FLASH_ATTN": 0.9}}
    assert vllm["acceptance_ratio"] == {"FLASH_ATTN": 0.8}
    assert vllm["missing"] == ["float32 greedy: vLLM's GDN kernels take no float32 (bf16 only)"]
    assert out["sources"] == {"vllm": "vllm_hybrid_h100.json", "vllm_mtp": "vllm_hybrid_h100_mtp.json"}
