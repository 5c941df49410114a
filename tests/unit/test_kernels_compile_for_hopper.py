"""Every kernel variant a serving engine runs compiles for an H100/H200 (sm_90) with Triton's own compiler, on this
machine without a GPU (scripts/compile_for_hopper.py), without spilling registers to local memory, with tensor-core
work and no byte-wide shared loads in its KV-tile loop. The interpreter runs the
kernels' Python; only this catches what the GPU compiler alone rejects."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
KERNELS = {"write_kv_cache_kernel", "chunk_attention_kernel", "prefix_attention_kernel",
           "split_merge_kernel", "merge_kernel", "widen_pages_kernel"}


def test_every_serving_variant_compiles_for_sm90_without_spills(tmp_path):
    pytest.importorskip("triton.backends.nvidia")
    report = tmp_path / "variants.json"
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "cache")}
    done = subprocess.run([sys.executable, "-m", "scripts.compile_for_hopper", "--json", str(report)], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(report.read_text())["variants"]
    import triton

    from dcp_plugin.kernels._gluon import GLUON_TRITON

    gluon = {"gluon_prefix_kernel", "gluon_chunk_kernel"} if triton.__version__.startswith(GLUON_TRITON) else set()
    assert {row["kernel"] for row in rows} == KERNELS | gluon
    decode = [r for r in rows if r["kernel"] == "prefix_attention_kernel" and r["constants"].get("DECODE") == "True"]
    prefix = [r for r in rows if r["kernel"] == "prefix_attention_kernel" and r["constants"].get("DECODE") == "False"]
    assert decode and prefix, "the decode and the prefix variants of prefix attention were not both compiled"
    merges = {r["constants"]["BLOCK_S"] for r in rows if r["kernel"] == "split_merge_kernel"}
    assert merges == {"8", "64"}, f"the split merge's narrow and wide variants were not both compiled: {merges}"
    descriptors = {r["kernel"] for r in rows if r["constants"].get("USE_TMA") == "True"}
    assert {"chunk_attention_kernel", "prefix_attention_kernel"} <= descriptors, \
        "the Hopper selections (tensor descriptors) were not compiled"
    # A decode step's kernels take programmatic dependent launches on sm_90 (kernels/_pdl.py): each such variant is
    # compiled for one and waits for the previous kernel before its first load; the others neither.
    pdl_kernels = {"write_kv_cache_kernel", "prefix_attention_kernel", "split_merge_kernel",
                   "gluon_decode_kernel"}
    assert all(r.get("launch_pdl") is True and r["pdl_wait"] for r in rows if r["kernel"] in pdl_kernels)
    assert not [r for r in rows if r["kernel"] not in pdl_kernels and (r.get("launch_pdl") or r["pdl_wait"])]
    spilled = [r for r in rows if r.get("local_bytes", 0)]
    assert not spilled, f"register spills: {spilled}"
    assert all("registers" in r for r in rows), "cuobjdump reported no resource usage"
    # The attention kernels' KV-tile loop, from the SASS: tensor-core work in every variant, and over a cache in the
    # model dtype no byte-wide shared-memory loads (what an fp8 cache's V costs: its tiles are read along tokens).
    attention = [r for r in rows if r["kernel"] in ("chunk_attention_kernel", "prefix_attention_kernel")]
    assert all(r["main_loop"].get("mma", 0) > 0 for r in attention), [r for r in attention if not r["main_loop"]]
    # The current chunk's products come from warpgroup MMAs, whose results its loop waits for; the barrier count is
    # reported, not judged (it depends on the compiler).
    chunk = [r for r in attention if r["kernel"] == "chunk_attention_kernel"]
    assert chunk and all(r["main_loop"]["mma_waits"] > 0 for r in chunk)
    assert all(isinstance(r["main_loop"]["cta_barriers"], int) for r in attention)
    plain = [r for r in attention if r["constants"].get("KV_FP8") != "True"]
    assert plain and not [r for r in plain if r["main_loop"]["shared_byte_loads"] or r["main_loop"]["fp8_converts"]]
    # An fp8 cache widens to fp16 before its tiles' shared-memory round trip (``_prefix_tile.widen_fp8``): no byte-wide
    # loads either, e4m3 through the hardware's conversion, e5m2 by moving its bytes.
    fp8 = [r for r in attention if r["constants"].get("KV_FP8") == "True"]
    assert fp8 and not [r for r in fp8 if r["main_loop"]["shared_byte_loads"]], fp8
    e4m3 = [r for r in fp8 if r["kv_cache"] == "*fp8e4nv" and r["constants"].get("FP8_DOT") in (None, "0")]
    assert e4m3 and all(r["main_loop"]["fp8_converts"] > 0 for r in e4m3)
    # With DCP_TRITON_FP8_DOT the prefix pass's products run in fp8 (1: Q x K, 2: P x V too), in no more MMA
    # instructions per tile loop than the same tiles' 16-bit products (fp8 MMAs take twice the K per instruction);
    # decode keeps its 16-bit products.
    dots = {}
    for r in attention:
        c = r["constants"]
        if r["kernel"] == "prefix_attention_kernel" and r["kv_cache"] == "*fp8e4nv" and c["DECODE"] == "False":
            tiles = tuple(c[k] for k in ("PAGE_SIZE", "USE_TMA", "BLOCK_Q", "BLOCK_H", "BLOCK_N"))
            dots.setdefault(tiles, {})[c["FP8_DOT"]] = r["main_loop"]["mma"]
    assert dots and all(set(d) == {"0", "1", "2"} and d["2"] <= d["1"] < d["0"] for d in dots.values()), dots
    assert not [r for r in attention if r["constants"].get("DECODE") == "True" and r["constants"].get("FP8_DOT")
                not in (None, "0")]
