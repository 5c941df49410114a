"""The README's headline numbers and docs/performance.md's tables, generated from the committed results, so the
pages cannot drift from them (``tests/unit/test_readme_tables.py`` checks every generated block).

A page marks each block ``<!-- generated: NAME -->`` ... ``<!-- end generated -->`` (NAME a key of ``blocks()``).

    python benchmarks/results_tables.py           # prints every block
    python benchmarks/results_tables.py --write   # rewrites the blocks in README.md and docs/performance.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAGES = ("README.md", "docs/performance.md")  # relative to the repository root
DECODE_HEADER = ["| decode, % of copy bandwidth (graph) | dcp-triton | FA3 | dcp-triton / FA3 "
                 "| vLLM unified (TRITON_ATTN) | vLLM split-KV decode |", "|---|---|---|---|---|---|"]


def ratio(ours: float, peer: float) -> str:
    """``ours / peer`` as ``1.23x``, in bold where dcp-triton leads."""
    text = f"{ours / peer:.2f}x"
    return f"**{text}**" if ours >= peer else text


def decode_rows(kernels: dict) -> list[str]:
    """One row per decode shape of a ``bench_kernels.py`` result, in its order: CUDA-graph replay, % of the copy
    bandwidth measured in the same run; the ratio in bold where dcp-triton leads FA3."""
    rows = []
    for r in kernels["decode"]:
        ours, fa3 = r["ours_graph_pct_copy"], r["fa3_graph_pct_copy"]
        rows.append(f"| {r['batch']} x {r['ctx'] // 1024}K, {r['q_heads']} Q / {r['kv_heads']} KV | {ours:.1f} | "
                    f"{fa3:.1f} | {ratio(ours, fa3)} | "
                    f"{r['vllm_unified_graph_pct_copy']:.1f} | {r['vllm_decode_graph_pct_copy']:.1f} |")
    return rows


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _dcp2_throughput(vllm_dcp: dict) -> dict[str, dict[str, float]]:
    """Output tokens/s per load and config of the tp = 2 CUDA-graph jobs of ``vllm_dcp_e2e.py``."""
    table: dict[str, dict[str, float]] = {}
    for r in vllm_dcp["throughput"]:
        if r["group"] == "tp2" and r["mode"] == "graphs":
            table.setdefault(r["load"], {})[r["config"]] = r["output_tok_s"]
    return table


def vllm_dcp2_rows(vllm_dcp: dict) -> list[str]:
    """The two-H200 table: dcp-triton at DCP = 2 (both combines) against FLASH_ATTN, and both at DCP = 1."""
    rows = ["| load | dcp-triton DCP=2, ag_rs (default) | a2a | FLASH_ATTN DCP=2 | ag_rs / FLASH_ATTN | "
            "dcp-triton DCP=1 | FLASH_ATTN DCP=1 |", "|---|---|---|---|---|---|---|"]
    for load, t in _dcp2_throughput(vllm_dcp).items():
        requests, prompt, output = vllm_dcp["meta"]["loads"][load]
        ours, peer = t["dcp_triton_dcp2_ag_rs"], t["flash_attn_dcp2"]
        rows.append(f"| {load}: {requests} x {prompt} -> {output} | {ours:,.0f} | {t['dcp_triton_dcp2_a2a']:,.0f} | "
                    f"{peer:,.0f} | {ratio(ours, peer)} | {t['dcp_triton_dcp1']:,.0f} | "
                    f"{t['flash_attn_dcp1']:,.0f} |")
    return rows


def headline_rows(vllm_dcp: dict, kernels: dict) -> list[str]:
    """The README's three numbers, each with its page section and results file."""
    capacity = {(r["config"], r["mode"]): r["kv_cache_tokens"] for r in vllm_dcp["kv_capacity"]}
    dcp1, dcp2 = capacity[("dcp_triton_dcp1", "graphs")], capacity[("dcp_triton_dcp2_ag_rs", "graphs")]
    ratios = [t["dcp_triton_dcp2_ag_rs"] / t["flash_attn_dcp2"] for t in _dcp2_throughput(vllm_dcp).values()]
    fa3 = [r["ours_graph_pct_copy"] / r["fa3_graph_pct_copy"] for r in kernels["decode"]]
    best = max(r["ours_graph_pct_copy"] for r in kernels["decode"])
    meta, page = vllm_dcp["meta"], "docs/performance.md"
    model = f"{meta['config']['num_attention_heads']} Q / {meta['config']['num_key_value_heads']} KV heads"
    return [
        f"- **{dcp2 / dcp1:.1f}x the KV cache at DCP = 2**: {dcp2:,} tokens against {dcp1:,} at DCP = 1, inside vLLM "
        f"{meta['vllm']} on two {meta['gpu']}s at tp = 2 ({model}), float32 prompt logprobs within "
        f"{vllm_dcp['summary']['fp32_max_abs_logprob_diff']:.1e} of vLLM's `TRITON_ATTN` "
        f"([details]({page}#dcp--2-inside-vllm-two-h200s), `benchmarks/results/vllm_dcp_2xh200.json`).",
        f"- **{min(ratios):.2f}x-{max(ratios):.2f}x the output tokens/s of vLLM's FLASH_ATTN at DCP = 2** over four "
        f"loads, same run ([table]({page}#dcp--2-inside-vllm-two-h200s), `benchmarks/vllm_dcp_e2e.py`).",
        f"- **Decode kernel at {min(fa3):.2f}x-{max(fa3):.2f}x FlashAttention-3** over {len(fa3)} shapes on one "
        f"{kernels['gpu']}, up to {best:.1f}% of its copy bandwidth ([table]({page}#kernels-one-h200), "
        "`benchmarks/results/kernels_h200.json`).",
    ]


def blocks() -> dict[str, list[str]]:
    """Every generated block, by the name a page marks it with."""
    vllm_dcp, kernels = _load("vllm_dcp_2xh200.json"), _load("kernels_h200.json")
    return {"headlines": headline_rows(vllm_dcp, kernels), "vllm_dcp2": vllm_dcp2_rows(vllm_dcp),
            "decode": DECODE_HEADER + decode_rows(kernels)}


BLOCK = re.compile(r"(<!-- generated: (\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def page_blocks(text: str) -> dict[str, list[str]]:
    """The generated blocks a page holds now, by name."""
    return {m[2]: m[3].splitlines() for m in BLOCK.finditer(text)}


def rewrite(text: str, generated: dict[str, list[str]]) -> str:
    """``text`` with each marked block replaced by its generated lines."""
    return BLOCK.sub(lambda m: m[1] + "".join(f"{line}\n" for line in generated[m[2]]) + m[4], text)


def main(argv: list[str]) -> None:
    generated = blocks()
    if argv == ["--write"]:
        root = RESULTS.parents[1]
        for page in PAGES:
            path = root / page
            path.write_text(rewrite(path.read_text(), generated))
        return
    for name, lines in generated.items():
        print(f"<!-- generated: {name} -->", *lines, "<!-- end generated -->", sep="\n")


if __name__ == "__main__":
    main(sys.argv[1:])
