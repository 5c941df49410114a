"""README tables generated from the committed results, so the README cannot drift from them
(``tests/unit/test_readme_tables.py`` checks that every generated row is in README.md).

    python benchmarks/results_tables.py      # prints the decode table of benchmarks/results/kernels_h200.json
"""

from __future__ import annotations

import json
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DECODE_HEADER = ["| decode, % of copy bandwidth (graph) | dcp-triton | FA3 | dcp-triton / FA3 "
                 "| vLLM unified (TRITON_ATTN) | vLLM split-KV decode |", "|---|---|---|---|---|---|"]


def decode_rows(kernels: dict) -> list[str]:
    """One row per decode shape of a ``bench_kernels.py`` result, in its order: CUDA-graph replay, % of the copy
    bandwidth measured in the same run; the ratio in bold where dcp-triton leads FA3."""
    rows = []
    for r in kernels["decode"]:
        ours, fa3 = r["ours_graph_pct_copy"], r["fa3_graph_pct_copy"]
        ratio = f"{ours / fa3:.2f}x"
        rows.append(f"| {r['batch']} x {r['ctx'] // 1024}K, {r['q_heads']} Q / {r['kv_heads']} KV | {ours:.1f} | "
                    f"{fa3:.1f} | {f'**{ratio}**' if ours >= fa3 else ratio} | "
                    f"{r['vllm_unified_graph_pct_copy']:.1f} | {r['vllm_decode_graph_pct_copy']:.1f} |")
    return rows


def main() -> None:
    kernels = json.loads((RESULTS / "kernels_h200.json").read_text())
    print("\n".join(DECODE_HEADER + decode_rows(kernels)))


if __name__ == "__main__":
    main()
