"""benchmarks/parity.py: the five parity numbers read from hand-made results files (each expected value worked out
here by hand), what counts for each (the worst row, the rows that qualify) and a null with its reason where a file
or a peer is missing. Also the default results names of the benchmarks it reads (by GPU, fp8 apart)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import parity
from benchmarks.vllm_e2e import vllm_one_h200


def _write(folder: Path, name: str, payload: dict) -> None:
    (folder / f"{name}.json").write_text(json.dumps(dict(payload, provenance={"commit": name})))


def _decode_row(batch, ctx, fp8, bf16, fp8_p64, bf16_p64) -> dict:
    return dict(batch=batch, ctx=ctx, q_heads=32, kv_heads=8, fp8_graph_ms=fp8, bf16_graph_ms=bf16,
                fp8_p64_graph_ms=fp8_p64, bf16_p64_graph_ms=bf16_p64)


def _every_file(folder: Path) -> None:
    _write(folder, "vllm_one_h100_fp8", {"summary": {"loads": {
        "llama8/decode-heavy": {"graphs": {"dcp_triton": 110.0, "flash_attn": 100.0}},
        "llama8/long": {"graphs": {"dcp_triton": 90.0, "flash_attn": 120.0},  # 0.75: the worst
                        "eager": {"dcp_triton": 80.0}},  # no peer in that mode: not counted
    }}})
    _write(folder, "kernels_h100", {"gpu": "NVIDIA H100 80GB HBM3",
                                    "decode_fp8": [_decode_row(1, 32768, 9.0, 1.0, 9.0, 1.0),  # batch 1: left out
                                                   _decode_row(8, 4096, 9.0, 1.0, 9.0, 1.0),  # 4K: left out
                                                   _decode_row(8, 8192, 0.6, 1.0, 0.7, 1.0),  # 0.7 on 64-token pages
                                                   _decode_row(64, 32768, 3.0, 5.0, 2.0, 4.0)],
                                    "prefill": [dict(num_seqs=2, seq_len=4096, q_heads=32, kv_heads=8, head_dim=128,
                                                     fa3_graph_ms=0.9, ours_graph_ms=1.0),  # 0.9
                                                dict(num_seqs=4, seq_len=2048, q_heads=32, kv_heads=1, head_dim=64,
                                                     fa3_graph_ms=1.2, ours_graph_ms=1.0),
                                                dict(num_seqs=1, seq_len=512, q_heads=8, kv_heads=8, head_dim=64,
                                                     fa3_graph_ms=None, ours_graph_ms=1.0)]})  # no FA3: left out
    _write(folder, "vllm_one_h100_startup", {"summary": {"loads": {}, "startup_s": {
        "dcp-triton-graphs-cold": 46.0, "FLASH_ATTN-graphs-cold": 40.0,  # 1.15
        "dcp-triton-eager-cold": 30.0, "FLASH_ATTN-eager-cold": 25.0,  # 1.2: the worse
        "dcp-triton-graphs-warm": 99.0, "FLASH_ATTN-graphs-warm": 1.0}}})  # warm starts do not count
    _write(folder, "kernels_oneshot_h100", {"summary": {"oneshot_call_ratio_max": 1.8374}})


def test_each_number_is_the_worst_qualifying_row_of_its_file(tmp_path):
    _every_file(tmp_path)
    result = json.loads(parity.combine("h100", tmp_path).read_text())
    assert result["summary"] == dict(vllm_fp8_ratio_min=0.75, fp8_decode_time_ratio_max=0.7, prefill_ratio_min=0.9,
                                     cold_start_ratio_max=1.2, oneshot_call_ratio_max=1.837,
                                     gpu="NVIDIA H100 80GB HBM3")
    assert result["missing"] == {}
    assert result["sources"]["vllm_fp8_ratio_min"] == "vllm_one_h100_fp8.json: llama8/long (graphs)"
    assert result["sources"]["fp8_decode_time_ratio_max"].endswith("batch 8 x 8192, 32 Q / 8 KV, 64-token pages")
    assert result["sources"]["cold_start_ratio_max"] == "vllm_one_h100_startup.json: eager"
    assert set(result["provenance"]) == {"vllm_one_h100_fp8.json", "kernels_h100.json", "vllm_one_h100_startup.json",
                                         "kernels_oneshot_h100.json"}


def test_a_missing_file_or_peer_gives_null_and_says_why(tmp_path):
    _write(tmp_path, "kernels_h200", {"gpu": "NVIDIA H200", "decode_fp8": [_decode_row(4, 8192, 1.0, 1.0, 1.0, 1.0)],
                                      "prefill": [dict(num_seqs=2, seq_len=4096, q_heads=32, kv_heads=8, head_dim=128,
                                                       fa3_graph_ms=None, ours_graph_ms=1.0)]})
    _write(tmp_path, "vllm_one_h200_startup", {"summary": {"loads": {}, "startup_s": {"dcp-triton-graphs-cold": 50.0}}})
    _write(tmp_path, "kernels_oneshot_h200", {"summary": {"oneshot_call_ratio_max": None}})
    result = json.loads(parity.combine("h200", tmp_path).read_text())
    assert {k: v for k, v in result["summary"].items() if k != "gpu"} == dict.fromkeys(parity.METRICS)
    assert result["summary"]["gpu"] == "NVIDIA H200"
    assert result["missing"]["vllm_fp8_ratio_min"] == "vllm_one_h200_fp8.json does not exist"
    assert "batch >= 8 and context >= 8192" in result["missing"]["fp8_decode_time_ratio_max"]
    assert "FA3" in result["missing"]["prefill_ratio_min"]
    assert "--startup" in result["missing"]["cold_start_ratio_max"]
    assert "FA3" in result["missing"]["oneshot_call_ratio_max"]


@pytest.mark.parametrize("dtype, gpu, name", [("auto", "NVIDIA H100 80GB HBM3", "vllm_one_h100"),
                                              ("fp8", "NVIDIA H200", "vllm_one_h200_fp8"),
                                              ("fp8_e5m2", "NVIDIA H100 80GB HBM3", "vllm_one_h100_fp8_e5m2")])
def test_the_vllm_benchmark_names_its_results_by_gpu_and_cache_dtype(dtype, gpu, name):
    assert vllm_one_h200.results_name(dtype, gpu) == name


def test_an_fp8_job_asks_vllm_for_an_fp8_cache_and_a_plain_one_does_not():
    job = dict(name="llama8-dcp-triton-graphs", model="llama8", backend="dcp-triton", mode="graphs",
               kind="throughput")
    plain = vllm_one_h200.engine_kwargs(dict(job, kv_cache_dtype="auto"), Path("/m"))
    fp8 = vllm_one_h200.engine_kwargs(dict(job, kv_cache_dtype="fp8"), Path("/m"))
    assert "kv_cache_dtype" not in plain and fp8["kv_cache_dtype"] == "fp8"
    assert dict(fp8, kv_cache_dtype=None) == dict(plain, kv_cache_dtype=None)
