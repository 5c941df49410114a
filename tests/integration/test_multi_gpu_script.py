"""benchmarks/dcp/multi_gpu_dcp.py, the multi-GPU DCP benchmark, run the way a GPU machine runs it (torchrun), on two
gloo ranks with the torch reference kernels and tiny shapes: every correctness case passes against float64
attention, the timing rows and the JSON come out, and a wrong kernel output makes the script exit non-zero."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import common
from benchmarks.dcp import multi_gpu_checks as checks

MODULE = "benchmarks.dcp.multi_gpu_dcp"
TINY = ["--backend", "gloo", "--kernels", "reference", "--contexts", "16,40", "--batches", "1,3"]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

# Wraps the script and scales every prefix_attention output by 1.001: far outside float32's tolerance.
FAULTY_WRAPPER = """
from benchmarks.dcp import multi_gpu_dcp
from dcp_plugin.kernels import reference
exact = reference.prefix_attention
def off_by_a_little(*args, **kwargs):
    out, lse = exact(*args, **kwargs)
    out.mul_(1.001)
    return out, lse
reference.prefix_attention = off_by_a_little
multi_gpu_dcp.main()
"""


def torchrun(*target: str, cwd) -> subprocess.CompletedProcess:
    """``torchrun --standalone --nproc-per-node 2 TARGET`` in ``cwd`` (``-m MODULE ARGS`` as scripts/device runs it,
    or a script's path), ``benchmarks`` importable there as in any job of the benchmarks (``common.child_env``)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *target]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, cwd=cwd, env=common.child_env())


def test_two_gloo_ranks_pass_every_case_and_write_the_json(tmp_path):
    before = set(common.RESULTS.glob("*"))
    result = torchrun("-m", MODULE, *TINY, "--results-dir", str(tmp_path), "--out", "cpu_run", cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert set(common.RESULTS.glob("*")) == before, "the CPU run must not write into benchmarks/results"
    report = json.loads((tmp_path / "cpu_run.json").read_text())
    assert (report["world_size"], report["backend"], report["kernels"], report["dtype"]) == (
        2, "gloo", "reference", "float32")
    assert report["env"] == NO_MULTICAST, "the ranks must run with NVLink multicast off"
    assert report["passed"] is True

    expected = {case.name(2) for case in checks.all_cases(2)}
    assert len(expected) == 12  # DCP 2 x {tp, group} x {ag_rs, a2a} x {decode, prefill, decode-graph}
    got = {entry["case"]: entry for entry in report["correctness"]}
    assert set(got) == expected
    for name, entry in got.items():
        assert entry["passed"] and entry["nan_count"] == 0, entry
        assert 0 < entry["max_rel_err"] and entry["max_abs_err"] < 2e-5, entry  # float32 tolerance, not exact 0
        assert entry["tol_ratio"] <= 1.0, entry
        assert entry["steps"] == {"prefill": 2, "decode": 1, "decode-graph": checks.GRAPH_STEPS}[entry["kind"]], entry

    rows = report["timing"]["rows"]
    configs = {(1, "none"), (2, "ag_rs"), (2, "a2a")}
    assert {(r["ctx"], r["batch"], r["dcp"], r["comm"]) for r in rows} == {
        (ctx, batch, *config) for ctx in (16, 40) for batch in (1, 3) for config in configs}
    for row in rows:
        assert row["step_ms"] > 0 and row["timer"] == "events", row
        assert (row["coll_ms"] > 0) == (row["dcp"] > 1), row
        assert row["coll_share"] == pytest.approx(row["coll_ms"] / row["step_ms"]), row
        assert row["speedup_vs_dcp1"] > 0, row
    crossover = {(c["dcp"], c["comm"], c["batch"]) for c in report["timing"]["crossover"]}
    assert crossover == {(2, comm, batch) for comm in ("ag_rs", "a2a") for batch in (1, 3)}


def test_wrong_attention_output_exits_nonzero(tmp_path):
    wrapper = tmp_path / "faulty.py"
    wrapper.write_text(FAULTY_WRAPPER)
    result = torchrun(str(wrapper), *TINY, "--results-dir", str(tmp_path), "--out", "faulty", cwd=tmp_path)
    assert result.returncode != 0, result.stdout[-3000:]
    assert "CORRECTNESS FAILED" in result.stdout, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "faulty.json").read_text())
    assert report["passed"] is False
    assert len(report["correctness"]) == 12 and not any(entry["passed"] for entry in report["correctness"])
    assert report["timing"]["rows"] == [] and report["timing"]["skipped"] == "correctness failed"


def test_compare_flags_errors_and_nan():
    want = torch.randn(5, 4, 8, dtype=torch.float64)
    exact = checks.compare(want.to(torch.bfloat16), want, torch.bfloat16)
    assert exact["passed"] and exact["tol_ratio"] < 1 and exact["nan_count"] == 0
    off = want.clone()
    off[2, 1, 3] += 0.5
    wrong = checks.compare(off.to(torch.float32), want, torch.float32)
    assert not wrong["passed"] and wrong["max_abs_err"] == pytest.approx(0.5, rel=1e-6) and wrong["tol_ratio"] > 1
    poisoned = want.clone()
    poisoned[0, 0, 0] = float("nan")
    nan = checks.compare(poisoned, want, torch.float32)
    assert not nan["passed"] and nan["nan_count"] == 1


def test_dcp_splits_and_heads():
    assert checks.dcp_splits(2) == [2]
    assert checks.dcp_splits(4) == [4, 2]
    assert checks.dcp_splits(8) == [8, 4, 2]
    assert len(checks.all_cases(8)) == 3 * 12  # DCP splits x layouts x comms x kinds
    assert checks.model_heads("tp", 8, 2, 8) == (64, 4)  # one KV head per DCP group of 2
    assert checks.model_heads("replicated", 8, 4, 8) == (64, 2)
