"""Where dcp-triton stands against FlashAttention on one GPU, in five numbers, from the results files of that GPU.

Reads, under ``<results>`` (``benchmarks/results/`` by default), for ``--gpu`` (``h100``, ``h200``):

  vllm_one_<gpu>_fp8.json   ``vllm_e2e/vllm_one_h200.py --kv-cache-dtype fp8``: output tokens/s inside vLLM with an
                            fp8 KV cache, dcp-triton and FLASH_ATTN
  kernels_<gpu>.json        ``kernels/bench_kernels.py``: the fp8 and bf16 decode (``decode_fp8``) and the causal
                            prefill against FA3 (``prefill``), CUDA-graph times
  vllm_one_<gpu>_startup.json  ``vllm_e2e/vllm_one_h200.py --startup --only 'startup-*' --name
                            vllm_one_<gpu>_startup``: engine start-up seconds, cold (empty caches) and warm,
                            graphs and eager
  kernels_oneshot_<gpu>.json  ``kernels/bench_oneshot.py``: a public kernel function's per-call time against FA3's

and writes ``<results>/parity_<gpu>.json`` whose ``summary`` holds (each ratio rounded to 3 places, each with the
file it came from under ``sources``; a number no file gives is null, with the reason under ``missing``):

  vllm_fp8_ratio_min          dcp-triton / FLASH_ATTN output tokens/s, both with an fp8 cache, the worst load and mode
  fp8_decode_time_ratio_max   fp8 / bf16 decode time, the worst shape at batch >= 8 and context >= 8K, over both
                              page sizes the benchmark times (16 tokens, and 64, which dcp-triton asks vLLM for)
  prefill_ratio_min           dcp-triton's causal prefill speed / FA3's (FA3's time over ours), the worst shape
  cold_start_ratio_max        dcp-triton / FLASH_ATTN start-up seconds from empty caches, the worse of graphs and eager
  oneshot_call_ratio_max      per-call time / FA3's function, the worse of decode and prefill
  gpu                         the card the files name (``gpu`` of the kernel results, else the ``--gpu`` tag)

    python -m benchmarks.parity --gpu h200
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import common

FP8_DECODE_MIN_BATCH, FP8_DECODE_MIN_CTX = 8, 8192
PAGES = ("", "_p64")  # the decode tables' page sizes: 16 tokens, and 64 (bench_kernels' ``*_p64_*`` columns)
MODES = ("graphs", "eager")


def _ratio(value: float) -> float:
    return round(value, 3)


def vllm_fp8(result: dict) -> tuple[float | None, str | None]:
    """dcp-triton over FLASH_ATTN, worst over every load and mode both ran with the fp8 cache."""
    ratios = [(by_backend["dcp_triton"] / by_backend["flash_attn"], f"{load} ({mode})")
              for load, modes in result["summary"]["loads"].items() for mode, by_backend in modes.items()
              if by_backend.get("dcp_triton") and by_backend.get("flash_attn")]
    if not ratios:
        return None, "no load ran with both dcp-triton and FLASH_ATTN"
    value, where = min(ratios)
    return _ratio(value), where


def fp8_decode(result: dict) -> tuple[float | None, str | None]:
    """fp8 over bf16 decode time (CUDA graphs), worst over the rows at batch >= 8 and context >= 8K and both pages."""
    ratios = [(row[f"fp8{page}_graph_ms"] / row[f"bf16{page}_graph_ms"],
               f"batch {row['batch']} x {row['ctx']}, {row['q_heads']} Q / {row['kv_heads']} KV, "
               f"{'64' if page else '16'}-token pages")
              for row in result.get("decode_fp8", []) for page in PAGES
              if row["batch"] >= FP8_DECODE_MIN_BATCH and row["ctx"] >= FP8_DECODE_MIN_CTX
              and row.get(f"fp8{page}_graph_ms") and row.get(f"bf16{page}_graph_ms")]
    if not ratios:
        return None, f"no decode_fp8 row at batch >= {FP8_DECODE_MIN_BATCH} and context >= {FP8_DECODE_MIN_CTX}"
    value, where = max(ratios)
    return _ratio(value), where


def prefill(result: dict) -> tuple[float | None, str | None]:
    """FA3's prefill time over ours (CUDA graphs): above 1 dcp-triton is faster; the worst shape."""
    ratios = [(row["fa3_graph_ms"] / row["ours_graph_ms"],
               f"{row['num_seqs']} x {row['seq_len']}, {row['q_heads']} Q / {row['kv_heads']} KV, D {row['head_dim']}")
              for row in result.get("prefill", []) if row.get("fa3_graph_ms") and row.get("ours_graph_ms")]
    if not ratios:
        return None, "no prefill row timed FA3 (its peer was not installed)"
    value, where = min(ratios)
    return _ratio(value), where


def cold_start(result: dict) -> tuple[float | None, str | None]:
    """dcp-triton's cold start-up over FLASH_ATTN's (the start-up jobs of one run), the worse mode."""
    seconds = result["summary"].get("startup_s", {})
    ratios = [(seconds[f"dcp-triton-{mode}-cold"] / seconds[f"FLASH_ATTN-{mode}-cold"], mode) for mode in MODES
              if seconds.get(f"dcp-triton-{mode}-cold") and seconds.get(f"FLASH_ATTN-{mode}-cold")]
    if not ratios:
        return None, "no cold start-up of both dcp-triton and FLASH_ATTN (vllm_one_h200.py --startup)"
    value, where = max(ratios)
    return _ratio(value), where


def oneshot(result: dict) -> tuple[float | None, str | None]:
    """bench_oneshot's own worst ratio (it times FA3's function beside ours)."""
    value = result["summary"].get("oneshot_call_ratio_max")
    return (None, "FA3's function was not timed beside it") if value is None else (_ratio(value), None)


# summary key -> (results file stem without the GPU tag, how to read it)
METRICS = {
    "vllm_fp8_ratio_min": ("vllm_one_{gpu}_fp8", vllm_fp8),
    "fp8_decode_time_ratio_max": ("kernels_{gpu}", fp8_decode),
    "prefill_ratio_min": ("kernels_{gpu}", prefill),
    "cold_start_ratio_max": ("vllm_one_{gpu}_startup", cold_start),
    "oneshot_call_ratio_max": ("kernels_oneshot_{gpu}", oneshot),
}


def combine(gpu: str, results_dir: Path = common.RESULTS) -> Path:
    """``parity_<gpu>.json``: ``summary`` (the five numbers and ``gpu``), ``sources`` (file and row of each),
    ``missing`` (why a number is null); its provenance is each source file's."""
    summary: dict = {}
    sources: dict = {}
    missing: dict = {}
    origin: dict = {}
    card = None
    for key, (stem, read) in METRICS.items():
        path = results_dir / f"{stem.format(gpu=gpu)}.json"
        if not path.exists():
            summary[key], missing[key] = None, f"{path.name} does not exist"
            continue
        result = json.loads(path.read_text())
        card = card or result.get("gpu") or result.get("summary", {}).get("gpu")
        origin[path.name] = result.get("provenance")
        summary[key], where = read(result)
        if summary[key] is None:
            missing[key] = f"{path.name}: {where}"
        else:
            sources[key] = path.name + (f": {where}" if where else "")
    summary["gpu"] = card or gpu
    return common.save(f"parity_{gpu}", dict(summary=summary, sources=sources, missing=missing),
                       results_dir=results_dir, origin=origin)


if __name__ == "__main__":
    common.summarise_by_gpu(__doc__, combine)
