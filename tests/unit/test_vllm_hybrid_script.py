"""The CPU-checkable parts of benchmarks/vllm_e2e/vllm_hybrid_gpu.py: the CLI without torch or vLLM, the job
catalogue (a Qwen3-Next of Qwen3.5's attention layout, MTP drafts, the backends it is compared with) and the summary
of the jobs' results."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import common
from benchmarks.vllm_e2e import vllm_hybrid_gpu as bench
from tests.helpers.vllm_checks import script_output


def cli(*args: str) -> list[str]:
    return script_output("benchmarks.vllm_e2e.vllm_hybrid_gpu", *args)


def test_list_plan_and_summarise_run_without_torch_or_vllm(tmp_path):
    work = ["--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r")]
    names = [line.split()[0] for line in cli("--list", *work)]
    assert names == [f"build-{bench.MODEL}", "q3n-dcp-triton", "q3n-FLASH_ATTN", "q3n-mtp-dcp-triton",
                     "q3n-mtp-FLASH_ATTN", "q3n-TRITON_ATTN"]
    assert cli("--plan", *work)[-1].startswith("estimated wall time:")
    assert cli("--summarise", *work) == [] and (tmp_path / "r" / "vllm_hybrid_h100.md").exists()


def test_the_model_is_qwen35s_attention_layout_with_mtp_and_engines_differ_only_in_backend(tmp_path):
    config = bench.CONFIG
    assert config["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + [
        "full_attention"]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (16, 2, 256)
    assert config["num_nextn_predict_layers"] == 1
    jobs = {j.name: j for j in bench.catalogue(tmp_path / "w", tmp_path / "raw")}
    engines = {name: job.spec["engine"] for name, job in jobs.items() if job.spec["kind"] == "engine"}
    assert {e["attention_backend"] for e in engines.values()} == {"dcp-triton", "FLASH_ATTN", "TRITON_ATTN"}
    assert all(e["dtype"] == "bfloat16" and "enforce_eager" not in e for e in engines.values())  # CUDA graphs
    assert [n for n, e in engines.items() if "speculative_config" in e] == ["q3n-mtp-dcp-triton",
                                                                          "q3n-mtp-FLASH_ATTN"]
    assert engines["q3n-mtp-dcp-triton"]["speculative_config"]["method"] == "qwen3_next_mtp"
    # the draft's attention layer on the job's backend: vLLM does not give a draft the target's unless asked
    assert {n: e["speculative_config"]["attention_backend"] for n, e in engines.items() if "mtp" in n} == {
        "q3n-mtp-dcp-triton": "dcp-triton", "q3n-mtp-FLASH_ATTN": "FLASH_ATTN"}
    plain = dict(engines["q3n-dcp-triton"], attention_backend=None)
    assert all(dict(e, attention_backend=None) == plain for n, e in engines.items() if "mtp" not in n)


def _found(tmp_path: Path) -> dict:
    """Three plain jobs and one MTP job as the runner hands them to ``summarise``: dcp-triton and TRITON_ATTN part
    from FLASH_ATTN at one prompt token and one greedy token; MTP leaves dcp-triton's tokens as they were."""
    jobs = {j.name: j for j in bench.catalogue(tmp_path / "w", tmp_path / "raw")}
    log = tmp_path / "q3n.log"
    log.write_text("INFO Setting attention block size to 576 tokens to ensure that attention page size is ...\n")

    def result(lp, tokens, counters=None):
        greedy = {"tokens": tokens, "top2_logprobs": [[[-0.5, -0.7]] * len(t) for t in tokens], "output_tok_s": 10.0,
                  "spec_decode": counters or {}}
        logprobs = {"token_logprobs": lp, "top1_ids": [[1] * len(x) for x in lp]}
        return {"tasks": {"logprobs": logprobs, "greedy": greedy}, "gpu": "H100", "vllm": "0.26.0"}

    data = {"q3n-FLASH_ATTN": result([[-1.0, -2.0]], [[5, 6, 7]]),
            "q3n-dcp-triton": result([[-1.0, -2.25]], [[5, 6, 8]]),
            "q3n-TRITON_ATTN": result([[-1.125, -2.0]], [[5, 6, 7]]),
            "q3n-mtp-dcp-triton": result([[-1.0, -2.25]], [[5, 6, 8]], {
                "vllm:spec_decode_num_drafts": 4, "vllm:spec_decode_num_draft_tokens": 8,
                "vllm:spec_decode_num_accepted_tokens": 2, "vllm:spec_decode_num_accepted_tokens_per_pos": [2, 0]})}
    return {name: {"spec": jobs[name].spec, "result": r, "status": "ok", "log": str(log), "backend_line": "x"}
            for name, r in data.items()}


def test_summary_compares_with_flash_attn_beside_triton_attn_and_mtp_with_plain(tmp_path):
    found = _found(tmp_path)
    found["q3n-dcp-triton"]["result"]["commit"] = "0123456789abcdef"  # the engine's own record of its code
    rows = bench.analyse(found)["jobs"]
    ours, triton, mtp = rows["q3n-dcp-triton"], rows["q3n-TRITON_ATTN"], rows["q3n-mtp-dcp-triton"]
    assert ours["versus"] == triton["versus"] == "q3n-FLASH_ATTN" and mtp["versus"] == "q3n-dcp-triton"
    assert ours["logprobs"]["max_abs"] == 0.25 and triton["logprobs"]["max_abs"] == 0.125
    assert ours["greedy"]["identical"] == 0 and ours["greedy"]["divergences"][0]["step"] == 2
    assert triton["greedy"]["identical"] == 1 and mtp["greedy"]["identical"] == 1
    assert mtp["acceptance_rate"] == 0.25 and mtp["mean_acceptance_length"] == 1.5
    assert {row["block_size"] for row in rows.values()} == {576} and "versus" not in rows["q3n-FLASH_ATTN"]
    written = bench.write_summary({"jobs": rows}, {"vllm": "0.26.0", "gpu": "H100"}, tmp_path / "r", "t")
    table = written[1].read_text()
    assert "| q3n-dcp-triton | q3n-FLASH_ATTN | 576 | 0.250 / 0.1250 (2) | 0/1 (first at gaps 0.200) |" in table
    assert ours["commit"] == "0123456789abcdef" and triton["commit"] is None  # a result without one: None, not ours
    assert next(line for line in table.splitlines() if line.startswith("| q3n-dcp-triton ")).endswith("| 0123456 |")
    assert next(line for line in table.splitlines() if line.startswith("| q3n-TRITON_ATTN ")).endswith("| - |")
    assert json.loads(written[0].read_text())["summary"]["jobs"]["q3n-mtp-dcp-triton"]["greedy"]["identical"] == 1


def test_the_two_gpu_set_shards_the_cache_of_a_one_kv_head_model(tmp_path):
    """``--tp 2``: vLLM allows DCP = 2 at tp = 2 only with fewer KV heads than ranks: the model keeps one; each DCP = 2
    job is compared with dcp-triton at DCP = 1 (MTP drafts with dcp-triton at DCP = 2)."""
    jobs = {j.name: j.spec for j in bench.catalogue(tmp_path / "w", tmp_path / "raw", tp=2)}
    build = jobs.pop(f"build-{bench.MODEL}-kv1")
    assert build["config"]["num_key_value_heads"] == 1 and build["config"]["num_attention_heads"] == 16
    assert all(s["engine"]["tensor_parallel_size"] == 2 for s in jobs.values())
    assert {n: (s["engine"]["decode_context_parallel_size"], s["versus"]) for n, s in jobs.items()} == {
        "q3n-tp2-dcp1-dcp-triton": (1, None), "q3n-tp2-dcp2-dcp-triton": (2, "q3n-tp2-dcp1-dcp-triton"),
        "q3n-tp2-dcp2-FLASH_ATTN": (2, "q3n-tp2-dcp1-dcp-triton"),
        "q3n-tp2-dcp2-mtp-dcp-triton": (2, "q3n-tp2-dcp2-dcp-triton")}
    assert cli("--tp", "2", "--plan", "--work-dir", str(tmp_path / "w"), "--results-dir", str(tmp_path / "r"))[0] \
        .endswith("[2 GPUs, 1 jobs at once]")


def _embedding_agreement(config: dict) -> tuple[int, int]:
    """On how many greedy positions (3 prompts, 24 new tokens each, float32) the current token's embedding alone
    (final norm, lm_head) predicts the model's next token."""
    import torch

    model = common.random_model(config).eval()
    gen = torch.Generator().manual_seed(1)
    agree = total = 0
    with torch.no_grad():
        for n in (50, 200, 400):
            prompt = torch.randint(3, config["vocab_size"], (1, n), generator=gen)
            seq = model.generate(prompt, max_new_tokens=24, do_sample=False)[0]
            full = model(seq[None]).logits[0].argmax(-1)
            alone = model.lm_head(model.model.norm(model.model.embed_tokens(seq))).argmax(-1)
            agree += int((full[n - 1:-1] == alone[n - 1:-1]).sum())
            total += len(seq) - n
    return agree, total


def test_the_models_mtp_drafts_are_those_a_draftable_model_accepts():
    """A random MTP layer's drafts are never accepted; the model is built draftable (``common.DRAFTABLE``): the
    current token's embedding alone then predicts most of the model's greedy tokens (the layers, attention among
    them, deciding the rest; without it none), and the MTP layer's fc passes the next token's embedding on, so it
    drafts that prediction."""
    import torch

    assert bench.CONFIG["draftable"] == common.DRAFTABLE
    agree, total = _embedding_agreement(bench.CONFIG)
    plain, _ = _embedding_agreement({k: v for k, v in bench.CONFIG.items() if k != "draftable"})
    assert total == 72 and 0.5 * total <= agree < total and plain <= 2, (agree, plain)
    model = common.random_model(bench.CONFIG)
    mtp = common._mtp_weights(model.config, model.state_dict(), 0, common.DRAFTABLE)
    hidden = bench.CONFIG["hidden_size"]
    assert torch.equal(mtp["mtp.fc.weight"], torch.cat([torch.eye(hidden) * 10.0, torch.zeros(hidden, hidden)], 1))
    assert torch.equal(mtp["mtp.norm.weight"], torch.zeros(hidden))  # (1 + weight): every channel alike
