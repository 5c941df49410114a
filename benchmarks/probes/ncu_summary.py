"""What Nsight Compute measured of ``ncu_attention.py``'s launches, one record per kernel: reads the report's
``--page raw --csv`` export (plain or .gz; with ``--details``, the ``--page details --csv`` export too, for ncu's
own hints) and writes a compact JSON. Each kernel gets the label of the call that launched it (``chunk_tl``,
``chunk_gluon``, ``chunk_gluon_persistent``, ``chunk_fa3``, ``prefix_ours``, ``prefix_fa3``, ``prefix_gluon`` or
``prefix_tl``, ``decode_ours``, ``decode_fa3``; FA3's scheduler and combine, our merge under their call), found
from the kernel names in launch order and printed for a reader to check; then what explains speed: duration, SM
and tensor-pipe use, occupancy and its limits, DRAM and L2 throughput, issue rate, local memory, shared-memory
conflicts and the warp stalls (cycles per issued instruction by reason, each one's share, the sampled shares).

    ncu --import OUT/attention.ncu-rep --page raw --csv > attention_raw.csv
    python -m benchmarks.probes.ncu_summary benchmarks/results/ncu_attention_h200_raw.csv.gz \\
        --details benchmarks/results/ncu_attention_h200_details.csv.gz --commit 3560296   # standard library only
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FA3 = "FlashAttnFwdSm90"
CHUNK = [("chunk_tl", "extend_attention_kernel"), ("chunk_gluon", "chunk_attention_kernel"),
         ("chunk_gluon_persistent", "chunk_attention_persistent_kernel"), ("chunk_fa3", FA3)]
DECODE = [("decode_ours", "paged_attention_kernel"), ("decode_fa3", FA3)]
# ncu_attention.py's calls in launch order, (label, the call's main kernel): at 3560296 the prefix pass's Gluon
# prototype beside the shipped tl kernel; since the Gluon kernels ship, the shipped persistent chunk in the
# prototype's place, and beside the prefix pass dcp-triton runs (gluon_prefix with DCP_TRITON_GLUON=1) its tl kernel
ORDERS = {"3560296": [*CHUNK, ("prefix_ours", "paged_attention_kernel"), ("prefix_fa3", FA3),
                      ("prefix_gluon", "prefix_attention_kernel"), *DECODE],
          "gluon_prefix": [*CHUNK[:2], ("chunk_gluon_persistent", "gluon_chunk_kernel"), CHUNK[3],
                           ("prefix_ours", "gluon_prefix_kernel"), ("prefix_fa3", FA3),
                           ("prefix_tl", "paged_attention_kernel"), *DECODE]}
# helper kernels: (name, role, +1: belongs to the next main kernel's call, -1: to the previous one's, 0: to none;
# the fill is a torch fill_ between prefix_fa3 and prefix_gluon whose call was not traced)
HELPERS = [("prepare_varlen_num_blocks", "scheduler", +1), ("paged_attention_reduce_kernel", "merge", -1),
           ("FlashAttnFwdCombine", "combine", -1), ("FillFunctor", "fill", 0)]
METRICS = {  # key in the JSON: raw metric name
    "duration_us": "gpu__time_duration.sum", "sm_clock_ghz": "sm__cycles_elapsed.avg.per_second",
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "tensor_pipe_active_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    "tensor_pipe_elapsed_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_elapsed",
    "wgmma_instructions": "smsp__sass_inst_executed_op_shared_gmma.sum",
    "achieved_occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
    "theoretical_occupancy_pct": "sm__maximum_warps_per_active_cycle_pct",
    "registers_per_thread": "launch__registers_per_thread", "shared_mem_per_block_kb": "launch__shared_mem_per_block",
    "block_size": "launch__block_size", "grid_size": "launch__grid_size", "waves": "launch__waves_per_multiprocessor",
    "dram_pct": "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", "dram_read_mb": "dram__bytes_read.sum",
    "dram_write_mb": "dram__bytes_write.sum", "l2_pct": "lts__throughput.avg.pct_of_peak_sustained_elapsed",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct", "l1_pct": "l1tex__throughput.avg.pct_of_peak_sustained_active",
    "issue_active_pct": "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "ipc": "sm__inst_executed.avg.per_cycle_active", "instructions_issued": "smsp__inst_issued.sum",
    "eligible_warps": "smsp__warps_eligible.avg.per_cycle_active",
    "active_warps_per_scheduler": "smsp__warps_active.avg.per_cycle_active",
    "cycles_per_issue": "smsp__average_warp_latency_per_inst_issued.ratio",
    "local_memory_requests": "derived__local_spilling_requests",
    "shared_bank_conflicts": "l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum",
    "shared_excess_wavefronts": "derived__memory_l1_wavefronts_shared_excessive",
}
SCALE = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6, "byte": 1e-6, "Kbyte": 1e-3, "Mbyte": 1.0, "Gbyte": 1e3,
         "byte/block": 1e-3, "Kbyte/block": 1.0}  # to us, MB and KB a block
STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+)_per_issue_active\.ratio")
SAMPLED = re.compile(r"smsp__pcsamp_warps_issue_stalled_(\w+)")
SOURCE = {
    "commands": [("cd /tmp && PYTHONPATH=/tmp/dcp:/tmp/fa3peer:$OLDPWD ncu --clock-control none --profile-from-start "
                  "off --set full -o $OUT/attention -f python3 -m benchmarks.probes.ncu_attention"),
                 "ncu --import OUT/attention.ncu-rep --page raw --csv > attention_raw.csv",
                 "ncu --import OUT/attention.ncu-rep --page details --csv > attention_details.csv"],
    "software": "Triton 3.6, torch 2.11, FA3 from vLLM 0.26's wheel",
    "calls": {"chunk_*": "current chunk, 2 x 4096 causal, 32 Q / 8 KV, D 128, bf16; Gluon configs (128, 2, 0, 0, 0) "
                         "and persistent (128, 2, 0, 0, 1)",
              "prefix_*": "prefix pass, 2 x 4096 rows over 32K cached tokens each, 64-token pages, non-causal; "
                          "Gluon with two pages a key tile, two stages",
              "decode_*": "decode, 128 requests x 8K, 32 Q / 1 KV, 64-token pages; ours: split pass + merge"},
    "note": "one launch per kernel, after a warm-up outside the profiled range; --clock-control none: the GPU's own "
            "clocks (sm_clock_ghz), no locked base clock; ncu replays each kernel over several passes, so durations "
            "are of single profiled launches, not the benchmarks' timings; at 3560296 a torch int32 fill_ ran "
            "between prefix_fa3 and prefix_gluon, not attributed to a call",
}


def read_csv(path: Path) -> list[list[str]]:
    raw = path.read_bytes()
    text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
    return list(csv.reader(io.StringIO(text)))


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def labels(names: list[str], calls: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(call label, role) per kernel: main kernels take the next of ``calls`` whose name they hold (a call that did
    not run is skipped), helpers the call before or after them."""
    out, nxt = [], 0
    for name in names:
        helper = next((h for h in HELPERS if h[0] in name), None)
        if helper:  # its direction for now: the call is known once every main kernel is
            out.append((helper[2], helper[1]))
            continue
        hit = next((i for i in range(nxt, len(calls)) if calls[i][1] in name), None)
        out.append((calls[hit][0], "main") if hit is not None else ("unknown", "main"))
        nxt = hit + 1 if hit is not None else nxt
    mains = [i for i, (_, role) in enumerate(out) if role == "main"]
    for i, (where, role) in enumerate(out):
        if isinstance(where, int):
            near = [m for m in mains if (m > i if where > 0 else m < i)] if where else []
            out[i] = (out[near[0] if where > 0 else near[-1]][0] if near else "unattributed", role)
    return out


def stalls(row: dict[str, str]) -> dict:
    """Warp states per issued instruction (ncu's warp state statistics; ``selected`` is the issuing cycle itself),
    each state's share of all warp cycles, and the shares of the PC samples."""
    per_issue = {m[1]: number(v) or 0.0 for k, v in row.items() if (m := STALL.fullmatch(k))}
    sampled = {m[1]: number(v) or 0.0 for k, v in row.items()
               if (m := SAMPLED.fullmatch(k)) and not k.endswith("_not_issued")}
    total, samples = sum(per_issue.values()) or 1.0, sum(sampled.values()) or 1.0
    top = sorted((r for r in per_issue if r != "selected"), key=per_issue.get, reverse=True)[:5]
    return {"top": [f"{r} {per_issue[r]:.2f} ({100 * per_issue[r] / total:.0f}%)" for r in top],
            "cycles_per_issue": {r: round(v, 3) for r, v in per_issue.items() if v >= 0.005},
            "share_pct": {r: round(100 * v / total, 1) for r, v in per_issue.items() if v / total >= 0.005},
            "sampled_share_pct": {r: round(100 * v / samples, 1) for r, v in sampled.items() if v / samples >= 0.005}}


def hints(details: list[list[str]]) -> dict[str, list[dict]]:
    """ncu's optimisation hints (rules of type OPT with an estimated speedup) per kernel ID, largest first."""
    head, found = details[0], {}
    for row in details[1:]:
        rec = dict(zip(head, row))
        speedup = number(rec.get("Estimated Speedup", ""))
        if rec.get("Rule Type") == "OPT" and speedup:
            text = rec["Rule Description"].split(". ")[0][:220]
            found.setdefault(rec["ID"], []).append({"rule": rec["Rule Name"], "est_speedup_pct": speedup,
                                                    "text": text})
    return {k: sorted(v, key=lambda h: -h["est_speedup_pct"])[:5] for k, v in found.items()}


def summarise(raw: list[list[str]], details: list[list[str]] | None) -> tuple[str, list[dict]]:
    """The launch order that labels the most kernels, and one record per kernel."""
    head, units = raw[0], dict(zip(raw[0], raw[1]))
    rows = [dict(zip(head, r)) for r in raw[2:] if r and r[0].strip().isdigit()]
    names, found, kernels = [r["Kernel Name"] for r in rows], hints(details) if details else {}, []
    order = min(ORDERS, key=lambda o: sum(label == "unknown" for label, _ in labels(names, ORDERS[o])))
    for row, (label, role) in zip(rows, labels(names, ORDERS[order])):
        rec = {"id": int(row["ID"]), "label": label, "role": role, "kernel": row["Kernel Name"][:120],
               "grid": row["Grid Size"], "block": row["Block Size"]}
        for key, name in METRICS.items():
            value = number(row.get(name, ""))
            if value is not None:
                value = round(value * SCALE.get(units.get(name, ""), 1.0), 4)
                rec[key] = int(value) if value.is_integer() else value
        limits = {k.removeprefix("launch__occupancy_limit_"): int(number(v)) for k, v in row.items()
                  if k.startswith("launch__occupancy_limit_") and number(v) is not None}
        rec["blocks_per_sm"] = min(limits.values()) if limits else None
        rec["blocks_per_sm_limited_by"] = sorted(k for k, v in limits.items() if v == rec["blocks_per_sm"])
        if "dram_read_mb" in rec and rec.get("duration_us"):
            rec["dram_tbs"] = round((rec["dram_read_mb"] + rec.get("dram_write_mb", 0.0)) / rec["duration_us"], 3)
        if (active := number(row.get("sm__cycles_active.avg", ""))) and (elapsed := number(
                row.get("sm__cycles_elapsed.avg", ""))):
            rec["sm_busy_pct"] = round(100 * active / elapsed, 1)  # two replay passes: +-1%
        rec["stalls"] = stalls(row)
        if row["ID"] in found:
            rec["ncu_hints"] = found[row["ID"]]
        kernels.append(rec)
    return order, kernels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("raw", type=Path, help="ncu --page raw --csv export (.csv or .csv.gz)")
    parser.add_argument("--details", type=Path, help="ncu --page details --csv export, for ncu's hints")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "ncu_attention_h200.json")
    parser.add_argument("--commit", help="the commit whose code ran under ncu")
    args = parser.parse_args()
    raw = read_csv(args.raw)
    order, kernels = summarise(raw, read_csv(args.details) if args.details else None)
    calls: dict[str, dict] = {}
    for k in kernels:
        call = calls.setdefault(k["label"], {"kernels": [], "duration_us": 0.0})
        call["kernels"].append(k["id"])
        call["duration_us"] = round(call["duration_us"] + k.get("duration_us", 0.0), 2)
    inputs = [p.resolve() for p in (args.raw, args.details) if p]
    source = {**SOURCE, "gpu": dict(zip(raw[0], raw[2])).get("device__attribute_display_name"), "commit": args.commit,
              "order": order, "inputs": [str(p.relative_to(REPO) if p.is_relative_to(REPO) else p) for p in inputs]}
    args.out.write_text(json.dumps({"source": source, "metrics": METRICS, "calls": calls, "kernels": kernels},
                                   indent=1) + "\n")
    for k in kernels:
        print(f"{k['id']:3d} {k['label']:24s} {k['role']:10s} {k.get('duration_us', 0):9.1f} us  {k['kernel'][:60]}")
    print(f"launch order {order}; wrote {args.out}")


if __name__ == "__main__":
    main()
