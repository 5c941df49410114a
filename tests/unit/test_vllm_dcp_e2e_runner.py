"""benchmarks/vllm_e2e/vllm_dcp_e2e.py's runner end to end on CPU: the real engine script (vllm_e2e_engine.py) over a
stand-in ``vllm`` module, with GPU slots, exclusive two-GPU jobs, the summary and host-overhead merge, mirroring, and
resuming from the tarball on a cold machine; the plan's scheduling and the tarball's safety."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
import textwrap
import time

import pytest

from benchmarks import common
from benchmarks.vllm_e2e import e2e_runner as runner
from benchmarks.vllm_e2e import vllm_dcp_e2e as dcp
from benchmarks.vllm_e2e import vllm_dcp_report as dcp_report


def test_simulate_keeps_two_gpu_jobs_alone_and_pairs_one_gpu_jobs():
    def job(name, gpus, est, exclusive=False):
        return runner.Job(name, {"kind": "engine"}, 99, ["b"], exclusive=exclusive, gpus=gpus, estimate_s=est)

    jobs = [runner.Job("b", {"kind": "build"}, 9, estimate_s=10), job("x", 2, 100, True), job("y", 1, 50),
            job("z", 1, 30), job("w", 1, 40), job("big", 4, 10, True)]
    times = runner.simulate(jobs, gpus=2, parallel=2, done=set())
    assert times["x"] == (10, 110) and times["y"] == (110, 160) and times["z"] == (110, 140)
    assert times["w"] == (140, 180) and times["big"] is None
    assert runner.simulate(jobs, gpus=2, parallel=2, done={"b", "x"})["y"] == (0, 50)


def test_unpack_restores_only_missing_files_inside_the_folders(tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "a.json.gz").write_bytes(b"new")
    pack = runner.write_pack(tmp_path / "p.tar.gz", {"raw": tmp_path / "raw", "logs": tmp_path / "none"})
    with tarfile.open(pack, "r:gz") as tar:
        assert tar.getnames() == ["raw/a.json.gz"]
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        for name in ("raw/../escape", "logs/ok.log", "other/x"):
            (tmp_path / "src").write_text(name)
            tar.add(tmp_path / "src", arcname=name)
    target = {"raw": tmp_path / "r2", "logs": tmp_path / "l2"}
    assert runner.unpack(evil, target) == 1 and (tmp_path / "l2" / "ok.log").read_text() == "logs/ok.log"
    assert not (tmp_path / "escape").exists() and not (tmp_path / "r2").exists()


FAKE_VLLM = '''
"""A stand-in for vllm: LLM(**kwargs) logs what vLLM would, generate() answers deterministically."""
import json, os, time
from types import SimpleNamespace

__version__ = "0.26.0-fake"
SamplingParams = lambda **kw: SimpleNamespace(**kw)
Logprob = lambda lp, rank: SimpleNamespace(logprob=lp, rank=rank)


class LLM:
    def __init__(self, **kw):
        self.kw, self.began, self.max_len = kw, time.time(), 0
        dcp, backend = kw["decode_context_parallel_size"], kw["attention_backend"]
        if backend == "dcp-triton":
            print(f"INFO dcp-triton attention: backend=DCP_TRITON dcp_size={dcp} dcp_rank=0 "
                  f"comm={kw.get('dcp_comm_backend', 'ag_rs')} kernels=triton cpu_attn_routed=no", flush=True)
        else:
            print(f"INFO Using AttentionBackendEnum.{backend} backend.", flush=True)
        print(f"INFO GPU KV cache size: {kw['kv_cache_memory_bytes'] // 2048 * dcp:,} tokens", flush=True)
        time.sleep(0.3)
        shift = {"ag_rs": 1e-6, "a2a": 3e-6}.get(kw.get("dcp_comm_backend"), 0) if backend == "dcp-triton" else 0
        self.shift = shift if kw["decode_context_parallel_size"] > 1 else 0
        self.llm_engine = SimpleNamespace(engine_core=SimpleNamespace(shutdown=self.shutdown))

    def shutdown(self):
        with open(os.environ["FAKE_TRACE"], "a") as f:
            f.write(json.dumps({"tp": self.kw["tensor_parallel_size"], "gpus": os.environ["CUDA_VISIBLE_DEVICES"],
                                "nvls": os.environ.get("NCCL_NVLS_ENABLE"), "began": self.began,
                                "ended": time.time()}) + "\\n")

    def generate(self, prompts, params, use_tqdm=False):
        longest = max(len(p["prompt_token_ids"]) for p in prompts)
        if self.kw.get("jit_monitor_verbose") and longest > self.max_len > 0:
            print("WARNING Triton kernel JIT compilation during inference: chunk_attention_kernel (constexprs={}). "
                  "This causes a latency spike", flush=True)
        self.max_len = max(self.max_len, longest)
        return [self._one(p["prompt_token_ids"], params) for p in prompts]

    def _one(self, prompt, params):
        tokens = [(prompt[-1] + i) % 97 + 3 for i in range(params.max_tokens)]
        plp = None
        if getattr(params, "prompt_logprobs", None):
            plp = [None] + [{t: Logprob(-1.0 - (t % 7) / 10 + self.shift, 1)} for t in prompt[1:]]
        steps = [{t: Logprob(-0.5, 1), t + 1: Logprob(-1.5, 2)} for t in tokens] if getattr(params, "logprobs", None) \\
            else None
        metrics = SimpleNamespace(first_token_latency=0.02, first_token_ts=1.0, last_token_ts=1.0 + 0.001 * (
            len(tokens) - 1), num_generation_tokens=len(tokens))
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=tokens, logprobs=steps)], prompt_logprobs=plp,
                               num_cached_tokens=0, metrics=metrics)
'''

FAKE_ENGINE = '''
import json, os, sys, types
from pathlib import Path
spec = json.loads(Path(sys.argv[1]).read_text())
if spec["kind"] == "engine" and os.environ.get("FAKE_FAIL"):
    sys.exit(3)
if spec["kind"] == "build":
    Path(spec["model_dir"]).mkdir(parents=True, exist_ok=True)
    (Path(spec["model_dir"]) / "config.json").write_text(json.dumps(spec["config"]))
    print("built", flush=True)
    sys.exit(0)
sys.modules["torch"] = types.SimpleNamespace(__version__="fake", cuda=types.SimpleNamespace(is_available=lambda: False))
import fake_vllm
sys.modules["vllm"] = fake_vllm
from benchmarks.vllm_e2e import vllm_e2e_engine
vllm_e2e_engine.main()
'''


@pytest.fixture
def fake_engine(tmp_path, monkeypatch):
    (tmp_path / "fake_vllm.py").write_text(textwrap.dedent(FAKE_VLLM))
    (tmp_path / "fake_engine.py").write_text(textwrap.dedent(FAKE_ENGINE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setattr(dcp, "ENGINE_MODULE", "fake_engine")  # each job: python -m fake_engine SPEC
    monkeypatch.setattr(runner, "STAGGER_S", 0.0)
    monkeypatch.setattr(dcp, "REQUIRED_MODULES", ())
    monkeypatch.setattr(dcp, "LOG_SETTLE_S", 0.05)
    monkeypatch.setattr(dcp_report, "plot", lambda summary, meta, path: path.write_bytes(b"png"))  # tested above
    monkeypatch.setenv("FAKE_TRACE", str(tmp_path / "trace.jsonl"))
    return tmp_path / "trace.jsonl"


def test_runner_end_to_end_with_the_real_engine_script(tmp_path, fake_engine, capsys, monkeypatch):
    monkeypatch.setattr(common, "REPO", tmp_path.resolve())  # the stand-in repository root, without .git
    monkeypatch.setenv(common.COMMIT_ENV, "c0ffee")
    results, out, work = tmp_path / "results", tmp_path / "out", tmp_path / "work"
    results.mkdir()
    (results / "host_overhead_h200.json").write_text(json.dumps({"summary": {"forward_host_us_dcp2_decode": 1.5}}))
    only = ("tp2-dcp-triton-dcp2-a2a-graphs,tp2-FLASH_ATTN-dcp1-graphs,"
            "fp32-tp2-dcp-triton-dcp2-a2a,fp32-tp2-TRITON_ATTN-dcp1,tp1-*-eager,jit-tp1-dcp-triton-graphs")
    args = ["--only", only, "--gpus", "2", "--jobs", "3", "--results-dir", str(results), "--work-dir", str(work),
            "--mirror", str(out), "--name", "dcp"]
    dcp.main(args)
    saved = json.loads((results / "dcp.json").read_text())
    assert all(j["status"] == "ok" for j in saved["jobs"].values()), saved["jobs"]
    assert all(j["log"] == f"work/logs/{name}.log" for name, j in saved["jobs"].items())  # from the root
    assert saved["jobs"]["jit-tp1-dcp-triton-graphs"]["jit_after_warmup"] == ["chunk_attention_kernel"]  # read so
    assert saved["meta"]["provenance"] == {"commit": "c0ffee", "dirty": None, "triton": common.triton_version()}
    loads = saved["summary"]["loads"]
    assert loads["decode-heavy"]["dcp_triton_dcp2"] > 0 and loads["decode-heavy"]["flash_attn_dcp1"] > 0
    assert loads["decode-heavy"]["flash_attn_dcp2"] is None and loads["decode-heavy"]["dcp_triton_dcp1"] is None
    assert loads["long-context"]["flash_attn_dcp2"] is None and loads["long-context"]["dcp_triton_dcp2"] > 0
    assert loads["long-context"]["flash_attn_dcp1"] > 0
    assert saved["summary"]["fp32_max_abs_logprob_diff"] == pytest.approx(3e-6, rel=1e-3)  # a2a's shift
    row = next(r for r in saved["throughput"] if r["job"] == "tp2-dcp-triton-dcp2-a2a-graphs")
    assert row["warmup_requests"] == 64 and row["tpot_median_s"] == pytest.approx(0.001)
    kv = {r["job"]: r for r in saved["kv_capacity"]}
    assert kv["tp2-FLASH_ATTN-dcp1-graphs"]["kv_cache_tokens"] == 393216  # read back from the job's own log
    assert kv["tp2-dcp-triton-dcp2-a2a-graphs"]["holds_all_requests"] is True
    check = saved["compile_check"]["jit-tp1-dcp-triton-graphs"]
    assert [b["dcp_triton_compiles"] for b in check["batches"]] == [0, 0, 1, 1, 0]
    assert not [c for c in saved["checks"] if not c["pass"] and "JIT" not in c["name"]]
    host = json.loads((results / "host_overhead_h200.json").read_text())
    assert host["summary"]["forward_host_us_dcp2_decode"] == 1.5 and host["summary"]["vllm_dcp1"]["eager_small_batch"]
    for name in ("dcp.json", "dcp.md", "dcp_jobs.tar.gz", "host_overhead_h200.json"):
        assert (out / name).exists(), name

    trace = [json.loads(line) for line in fake_engine.read_text().splitlines()]
    assert all(t["nvls"] == "0" for t in trace)
    assert {t["gpus"] for t in trace if t["tp"] == 2} == {"0,1"} and {t["gpus"] for t in trace if t["tp"] == 1} == {
        "0", "1"}
    two = [t for t in trace if t["tp"] == 2]
    assert all(a["ended"] <= b["began"] or b["ended"] <= a["began"] for a in trace for b in two if a is not b)
    one = [t for t in trace if t["tp"] == 1]
    overlapping = [(a, b) for a in one for b in one
                   if a is not b and a["began"] < b["ended"] and b["began"] < a["ended"]]
    assert overlapping and all(a["gpus"] != b["gpus"] for a, b in overlapping)  # --jobs 3, but one job a GPU

    shutil.rmtree(work)  # a cold machine: only the tarball that travelled back
    capsys.readouterr()
    dcp.main(args)
    printed = capsys.readouterr().out
    assert printed.count("cached: ") == 8 and "start " not in printed  # nothing reran, not even the build
    assert json.loads((results / "dcp.json").read_text())["summary"] == saved["summary"]

    shutil.rmtree(work)  # summary only, from the tarball, with no engine at all
    (results / "dcp.json").unlink()
    (results / "host_overhead_h200.json").write_text(json.dumps({"summary": {"other": 2}}))
    dcp.main(["--summarise", *args[:2], *args[6:]])
    assert json.loads((results / "dcp.json").read_text())["summary"] == saved["summary"]
    host = json.loads((results / "host_overhead_h200.json").read_text())
    assert host["summary"]["other"] == 2 and host["summary"]["vllm_dcp1"]["eager_small_batch"]


def test_one_gpu_machine_skips_two_gpu_jobs(tmp_path, fake_engine, capsys):
    dcp.main(["--only", "tp2-dcp-triton-dcp1-graphs,tp1-TRITON_ATTN-eager", "--gpus", "1", "--results-dir",
              str(tmp_path / "r"), "--work-dir", str(tmp_path / "w"), "--name", "d"])
    jobs = json.loads((tmp_path / "r" / "d.json").read_text())["jobs"]
    assert jobs["tp2-dcp-triton-dcp1-graphs"]["status"] == "skipped (needs 2 GPUs, 1 visible)"
    assert jobs["tp1-TRITON_ATTN-eager"]["status"] == "ok"


def test_missing_vllm_fails_fast(tmp_path, monkeypatch):
    real = runner.importlib.util.find_spec
    monkeypatch.setattr(runner.importlib.util, "find_spec", lambda name: None if name == "vllm" else real(name))
    began = time.monotonic()
    with pytest.raises(SystemExit, match="vllm not importable here"):
        dcp.main(["--budget-s", "540", "--results-dir", str(tmp_path / "r"), "--work-dir", str(tmp_path / "w")])
    assert time.monotonic() - began < 1.0 and not (tmp_path / "w").exists()


def test_a_forced_rerun_that_fails_leaves_no_earlier_result_under_its_name(tmp_path, fake_engine, monkeypatch):
    args = ["--only", "tp1-TRITON_ATTN-eager", "--gpus", "1", "--results-dir", str(tmp_path / "r"), "--work-dir",
            str(tmp_path / "w"), "--name", "d"]
    dcp.main(args)
    first = json.loads((tmp_path / "r" / "d.json").read_text())
    assert first["jobs"]["tp1-TRITON_ATTN-eager"]["status"] == "ok"
    assert [r["job"] for r in first["throughput"]] == ["tp1-TRITON_ATTN-eager"] * 2  # its two loads' rows
    monkeypatch.setenv("FAKE_FAIL", "1")
    dcp.main([*args, "--force"])
    again = json.loads((tmp_path / "r" / "d.json").read_text())
    assert again["jobs"]["tp1-TRITON_ATTN-eager"]["status"] == "failed (exit 3)"
    assert again["throughput"] == []  # not the first run's numbers under the failed run's status
