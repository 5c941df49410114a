"""The CPU-checkable parts of benchmarks/sglang_e2e/sglang_one_h200.py: its ``--dry-run`` (config, jobs, engine kwargs,
without torch, transformers or SGLang), job selection, and the summary of the jobs' results."""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
from pathlib import Path

import pytest

from benchmarks.sglang_e2e import sglang_one_h200 as bench
from tests.helpers.bench_scripts import run_module


def run_script(*args: str, tmp_path: Path, module: str = "benchmarks.sglang_e2e.sglang_one_h200"):
    """The script's CLI (default: sglang_one_h200's), with its work folder under ``tmp_path``: the finished process and
    the top-level modules it imported."""
    return run_module(module, *args, env=dict(os.environ, DCP_BENCH_WORK=str(tmp_path / "work")))


def test_dry_run_prints_the_config_jobs_and_engine_kwargs_without_torch_or_sglang(tmp_path):
    done, imported = run_script("--dry-run", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "json" in imported
    assert not imported & {"torch", "transformers", "sglang", "triton"}
    plan = json.loads(done.stdout)
    model = plan["model"]
    assert (model["num_attention_heads"], model["num_key_value_heads"], model["head_dim"], model["hidden_size"]) == \
        (32, 8, 128, 4096)
    assert model["architectures"] == ["LlamaForCausalLM"] and 4 <= model["num_hidden_layers"] <= 8
    assert [j["name"] for j in plan["jobs"]] == ["dcp-triton-bf16", "triton-bf16", "dcp-triton-fp32", "triton-fp32"]
    assert {(r["requests"], r["prompt_len"], r["output_len"]) for r in plan["loads"].values()} == \
        {(64, 512, 128), (8, 8192, 32)}
    for job in plan["jobs"]:
        engine = job["engine"]
        assert engine["attention_backend"] == job["backend"] and engine["skip_tokenizer_init"] is True
        assert engine["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[job["dtype"]]
        assert engine["load_format"] == "auto" and engine["model_path"].endswith("llama8x4-random")
        assert engine["context_length"] >= 8192 + 32
        assert engine.get("disable_cuda_graph", False) is (job["dtype"] == "fp32")  # float32: eager
        assert "disable_prefill_cuda_graph" not in engine  # bf16: SGLang's default graphs
    assert not (tmp_path / "work").exists()  # built nothing


def test_dry_run_options_select_jobs_and_change_kwargs(tmp_path):
    done, _ = run_script("--dry-run", "--dummy", "--no-prefill-graph", "--only", "*-bf16", tmp_path=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    jobs = json.loads(done.stdout)["jobs"]
    assert [j["name"] for j in jobs] == ["dcp-triton-bf16", "triton-bf16"]
    assert all(j["engine"]["load_format"] == "dummy" and j["engine"]["disable_prefill_cuda_graph"] for j in jobs)
    listed, _ = run_script("--list", tmp_path=tmp_path)
    assert listed.returncode == 0 and listed.stdout.split() == [j["name"] for j in bench.jobs()]
    assert run_script("--only", "nothing", tmp_path=tmp_path)[0].returncode == 2


def test_engine_kwargs_are_server_args_fields():
    server_args = pytest.importorskip("sglang.srt.server_args")  # the SGLang matrix venvs (CPU) have it
    cls = server_args.ServerArgs  # a dataclass in 0.5.17; 0.5.23's takes the same names as keyword arguments
    fields = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
              else set(inspect.signature(cls).parameters))
    for job in bench.jobs():
        kwargs = bench.engine_kwargs(job, Path("m"), dummy=True, prefill_graph=False)
        assert set(kwargs) <= fields, set(kwargs) - fields


def test_greedy_agreement_counts_differing_positions():
    same = bench.greedy_agreement([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 5]])
    assert same == dict(sequences=2, equal=2, differing_positions=0, positions=5, first_difference=[None, None])
    diff = bench.greedy_agreement([[1, 2, 3, 4], [4, 5, 6]], [[1, 9, 3, 8], [4, 5]])
    assert diff["equal"] == 0 and diff["differing_positions"] == 3 and diff["first_difference"] == [1, 2]


def fake_job(name: str, *, greedy, logprobs=None, tok_s=None, init_s=30.0) -> dict:
    backend, dtype = name.rsplit("-", 1)
    runs = {load: [dict(output_tok_s=t) for t in (tok_s * 0.9, tok_s)] for load in bench.LOADS} if tok_s else {}
    return dict(name=name, backend=backend, dtype=dtype, init_s=init_s, greedy=greedy, runs=runs,
                **({"prompt_logprobs": logprobs} if logprobs else {}))


def test_summary_of_the_four_jobs():
    results = [fake_job("dcp-triton-bf16", greedy=[[1, 2], [3, 4]], tok_s=900.0),
               fake_job("triton-bf16", greedy=[[1, 2], [3, 5]], tok_s=1000.0),
               fake_job("dcp-triton-fp32", greedy=[[1, 2], [3, 4]], logprobs=[[None, -1.0, -2.0], [None, -3.0]]),
               fake_job("triton-fp32", greedy=[[1, 2], [3, 4]], logprobs=[[None, -1.0004, -2.0], [None, -3.0]])]
    summary = bench.summarise(results)
    assert summary["greedy"]["bf16"]["equal"] == 1 and summary["greedy"]["bf16"]["differing_positions"] == 1
    assert summary["greedy"]["fp32"]["equal"] == 2
    assert summary["fp32_max_abs_logprob_diff"] == pytest.approx(4e-4) and summary["logprobs_within_bound"]
    assert summary["logprob_positions"] == 3 and summary["logprob_bound"] == 1e-3
    assert summary["throughput"] == {load: {"dcp_triton": 900.0, "triton": 1000.0, "ratio": 0.9}
                                     for load in bench.LOADS}
    assert summary["failed"] == [] and summary["init_s"]["triton-fp32"] == 30.0
    json.dumps(summary)  # what common.save writes


def test_summary_of_partial_and_failed_runs():
    results = [fake_job("dcp-triton-bf16", greedy=[[1]], tok_s=500.0),
               dict(name="triton-bf16", backend="triton", dtype="bf16", error="timeout"),
               fake_job("dcp-triton-fp32", greedy=[[1]], logprobs=[[None, -1.0]]),
               fake_job("triton-fp32", greedy=[[1]], logprobs=[[None, -1.5]])]
    summary = bench.summarise(results)
    assert summary["failed"] == ["triton-bf16"] and "bf16" not in summary["greedy"]
    assert summary["throughput"] == {load: {"dcp_triton": 500.0} for load in bench.LOADS}
    assert summary["fp32_max_abs_logprob_diff"] == 0.5 and not summary["logprobs_within_bound"]


def test_only_the_float32_jobs_run_sglangs_torch_ops():
    flags = {job["name"]: bench.job_env(job)[bench.NATIVE_OPS_ENV] for job in bench.jobs()}
    assert flags == {"dcp-triton-bf16": "0", "triton-bf16": "0", "dcp-triton-fp32": "1", "triton-fp32": "1"}
    # and full-precision float32 products in Triton, for both backends' float32 jobs
    assert all(bench.job_env(job).get("TRITON_F32_DEFAULT") == "ieee" for job in bench.jobs() if job["dtype"] == "fp32")


def test_native_ops_make_sglangs_layers_dispatch_to_forward_native(monkeypatch):
    # Where SGLang is installed (the SGLang matrix): on a CUDA platform its ops dispatch to forward_cuda (RMSNorm's
    # sgl-kernel refuses float32); after use_native_ops every MultiPlatformOp takes its torch forward_native.
    multi_platform = pytest.importorskip("sglang.srt.layers.utils.multi_platform")
    if not hasattr(multi_platform.MultiPlatformOp, "dispatch_forward"):  # 0.5.23: another mechanism, refused
        with pytest.raises(RuntimeError, match="0.5.17's ops dispatch"):
            bench.use_native_ops()
        return
    from sglang.srt.layers.activation import SiluAndMul
    from sglang.srt.layers.layernorm import RMSNorm

    class Probe(multi_platform.MultiPlatformOp):  # RMSNorm itself needs SGLang's published server args to build
        forward_cuda = RMSNorm.forward_cuda
        forward_native = RMSNorm.forward_native

    class SiluProbe(multi_platform.MultiPlatformOp):
        forward_cuda = SiluAndMul.forward_cuda
        forward_native = SiluAndMul.forward_native

    monkeypatch.setattr(multi_platform, "_is_cuda", True)
    monkeypatch.setattr(multi_platform.current_platform, "is_out_of_tree", lambda: False, raising=False)
    assert Probe()._forward_method.__func__ is RMSNorm.forward_cuda  # SGLang's own choice on CUDA
    assert SiluProbe()._forward_method.__func__ is SiluAndMul.forward_cuda
    monkeypatch.setattr(multi_platform.MultiPlatformOp, "dispatch_forward",
                        multi_platform.MultiPlatformOp.dispatch_forward)  # restored after the test
    bench.use_native_ops()
    assert Probe()._forward_method.__func__ is RMSNorm.forward_native
    assert SiluProbe()._forward_method.__func__ is SiluAndMul.forward_native


SPEC_MODULE = "benchmarks.sglang_e2e.sglang_spec_gpu"


def test_spec_script_dry_run_needs_no_torch_and_its_kwargs_are_server_args_fields(tmp_path):
    """benchmarks/sglang_e2e/sglang_spec_gpu.py: its ``--dry-run`` imports neither torch nor SGLang; the hybrid
    model is Qwen3.5's attention layout (16 Q / 2 KV heads of size 256) under SGLang's ``full_attention_interval``;
    the speculative jobs name their draft checkpoint, and every engine argument is a ServerArgs field (where SGLang
    is installed)."""
    done, imported = run_script("--dry-run", tmp_path=tmp_path, module=SPEC_MODULE)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not imported & {"torch", "transformers", "sglang", "triton"}
    plan = json.loads(done.stdout)
    q3n = plan["models"]["q3n"]
    assert (q3n["num_attention_heads"], q3n["num_key_value_heads"], q3n["head_dim"]) == (16, 2, 256)
    full = [i for i in range(q3n["num_hidden_layers"]) if (i + 1) % q3n["full_attention_interval"] == 0]
    assert full == [i for i, kind in enumerate(q3n["layer_types"]) if kind == "full_attention"] == [3, 7]
    engines = {j["name"]: j["engine"] for j in plan["jobs"]}
    assert engines["q3n-dcp-triton-chain"]["speculative_eagle_topk"] == 1
    assert engines["llama-fp32-dcp-triton-tree"]["speculative_eagle_topk"] == 4
    assert engines["llama-fp32-dcp-triton-tree"]["speculative_draft_model_path"].endswith("llama")
    assert engines["llama-fp32-dcp-triton-tree"]["disable_cuda_graph"] is True
    assert not (tmp_path / "work").exists()
    server_args = pytest.importorskip("sglang.srt.server_args")
    cls = server_args.ServerArgs
    fields = ({f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls)
              else set(inspect.signature(cls).parameters))
    for name, engine in engines.items():
        assert set(engine) <= fields, (name, set(engine) - fields)


def test_spec_script_summary_compares_each_job_with_its_reference():
    from benchmarks.sglang_e2e import sglang_spec_gpu as spec

    def job(name, greedy, verify=None, tok_s=100.0):
        return dict(name=name, init_s=1.0, greedy=greedy, verify_steps=verify, load=dict(output_tok_s=tok_s))

    results = [job("q3n-dcp-triton", [[1, 2, 3]]), job("q3n-triton", [[1, 2, 4]]),
               job("q3n-dcp-triton-chain", [[1, 2, 3]], verify=[2], tok_s=150.0),
               dict(name="llama-fp32-dcp-triton", error="timeout")]
    summary = spec.summarise(results)
    rows = summary["jobs"]
    assert summary["failed"] == ["llama-fp32-dcp-triton"]
    assert rows["q3n-dcp-triton"]["versus"] == "q3n-triton"
    assert rows["q3n-dcp-triton"]["greedy"]["first_difference"] == [2]
    chain = rows["q3n-dcp-triton-chain"]
    assert chain["versus"] == "q3n-dcp-triton" and chain["greedy"]["equal"] == 1 and chain["speedup"] == 1.5
    assert chain["mean_accepted_length"] == 1.5  # 3 tokens over 2 verify steps
    assert "versus" not in rows["q3n-triton"]


def test_spec_script_two_gpu_set_runs_every_job_at_dcp_2_on_one_kv_head(tmp_path):
    done, _ = run_script("--dry-run", "--tp", "2", tmp_path=tmp_path, module=SPEC_MODULE)
    assert done.returncode == 0, done.stderr[-2000:]
    plan = json.loads(done.stdout)
    assert {config["num_key_value_heads"] for config in plan["models"].values()} == {1}
    assert all((j["engine"]["tp_size"], j["engine"]["dcp_size"]) == (2, 2) for j in plan["jobs"])
    assert all(j["engine"]["model_path"].endswith("-kv1") for j in plan["jobs"])


def test_the_float32_jobs_run_sglangs_chunked_gdn_on_bf16_inputs():
    """SGLang's chunked GDN prefill refuses float32: the float32 jobs hand it q, k, v and beta in bf16 (g as given)
    and get float32 back; a bf16 call passes through untouched."""
    import torch

    seen = []

    def chunk(q, k, v, g, beta, **kwargs):
        seen.append(([t.dtype for t in (q, k, v, g, beta)], kwargs))
        return (q * 2, None, k.clone()) if q.dtype == torch.bfloat16 else (q, None, None)

    wrapped = bench.bf16_chunked_gdn(chunk)
    q, k, v, beta = (torch.full((1, 3, 2, 4), 1.0 + 2.0 ** -12) for _ in range(4))
    g = torch.zeros(1, 3, 2)
    o, final, states = wrapped(q, k, v, g, beta, cu_seqlens="lens")
    assert seen[0] == ([torch.bfloat16] * 3 + [torch.float32, torch.bfloat16], {"cu_seqlens": "lens"})
    assert o.dtype == states.dtype == torch.float32 and final is None
    assert torch.equal(o, torch.full_like(q, 2.0))  # computed on bf16 inputs: 1 + 2^-12 rounds to 1
    bf16 = q.bfloat16()
    assert wrapped(bf16, bf16, bf16, g, bf16)[0].dtype == torch.bfloat16
    assert seen[1][0][0] == torch.bfloat16



def test_the_float32_jobs_patch_the_function_sglangs_gdn_prefill_calls(monkeypatch):
    """The patch lands where SGLang's Triton GDN kernel looks the function up when it runs its prefill."""
    gdn = pytest.importorskip("sglang.srt.layers.attention.linear.kernels.gdn_triton",
                              reason="SGLang runs in its own venv: make test-sglang-matrix")
    original = gdn.chunk_gated_delta_rule
    monkeypatch.setattr(gdn, "chunk_gated_delta_rule", original)  # put back after the test
    assert "return chunk_gated_delta_rule(" in inspect.getsource(gdn.TritonGDNKernel.extend)
    bench.use_bf16_chunked_gdn()
    assert gdn.chunk_gated_delta_rule is not original and gdn.chunk_gated_delta_rule.__name__ == "chunk_fp32"


def test_the_hybrid_script_runs_sglangs_triton_first():
    """The first job of a machine compiles SGLang's own GDN and MoE kernels too: the reference pays that, so the
    start-ups of dcp-triton and fa3 after it compare."""
    from benchmarks.sglang_e2e import sglang_hybrid_spec as hybrid

    assert [job["name"] for job in hybrid.JOBS] == ["q3n-bf16-triton", "q3n-bf16-dcp-triton", "q3n-bf16-fa3",
                                                     "q3n-fp32-dcp-triton", "q3n-fp32-triton", "q3n-bf16-triton-p64",
                                                     "q3n-bf16-dcp-triton-p64", "q3n-bf16-fa3-p64"]
