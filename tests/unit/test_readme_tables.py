"""The README's headline numbers and the tables of docs/performance.md and docs/kernels.md are the committed
benchmark results: every block a page marks as generated equals what ``benchmarks/results_tables.py`` derives from
``benchmarks/results/*.json`` (``python -m benchmarks.results_tables --write`` rewrites them after a new run)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import results_tables

ROOT = Path(__file__).resolve().parents[2]

EXPECTED_BLOCKS = {"README.md": {"headlines"},
                   "docs/performance.md": {"vllm_dcp2", "vllm_one"},
                   "docs/kernels.md": {"decode", "prefill", "prefix"}}


@pytest.mark.parametrize("page", results_tables.PAGES)
def test_generated_blocks_are_the_committed_results(page):
    held = results_tables.page_blocks((ROOT / page).read_text())
    assert set(held) == EXPECTED_BLOCKS[page]
    generated = results_tables.blocks()
    for name, lines in held.items():
        assert lines == generated[name], (f"{page}: block {name} differs; run python -m benchmarks.results_tables "
                                          "--write")


def test_decode_table_has_every_shape_of_the_run():
    kernels = json.loads((ROOT / "benchmarks" / "results" / "kernels_h200.json").read_text())
    table = results_tables.blocks()["decode"]
    assert table == results_tables.decode_rows(kernels)
    assert len(table) == 2 + len(kernels["decode"]) == 30  # every shape of the run, none left out
    prefill, one = results_tables.blocks()["prefill"], results_tables.blocks()["vllm_one"]
    assert len(prefill) == 2 + len(kernels["prefill"]) == 18
    loads = json.loads((ROOT / "benchmarks" / "results" / "vllm_one_h200.json").read_text())["summary"]["loads"]
    assert len(one) == 2 + sum(len(modes) for modes in loads.values())


def test_rows_bold_the_ratio_only_where_dcp_triton_leads():
    row = {"batch": 8, "ctx": 8192, "q_heads": 32, "kv_heads": 1, "ours_graph_pct_copy": 50.0,
           "fa3_graph_pct_copy": 40.0, "vllm_unified_graph_pct_copy": 10.0, "vllm_decode_graph_pct_copy": 20.0}
    behind = {**row, "ours_graph_pct_copy": 30.0}
    assert results_tables.decode_rows({"decode": [row, behind]})[2:] == [
        "| 8 x 8K, 32 Q / 1 KV | 50.0 | 40.0 | **1.25x** | 10.0 | 20.0 |",
        "| 8 x 8K, 32 Q / 1 KV | 30.0 | 40.0 | 0.75x | 10.0 | 20.0 |"]
    fa3_only = [{k: v for k, v in r.items() if not k.startswith("vllm_")} for r in (row, behind)]
    assert results_tables.decode_rows({"decode": fa3_only})[0].count("|") == 5  # no empty peer columns


def test_headlines_from_hand_made_results():
    throughput = [{"group": "tp2", "mode": "graphs", "load": load, "config": config, "output_tok_s": tok_s}
                  for load, ours, peer in (("decode", 90.0, 100.0), ("prefill", 120.0, 100.0))
                  for config, tok_s in (("dcp_triton_dcp2_ag_rs", ours), ("flash_attn_dcp2", peer))]
    vllm_dcp = {"meta": {"vllm": "0.26.0", "gpu": "GPU X", "config": {"num_attention_heads": 16,
                                                                     "num_key_value_heads": 1}},
                "kv_capacity": [{"config": "dcp_triton_dcp1", "mode": "graphs", "kv_cache_tokens": 1000},
                                {"config": "dcp_triton_dcp2_ag_rs", "mode": "graphs", "kv_cache_tokens": 2000}],
                "summary": {"fp32_max_abs_logprob_diff": 1.5e-6}, "throughput": throughput}
    kernels = {"gpu": "GPU X", "decode": [{"ours_graph_pct_copy": 45.0, "fa3_graph_pct_copy": 50.0},
                                          {"ours_graph_pct_copy": 99.0, "fa3_graph_pct_copy": 90.0}],
               "prefill": [{"ours_tflops": 300.0, "fa3_tflops": 500.0}, {"ours_tflops": 400.0, "fa3_tflops": 500.0}]}
    one = {"summary": {"loads": {"m/a": {"graphs": {"dcp_triton": 90.0, "flash_attn": 100.0, "triton_attn": 45.0}},
                                 "m/b": {"graphs": {"dcp_triton": 130.0, "flash_attn": 100.0, "triton_attn": 130.0},
                                         "eager": {"dcp_triton": 1.0, "flash_attn": 100.0}}}}}
    text = "\n".join(results_tables.headline_rows(vllm_dcp, kernels, one))
    assert ("**2.0x the KV cache at DCP = 2**: 2,000 tokens against 1,000 at DCP = 1, at 0.90x-1.20x FLASH_ATTN's "
            "output tokens/s at DCP = 2 over 2 loads, inside vLLM 0.26.0" in text)  # no FLASH_ATTN capacity row
    vllm_dcp["kv_capacity"].append({"config": "flash_attn_dcp2", "mode": "graphs", "kv_cache_tokens": 2000})
    with_peer = "\n".join(results_tables.headline_rows(vllm_dcp, kernels, one))
    assert ("2,000 tokens against 1,000 at DCP = 1 (vLLM's FLASH_ATTN at DCP = 2 holds as many), at 0.90x-1.20x "
            "FLASH_ATTN's output tokens/s at DCP = 2 over 2 loads, inside vLLM" in with_peer)
    assert "(16 Q / 1 KV heads), float32 prompt logprobs within 1.5e-06" in text
    assert "**0.90x-1.30x the output tokens/s of vLLM's FLASH_ATTN** (and 1.00x-2.00x `TRITON_ATTN`'s) over 2 loads" \
        in text  # graphs only: the eager row's 0.01x is not a headline
    assert "decode 0.90x-1.10x over 2 shapes, causal prefill 0.60x-0.80x (" in text  # no prefix rows: no clause
    kernels["prefix"] = [{"page": 16, "ours_tflops": 100.0, "fa3_tflops": 500.0},
                         {"page": 64, "ours_tflops": 420.0, "fa3_tflops": 500.0},
                         {"page": 64, "ours_tflops": 421.0, "fa3_tflops": 500.0}]
    for load in one["summary"]["loads"].values():  # a run without TRITON_ATTN: its clause goes
        load["graphs"].pop("triton_attn")
    text = "\n".join(results_tables.headline_rows(vllm_dcp, kernels, one))
    assert "causal prefill 0.60x-0.80x, prefix pass 0.84x over 64-token pages (" in text
    assert "**0.90x-1.30x the output tokens/s of vLLM's FLASH_ATTN** over 2 loads" in text
    one["summary"]["loads"] = {"m/a": {"graphs": {"dcp_triton": 90.0, "flash_attn": 100.0, "triton_attn": 45.0}},
                               "n/a": {"graphs": {"dcp_triton": 50.0, "flash_attn": 100.0, "triton_attn": 10.0}}}
    one["jobs"] = [{"model": model, "mode": "graphs", "backend": backend, "provenance": {"commit": commit}}
                   for model, late in (("m", "new"), ("n", "old"))
                   for backend, commit in (("dcp-triton", "new"), ("FLASH_ATTN", "new"), ("TRITON_ATTN", late))]
    text = "\n".join(results_tables.headline_rows(vllm_dcp, kernels, one))  # n's TRITON_ATTN: another call
    assert "(and 2.00x `TRITON_ATTN`'s where it ran beside dcp-triton, 1 loads) over 2 loads" in text
    assert "each model's dcp-triton and FLASH_ATTN in one run" in text


def test_a_ratio_to_a_backend_of_another_run_says_so():
    one = {"summary": {"loads": {"m/a": {"graphs": {"dcp_triton": 90.0, "flash_attn": 100.0, "triton_attn": 45.0},
                                         "eager": {"dcp_triton": 90.0, "flash_attn": 100.0, "triton_attn": 45.0}}}},
           "jobs": [{"model": "m", "mode": mode, "kind": "throughput", "backend": backend,
                     "provenance": {"commit": "old" if (mode, backend) == ("graphs", "TRITON_ATTN") else "new"}}
                    for mode in ("graphs", "eager") for backend in ("dcp-triton", "FLASH_ATTN", "TRITON_ATTN")]}
    assert results_tables.vllm_one_rows(one)[2:] == [
        "| m | a | graphs | 90 | 100 | 45 | 0.90x | **2.00x** (another run) |",
        "| m | a | eager | 90 | 100 | 45 | 0.90x | **2.00x** |"]


def test_write_replaces_only_the_marked_blocks():
    page = "intro\n<!-- generated: decode -->\nstale\n<!-- end generated -->\noutro\n"
    assert results_tables.rewrite(page, {"decode": ["a", "b"]}) == \
        "intro\n<!-- generated: decode -->\na\nb\n<!-- end generated -->\noutro\n"
