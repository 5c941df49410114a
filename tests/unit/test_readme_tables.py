"""README.md's kernel table is the committed benchmark result: every decode row that
``benchmarks/results_tables.py`` derives from ``benchmarks/results/kernels_h200.json`` is in the README, and the
README's table has no other row."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import results_tables  # noqa: E402


def test_readme_decode_table_is_the_committed_result():
    kernels = json.loads((ROOT / "benchmarks" / "results" / "kernels_h200.json").read_text())
    readme = (ROOT / "README.md").read_text().splitlines()
    start = readme.index(results_tables.DECODE_HEADER[0])
    table = []
    for line in readme[start:]:
        if not line.startswith("|"):
            break
        table.append(line)
    assert table == results_tables.DECODE_HEADER + results_tables.decode_rows(kernels)
    assert len(table) == 2 + len(kernels["decode"]) == 30  # every shape of the run, none left out


def test_rows_bold_the_ratio_only_where_dcp_triton_leads():
    row = {"batch": 8, "ctx": 8192, "q_heads": 32, "kv_heads": 1, "ours_graph_pct_copy": 50.0,
           "fa3_graph_pct_copy": 40.0, "vllm_unified_graph_pct_copy": 10.0, "vllm_decode_graph_pct_copy": 20.0}
    behind = {**row, "ours_graph_pct_copy": 30.0}
    assert results_tables.decode_rows({"decode": [row, behind]}) == [
        "| 8 x 8K, 32 Q / 1 KV | 50.0 | 40.0 | **1.25x** | 10.0 | 20.0 |",
        "| 8 x 8K, 32 Q / 1 KV | 30.0 | 40.0 | 0.75x | 10.0 | 20.0 |"]
