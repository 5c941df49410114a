"""The CPU-checkable parts of benchmarks/vllm_e2e/vllm_one_h200.py: the start-up jobs (which Triton cache each one
compiles into, which it empties, whether its warm-up compiles ahead in worker processes), the runs per load, and
their summary."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from benchmarks.vllm_e2e import vllm_one_h200 as bench


def test_startup_jobs_are_listed_only_when_asked_for():
    plain = [j["name"] for j in bench.jobs(profile=False)]
    both = [j["name"] for j in bench.jobs(profile=False, startup=True)]
    assert not any(name.startswith("startup-") for name in plain)
    assert both[:len(plain)] == plain
    assert sorted(both[len(plain):]) == sorted(
        f"startup-{b}-{mode}{suffix}" for mode in bench.MODES
        for b, suffix in [("dcp-triton", "-cold"), ("dcp-triton", "-cold-serial"), ("dcp-triton", "-warm"),
                          ("FLASH_ATTN", "-cold"), ("FLASH_ATTN", "-warm")])


def test_cold_jobs_start_from_empty_caches_and_the_warm_job_reuses_the_cold_ones(tmp_path):
    by_name = {j["name"]: j for j in bench.startup_jobs()}
    for mode in bench.MODES:
        for backend in ("dcp-triton", "FLASH_ATTN"):
            cold, warm = (by_name[f"startup-{backend}-{mode}{s}"] for s in ("-cold", "-warm"))
            cold_env = bench.job_env(cold, tmp_path, smoke=False, cold_triton_cache=False)
            markers = []
            for var in bench.STARTUP_CACHES:  # Triton's, vLLM's and inductor's caches, each the job's own
                assert cold_env[var] != bench.os.environ.get(var)
                markers.append(Path(cold_env[var]) / "compiled")
                markers[-1].parent.mkdir(parents=True)
                markers[-1].write_text("a build")  # what the cold job leaves behind
            warm_env = bench.job_env(warm, tmp_path, smoke=False, cold_triton_cache=False)
            assert all(warm_env[var] == cold_env[var] for var in bench.STARTUP_CACHES)
            assert all(m.exists() for m in markers)
            assert "DCP_TRITON_COMPILE_WORKERS" not in cold_env and "DCP_TRITON_COMPILE_WORKERS" not in warm_env
            bench.job_env(cold, tmp_path, smoke=False, cold_triton_cache=False)  # a second cold start
            assert not any(m.exists() for m in markers)
        serial = bench.job_env(by_name[f"startup-dcp-triton-{mode}-cold-serial"], tmp_path, smoke=False,
                               cold_triton_cache=False)
        assert serial["DCP_TRITON_COMPILE_WORKERS"] == "0"
        dcp_cold = bench.job_env(by_name[f"startup-dcp-triton-{mode}-cold"], tmp_path, smoke=False,
                                 cold_triton_cache=False)
        fa_cold = bench.job_env(by_name[f"startup-FLASH_ATTN-{mode}-cold"], tmp_path, smoke=False,
                                cold_triton_cache=False)
        assert len({serial["TRITON_CACHE_DIR"], dcp_cold["TRITON_CACHE_DIR"], fa_cold["TRITON_CACHE_DIR"]}) == 3


def test_small_batch_runs_at_least_min_repeats_and_the_summary_keeps_the_best(monkeypatch):
    calls = []

    def fake_run_load(llm, name, load, seed):
        calls.append(name)
        return dict(load=name, elapsed_s=1.0 + seed % 7 / 10, output_tokens=100)

    monkeypatch.setattr(bench, "run_load", fake_run_load)
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))
    sys.modules["vllm"].LLM = lambda **kwargs: object()
    job = dict(name="llama8-dcp-triton-eager", model="llama8", backend="dcp-triton", mode="eager",
               kind="throughput")
    result = bench.run_job(job, Path("/nonexistent"), repeats=3)
    for name, load in bench.LOADS.items():
        expected = max(3, load.get("min_repeats", 0))
        assert calls.count(name) == 1 + expected  # the warm-up, then the timed runs
        assert len(result["runs"][name]) == expected
    assert bench.LOADS["small-batch"]["min_repeats"] == 6
    summary = bench.summarise([result])
    best = max(r["output_tok_s"] for r in result["runs"]["small-batch"])
    assert summary["loads"]["llama8/small-batch"]["eager"] == {"dcp_triton": round(best, 1)}


def test_loads_runs_only_the_loads_named_with_their_own_seeds(monkeypatch):
    seeds = []
    monkeypatch.setattr(bench, "run_load", lambda llm, name, load, seed: seeds.append((name, seed)) or dict(
        load=name, elapsed_s=1.0, output_tokens=10))
    monkeypatch.setitem(sys.modules, "vllm", type(sys)("vllm"))
    sys.modules["vllm"].LLM = lambda **kwargs: object()
    job = dict(name="llama8-dcp-triton-graphs", model="llama8", backend="dcp-triton", mode="graphs",
               kind="throughput", loads=["small-batch", "mixed"])
    result = bench.run_job(job, Path("/nonexistent"), repeats=1)
    assert sorted(result["runs"]) == ["mixed", "small-batch"]
    index = list(bench.LOADS)
    assert {name for name, _ in seeds} == {"small-batch", "mixed"}
    assert all(seed // 1000 == index.index(name) for name, seed in seeds), "a load's seeds moved with --loads"


def test_startup_summary_names_each_job_by_its_start_up_seconds():
    results = [dict(j, init_s=10.0 + i) for i, j in enumerate(bench.startup_jobs())]
    results.append(dict(name="llama8-FLASH_ATTN-eager", model="llama8", backend="FLASH_ATTN", mode="eager",
                        kind="throughput", init_s=5.0, runs={}))
    startup = bench.summarise(results)["startup_s"]
    assert startup["dcp-triton-eager-cold"] == results[[j["name"] for j in results].index(
        "startup-dcp-triton-eager-cold")]["init_s"]
    assert len(startup) == len(bench.startup_jobs())  # throughput jobs' start-up stays in their own records


def test_profile_jobs_run_the_load_asked_for_and_key_their_results_by_it():
    for load in ("small-batch", "long"):
        profiles = [j for j in bench.jobs(profile=True, profile_load=load) if j["kind"] == "profile"]
        assert profiles and all(j["load"] == load for j in profiles)
        kwargs = bench.engine_kwargs(profiles[0], Path("/model"))
        assert kwargs["distributed_executor_backend"] == "uni"  # the timers wrap calls in this process
        assert kwargs["max_num_seqs"] == 256  # the throughput jobs' engine otherwise
    results = [dict(j, profile={"step_ms": 1.0}) for load in ("small-batch", "long")
               for j in bench.jobs(profile=True, profile_load=load) if j["kind"] == "profile"]
    assert sorted(bench.summarise(results)["profile"]) == sorted(
        f"{b}/{mode}{suffix}" for b in ("dcp-triton", "FLASH_ATTN") for mode in bench.MODES for suffix in ("", "/long"))
    mqa = [dict(j, profile={"step_ms": 1.0}) for j in bench.jobs(profile=True, profile_load="decode-heavy",
                                                                profile_model="mqa16") if j["kind"] == "profile"]
    assert {j["model"] for j in mqa} == {"mqa16"} and all(j["name"].startswith("profile-mqa16-") for j in mqa)
    assert sorted(bench.summarise(mqa)["profile"]) == sorted(
        f"mqa16/{b}/{mode}/decode-heavy" for b in ("dcp-triton", "FLASH_ATTN") for mode in bench.MODES)


def test_the_warm_up_seconds_and_lines_come_from_the_adapters_log_line():
    from dcp_plugin.warmup import warmed_up_line

    log = ("INFO 12-01 [impl.py:165] " + warmed_up_line(10, 12.34, 1, "torch.bfloat16") + "\n"
           "(Worker pid=7) INFO " + warmed_up_line(10, 3.0, 2, "torch.bfloat16") + "\nINFO other 5.0 s\n")
    assert bench.warmup_seconds(log) == [12.3, 3.0]
    ahead = warmed_up_line(10, 4.5, 1, "torch.bfloat16", {"built": 0, "build_s": 0.0, "cached": 19},
                           {"variants": 19, "missing": 19, "compiled": 19, "workers": 8, "failed": 0})
    assert ahead.endswith("0 kernel variants built in 0.0 s, 19 from Triton's cache; compile-ahead: 19 variants, 19 "
                          "not in Triton's cache, 19 compiled by 8 worker processes)")
    report = {"variants": 19, "missing": 19, "compiled": 0, "workers": 8, "failed": 8, "reason": "exit status 1"}
    failed = warmed_up_line(10, 9.0, 1, "torch.bfloat16", None, report)
    assert failed.endswith("; compile-ahead: 19 variants, 19 not in Triton's cache, 0 compiled by 8 worker processes, "
                           "8 failed: exit status 1)")
    assert bench.warmup_lines("INFO 12-01 [impl.py:165] " + ahead + "\nINFO other\n") == [ahead]


def test_vllms_start_up_stages_come_from_its_log_lines():
    log = ("(EngineCore pid=8268) INFO 12-01 02:27:00 [model_runner.py:305] Model loading took 0.62 GiB and 1.605612 "
           "seconds\n(EngineCore pid=8268) INFO [monitor.py:53] torch.compile took 9.47 s in total\n"
           "(EngineCore pid=8268) INFO [model_runner.py:747] Graph capturing finished in 8 secs, took 0.13 GiB\n"
           "(EngineCore pid=8268) INFO [gpu_worker.py:561] Available KV cache memory: 61.34 GiB\n"
           "(EngineCore pid=8268) INFO [core.py:340] init engine (profile, create kv cache, warmup model) took 35.80 s "
           "(compilation: 9.47 s)\n")
    assert bench.init_breakdown(log) == {"model_load_s": 1.605612, "torch_compile_s": 9.47, "graph_capture_s": 8.0,
                                         "init_engine_s": 35.8, "kv_cache_gib": 61.34}
    assert bench.init_breakdown("INFO eager: init engine (profile, create kv cache, warmup model) took 14.51 s\n") \
        == {"init_engine_s": 14.51}  # eager: no compile, no capture


@pytest.mark.parametrize("field, value, variable, tag", [("fp8_dot", 2, "DCP_TRITON_FP8_DOT", "fp8dot2"),
                                                          ("fp8_prefill", "copy", "DCP_TRITON_FP8_PREFILL", "fp8copy"),
                                                          ("fp8_prefill", "tiles", "DCP_TRITON_FP8_PREFILL",
                                                           "fp8tiles")])
def test_twins_run_dcp_tritons_throughput_jobs_with_the_variable_and_their_own_summary_key(field, value, variable,
                                                                                           tag, tmp_path, monkeypatch):
    monkeypatch.delenv(variable, raising=False)
    chosen = [dict(j, kv_cache_dtype="fp8") for j in bench.jobs(profile=True, startup=True)
              if j["model"] == "llama8" and j["mode"] == "graphs" or j["kind"] != "throughput"]
    assert bench.twins(chosen, field, None) == []
    twins = bench.twins(chosen, field, value)
    assert [t["name"] for t in twins] == [f"llama8-dcp-triton-{tag}-graphs"]
    env = bench.job_env(twins[0], tmp_path, smoke=False, cold_triton_cache=False)
    assert env[variable] == str(value)
    assert not {"DCP_TRITON_FP8_DOT", "DCP_TRITON_FP8_PREFILL"} - {variable} & set(env)  # the other one: unset
    plain = next(j for j in chosen if j["name"] == "llama8-dcp-triton-graphs")
    assert variable not in bench.job_env(plain, tmp_path, smoke=False, cold_triton_cache=False)
    runs = {"long": [dict(output_tok_s=10.0)]}
    summary = bench.summarise([dict(plain, runs=runs), dict(twins[0], runs={"long": [dict(output_tok_s=12.0)]})])
    assert summary["loads"]["llama8/long"]["graphs"] == {"dcp_triton": 10.0, f"dcp_triton_{tag}": 12.0}