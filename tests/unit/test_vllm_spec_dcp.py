"""The CPU-checkable parts of benchmarks/vllm_e2e/vllm_spec_dcp.py: the CLI without torch or vLLM, the job catalogue
(engine and speculative arguments, references), the prompts, the summary, and the engine script's ``spec_decode``
task on a stand-in LLM."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

from benchmarks.vllm_e2e import vllm_e2e_engine as engine  # the job process: its spec_decode task
from benchmarks.vllm_e2e import vllm_spec_dcp as bench
from tests.helpers.vllm_checks import script_output


def cli(*args: str) -> list[str]:
    return script_output("benchmarks.vllm_e2e.vllm_spec_dcp", *args)


def test_list_and_plan_run_without_torch_or_vllm(tmp_path):
    work = ["--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]
    names = [line.split()[0] for line in cli("--list", *work)]
    assert names[:3] == ["build-mqa-d128", "build-draft-d64", "base-dcp2-ag_rs"] and "ngram-dcp2-a2a" in names
    lines = cli("--plan", "--gpus", "2", "--budget-s", "540", *work)
    assert lines[1].split()[:2] == ["build-mqa-d128", "build"] and "(past budget)" in "\n".join(lines)
    assert lines[-1].startswith("estimated wall time:")
    assert [line.split()[0] for line in cli("--list", "--only", "draft-*", *work)] == [
        "build-mqa-d128", "build-draft-d64", "draft-dcp2-ag_rs"]
    assert cli("--summarise", *work) == [] and (tmp_path / "r" / "vllm_spec_dcp_2xh200.md").exists()


def test_engine_jobs_run_both_speculations_at_tp2_dcp2_against_a_plain_reference(tmp_path):
    jobs = {j.name: j for j in bench.catalogue(tmp_path / "work", tmp_path / "raw")}
    for name in ("ngram-dcp2-ag_rs", "draft-dcp2-ag_rs", "selfdraft-dcp2-ag_rs", "ngram-dcp2-a2a"):
        spec, kw = jobs[name].spec, jobs[name].spec["engine"]
        assert (kw["tensor_parallel_size"], kw["decode_context_parallel_size"], kw["dtype"]) == (2, 2, "float32")
        assert kw["attention_backend"] == "dcp-triton" and kw["disable_log_stats"] is False
        reference = jobs[spec["reference"]].spec
        assert reference["method"] is None and "speculative_config" not in reference["engine"]
        assert (reference["dcp"], reference["comm"]) == (spec["dcp"], spec["comm"])
        assert reference["tasks"] == spec["tasks"]  # the same prompts, warm-up and length
        assert jobs[name].env["VLLM_USE_V2_MODEL_RUNNER"] == "0" and jobs[name].gpus == 2
    ngram = jobs["ngram-dcp2-a2a"].spec["engine"]
    assert ngram["speculative_config"] == bench.NGRAM and ngram["dcp_comm_backend"] == "a2a"
    draft = jobs["draft-dcp2-ag_rs"].spec["engine"]["speculative_config"]
    assert draft["method"] == "draft_model" and draft["model"].endswith("draft-d64")
    assert draft["draft_tensor_parallel_size"] == 2 and draft["attention_backend"] == "dcp-triton"
    assert jobs["selfdraft-dcp1"].spec["engine"]["speculative_config"]["model"].endswith("mqa-d128")
    task = jobs["base-dcp2-ag_rs"].spec["tasks"][0]
    assert task["type"] == "spec_decode" and len(task["prompt_ids"]) >= 16
    assert bench.DRAFT_CONFIG["vocab_size"] == bench.dcp_e2e.CONFIG["vocab_size"]  # vLLM requires equal vocabularies
    assert "compilation_config" not in bench.catalogue(tmp_path, tmp_path, eager=True)[2].spec["engine"]


def test_the_one_gpu_set_runs_both_speculations_at_tp1_dcp1(tmp_path):
    jobs = {j.name: j for j in bench.catalogue(tmp_path / "work", tmp_path / "raw", tp=1)}
    engines = [name for name, job in jobs.items() if job.spec["kind"] == "engine"]
    assert engines == ["base-tp1", "ngram-tp1", "draft-tp1", "selfdraft-tp1", "base-tp1-TRITON_ATTN",
                       "ngram-tp1-TRITON_ATTN"]
    backends = {name: (jobs[name].spec["backend"], jobs[name].spec["engine"]["attention_backend"]) for name in engines}
    assert backends["ngram-tp1-TRITON_ATTN"] == ("TRITON_ATTN", "TRITON_ATTN")  # vLLM's speed-up, for comparison
    assert backends["ngram-tp1"] == ("dcp-triton", "dcp-triton")
    assert jobs["ngram-tp1-TRITON_ATTN"].spec["reference"] == "base-tp1-TRITON_ATTN"
    for name in engines:
        kw = jobs[name].spec["engine"]
        assert (kw["tensor_parallel_size"], kw["decode_context_parallel_size"], jobs[name].gpus) == (1, 1, 1)
        assert "dcp_comm_backend" not in kw and kw["dtype"] == "float32"
    assert jobs["ngram-tp1"].spec["reference"] == "base-tp1"
    assert jobs["ngram-tp1"].spec["engine"]["speculative_config"] == bench.NGRAM
    draft = jobs["draft-tp1"].spec["engine"]["speculative_config"]
    assert draft["draft_tensor_parallel_size"] == 1 and draft["model"].endswith("draft-d64")
    assert jobs["base-tp1"].spec["tasks"] == jobs["draft-tp1"].spec["tasks"]


def test_prompts_repeat_a_unit_and_are_reproducible():
    prompts = bench.repeat_prompts(count=8, min_len=100, max_len=300, seed=1, vocab=50)
    assert prompts == bench.repeat_prompts(count=8, min_len=100, max_len=300, seed=1, vocab=50)
    for p in prompts:
        assert 100 <= len(p) <= 300 and min(p) >= 3
        period = next(n for n in range(8, 65) if p[n:] == p[:-n])  # a unit of 8-64 tokens, repeated
        assert len(p) >= 2 * period


def fake_job(method, tokens, top2, tok_s, counters=None, reference=None) -> dict:
    spec = {"method": method, "dcp": 2, "comm": "ag_rs", "reference": reference}
    task = {"tokens": tokens, "top2_logprobs": top2, "output_tok_s": tok_s, "spec_decode": counters or {}}
    return {"spec": spec, "status": "ok", "backend_line": "dcp-triton attention: ...",
            "result": {"tasks": {"spec": task}, "vllm": "0.26.0", "gpu": "H200"}}


def test_summary_compares_with_the_reference_and_reads_the_counters(tmp_path):
    top2 = [[[-0.1, -3.0], [-0.2, -0.2005], [-0.1, -2.0]]] * 2
    counters = {f"{bench.COUNTER}{name}": value for name, value in (
        ("drafts", 10), ("draft_tokens", 40), ("accepted_tokens", 30), ("accepted_tokens_per_pos", [9, 8, 7, 6]))}
    jobs = {"base": fake_job(None, [[5, 6, 7], [5, 6, 7]], top2, 100.0),
            "ngram": fake_job("ngram", [[5, 6, 7], [5, 9, 7]], top2, 150.0, counters, "base"),
            "wrong": fake_job("ngram", [[8, 6, 7], [5, 6, 7]], top2, 50.0, counters, "base")}
    rows = bench.analyse(jobs)["jobs"]
    assert rows["base"]["acceptance_rate"] is None and "greedy" not in rows["base"]
    ngram = rows["ngram"]
    assert (ngram["acceptance_rate"], ngram["mean_acceptance_length"], ngram["speedup"]) == (0.75, 4.0, 1.5)
    assert ngram["per_position"] == [0.9, 0.8, 0.7, 0.6]
    assert ngram["greedy"]["identical"] == 1 and ngram["greedy"]["all_at_near_ties"]  # step 1: gap 5e-4
    assert rows["wrong"]["greedy"]["divergences"] == [{"prompt": 0, "step": 0, "ref_top2_gap": 2.9}]
    assert not rows["wrong"]["greedy"]["all_at_near_ties"]
    json_path, md_path = bench.write_summary(bench.analyse(jobs), {"vllm": "0.26.0", "gpu": "H200"}, tmp_path, "s")
    table = md_path.read_text()
    assert "| ngram | ngram | 2 | ag_rs | ok | 1/2 (near ties) | 0.750 | 4.000 | 150 | 1.50x |" in table
    assert "1/2 (REAL)" in table and json.loads(json_path.read_text())["summary"]["jobs"]["ngram"]["speedup"] == 1.5


def test_spec_decode_task_times_the_run_and_counts_only_it(monkeypatch):
    """The engine script's task on a stand-in LLM whose counters grow with every generate call."""
    calls = []

    class FakeLLM:
        def generate(self, prompts, params, use_tqdm=False):
            calls.append(len(prompts))
            return [SimpleNamespace(num_cached_tokens=0, outputs=[SimpleNamespace(
                token_ids=[3] * params.max_tokens,
                logprobs=[{3: SimpleNamespace(rank=1, logprob=-0.1), 4: SimpleNamespace(rank=2, logprob=-2.0)}]
                * params.max_tokens)]) for _ in prompts]

        def get_metrics(self):
            n = len(calls)
            return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=5 * n),
                    SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens_per_pos", values=[n, 2 * n]),
                    SimpleNamespace(name="vllm:num_requests_running", value=0)]

    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=lambda **kw: SimpleNamespace(**kw)))
    task = {"prompt_ids": [[1, 2, 3]] * 3, "warmup_ids": [[4, 5]], "max_tokens": 4}
    out = engine.spec_decode_task(FakeLLM(), task, 100)
    assert calls == [1, 3] and out["tokens"] == [[3] * 4] * 3
    assert out["spec_decode"] == {"vllm:spec_decode_num_drafts": 5, "vllm:spec_decode_num_accepted_tokens_per_pos":
                                  [1, 2]}  # the timed run's counts only, not the warm-up's
    assert out["output_tok_s"] == 12 / out["timed_s"] and out["top2_logprobs"][0][0] == [-0.1, -2.0]
