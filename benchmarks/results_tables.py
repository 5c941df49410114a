"""The README's headline numbers and the tables of docs/performance.md and docs/kernels.md, generated from the
committed results, so the pages cannot drift from them (``tests/unit/test_readme_tables.py`` checks every generated
block).

A page marks each block ``<!-- generated: NAME -->`` ... ``<!-- end generated -->`` (NAME a key of ``blocks()``).

    python -m benchmarks.results_tables           # prints every block
    python -m benchmarks.results_tables --write   # rewrites the blocks in README.md and docs/*.md (PAGES)
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PAGES = ("README.md", "docs/performance.md", "docs/kernels.md")  # relative to the repository root
DECODE_PEERS = ("vllm_unified_graph_pct_copy", "vllm_decode_graph_pct_copy")


def ratio(ours: float, peer: float) -> str:
    """``ours / peer`` as ``1.23x``, in bold where dcp-triton leads."""
    text = f"{ours / peer:.2f}x"
    return f"**{text}**" if ours >= peer else text


def span(ratios: list[float]) -> str:
    """``0.80x-0.90x``, or ``0.84x`` when both ends print the same."""
    low, high = f"{min(ratios):.2f}x", f"{max(ratios):.2f}x"
    return low if low == high else f"{low}-{high}"


def decode_rows(kernels: dict) -> list[str]:
    """One row per decode shape of a ``bench_kernels.py`` result, in its order: CUDA-graph replay, % of the copy
    bandwidth measured in the same run; the ratio in bold where dcp-triton leads FA3. vLLM's Triton kernels get
    columns when the run had them (they travel only with vLLM's whole bundle, not with the FA3-only one)."""
    peers = all(k in r for r in kernels["decode"] for k in DECODE_PEERS)
    p64 = all("ours_p64_graph_pct_copy" in r for r in kernels["decode"])  # 64-token pages: what vLLM runs it over
    rows = ["| decode, % of copy bandwidth (graph) | dcp-triton | FA3 | dcp-triton / FA3 |"
            + (" dcp-triton, 64-token pages | / FA3 |" if p64 else "")
            + (" vLLM unified (TRITON_ATTN) | vLLM split-KV decode |" if peers else ""),
            "|---|---|---|---|" + ("---|---|" if p64 else "") + ("---|---|" if peers else "")]
    for r in kernels["decode"]:
        ours, fa3 = r["ours_graph_pct_copy"], r["fa3_graph_pct_copy"]
        rows.append(f"| {r['batch']} x {r['ctx'] // 1024}K, {r['q_heads']} Q / {r['kv_heads']} KV | {ours:.1f} | "
                    f"{fa3:.1f} | {ratio(ours, fa3)} |"
                    + (f" {r['ours_p64_graph_pct_copy']:.1f} | {ratio(r['ours_p64_graph_pct_copy'], fa3)} |"
                       if p64 else "")
                    + "".join(f" {r[k]:.1f} |" for k in DECODE_PEERS if peers))
    return rows


def prefill_rows(kernels: dict) -> list[str]:
    """The current chunk (causal prefill) against FA3 and SDPA, TFLOP/s (causal FLOPs counted once)."""
    rows = ["| causal prefill, TFLOP/s | dcp-triton | FA3 | dcp-triton / FA3 | SDPA |", "|---|---|---|---|---|"]
    for r in kernels["prefill"]:
        rows.append(f"| {r['num_seqs']} x {r['seq_len']}, {r['q_heads']} Q / {r['kv_heads']} KV, D {r['head_dim']} | "
                    f"{r['ours_tflops']:.0f} | {r['fa3_tflops']:.0f} | {ratio(r['ours_tflops'], r['fa3_tflops'])} | "
                    f"{r['sdpa_tflops']:.0f} |")
    return rows


def prefix_rows(kernels: dict) -> list[str]:
    """The DCP prefix pass (query rows against a paged cache, non-causal) and fp8 decode against bf16."""
    rows = ["| prefix pass, TFLOP/s | page | dcp-triton | FA3 (paged) | dcp-triton / FA3 |", "|---|---|---|---|---|"]
    for r in kernels["prefix"]:
        rows.append(f"| {r['batch']} x {r['q_rows']} rows over {r['ctx'] // 1024}K cached, {r['q_heads']} Q / "
                    f"{r['kv_heads']} KV | {r.get('page', 16)} | {r['ours_tflops']:.0f} | {r['fa3_tflops']:.0f} | "
                    f"{ratio(r['ours_tflops'], r['fa3_tflops'])} |")
    rows += ["", "| fp8 (e4m3) decode, graph replay | page | fp8 us | bf16 us | fp8 / bf16 time |",
             "|---|---|---|---|---|"]
    for r in kernels["decode_fp8"]:
        for page, key in ((16, ""), (64, "_p64")):  # a row without 64-token pages' times predates them
            if f"fp8{key}_graph_ms" in r:
                fp8, bf16 = r[f"fp8{key}_graph_ms"], r[f"bf16{key}_graph_ms"]
                rows.append(f"| {r['batch']} x {r['ctx'] // 1024}K, {r['q_heads']} Q / {r['kv_heads']} KV | {page} | "
                            f"{fp8 * 1e3:.1f} | {bf16 * 1e3:.1f} | {fp8 / bf16:.2f}x |")
    return rows


# The models of ``vllm_one_h200.py`` (its MODELS), as the tables and the headline name them.
ONE_MODELS = {"llama8": "32 Q / 8 KV (Llama-3-8B)", "mqa16": "16 Q / 1 KV"}


def same_run(one: dict, model: str, mode: str, peer: str) -> bool:
    """Whether ``peer``'s throughput job for ``model`` and ``mode`` ran beside dcp-triton's, as far as the jobs'
    provenance tells (a merged file keeps each job's own: two commits are two calls); a file without jobs is one run."""
    origin = {j["backend"]: j.get("provenance") for j in one.get("jobs", [])
              if j.get("kind", "throughput") == "throughput" and (j["model"], j["mode"]) == (model, mode)}
    return origin.get(peer) == origin.get("dcp-triton")


def vllm_one_rows(one: dict) -> list[str]:
    """Output tokens/s inside vLLM on one GPU (``vllm_one_h200.py``), best of its runs, per model, load and mode; a
    ratio to a backend that ran in another call than dcp-triton says so."""
    rows = ["| model | load | mode | dcp-triton | FLASH_ATTN | TRITON_ATTN | / FLASH_ATTN | / TRITON_ATTN |",
            "|---|---|---|---|---|---|---|---|"]
    for key, modes in one["summary"]["loads"].items():
        model, load = key.split("/")
        for mode, t in modes.items():
            ours, fa, tr = t["dcp_triton"], t["flash_attn"], t.get("triton_attn")
            to_fa, to_tr = ratio(ours, fa), ratio(ours, tr) if tr else "-"
            to_fa += "" if same_run(one, model, mode, "FLASH_ATTN") else " (another run)"
            to_tr += "" if not tr or same_run(one, model, mode, "TRITON_ATTN") else " (another run)"
            rows.append(f"| {ONE_MODELS.get(model, model)} | {load} | {mode} | {ours:,.0f} | {fa:,.0f} | "
                        f"{f'{tr:,.0f}' if tr else 'not run'} | {to_fa} | {to_tr} |")
    return rows


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _kernels() -> dict:
    """kernels_h200.json: every section from one run of bench_kernels.py, its peers in the same process."""
    return _load("kernels_h200.json")


def _dcp2_throughput(vllm_dcp: dict) -> dict[str, dict[str, float]]:
    """Output tokens/s per load and config of the tp = 2 CUDA-graph jobs of ``vllm_dcp_e2e.py``."""
    table: dict[str, dict[str, float]] = {}
    for r in vllm_dcp["throughput"]:
        if r["group"] == "tp2" and r["mode"] == "graphs":
            table.setdefault(r["load"], {})[r["config"]] = r["output_tok_s"]
    return table


def vllm_dcp2_rows(vllm_dcp: dict) -> list[str]:
    """The two-H200 table: dcp-triton at DCP = 2 (both merge modes) against FLASH_ATTN, and both at DCP = 1."""
    rows = ["| load | dcp-triton DCP=2, ag_rs (default) | a2a | FLASH_ATTN DCP=2 | ag_rs / FLASH_ATTN | "
            "dcp-triton DCP=1 | FLASH_ATTN DCP=1 |", "|---|---|---|---|---|---|---|"]
    for load, t in _dcp2_throughput(vllm_dcp).items():
        requests, prompt, output = vllm_dcp["meta"]["loads"][load]
        ours, peer = t["dcp_triton_dcp2_ag_rs"], t["flash_attn_dcp2"]
        rows.append(f"| {load}: {requests} x {prompt} -> {output} | {ours:,.0f} | {t['dcp_triton_dcp2_a2a']:,.0f} | "
                    f"{peer:,.0f} | {ratio(ours, peer)} | {t['dcp_triton_dcp1']:,.0f} | "
                    f"{t['flash_attn_dcp1']:,.0f} |")
    return rows


def headline_rows(vllm_dcp: dict, kernels: dict, one: dict) -> list[str]:
    """The README's three numbers, each with its page section and results file."""
    capacity = {(r["config"], r["mode"]): r["kv_cache_tokens"] for r in vllm_dcp["kv_capacity"]}
    dcp1, dcp2 = capacity[("dcp_triton_dcp1", "graphs")], capacity[("dcp_triton_dcp2_ag_rs", "graphs")]
    graphs = [(k.split("/")[0], t["graphs"]) for k, t in one["summary"]["loads"].items()]
    models = list(dict.fromkeys(ONE_MODELS.get(model, model) for model, _ in graphs))
    vs_fa = [t["dcp_triton"] / t["flash_attn"] for _, t in graphs]
    fa_beside = all(same_run(one, model, "graphs", "FLASH_ATTN") for model, _ in graphs)
    vs_tr = [t["dcp_triton"] / t["triton_attn"] for model, t in graphs
             if t.get("triton_attn") and same_run(one, model, "graphs", "TRITON_ATTN")]
    triton = "" if not vs_tr else f" (and {span(vs_tr)} `TRITON_ATTN`'s" + (
        ")" if len(vs_tr) == len(graphs) else f" where it ran beside dcp-triton, {len(vs_tr)} loads)")
    beside = ("each model's backends in one run" if fa_beside and len(vs_tr) == len(graphs)
              else "each model's dcp-triton and FLASH_ATTN in one run" if fa_beside else "backends from several runs")
    eager = [(k.split("/")[0], t["eager"]["dcp_triton"] / t["eager"]["flash_attn"])
             for k, t in one["summary"]["loads"].items() if t.get("eager", {}).get("flash_attn")]
    behind = [ONE_MODELS.get(m, m) for m in dict.fromkeys(m for m, _ in eager)
              if all(r < 1 for model, r in eager if model == m)]
    eager_text = "" if not eager else (
        f"; eager (`--enforce-eager`): {span([r for _, r in eager])} FLASH_ATTN's over {len(eager)} loads"
        + (f", the {' and '.join(behind)} model behind it on every load" if behind else ""))
    fa3 = [r["ours_graph_pct_copy"] / r["fa3_graph_pct_copy"] for r in kernels["decode"]]
    fa3_p64 = [r["ours_p64_graph_pct_copy"] / r["fa3_graph_pct_copy"] for r in kernels["decode"]
               if "ours_p64_graph_pct_copy" in r]
    prefill = [r["ours_tflops"] / r["fa3_tflops"] for r in kernels["prefill"]]
    prefix = [r["ours_tflops"] / r["fa3_tflops"] for r in kernels.get("prefix", []) if r.get("page") == 64]
    meta, page, kernel_page = vllm_dcp["meta"], "docs/performance.md", "docs/kernels.md"
    model = f"{meta['config']['num_attention_heads']} Q / {meta['config']['num_key_value_heads']} KV heads"
    peer_dcp2 = capacity.get(("flash_attn_dcp2", "graphs"))
    vs_fa_dcp2 = [t["dcp_triton_dcp2_ag_rs"] / t["flash_attn_dcp2"] for t in _dcp2_throughput(vllm_dcp).values()
                  if t.get("flash_attn_dcp2") and t.get("dcp_triton_dcp2_ag_rs")]
    peer = ((f" (vLLM's FLASH_ATTN at DCP = 2 holds {'as many' if peer_dcp2 == dcp2 else f'{peer_dcp2:,}'})"
             if peer_dcp2 else "")
            + (f", at {span(vs_fa_dcp2)} FLASH_ATTN's output tokens/s at DCP = 2 over {len(vs_fa_dcp2)} loads"
               if vs_fa_dcp2 else ""))
    return [
        f"- **{dcp2 / dcp1:.1f}x the KV cache at DCP = 2**: {dcp2:,} tokens against {dcp1:,} at DCP = 1{peer}, "
        f"inside vLLM {meta['vllm']} on two {meta['gpu']}s at tp = 2 ({model}), float32 prompt logprobs within "
        f"{vllm_dcp['summary']['fp32_max_abs_logprob_diff']:.1e} of vLLM's `TRITON_ATTN` "
        f"([details]({page}#dcp--2-inside-vllm-two-h200s), `benchmarks/results/vllm_dcp_2xh200.json`).",
        f"- **{min(vs_fa):.2f}x-{max(vs_fa):.2f}x the output tokens/s of vLLM's FLASH_ATTN**{triton} over "
        f"{len(graphs)} loads with CUDA graphs, one {kernels['gpu']}, "
        f"{' and '.join(models)} heads, {beside}{eager_text} ([table]({page}#inside-vllm-one-h200), "
        "`benchmarks/results/vllm_one_h200.json`).",
        f"- **Kernels against FlashAttention-3**: decode {min(fa3):.2f}x-{max(fa3):.2f}x over {len(fa3)} shapes"
        + (f" ({span(fa3_p64)} over the 64-token pages dcp-triton asks vLLM for, FA3 over its 16)"
           if fa3_p64 else "") + ", "
        f"causal prefill {min(prefill):.2f}x-{max(prefill):.2f}x"
        + (f", prefix pass {span(prefix)} over 64-token pages" if prefix else "")
        + f" ([tables]({kernel_page}#kernels-one-h200), `benchmarks/results/kernels_h200.json`).",
    ]


def blocks() -> dict[str, list[str]]:
    """Every generated block, by the name a page marks it with."""
    vllm_dcp, kernels, one = _load("vllm_dcp_2xh200.json"), _kernels(), _load("vllm_one_h200.json")
    return {"headlines": headline_rows(vllm_dcp, kernels, one), "vllm_dcp2": vllm_dcp2_rows(vllm_dcp),
            "decode": decode_rows(kernels), "prefill": prefill_rows(kernels),
            "prefix": prefix_rows(kernels), "vllm_one": vllm_one_rows(one)}


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
