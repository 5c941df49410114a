"""A load model of the persistent Gluon current chunk (``dcp_plugin.kernels.gluon_chunk``): how evenly each way of
dealing its tiles (``ORDER``) spreads causal work over the programs, against the H200 probe's measurements.

A tile (a 128-row query block of one request and Q head) costs its key tiles (block m of a request reads m + 1 tiles
of 128 keys) plus ``OVERHEAD`` (its Q load, output store and pipeline fill, in key tiles); with ``PAIRS`` a tile is
blocks j and n - 1 - j of one request. Tiles are enumerated as the kernel does (flat programs from the last, every
head of one before the next) and dealt to ``PROGRAMS`` programs round-robin (``ROUND_ROBIN``), in rounds of
alternating direction (``SNAKE``), as pairs round-robin (``PAIRS``), or each to the least loaded program (on demand,
which no shipped order does). The figure per order is the mean load over the largest: 1.0 would keep every SM busy
to the end. No GPU: it prints and saves ``benchmarks/results/gluon_chunk_order_model_h200.json``, with the probe's
measured SNAKE / round-robin ratio beside the model's where ``kernels_h200_gluon_probe.json`` has both.

    python -m benchmarks.probes.tile_order_model
"""

from __future__ import annotations

import heapq
import json
import math

from benchmarks.common import RESULTS, save

SHAPES = [(16, 1024), (4, 2048), (2, 4096), (1, 16384)]  # the probe's (sequences, length), 32 Q heads
HEADS, BLOCK, PROGRAMS, OVERHEAD = 32, 128, 132, 0.3  # H200: 132 SMs, one program each


def tiles(seqs: int, length: int, pairs: bool) -> list[float]:
    """Tile costs in the kernel's order (``gluon_chunk._tile``): flat program ids from the last, every head of one
    before the next. Request b owns ids ``first(b) = query_start // rows + b`` onward (rows: 128, or 256 for pairs),
    one more than its blocks need at most; a spare id is a tile that does nothing (cost 0) but still takes its turn."""
    rows = 2 * BLOCK if pairs else BLOCK
    n = math.ceil(length / BLOCK)
    owner = {}
    for b in range(seqs):
        first = b * length // rows + b
        for j in range(math.ceil(length / rows) + 1):
            owner.setdefault(first + j, j)
    out = []
    for pid in reversed(range(seqs * length // rows + seqs)):
        j = owner.get(pid, n)  # past a request's blocks: nothing
        if pairs:
            cost = (j + 1 + OVERHEAD if 2 * j < n else 0.0) + (n - j + OVERHEAD if n - 1 - j > j else 0.0)
        else:
            cost = j + 1 + OVERHEAD if j < n else 0.0
        out += [cost] * HEADS
    return out


def balance(costs: list[float], order: str) -> float:
    """Mean program load over the largest, ``costs`` dealt to ``PROGRAMS`` programs as ``order`` says."""
    load = [0.0] * PROGRAMS
    if order == "on_demand":
        heap = [(0.0, p) for p in range(PROGRAMS)]
        for cost in costs:
            total, p = heapq.heappop(heap)
            heapq.heappush(heap, (total + cost, p))
        load = [total for total, _ in heap]
    else:
        for t, cost in enumerate(costs):
            k, p = divmod(t, PROGRAMS)
            load[PROGRAMS - 1 - p if order == "snake" and k % 2 else p] += cost
    return sum(load) / len(load) / max(load)


def measured_snake_over_round_robin() -> dict:
    """The probe's last run holding both ``("chunk", 0)`` and ``("chunk", 1)``: SNAKE's TFLOP/s over round-robin's
    per shape (``{}`` without such a run)."""
    path = RESULTS / "kernels_h200_gluon_probe.json"
    if not path.exists():
        return {}
    for run in reversed(json.loads(path.read_text())["runs"]):
        timing = {tuple(c["config"]): c.get("timing") for c in run["configs"] if c["config"][0] == "chunk"}
        if timing.get(("chunk", 0)) and timing.get(("chunk", 1)):
            return {f"{r0['num_seqs']}x{r0['seq_len']}": r1["gluon_tflops"] / r0["gluon_tflops"]
                    for r0, r1 in zip(timing[("chunk", 0)], timing[("chunk", 1)])}
    return {}


def main() -> None:
    measured = measured_snake_over_round_robin()
    rows = []
    for seqs, length in SHAPES:
        row = dict(shape=f"{seqs}x{length}", round_robin=balance(tiles(seqs, length, False), "round_robin"),
                   snake=balance(tiles(seqs, length, False), "snake"),
                   pairs=balance(tiles(seqs, length, True), "round_robin"),
                   on_demand=balance(tiles(seqs, length, False), "on_demand"))
        row["model_snake_over_round_robin"] = row["snake"] / row["round_robin"]
        row["measured_snake_over_round_robin"] = measured.get(row["shape"])
        rows.append(row)
        print(" ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    path = save("gluon_chunk_order_model_h200", dict(programs=PROGRAMS, heads=HEADS, block=BLOCK, overhead=OVERHEAD,
                                                rows=rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
